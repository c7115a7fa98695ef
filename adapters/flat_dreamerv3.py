"""The fast path of :class:`DreamerV3Optimizer`: flat buffers and one compiled kernel.

A DreamerV3 step is memory-bound elementwise work. This path keeps, for each (device, dtype)
bucket of a param group, the params, their gradients and both moments in contiguous flat
buffers (the params and the optimizer state become views into them, as DDP's
``gradient_as_bucket_view`` does for gradients), so that one step is:

1. per-tensor norms of gradients and params (one reduction per run of equally sized tensors)
   giving the per-tensor clip factors;
2. one elementwise kernel, compiled once with ``torch.compile`` (``dynamic=True``: one kernel
   serves every size), reading ``g, p, nu, mu`` and writing ``nu, mu, p``. It runs on 1-D
   views: once over all small tensors (their clip factors applied to the gradient buffer
   first, one op per run) and once per tensor of at least ``LARGE`` elements (its factor
   passed as an argument, so no extra pass over memory).

So 2000 small tensors cost about what one large tensor costs. The math is that of
``functional_opt.dreamerv3`` (and torchrl's optimizer), checked against it in the tests to
float32 rounding. A gradient that is not already a view of the bucket is copied in first.
Params without a gradient are masked out per tensor (their state and value are untouched).

The path is used only for plain dense tensors whose options are Python numbers; anything else
(``DTensor``, sparse gradients, tensor options) goes through the generic
:class:`~functional_opt.adapters.TransformOptimizer` step. If ``torch.compile`` is unavailable
or fails, the same kernel runs eagerly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["FlatBucket", "dreamerv3_kernel", "eligible"]


def dreamerv3_kernel(
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
    """One DreamerV3 update of a run of equally sized tensors (2-D views ``[count, size]``), in
    place (``nu``, ``mu``, ``p``), with ``factor`` (``[count, 1]``) each tensor's clip factor:
    ``g' = factor g``; ``nu' = b2 nu + (1-b2) g'^2``; ``r = g' / (sqrt(nu' inv_bc2) + eps)``;
    ``mu' = b1 mu + (1-b1) r``; ``p' = p + step_size mu'``, where ``inv_bc2 = 1/(1-b2^t)`` and
    ``step_size = -lr_t/(1-b1^t)`` (scalars: one division per element, not three).
    """
    gs = g.to(nu.dtype) * factor
    nu_new = beta2 * nu + (1 - beta2) * (gs * gs)
    r = gs / (torch.sqrt(nu_new * inv_bc2) + eps)
    mu_new = beta1 * mu + (1 - beta1) * r
    nu.copy_(nu_new)
    mu.copy_(mu_new)
    p.copy_((p.to(mu.dtype) + mu_new * step_size).to(p.dtype))


_KERNEL: dict[str, Callable[..., None]] = {}

LARGE = 1 << 16
"""Tensors with at least this many elements get a kernel call of their own."""


def _compiled_kernel() -> Callable[..., None]:
    if "fn" not in _KERNEL:
        _KERNEL["fn"] = torch.compile(dreamerv3_kernel, fullgraph=True, dynamic=True)
    return _KERNEL["fn"]


def eligible(params: Sequence[Tensor], options: dict[str, Any]) -> bool:
    """Whether the flat path can run a group: plain dense floating tensors, numeric options."""
    for p in params:
        if type(p) not in (Tensor, torch.nn.Parameter) or p.layout != torch.strided:
            return False
        if not p.is_floating_point():
            return False
        g = p.grad
        if g is not None and (type(g) is not Tensor or g.is_sparse):
            return False
    return all(
        isinstance(options[k], (int, float)) and not isinstance(options[k], bool)
        for k in ("lr", "agc", "parameter_norm_min", "beta1", "beta2", "eps", "warmup_steps")
    )


def _moment_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class FlatBucket:
    """Params of one (device, dtype) bucket with their gradients and moments in flat buffers.

    The params are laid out sorted by size, so that runs of equally sized tensors (all the
    biases of a width, all the blocks of a transformer) are 2-D views: their norms and clip
    factors then cost one op per run, not one per tensor.
    """

    def __init__(self, params: list[Tensor]) -> None:
        order = sorted(range(len(params)), key=lambda i: params[i].numel())
        self.params = [params[i] for i in order]
        self.sizes = [p.numel() for p in self.params]
        first = params[0]
        mdtype = _moment_dtype(first.dtype)
        with torch.no_grad():
            self.p = torch.cat([p.detach().reshape(-1) for p in self.params])
        # Gradients are kept in the moment dtype: 16-bit gradients are widened on the copy in.
        self.g = torch.zeros_like(self.p, dtype=mdtype)
        self.nu = torch.zeros_like(self.p, dtype=mdtype)
        self.mu = torch.zeros_like(self.p, dtype=mdtype)
        self.p_views = self._views(self.p)
        self.g_views = self._views(self.g)
        self.nu_views = self._views(self.nu)
        self.mu_views = self._views(self.mu)
        self.runs: list[tuple[int, int, int, int]] = []  # (first tensor, count, size, offset)
        offset = 0
        i = 0
        while i < len(self.sizes):
            j = i
            while j < len(self.sizes) and self.sizes[j] == self.sizes[i]:
                j += 1
            self.runs.append((i, j - i, self.sizes[i], offset))
            offset += (j - i) * self.sizes[i]
            i = j
        self.offsets = [0]
        for n in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.first_large = next(
            (i for i, n in enumerate(self.sizes) if n >= LARGE), len(self.sizes)
        )
        self.small_numel = sum(self.sizes[: self.first_large])
        self.flats = (self.g, self.p, self.nu, self.mu)
        for p, view in zip(self.params, self.p_views, strict=True):
            p.data = view
        self.data_ptrs = [v.data_ptr() for v in self.p_views]
        self._kernel: Callable[..., None] | None = None

    def _views(self, flat: Tensor) -> list[Tensor]:
        return [
            v.view_as(p) for v, p in zip(torch.split(flat, self.sizes), self.params, strict=True)
        ]

    def intact(self) -> bool:
        """Whether every param still lives in the bucket (nobody re-pointed ``p.data``)."""
        return [p.data_ptr() for p in self.params] == self.data_ptrs

    def adopt_state(self, states: dict[Tensor, dict[str, Any]], names: tuple[str, str]) -> None:
        """Make ``states[p][names]`` the bucket's views, copying values that live elsewhere
        (after ``load_state_dict``, or state made by the generic path)."""
        rms, momentum = names
        for p, nu, mu in zip(self.params, self.nu_views, self.mu_views, strict=True):
            entry = states.get(p)
            if not entry:
                continue
            for name, view in ((rms, nu), (momentum, mu)):
                current = entry.get(name)
                if current is None or current.data_ptr() == view.data_ptr():
                    continue
                view.copy_(current)
                entry[name] = view

    def _run_norms(self, flat: Tensor) -> Tensor:
        """The L2 norm of every tensor of the bucket (in the moment dtype), one op per run."""
        mdtype = self.nu.dtype
        parts = [
            torch.linalg.vector_norm(
                flat[offset : offset + count * size].view(count, size), dim=1, dtype=mdtype
            )
            for _, count, size, offset in self.runs
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def step(
        self,
        present: list[int],
        *,
        lr: float,
        bc1: float,
        bc2: float,
        agc: float,
        pmin: float,
        beta1: float,
        beta2: float,
        eps: float,
    ) -> None:
        """One update of the params at ``present`` (bucket indices of params with a gradient)."""
        params = self.params
        dst = []
        src = []
        for i in present:
            g = params[i].grad
            view = self.g_views[i]
            if g is not view:
                dst.append(view)
                src.append(g)
        if dst:
            torch._foreach_copy_(dst, src)  # type: ignore[arg-type]
            if self.g.dtype == self.p.dtype:
                for i in present:
                    params[i].grad = self.g_views[i]
        absent = (
            [] if len(present) == len(params) else sorted(set(range(len(params))) - set(present))
        )
        for i in absent:
            self.g_views[i].zero_()
        if agc > 0:
            upper = agc * torch.clamp(self._run_norms(self.p), min=pmin)
            factor = 1.0 / torch.clamp(self._run_norms(self.g) / upper, min=1.0)
        else:
            factor = torch.ones(len(params), dtype=self.nu.dtype, device=self.p.device)
        # Params without a gradient keep value and state: the kernel runs over the whole
        # bucket (their gradient is zero), then what it changed of theirs is put back.
        saved = [
            (i, self.p_views[i].clone(), self.nu_views[i].clone(), self.mu_views[i].clone())
            for i in absent
        ]
        values = (-lr / bc1, 1 / bc2, beta1, beta2, eps)
        scalars = [torch.tensor(x, dtype=torch.float64) for x in values]
        # Small tensors: their clip factors are applied to the gradient buffer (one op per run),
        # then one kernel call covers them all. Large tensors: one call each, with the factor as
        # an argument (no extra pass over memory). Kernels always see 1-D runs ([1, n] views):
        # broadcasting a per-row factor over 2-D views compiles to a kernel twice as slow.
        small = self.small_numel
        if small:
            if agc > 0:
                for first, count, size, offset in self.runs:
                    if size >= LARGE:
                        break
                    block = self.g[offset : offset + count * size].view(count, size)
                    block.mul_(factor[first : first + count, None])
            one = torch.ones((1, 1), dtype=self.nu.dtype, device=self.p.device)
            self._run(*(t[:small].view(1, small) for t in self.flats), one, *scalars)
        for i in range(self.first_large, len(params)):
            offset, size = self.offsets[i], self.sizes[i]
            self._run(
                *(t[offset : offset + size].view(1, size) for t in self.flats),
                factor[i].view(1, 1),
                *scalars,
            )
        for i, p, nu, mu in saved:
            self.p_views[i].copy_(p)
            self.nu_views[i].copy_(nu)
            self.mu_views[i].copy_(mu)

    def _run(self, *args: Tensor) -> None:
        if self._kernel is None:
            try:
                kernel = _compiled_kernel()
                kernel(*args)
                self._kernel = kernel
                return
            except Exception as err:  # no compiler on this machine, an unsupported device...
                warnings.warn(
                    f"DreamerV3Optimizer: torch.compile of the fused kernel failed ({err!r}); "
                    "running it eagerly",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self._kernel = dreamerv3_kernel
        self._kernel(*args)
