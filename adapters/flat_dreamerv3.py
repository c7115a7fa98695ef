"""The fast path of :class:`DreamerV3Optimizer`: flat buffers and one compiled kernel.

A DreamerV3 step is elementwise work over ``g, p, nu, mu`` plus the per-tensor norms of ``g``
and ``p`` that adaptive clipping needs. This path keeps, for each (device, dtype) bucket of a
param group, the params, their gradients and both moments in contiguous flat buffers (the params,
their ``.grad`` and the optimizer state become views into them, as DDP's
``gradient_as_bucket_view`` does for gradients). Tensors are laid out in *runs* of equal size,
so a run of ``rows`` tensors of ``size`` elements is a 2-D view ``[rows, size]`` and one step
is:

1. per-tensor norms of gradients and params: one reduction per run, giving the clip factors;
2. one call per run of the elementwise kernel ``functional_opt._kernels.apply_kernel``,
   compiled once with ``torch.compile`` (``dynamic=True``: one kernel serves every shape),
   reading ``g, p, nu, mu`` and writing ``nu, mu, p`` with the run's clip factors and step sizes
   broadcast per row. Runs too small to be worth a call of their own (fewer than ``MERGE``
   elements in all) share one eager run of the same function, with the clip factor spread per
   element.

So 2000 tensors of one size cost what one large tensor costs, and a model with a handful of
distinct shapes makes a handful of kernel calls. Gradients and params are never modified outside
the kernel's own write of ``p`` (the clip is applied inside the kernel). The math is that of
``functional_opt.dreamerv3`` (and torchrl's optimizer), checked against it in the tests to float32
rounding. A gradient that is not already a view of the bucket (a fresh ``.grad`` after
``zero_grad(set_to_none=True)``) is copied in first and replaced by its view. Params without a
gradient are masked out per tensor (their state and value are untouched).

The path is used only for plain dense tensors whose options are Python numbers; anything else
(``DTensor``, sparse gradients, tensor options) goes through the generic
:class:`~functional_opt.adapters.TransformOptimizer` step. If ``torch.compile`` is unavailable
or fails, the same kernel runs eagerly.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _kernels
from functional_opt._kernels import apply_kernel
from functional_opt.transforms.moments import moment_dtype

__all__ = ["FlatBucket", "eligible_options", "eligible_params"]


def _row_norms(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The L2 norm of each row of ``x`` in ``dtype`` (a cascade sum: more accurate than
    ``vector_norm``, and without a widened copy of 16-bit inputs)."""
    y = x.to(dtype)
    return torch.sqrt((y * y).sum(-1))


MERGE = 1 << 16
"""Runs with fewer elements than this (all their tensors together) share one eager pass."""

DOT_ROWS = 1 << 14
DOT_MAX_COUNT = 256
"""Norms of runs of at most ``DOT_MAX_COUNT`` float32/64 tensors of at least ``DOT_ROWS``
elements are BLAS dot products, one per tensor."""


def eligible_params(params: Sequence[Tensor]) -> bool:
    """Whether the flat path can hold these params: plain dense floating tensors."""
    return all(
        type(p) in (Tensor, torch.nn.Parameter)
        and p.layout == torch.strided
        and p.is_floating_point()
        for p in params
    )


def eligible_options(options: dict[str, Any]) -> bool:
    """Whether a group's options are Python numbers (tensor options take the generic path)."""
    return all(
        isinstance(options[k], (int, float)) and not isinstance(options[k], bool)
        for k in ("lr", "agc", "parameter_norm_min", "beta1", "beta2", "eps", "warmup_steps")
    )


def _eligible_grad(g: Tensor, view: Tensor) -> bool:
    return (
        type(g) is Tensor
        and g.layout == torch.strided
        and g.shape == view.shape
        and g.device == view.device
    )


class Run(NamedTuple):
    """``rows`` tensors of ``size`` elements each, starting at tensor ``first`` and element
    ``offset`` of the bucket."""

    first: int
    rows: int
    size: int
    offset: int


