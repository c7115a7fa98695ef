"""Clipping: elementwise ``clip``, ``clip_by_global_norm``, unit-wise ``adaptive_grad_clip`` and
DreamerV3's per-tensor ``clip_by_agc``."""

from __future__ import annotations

import numbers
from typing import Any, Literal

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import GradientTransformation, Params, Updates, stateless

__all__ = [
    "adaptive_grad_clip",
    "check_agc",
    "clip",
    "clip_by_agc",
    "clip_by_global_norm",
    "unitwise_norm",
]


def clip(max_delta: float | Tensor) -> GradientTransformation:
    """``u -> clamp(u, -max_delta, max_delta)`` elementwise."""
    _validate.non_negative("max_delta", max_delta)

    def apply(updates: Updates, params: Params | None) -> Updates:
        del params
        g, at = tree.split(updates, elementwise=True)
        leaves = tree.split(updates)[0] if any(x.is_complex() for x in g) else []
        for i, x in zip(at.index, leaves, strict=False):  # (only to name a complex leaf)
            if x.is_complex():
                raise TypeError(
                    f"clip: the updates at {at.path(i)} are complex ({x.dtype}), which have no "
                    "order to clamp in; clip their real and imaginary parts or their modulus "
                    "with a transform of your own"
                )
        return at.updates(_lists.clamp(g, -max_delta, max_delta))

    return stateless(apply, elementwise=True, leafwise=True)


def clip_by_global_norm(max_norm: float | Tensor) -> GradientTransformation:
    """``u -> u * min(1, max_norm / ||u||)`` with ``||u|| = sqrt(sum_i ||u_i||^2)`` over all
    leaves (``None`` leaves ignored); unchanged when ``||u|| < max_norm``.

    ``max_norm`` is a positive normal float32 (``>= 1.2e-38``): norms are computed in at least
    float32, where a smaller bound is 0 and a zero gradient would give ``0 / 0 = NaN``."""
    _validate.float32_magnitude("max_norm", max_norm)

    def apply(updates: Updates, params: Params | None) -> Updates:
        del params
        g, at = tree.split(updates, elementwise=True)
        norm = at.global_norm(g)
        factor = torch.where(norm < max_norm, torch.ones_like(norm), max_norm / norm)
        return at.updates(_lists.mul(g, factor))

    # (leaf by leaf given the global norm: see functional_opt._lists.Across)
    return stateless(apply, elementwise=True, leafwise=True, reductions=True)


Axis = int | tuple[int, ...] | Literal["torch"] | None
"""``adaptive_grad_clip``'s unit layout: ``None`` (optax's default by rank), ``"torch"``
(torch's ``(out, in, ...)`` weights: one unit per output), or the axes to reduce."""


def _check_axis(axis: Any) -> Axis:
    """``axis`` validated (a ``ValueError``/``TypeError`` naming it), a list as a tuple."""
    if axis is None:
        return None
    if isinstance(axis, str) and axis == "torch":
        return "torch"
    if isinstance(axis, str):
        raise ValueError(f'axis must be None, "torch", an int or a tuple of ints, got {axis!r}')
    items = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    for a in items:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise _validate.HyperparameterTypeError(
                f'axis must be None, "torch", an int or a tuple of ints, got {axis!r}'
            )
    ints = tuple(int(a) for a in items)
    if len(set(ints)) != len(ints):
        raise ValueError(f"axis must not repeat an axis, got {axis!r}")
    return ints if isinstance(axis, (tuple, list)) else ints[0]


def _reduced(axis: Axis, shape: torch.Size) -> tuple[int, ...]:
    """The axes ``unitwise_norm`` sums over for a tensor of ``shape``."""
    rank = len(shape)
    if isinstance(axis, str):  # "torch"
        return tuple(range(rank)) if rank <= 1 else tuple(range(1, rank))
    if axis is not None:
        axes = (axis,) if isinstance(axis, int) else tuple(axis)  # type: ignore[arg-type]
        out = []
        for a in axes:
            if not -rank <= a < rank:
                raise ValueError(
                    f"axis {a} is out of range for a tensor of shape {tuple(shape)} (rank {rank})"
                )
            out.append(a % rank)
        if len(set(out)) != len(out):
            raise ValueError(f"axis {axis!r} names an axis twice for rank {rank}")
        return tuple(out)
    if sum(1 for n in shape if n != 1) <= 1:  # scalars and vectors (after squeezing)
        return tuple(range(rank))
    if rank in (2, 3):
        return (0,)
    if rank == 4:
        return (0, 1, 2)
    if rank == 5:
        return (0, 1, 2, 3)
    raise ValueError(
        f"unitwise_norm: expected a tensor of rank <= 5, got shape {tuple(shape)}: pass axis "
        '(e.g. axis="torch") for other ranks'
    )


def unitwise_norm(x: Tensor, axis: Axis = None) -> Tensor:
    """L2 norm per unit, broadcast to ``x.shape``; complex ``x`` sums ``|x|^2``.

    A unit is what is left when the reduced axes are summed over:

    * ``axis=None``: optax's (JAX's ``(in, out)``) layout by rank: scalars and vectors (also
      after squeezing size-1 axes) whole, 2-D and 3-D over axis 0, 4-D over axes 0-2, 5-D over
      axes 0-3; other ranks need ``axis``;
    * ``axis="torch"``: torch's ``(out, in, *kernel)`` layout, one unit per output: rank >= 2
      over axes ``1 .. ndim-1`` (a ``Linear`` weight's rows, a ``Conv`` weight's output
      channels), scalars and vectors whole (a bias is one unit);
    * an int or a tuple of ints: those axes (negative ones count from the end; ``()`` makes
      every element its own unit), as optax's ``axis``.
    """
    dims = _reduced(_check_axis(axis), x.shape)
    x2 = torch.real(x * x.conj()) if x.is_complex() else x * x  # |x|^2 for complex x
    sq = torch.sum(x2, dim=dims, keepdim=True) if dims else x2  # (dim=() would sum everything)
    return torch.broadcast_to(torch.sqrt(sq), x.shape)


