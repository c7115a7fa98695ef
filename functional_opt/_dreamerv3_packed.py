"""DreamerV3's fused update over packed trees (:mod:`functional_opt.packed`): the kernels of
:mod:`functional_opt._dreamerv3_fused` on views of the buffers, with no per-leaf Python."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from functional_opt import _kernels, _lists, tree
from functional_opt._dreamerv3_fused import (
    KERNEL_MIN,
    RUN_MIN,
    Hyper,
    check_state,
    foreach_update,
    kernel_options,
    kernel_scalars,
    leaf_norms,
    rows_update,
)
from functional_opt.base import OptState, Params, Updates, safe_increment
from functional_opt.packed import Layout, Packed
from functional_opt.transforms.clipping import agc_factors, agc_factors_from_norms
from functional_opt.transforms.moments import EmaState, ScaleByRmsWithCountState
from functional_opt.transforms.scaling import ScaleByScheduleState


class _Plan(NamedTuple):
    """How one buffer of a packed layout runs: consecutive large leaves of one size
    ``(start, rows, n)`` one kernel call per size (their norms by BLAS dot products, as for
    separate large leaves), runs of at least ``RUN_MIN`` consecutive small leaves of one size
    one call per run, the other leaves (``rest``, leaf indices) through the multi-tensor ops."""

    big: list[tuple[int, int, int]]
    runs: list[tuple[int, int, int]]
    rest: list[int]


def _plans(layout: Layout) -> list[_Plan]:
    """The :class:`_Plan` of each buffer of ``layout`` (made once per layout)."""
    key = ("dreamerv3", KERNEL_MIN, RUN_MIN)
    plans: list[_Plan] | None = layout._plans.get(key)
    if plans is None:
        plans = [_plan(layout, b) for b in range(len(layout.sizes))]
        layout._plans[key] = plans
    return plans


def _plan(layout: Layout, buffer: int) -> _Plan:
    plan = _Plan([], [], [])
    leaves = layout.members(buffer)
    start = {i: slot[1] for i in leaves if (slot := layout.slots[i]) is not None}
    numel = {i: shape.numel() for i in leaves if (shape := layout.shapes[i]) is not None}
    run: list[int] = []  # consecutive leaves of one size

    def close(run: list[int]) -> None:
        if not run:
            return
        rows = (start[run[0]], len(run), numel[run[0]])
        if numel[run[0]] >= KERNEL_MIN:
            plan.big.append(rows)
        elif len(run) >= RUN_MIN:
            plan.runs.append(rows)
        else:
            plan.rest.extend(run)

    for i in leaves:
        n = numel[i]
        if n == 0:
            continue  # nothing to update
        if run and numel[run[0]] == n and start[run[-1]] + n == start[i]:
            run.append(i)
            continue
        close(run)
        run = [i]
    close(run)
    return plan


def packed_update(
    h: Hyper,
    updates: Updates,
    state: OptState,
    params: Params | None,
    donate: bool,
    donate_updates: bool,
) -> tuple[Updates, OptState] | None:
    """The fused update over the buffers of packed trees (:mod:`functional_opt.packed`):
    gradients, params and both moments packed with one layout, in eager mode, with the
    kernels' options (``None``: not applicable).

    The same kernels and norms as the per-leaf path, on views of the buffers, so a tree of
    thousands of small leaves costs no per-leaf Python. The moments are updated in place when
    donated and the update written into the gradients' buffers when they are donated too;
    otherwise into copies (the same arithmetic either way). Loose packed trees (rebuilt from
    separate tensors, e.g. by a transform before this one in a chain) are copied into buffers
    first. Gradients must be of at least 32 bits. A buffer holds its leaves by size, so runs
    here are leaves of one size where the per-leaf path stacks leaves of one shape: the two can
    route a small leaf differently (equal to float rounding)."""
    check_state(h, state)  # (first: dreamerv3's every path names a wrong state alike)
    if not (kernel_options(h) and isinstance(updates, Packed)) or torch.compiler.is_compiling():
        return None
    original = updates
    rms_state: ScaleByRmsWithCountState = state[1]
    ema_state: EmaState = state[2]
    if updates.buffers is None:  # loose: copied into buffers below, unless 16-bit
        if any(x.element_size() < 4 for x in tree.leaves(updates.tree) if x is not None):
            return None
        updates = updates.repack()
    assert updates.layout is not None and updates.buffers is not None
    layout = updates.layout
    if layout.structure.batch:  # (per-leaf norms over batched leaves: the per-leaf path)
        return None
    if any(g.element_size() < 4 for g in updates.buffers):
        return None  # (16-bit updates are fresh buffers: see ``writable``)
    trees = (updates, params, rms_state.nu, ema_state.ema)
    if not all(isinstance(t, Packed) and t.structure == layout.structure for t in trees):
        return None
    buffers: list[list[Tensor]] = []
    owned: list[bool] = []  # a fresh copy of a loose tree: ours to write
    for t in trees:
        packed = t.repack()  # type: ignore[union-attr]
        if packed.layout != layout or packed.buffers is None:
            return None
        buffers.append(list(packed.buffers))
        owned.append(packed is not t)
        if t is rms_state.nu:  # the state's layout object persists from step to step, and
            layout = packed.layout  # with it the routing cached on it (``_plans``)
    flat = [b for bs in buffers for b in bs]
    if len(set(map(id, flat))) != len(flat) or not _lists.use_foreach(flat, *h):
        return None
    if torch.is_grad_enabled() and _lists.tracked(flat):
        return None
    g_b, p_b, nu_b, mu_b = buffers
    for g, p, nu, mu in zip(g_b, p_b, nu_b, mu_b, strict=True):
        if p.dtype != g.dtype or mu.dtype != nu.dtype or g.dtype.is_complex:
            return None  # (the kernels are real: complex leaves take the per-leaf path)
        if torch.promote_types(nu.dtype, g.dtype) != nu.dtype:
            return None
        if not (g.device == p.device == nu.device == mu.device):
            return None
    if not (donate_updates or updates is not original):  # (a repacked copy is ours)
        g_b = [g.clone() for g in g_b]  # the update's buffers
    if not (donate or owned[2]):
        nu_b = [nu.clone() for nu in nu_b]
    if not (donate or owned[3]):
        mu_b = [mu.clone() for mu in mu_b]
    count = safe_increment(rms_state.count)
    ema_count = safe_increment(ema_state.count)
    sched_state: ScaleByScheduleState = state[-1]
    lr_step = -1.0 * torch.as_tensor(h.schedule(sched_state.count))
    step, inv_bc2, scalars, decay = kernel_scalars(h, count, ema_count, lr_step)
    agc_off = isinstance(h.agc, (int, float)) and h.agc == 0
    for plan, g, p, nu, mu in zip(_plans(layout), g_b, p_b, nu_b, mu_b, strict=True):
        if plan.rest:
            views = [[layout.view(i, x) for i in plan.rest] for x in (g, p, nu, mu)]
            gv, pv, nuv, muv = views
            factors = None if agc_off else agc_factors(gv, pv, h.agc, h.pmin)
            u, nu_new, mu_new = foreach_update(
                h, gv, pv, nuv, muv, factors, count, ema_count, lr_step, donate=True
            )
            _copy_into(nuv + muv + gv, nu_new + mu_new + u)
        if plan.big:
            leaves = [(s + k * n, s + (k + 1) * n) for s, rows, n in plan.big for k in range(rows)]
            if agc_off:  # no clipping
                big_factors = torch.ones(len(leaves), dtype=torch.float32, device=g.device)
            else:
                unorm, pnorm = leaf_norms([g[a:b] for a, b in leaves], [p[a:b] for a, b in leaves])
                big_factors = agc_factors_from_norms(unorm, pnorm, h.agc, h.pmin)
            first = 0
            for s, rows, n in plan.big:
                _big_call(
                    (g, p, nu, mu), s, rows, n, big_factors[first : first + rows], step, decay,
                    (inv_bc2, *scalars),
                )  # fmt: skip
                first += rows
        for s, rows, n in plan.runs:
            gr, pr, nur, mur = (x[s : s + rows * n].view(rows, n) for x in (g, p, nu, mu))
            factor = torch.ones((rows, 1), dtype=nu.dtype, device=nu.device)
            if not agc_off:
                pnorm = torch.linalg.vector_norm(pr, dim=1, dtype=nu.dtype)
                unorm = torch.linalg.vector_norm(gr, dim=1, dtype=nu.dtype)
                factor = agc_factors_from_norms(unorm, pnorm, h.agc, h.pmin).view(rows, 1)
            rows_update(gr, nur, mur, factor, step, (inv_bc2, *scalars), pr, decay)
    new_state = list(state)
    new_state[1] = ScaleByRmsWithCountState(count, Packed(layout, buffers=nu_b))
    new_state[2] = EmaState(ema_count, Packed(layout, buffers=mu_b))
    new_state[-1] = ScaleByScheduleState(safe_increment(sched_state.count))
    return Packed(layout, buffers=g_b), tuple(new_state)


def _big_call(
    buffers: tuple[Tensor, Tensor, Tensor, Tensor],
    s: int,
    rows: int,
    n: int,
    factors: Tensor,
    step: Tensor,
    decay: Tensor | None,
    scalars: tuple[Tensor, ...],
) -> None:
    """One kernel call for ``rows`` consecutive large leaves of ``n`` elements from ``s``: one
    leaf as a 1-d view with 0-d factor and step (the per-leaf path's call), several as the rows
    of a matrix with a factor and step per row (the same arithmetic)."""
    g, p, nu, mu = (x[s : s + rows * n] for x in buffers)
    if rows > 1:
        g, p, nu, mu = (x.view(rows, n) for x in (g, p, nu, mu))
        rows_update(g, nu, mu, factors.to(nu.dtype).view(rows, 1), step, scalars, p, decay)
        return
    tail: tuple[Tensor, ...] = () if decay is None else (p, decay)
    _kernels.call(_kernels.update_kernel_in_place, g, nu, mu, factors[0], step, *scalars, *tail)


def _copy_into(targets: list[Tensor], values: list[Tensor]) -> None:
    """``t.copy_(v)`` for each pair where ``v`` is not already ``t``."""
    pairs = [(t, v) for t, v in zip(targets, values, strict=True) if t is not v]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])  # type: ignore[misc]