class FlatBucket:
    """Params of one (device, dtype) bucket with their gradients and moments in flat buffers.

    Layout: the runs small enough to share a kernel call first (the *merged region*), then the
    others, each group sorted by size; every run is a 2-D view ``[rows, size]``.
    """

    def __init__(self, params: list[Tensor]) -> None:
        by_size: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            by_size.setdefault(p.numel(), []).append(i)
        merged = sorted(n for n, idx in by_size.items() if n * len(idx) < MERGE)
        own = sorted(n for n, idx in by_size.items() if n * len(idx) >= MERGE)
        order = [i for n in merged + own for i in by_size[n]]
        self.params = [params[i] for i in order]
        self.sizes = [p.numel() for p in self.params]
        first = params[0]
        mdtype = moment_dtype(first, "float32_for_16bit")
        with torch.no_grad():
            self.p = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.g = torch.zeros_like(self.p)
        self.nu = torch.zeros_like(self.p, dtype=mdtype)
        self.mu = torch.zeros_like(self.p, dtype=mdtype)
        self.p_views = self._views(self.p)
        self.g_views = self._views(self.g)
        self.nu_views = self._views(self.nu)
        self.mu_views = self._views(self.mu)
        self.runs: list[Run] = []
        offset = first_index = 0
        for n in merged + own:
            count = len(by_size[n])
            self.runs.append(Run(first_index, count, n, offset))
            first_index += count
            offset += count * n
        self.merged_runs = len(merged)
        self.merged_numel = sum(n * len(by_size[n]) for n in merged)
        self.merged_tensors = sum(len(by_size[n]) for n in merged)
        device = self.p.device
        # The sizes that spread the merged tensors' clip factors per element, and the row buffer
        # that carries each tensor's step size into the kernel.
        self.merged_sizes = torch.tensor(self.sizes[: self.merged_tensors], device=device)
        self.step_rows = torch.empty((len(self.params), 1), dtype=mdtype, device=device)
        self.flats = (self.g, self.p, self.nu, self.mu)
        for p, view in zip(self.params, self.p_views, strict=True):
            p.data = view
        self.data_ptrs = [v.data_ptr() for v in self.p_views]
        self.everyone = list(range(len(self.params)))
        self.unbound = set(self.everyone)
        """Params whose optimizer-state entries are not yet the bucket's views."""

    def _views(self, flat: Tensor) -> list[Tensor]:
        return [
            v.view_as(p) for v, p in zip(torch.split(flat, self.sizes), self.params, strict=True)
        ]

    def intact(self) -> bool:
        """Whether every param still lives in the bucket (nobody re-pointed ``p.data``)."""
        return list(map(Tensor.data_ptr, self.params)) == self.data_ptrs

    def adopt_state(self, states: dict[Tensor, dict[str, Any]], names: tuple[str, str]) -> None:
        """Make ``states[p][names]`` the bucket's views, copying values that live elsewhere
        (after ``load_state_dict``, or state made by the generic path)."""
        rms, momentum = names
        for i, (p, nu, mu) in enumerate(
            zip(self.params, self.nu_views, self.mu_views, strict=True)
        ):
            entry = states.get(p)
            if not entry:
                continue
            for name, view in ((rms, nu), (momentum, mu)):
                current = entry.get(name)
                if current is None or current.data_ptr() == view.data_ptr():
                    continue
                view.copy_(current)
                entry[name] = view
            self.unbound.discard(i)

    def bind_state(
        self, states: dict[Tensor, dict[str, Any]], names: tuple[str, str], present: list[int]
    ) -> None:
        """Give the params at ``present`` that have no state entry yet the bucket's views."""
        if not self.unbound:
            return
        for i in present:
            if i in self.unbound:
                entry = states[self.params[i]]
                entry[names[0]] = self.nu_views[i]
                entry[names[1]] = self.mu_views[i]
                self.unbound.discard(i)

    def _rows(self, flat: Tensor, run: Run) -> Tensor:
        return flat[run.offset : run.offset + run.rows * run.size].view(run.rows, run.size)

    def _run_norms(self, flat: Tensor, run: Run) -> Tensor:
        """The L2 norm of each tensor of ``run`` (in the moment dtype).

        Long float32/float64 rows use BLAS dot products (one stream at full read bandwidth);
        other float32/64 runs and small runs one eager ``vector_norm``; long 16-bit runs a
        compiled cascade sum (no widened copy; like the dot products, more accurate than
        ``vector_norm``)."""
        mdtype = self.nu.dtype
        rows = self._rows(flat, run)
        if flat.dtype == mdtype and run.size >= DOT_ROWS and run.rows <= DOT_MAX_COUNT:
            return torch.stack([torch.dot(r, r) for r in rows]).sqrt_()
        out: Tensor
        if flat.dtype == mdtype or run.rows * run.size < MERGE:
            out = torch.linalg.vector_norm(rows, dim=1, dtype=mdtype)
        else:
            out = _kernels.call(_row_norms, rows, mdtype)
        return out

    def _factors(self, run: Run, agc: float, pmin: float) -> Tensor:
        """Each tensor's clip factor ``1 / max(1, ||g|| / (agc max(pmin, ||p||)))``."""
        if agc <= 0:
            return torch.ones(run.rows, dtype=self.nu.dtype, device=self.p.device)
        upper = agc * torch.clamp(self._run_norms(self.p, run), min=pmin)
        return 1.0 / torch.clamp(self._run_norms(self.g, run) / upper, min=1.0)

    def gather_grads(self) -> list[int] | None:
        """The bucket indices of the params with a gradient, after copying gradients that are
        not views of the bucket in (their ``.grad`` becomes the view); ``None`` if a gradient
        is one the flat path cannot take (sparse, a tensor subclass), before copying anything.
        """
        views = self.g_views
        grads = [p.grad for p in self.params]
        if all(map(operator.is_, grads, views)):  # the usual step: nothing to do
            return self.everyone
        present = []
        copy = []
        for i, (g, view) in enumerate(zip(grads, views, strict=True)):
            if g is None:
                continue
            present.append(i)
            if g is not view:
                if not _eligible_grad(g, view):
                    return None
                copy.append(i)
        if copy:
            torch._foreach_copy_([views[i] for i in copy], [grads[i] for i in copy])  # type: ignore[misc]
            for i in copy:
                self.params[i].grad = views[i]
        return present

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
        """One update of the params at ``present`` (from :meth:`gather_grads`)."""
        params = self.params
        absent = (
            [] if len(present) == len(params) else sorted(set(range(len(params))) - set(present))
        )
        for i in absent:
            self.g_views[i].zero_()
        # Params without a gradient keep value and state: the kernel runs over the whole
        # bucket (their gradient is zero), then what it changed of theirs is put back.
        saved = [
            (i, self.p_views[i].clone(), self.nu_views[i].clone(), self.mu_views[i].clone())
            for i in absent
        ]
        step_size = -lr / bc1
        self.step_rows.fill_(step_size)
        values = (1 / bc2, beta1, beta2, eps)
        scalars = [torch.tensor(x, dtype=torch.float64) for x in values]
        if self.merged_numel:
            n = self.merged_numel
            merged = self.runs[: self.merged_runs]
            factors = [self._factors(run, agc, pmin) for run in merged]
            factor = factors[0] if len(factors) == 1 else torch.cat(factors)
            spread = torch.repeat_interleave(factor, self.merged_sizes, output_size=n)
            # Small by construction: eager ops cost less than compiling one more kernel form.
            g, p, nu, mu = (t[:n].view(1, n) for t in self.flats)
            apply_kernel(g, p, nu, mu, spread.view(1, n), self.step_rows[:1], *scalars)
        # Run by run. (Updating in chunks right after their norms, so that the kernel would find
        # g and p in cache, measured slower on W1: the calls cost more than the cache saves.)
        for run in self.runs[self.merged_runs :]:
            _kernels.call(
                apply_kernel,
                *(self._rows(t, run) for t in self.flats),
                self._factors(run, agc, pmin).view(-1, 1),
                self.step_rows[run.first : run.first + run.rows],
                *scalars,
            )
        for i, p, nu, mu in saved:
            self.p_views[i].copy_(p)
            self.nu_views[i].copy_(nu)
            self.mu_views[i].copy_(mu)