def adaptive_grad_clip(
    clipping: float | Tensor, eps: float | Tensor = 1e-3, axis: Axis = None
) -> GradientTransformation:
    """Unit-wise adaptive gradient clipping (Brock et al. 2021, NFNets).

    ``max = clipping * max(||p||_unit, eps)``; ``u -> u`` where ``||u||_unit < max``, else
    ``u * max / max(||u||_unit, 1e-6)``. Needs ``params``. The units are those of
    :func:`unitwise_norm`: by default optax's (JAX) layout, where a 2-D weight ``(in, out)``
    has one unit per column (norms over axis 0); ``axis="torch"`` fits torch's ``(out, in)``
    weights (norms over axes ``1 .. ndim-1``: one unit per output row or output channel, as
    timm's and the NFNet paper's PyTorch code); an int or tuple of ints reduces those axes
    (optax's ``axis``). An axis out of range for a leaf is a ``ValueError`` naming the leaf.
    """
    _validate.non_negative("clipping", clipping)
    _validate.non_negative("eps", eps)
    axis = _check_axis(axis)

    def apply(updates: Updates, params: Params | None) -> Updates:
        if params is None:
            raise ValueError("adaptive_grad_clip needs params: call update(updates, state, params)")
        g, at = tree.split(updates)
        p = at.take(params, "params")
        out = []
        for i, gi, pi in zip(at.index, g, p, strict=True):
            try:
                g_norm = unitwise_norm(gi, axis)
            except ValueError as err:
                raise ValueError(
                    f"adaptive_grad_clip: the updates at {at.path(i)}: {err}"
                ) from None
            max_norm = clipping * torch.clamp(unitwise_norm(pi, axis), min=eps)
            clipped = gi * (max_norm / torch.clamp(g_norm, min=1e-6))
            out.append(torch.where(g_norm < max_norm, gi, clipped).to(gi.dtype))
        return at.updates(out)

    return stateless(apply)


def agc_factors_from_norms(
    unorm: Tensor, pnorm: Tensor, clip: float | Tensor, pmin: float | Tensor
) -> Tensor:
    """Per-tensor DreamerV3 clip factors ``1 / max(1, ||u|| / (clip * max(pmin, ||p||)))``
    (1 where ``clip == 0``), from stacked update and param norms."""
    upper = clip * torch.clamp(pnorm, min=pmin)
    factor = 1.0 / torch.clamp(unorm / upper, min=1.0)
    if isinstance(clip, Tensor):
        factor = torch.where(clip > 0, factor, torch.ones_like(factor))
    return factor


def check_agc(clip: float | Tensor, pmin: float | Tensor, clip_name: str = "clip") -> None:
    """Checks ``clip_by_agc``'s arguments: ``clip >= 0``; where clipping can be on (``clip``
    not a Python 0), ``pmin > 0`` with ``clip * pmin >= 1.2e-38`` (float32's smallest normal).
    The bound ``clip * max(pmin, ||p||)`` is computed in at least float32: were it 0, a zero
    param with a zero gradient would give ``0 / 0 = NaN``, for good."""
    _validate.non_negative(clip_name, clip)
    _validate.non_negative("pmin", pmin)
    if isinstance(clip, (int, float)) and clip == 0:
        return
    if isinstance(pmin, (int, float)) and pmin == 0:
        raise ValueError(
            f"pmin must be > 0 unless {clip_name} == 0 (with pmin = 0 a zero param with a zero "
            f"gradient gets a zero clipping bound and 0 / 0 = NaN), got pmin={pmin!r}, "
            f"{clip_name}={clip!r}"
        )
    tiny = torch.finfo(torch.float32).tiny
    if isinstance(clip, (int, float)) and isinstance(pmin, (int, float)) and clip * pmin < tiny:
        raise ValueError(
            f"{clip_name} * pmin must be >= {tiny!r} (float32's smallest normal number; the "
            f"clipping bound would be 0 for a zero param), got {clip_name}={clip!r}, "
            f"pmin={pmin!r}"
        )


def clip_by_agc(clip: float | Tensor = 0.3, pmin: float | Tensor = 1e-3) -> GradientTransformation:
    """DreamerV3's per-tensor adaptive clipping:
    ``u -> u / max(1, ||u|| / (clip * max(pmin, ||p||)))``; ``clip=0`` disables it. Needs params.

    ``pmin`` must be ``> 0`` unless ``clip == 0``, with ``clip * pmin >= 1.2e-38``: with a zero
    bound a zero param with a zero gradient would get ``0 / 0 = NaN`` (see :func:`check_agc`).
    """
    check_agc(clip, pmin)

    def apply(updates: Updates, params: Params | None) -> Updates:
        if isinstance(clip, (int, float)) and clip == 0:
            return updates
        if params is None:
            raise ValueError("clip_by_agc needs params: call update(updates, state, params)")
        g, at = tree.split(updates, elementwise=True)
        if not g:
            return updates
        p = at.take(params, "params")
        unorm, pnorm = at.norm_vectors(g, p)
        return at.updates(at.scale_leaves(g, agc_factors_from_norms(unorm, pnorm, clip, pmin)))

    return stateless(apply, elementwise=True, leafwise=True)
