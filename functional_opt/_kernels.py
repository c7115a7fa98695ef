"""DreamerV3's elementwise update as single-pass kernels, compiled once with ``torch.compile``.

One pass reads ``g, nu, mu`` (and ``p`` where the kernel applies the update) and writes the new
moments and the update: the clip factor, both bias corrections and the learning rate are folded
into per-tensor scalars, so there is one division per element and no temporaries. Used by
``dreamerv3``'s eager update for large leaves and by ``DreamerV3Optimizer``'s flat buffers.

Every kernel is compiled with ``dynamic=True`` (one compilation serves every size) the first
time it runs with a given signature, and falls back to running eagerly, with a warning, if
compilation fails.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "apply_kernel",
    "call",
    "compiled",
    "moments_math",
    "norm_pair",
    "update_kernel",
    "update_kernel_donated",
    "update_kernel_in_place",
]


def moments_math(
    g: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
) -> tuple[Tensor, Tensor]:
    """``g' = factor g`` (rounded to ``g``'s dtype, as the chain's clip is);
    ``nu' = b2 nu + (1-b2) g'^2``; ``r = g' / (sqrt(nu' inv_bc2) + eps)``;
    ``mu' = b1 mu + (1-b1) r``. Returns ``(nu', mu')`` in the moments' dtype."""
    gs = (g.to(nu.dtype) * factor).to(g.dtype).to(nu.dtype)
    nu_new = beta2 * nu + (1 - beta2) * (gs * gs)
    r = gs / (torch.sqrt(nu_new * inv_bc2) + eps)
    mu_new = beta1 * mu + (1 - beta1) * r
    return nu_new, mu_new


def apply_kernel(
    g: Tensor,
    p: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
) -> None:
    """:func:`moments_math` written into ``nu`` and ``mu``, and ``p' = p + step_size mu'`` into
    ``p``, with ``inv_bc2 = 1/(1-b2^t)`` and ``step_size = -lr_t/(1-b1^t)``. ``factor`` and
    ``step_size`` broadcast (per row of 2-D views, or per element)."""
    nu_new, mu_new = moments_math(g, nu, mu, factor, inv_bc2, beta1, beta2, eps)
    nu.copy_(nu_new)
    mu.copy_(mu_new)
    p.copy_((p.to(mu.dtype) + mu_new * step_size).to(p.dtype))


def _update(
    g: Tensor, mu: Tensor, step_size: Tensor, p: Tensor | None, decay: Tensor | None
) -> Tensor:
    u = mu * step_size
    if p is not None and decay is not None:
        u = u + decay * p.to(mu.dtype)
    return u.to(g.dtype)


def update_kernel(
    g: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
    p: Tensor | None = None,
    decay: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure: ``(nu', mu', u)`` with ``u = step_size mu' (+ decay p)`` in ``g``'s dtype (``decay``
    is ``-lr_t`` times the weight decay; without ``p`` there is none)."""
    nu_new, mu_new = moments_math(g, nu, mu, factor, inv_bc2, beta1, beta2, eps)
    return nu_new, mu_new, _update(g, mu_new, step_size, p, decay)


def update_kernel_donated(
    g: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
    p: Tensor | None = None,
    decay: Tensor | None = None,
) -> Tensor:
    """:func:`update_kernel` with the new moments written into ``nu`` and ``mu``; returns ``u``
    (the same arithmetic, so the same bits)."""
    nu_new, mu_new = moments_math(g, nu, mu, factor, inv_bc2, beta1, beta2, eps)
    nu.copy_(nu_new)
    mu.copy_(mu_new)
    return _update(g, mu_new, step_size, p, decay)


def update_kernel_in_place(
    g: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    inv_bc2: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
    p: Tensor | None = None,
    decay: Tensor | None = None,
) -> None:
    """:func:`update_kernel_donated` with ``u`` written into ``g`` too (donated updates)."""
    nu_new, mu_new = moments_math(g, nu, mu, factor, inv_bc2, beta1, beta2, eps)
    nu.copy_(nu_new)
    mu.copy_(mu_new)
    g.copy_(_update(g, mu_new, step_size, p, decay))


def norm_pair(g: Tensor, p: Tensor, dtype: torch.dtype) -> Tensor:
    """``[||g||, ||p||]`` accumulated in ``dtype`` (a cascade sum, without widened copies of
    16-bit inputs, and more accurate than ``torch.linalg.vector_norm``)."""
    g32, p32 = g.to(dtype), p.to(dtype)
    return torch.sqrt(torch.stack([(g32 * g32).sum(), (p32 * p32).sum()]))


_Key = tuple[Any, ...]
_COMPILED: dict[_Key, Callable[..., Any]] = {}
_FAILED: set[Callable[..., Any]] = set()


def _signature(fn: Callable[..., Any], args: tuple[Any, ...]) -> _Key:
    parts = [(a.dtype, a.device.type, a.dim()) if isinstance(a, Tensor) else a for a in args]
    return (fn, *parts)


def compiled(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``fn`` under ``torch.compile(fullgraph=True, dynamic=True)`` for arguments like ``args``.

    Each signature (the dtypes, devices and ranks of the tensors, the other arguments) gets a
    copy of ``fn`` with a code object of its own, so that its compilations never share
    ``torch._dynamo``'s per-function recompile limit with other signatures: past that limit
    dynamo would silently run the function eagerly, with other rounding."""
    key = _signature(fn, args)
    out = _COMPILED.get(key)
    if out is None:
        copy = types.FunctionType(
            fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        out = _COMPILED[key] = torch.compile(copy, fullgraph=True, dynamic=True)
    return out


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` compiled (see :func:`compiled`); if compiling fails (no C++ compiler, an
    unsupported device...), warn once and run it eagerly from then on."""
    if fn in _FAILED:
        return fn(*args)
    try:
        return compiled(fn, *args)(*args)
    except Exception as err:
        _FAILED.add(fn)
        warnings.warn(
            f"functional_opt: torch.compile of {fn.__name__} failed ({err!r}); running it eagerly",
            RuntimeWarning,
            stacklevel=3,
        )
        return fn(*args)
