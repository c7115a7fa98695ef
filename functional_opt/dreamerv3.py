"""The DreamerV3 optimizer (Hafner et al. 2023, arXiv:2301.04104), as a chain of transforms."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from functional_opt import _kernels, _lists, _validate, tree
from functional_opt.base import (
    GradientTransformation,
    OptState,
    Params,
    Updates,
    chain,
    donating,
    donating_updates,
    safe_increment,
)
from functional_opt.packed import Layout, Packed
from functional_opt.schedules import Schedule
from functional_opt.transforms.clipping import agc_factors, agc_factors_from_norms, clip_by_agc
from functional_opt.transforms.moments import (
    EmaState,
    MomentDtype,
    ScaleByRmsWithCountState,
    bias_correction,
    ema,
    moment_dtype,
    scale_by_rms,
)
from functional_opt.transforms.scaling import ScaleByScheduleState, scale_by_learning_rate
from functional_opt.transforms.weight_decay import add_decayed_weights
from functional_opt.tree import PyTree

__all__ = ["dreamerv3", "dreamerv3_schedule"]

Number = float | int | Tensor
SCHEDULES = ("const", "linear", "cosine")


def _where(cond: Tensor, a: Tensor | float, b: Tensor | float) -> Tensor:
    return torch.where(
        cond, torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    )


def dreamerv3_schedule(
    lr: Number,
    warmup: Number = 1000,
    schedule: Literal["const", "linear", "cosine"] = "const",
    anneal: Number = 0,
) -> Schedule:
    """DreamerV3's learning rate at update count ``t`` (from 0).

    Warm-up: ``lr * t / warmup`` for ``t < warmup`` (0 on the first update). Then, with
    ``s = t - warmup`` and ``T = anneal - warmup``: ``const`` gives ``lr``; ``linear`` goes
    linearly to ``0.1 lr`` at ``s = T``; ``cosine`` gives
    ``lr * (0.9 * 0.5 * (1 + cos(pi * min(s, T) / T)) + 0.1)``. ``T <= 0`` gives ``lr``.
    Works with tensor hyperparameters (no Python branching on their values).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")

    def fn(count: int | Tensor) -> Tensor:
        t = torch.as_tensor(count).to(torch.float64)
        w = torch.as_tensor(warmup).to(torch.float64)
        span = torch.as_tensor(anneal).to(torch.float64) - w
        # Linear ramp from 0 to lr over `warmup` updates (optax.linear_schedule(0, lr, warmup)).
        ramp = (0.0 - lr) * (1 - torch.clamp(t, min=0) / torch.clamp(w, min=1)) + lr
        s = t - w
        safe_span = torch.clamp(span, min=1)
        if schedule == "const":
            body = torch.zeros_like(t) + lr
        elif schedule == "linear":
            frac = 1 - torch.minimum(torch.clamp(s, min=0), safe_span) / safe_span
            body = _where(span > 0, (lr - 0.1 * lr) * frac + 0.1 * lr, torch.zeros_like(t) + lr)
        else:
            cosine = 0.5 * (1 + torch.cos(math.pi * torch.minimum(s, safe_span) / safe_span))
            body = _where(span > 0, lr * ((1 - 0.1) * cosine + 0.1), torch.zeros_like(t) + lr)
        return torch.where(t < w, ramp, body)

    return fn


def dreamerv3(
    lr: Number = 4e-5,
    *,
    agc: Number = 0.3,
    pmin: Number = 1e-3,
    beta1: Number = 0.9,
    beta2: Number = 0.999,
    eps: Number = 1e-20,
    warmup: Number = 1000,
    momentum: bool = True,
    nesterov: bool = False,
    weight_decay: Number = 0.0,
    weight_decay_mask: PyTree | Callable[[Params], PyTree] | None = None,
    schedule: Literal["const", "linear", "cosine"] = "const",
    anneal: Number = 0,
    _fused: bool = True,
) -> GradientTransformation:
    """DreamerV3's optimizer.

    ``chain(clip_by_agc(agc, pmin), scale_by_rms(beta2, eps, eps_in_sqrt=False,
    bias_correction=True), ema(beta1, debias=True), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(dreamerv3_schedule(lr, warmup, schedule, anneal)))``. That is
    ``u = u / max(1, ||u|| / (agc max(pmin, ||p||)))``, ``nu = b2 nu + (1-b2) u^2``,
    ``r = u / (sqrt(nu / (1-b2^t)) + eps)``, ``mu = b1 mu + (1-b1) r``,
    ``u = -lr_t (mu / (1-b1^t) + wd p)``. ``nesterov`` uses ``b1 mu + (1-b1) r`` in place of
    ``mu``; ``momentum=False`` drops the ``mu`` step. Moments are float32 for 16-bit params.

    In eager mode on multi-tensor-ready lists the update runs as one fused function (the chain's
    ops, fewer passes and allocations, same result); elsewhere (``torch.compile``, ``vmap``, a
    ``weight_decay_mask``, an update autograd records) it runs the chain itself.
    """
    _validate.non_negative("lr", lr)
    _validate.non_negative("agc", agc)
    _validate.non_negative("pmin", pmin)
    _validate.unit_interval("beta1", beta1)
    _validate.unit_interval("beta2", beta2)
    _validate.non_negative("eps", eps)
    _validate.int_at_least("warmup", warmup, 0)
    _validate.int_at_least("anneal", anneal, 0)
    _validate.non_negative("weight_decay", weight_decay)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    static = isinstance(anneal, int) and isinstance(warmup, int)
    if schedule == "cosine" and static and anneal <= warmup:
        raise ValueError(
            f"anneal must be > warmup for the cosine schedule, got anneal={anneal}, warmup={warmup}"
        )
    moments: MomentDtype = "float32_for_16bit"
    sched = dreamerv3_schedule(lr, warmup, schedule, anneal)
    parts = [
        clip_by_agc(agc, pmin),
        scale_by_rms(beta2, eps, eps_in_sqrt=False, bias_correction=True, _moment_dtype=moments),
    ]
    if momentum:
        parts.append(ema(beta1, debias=True, _moment_dtype=moments, _nesterov=nesterov))
    parts.append(add_decayed_weights(weight_decay, weight_decay_mask))
    parts.append(scale_by_learning_rate(sched))
    reference = chain(*parts)
    if weight_decay_mask is not None or not _fused:
        return reference
    hyper = _Hyper(agc, pmin, beta1, beta2, eps, weight_decay, momentum, nesterov, sched)

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        donate, donate_updates = donating(extra), donating_updates(extra)
        fast = _packed_update(hyper, updates, state, params, donate, donate_updates)
        if fast is None:
            fast = _fused_update(hyper, updates, state, params, donate, donate_updates)
        if fast is not None:
            return fast
        out, new_state = reference.update(updates, state, params, **extra)
        if donating_updates(extra) and torch.compiler.is_compiling():
            out = _into_donated(updates, out)
        return out, new_state

    return GradientTransformation(reference.init, update_fn)


def _into_donated(updates: Updates, out: Updates) -> Updates:
    """Under ``torch.compile``: ``out`` written into the donated ``updates``' buffers, which
    lets inductor store the update where the gradient was instead of in a fresh buffer (fresh
    multi-MB buffers cost page faults on every step). Unchanged where a buffer cannot take it."""
    g, at = tree.split(updates)
    u = at.take(out, "updates")
    if len({id(x) for x in g}) != len(g) or not _lists.use_foreach(g):
        return out
    for x, y in zip(g, u, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape or not _writable(x):
            return out
    torch._foreach_copy_(g, u)  # type: ignore[misc]
    return at.updates(g)


class _Hyper(NamedTuple):
    agc: Number
    pmin: Number
    beta1: Number
    beta2: Number
    eps: Number
    weight_decay: Number
    momentum: bool
    nesterov: bool
    schedule: Schedule


KERNEL_MIN = 1 << 14
"""Leaves with at least this many elements take the compiled single-pass kernel in eager mode
(when its options allow: momentum without Nesterov)."""

RUN_MIN = 4
"""Smaller leaves of one shape and dtype, at least this many, are stacked and take the kernel
together (their state then lives in one buffer, updated in place when donated)."""


def _fused_update(
    h: _Hyper,
    updates: Updates,
    state: OptState,
    params: Params | None,
    donate: bool,
    donate_updates: bool = False,
) -> tuple[Updates, OptState] | None:
    """The chain's update in fewer passes and allocations, for multi-tensor-ready lists in eager
    mode that autograd does not record (``None``: not applicable, run the chain).

    Large leaves (``KERNEL_MIN``) go through one compiled single-pass kernel each, and runs of
    at least ``RUN_MIN`` smaller leaves of one shape through one call per run
    (:mod:`functional_opt._kernels`; equal to the chain to float rounding). The others run the
    same ops in the same order as the chain, with temporaries reused in place, so their result
    equals the chain's (bit for bit for float32 and float64). Which leaves take which path
    depends only on their size and layout, never on ``donate``, so donation never changes a
    result."""
    if params is None or torch.compiler.is_compiling():
        return None
    g, at = tree.split(updates)
    if not g:
        return None
    p = at.take(params, "params")
    rms_state: ScaleByRmsWithCountState = state[1]
    nu_old = at.take(rms_state.nu, "state.nu")
    if not (_lists.use_foreach(g, *h) and _lists.use_foreach(p) and _lists.use_foreach(nu_old)):
        return None
    mu_old: list[Tensor] = at.take(state[2].ema, "state.ema") if h.momentum else []
    if torch.is_grad_enabled() and _lists.tracked(g, p, nu_old, mu_old):
        return None  # differentiated through: the chain, whose ops autograd can record
    count = safe_increment(rms_state.count)
    sched_state: ScaleByScheduleState = state[-1]
    lr_step = -1.0 * torch.as_tensor(h.schedule(sched_state.count))
    new_state = list(state)
    new_state[-1] = ScaleByScheduleState(safe_increment(sched_state.count))
    ema_count = count
    if h.momentum:
        ema_state: EmaState = state[2]
        ema_count = safe_increment(ema_state.count)
    big, runs = _kernel_routes(h, g, nu_old, mu_old)
    routed = big.union(*runs)
    small = [i for i in range(len(g)) if i not in routed] if routed else list(range(len(g)))
    factors: list[Tensor] | None = None
    if not (isinstance(h.agc, (int, float)) and h.agc == 0):
        factors = [g[0]] * len(g)
        if small:
            part = agc_factors([g[i] for i in small], [p[i] for i in small], h.agc, h.pmin)
            for i, f in zip(small, part, strict=True):
                factors[i] = f
        if big:
            order = sorted(big)
            unorm, pnorm = _leaf_norms([g[i] for i in order], [p[i] for i in order])
            stacked = agc_factors_from_norms(unorm, pnorm, h.agc, h.pmin)
            for i, f in zip(order, stacked.unbind(), strict=True):
                factors[i] = f
    u: list[Tensor] = [g[0]] * len(g)
    nu: list[Tensor] = [g[0]] * len(g)
    mu: list[Tensor] = [g[0]] * len(g)
    if small:
        parts = _foreach_update(
            h,
            [g[i] for i in small],
            [p[i] for i in small],
            [nu_old[i] for i in small],
            [mu_old[i] for i in small] if h.momentum else [],
            None if factors is None else [factors[i] for i in small],
            count,
            ema_count,
            lr_step,
            donate,
        )
        for out, values in zip((u, nu, mu), parts, strict=True):
            for i, v in zip(small, values, strict=bool(values)):  # no mu without momentum
                out[i] = v
    if big or runs:
        step, inv_bc2, scalars, decay = _kernel_scalars(h, count, ema_count, lr_step)
        # The update goes into a donated gradient's buffer unless a gradient appears twice.
        in_place = donate and donate_updates and len({id(g[i]) for i in big}) == len(big)
        ctx = _KernelStep(
            g, p, nu_old, mu_old, (u, nu, mu), donate, donate_updates, step, inv_bc2, scalars, decay
        )
        one = torch.ones((), dtype=torch.float32)  # the clip factor without clipping
        for i in big:
            _leaf_update(ctx, i, in_place, one if factors is None else factors[i])
        for idx in runs:
            _run_update(ctx, h, idx)
    new_state[1] = ScaleByRmsWithCountState(count, at.carry(rms_state.nu, nu))
    if h.momentum:
        new_state[2] = EmaState(ema_count, at.carry(state[2].ema, mu))
    return at.updates(u), tuple(new_state)


class _Plan(NamedTuple):
    """How one buffer of a packed layout runs: large leaves ``(start, n)`` one kernel call each,
    runs of at least ``RUN_MIN`` consecutive small leaves of one size ``(start, rows, n)`` one
    call per run, the other leaves (``rest``, leaf indices) through the multi-tensor ops."""

    big: list[tuple[int, int]]
    runs: list[tuple[int, int, int]]
    rest: list[int]


def _plans(layout: Layout) -> list[_Plan]:
    """The :class:`_Plan` of each buffer of ``layout`` (made once per layout)."""
    key = ("dreamerv3", KERNEL_MIN, RUN_MIN)
    plans: list[_Plan] | None = layout._plans.get(key)
    if plans is not None:
        return plans
    plans = []
    for b in range(len(layout.sizes)):
        plan = _Plan([], [], [])
        run: list[int] = []

        def flush(run: list[int], plan: _Plan = plan) -> None:
            if len(run) >= RUN_MIN:
                shape = layout.shapes[run[0]]
                assert shape is not None and layout.slots[run[0]] is not None
                plan.runs.append((layout.slots[run[0]][1], len(run), shape.numel()))  # type: ignore[index]
            else:
                plan.rest.extend(run)

        for i in layout.members(b):
            n = layout.shapes[i].numel()  # type: ignore[union-attr]
            if n == 0:
                continue  # nothing to update
            if n >= KERNEL_MIN:
                flush(run)
                run = []
                plan.big.append((layout.slots[i][1], n))  # type: ignore[index]
            elif run and layout.shapes[run[0]].numel() != n:  # type: ignore[union-attr]
                flush(run)
                run = [i]
            else:
                run.append(i)
        flush(run)
        plans.append(plan)
    layout._plans[key] = plans
    return plans


def _packed_update(
    h: _Hyper,
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
    first. Gradients must be of at least 32 bits. Consecutive small leaves of one
    size form runs here, where the per-leaf path groups small leaves of one shape anywhere in
    the tree, so the two can route a leaf differently (equal to float rounding)."""
    if not (_kernel_options(h) and isinstance(updates, Packed)) or torch.compiler.is_compiling():
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
    if any(g.element_size() < 4 for g in updates.buffers):
        return None  # (16-bit updates are fresh buffers: see ``_writable``)
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
        if p.dtype != g.dtype or mu.dtype != nu.dtype:
            return None
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
    step, inv_bc2, scalars, decay = _kernel_scalars(h, count, ema_count, lr_step)
    agc_off = isinstance(h.agc, (int, float)) and h.agc == 0
    for plan, g, p, nu, mu in zip(_plans(layout), g_b, p_b, nu_b, mu_b, strict=True):
        if plan.rest:
            views = [_leaf_views(layout, plan.rest, x) for x in (g, p, nu, mu)]
            gv, pv, nuv, muv = views
            factors = None if agc_off else agc_factors(gv, pv, h.agc, h.pmin)
            u, nu_new, mu_new = _foreach_update(
                h, gv, pv, nuv, muv, factors, count, ema_count, lr_step, donate=True
            )
            _copy_into(nuv + muv + gv, nu_new + mu_new + u)
        if plan.big:
            gv = [g[s : s + n] for s, n in plan.big]
            pv = [p[s : s + n] for s, n in plan.big]
            one = torch.ones((), dtype=torch.float32)  # the clip factor without clipping
            factors_big = [one] * len(gv)
            if not agc_off:
                unorm, pnorm = _leaf_norms(gv, pv)
                factors_big = list(agc_factors_from_norms(unorm, pnorm, h.agc, h.pmin).unbind())
            for (s, n), gi, pi, f in zip(plan.big, gv, pv, factors_big, strict=True):
                args: tuple[Tensor, ...] = (gi, nu[s : s + n], mu[s : s + n], f, step, inv_bc2)
                args = (*args, *scalars)
                if decay is not None:
                    args = (*args, pi, decay)
                _kernels.call(_kernels.update_kernel_in_place, *args)
        for s, rows, n in plan.runs:
            gr, pr, nur, mur = (x[s : s + rows * n].view(rows, n) for x in (g, p, nu, mu))
            factor = torch.ones((rows, 1), dtype=nu.dtype, device=nu.device)
            if not agc_off:
                pnorm = torch.linalg.vector_norm(pr, dim=1, dtype=nu.dtype)
                unorm = torch.linalg.vector_norm(gr, dim=1, dtype=nu.dtype)
                factor = agc_factors_from_norms(unorm, pnorm, h.agc, h.pmin).view(rows, 1)
            step_rows = step.to(nu.dtype).expand(rows, 1).contiguous()
            args = (gr, nur, mur, factor, step_rows, inv_bc2, *scalars)
            if decay is not None:
                args = (*args, pr, decay.to(nu.dtype).expand(rows, 1).contiguous())
            _kernels.call(_kernels.update_kernel_in_place, *args)
    new_state = list(state)
    new_state[1] = ScaleByRmsWithCountState(count, Packed(layout, buffers=nu_b))
    new_state[2] = EmaState(ema_count, Packed(layout, buffers=mu_b))
    new_state[-1] = ScaleByScheduleState(safe_increment(sched_state.count))
    return Packed(layout, buffers=g_b), tuple(new_state)


def _leaf_views(layout: Layout, leaves: list[int], buffer: Tensor) -> list[Tensor]:
    """The ``leaves`` of a packed layout as views of their ``buffer``."""
    out = []
    for i in leaves:
        shape, slot = layout.shapes[i], layout.slots[i]
        assert shape is not None and slot is not None
        out.append(buffer[slot[1] : slot[1] + shape.numel()].view(shape))
    return out


def _copy_into(targets: list[Tensor], values: list[Tensor]) -> None:
    """``t.copy_(v)`` for each pair where ``v`` is not already ``t``."""
    pairs = [(t, v) for t, v in zip(targets, values, strict=True) if t is not v]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])  # type: ignore[misc]


def _kernel_scalars(
    h: _Hyper, count: Tensor, ema_count: Tensor, lr_step: Tensor
) -> tuple[Tensor, Tensor, list[Tensor], Tensor | None]:
    """The kernels' per-update scalars (float64): ``-lr_t / (1 - b1^t)``, ``1 / (1 - b2^t)``,
    ``[b1, b2, eps]`` and ``-lr_t wd`` (``None`` without weight decay)."""
    inv_bc2 = 1 / (1 - torch.as_tensor(h.beta2, dtype=torch.float64) ** count.double())
    step = lr_step / (1 - torch.as_tensor(h.beta1, dtype=torch.float64) ** ema_count.double())
    scalars = [torch.as_tensor(x, dtype=torch.float64) for x in (h.beta1, h.beta2, h.eps)]
    decay = None
    if _decays(h):  # u gets -lr_t wd p: the kernels then read the params too
        decay = lr_step * torch.as_tensor(h.weight_decay, dtype=torch.float64)
    return step, inv_bc2, scalars, decay


class _KernelStep(NamedTuple):
    """What the kernel calls of one update share: the leaves (present ones, in order), the
    lists the results go into, and the per-update scalars."""

    g: list[Tensor]
    p: list[Tensor]
    nu_old: list[Tensor]
    mu_old: list[Tensor]
    out: tuple[list[Tensor], list[Tensor], list[Tensor]]  # u, nu, mu
    donate: bool
    donate_updates: bool
    step: Tensor  # -lr_t / (1 - b1^t)
    inv_bc2: Tensor  # 1 / (1 - b2^t)
    scalars: list[Tensor]  # b1, b2, eps
    decay: Tensor | None  # -lr_t wd, or None without weight decay


def _leaf_update(c: _KernelStep, i: int, in_place: bool, factor: Tensor) -> None:
    """One kernel call for the large leaf ``i``: the moments in place when donated, the update
    into the gradient's buffer when the updates are donated too (``in_place``)."""
    u, nu, mu = c.out
    g, nu_old, mu_old = c.g, c.nu_old, c.mu_old
    views = (g[i].view(-1), nu_old[i].view(-1), mu_old[i].view(-1))
    args: tuple[Tensor, ...] = (*views, factor, c.step, c.inv_bc2, *c.scalars)
    if c.decay is not None:
        args = (*args, c.p[i].reshape(-1), c.decay)
    if in_place and _writable(g[i]):
        _kernels.call(_kernels.update_kernel_in_place, *args)
        nu[i], mu[i], u[i] = nu_old[i], mu_old[i], g[i]
        return
    if c.donate:
        flat_u = _kernels.call(_kernels.update_kernel_donated, *args)
        nu[i], mu[i] = nu_old[i], mu_old[i]
    else:
        flat_nu, flat_mu, flat_u = _kernels.call(_kernels.update_kernel, *args)
        nu[i], mu[i] = flat_nu.view_as(nu_old[i]), flat_mu.view_as(mu_old[i])
    u[i] = flat_u.view_as(g[i])


def _run_update(c: _KernelStep, h: _Hyper, idx: list[int]) -> None:
    """One kernel call for the leaves ``idx`` (one shape and dtype), stacked into rows.

    Leaves that already are the consecutive rows of one buffer (the state this function
    returns, or params and gradients a training loop keeps flat) are used through that buffer:
    the moments when donated, the gradients when the updates are donated too (they then take
    the update), the params always (only read). Other leaves are stacked into new buffers, so
    every case runs the same kernel on the same values (the same bits); the update goes into
    the params' stacked copy once their norms are taken, when the kernel has no other use for
    it (one fresh buffer instead of two: fresh multi-MB buffers cost page faults on every
    step)."""
    g, p, nu_old, mu_old, decay = c.g, c.p, c.nu_old, c.mu_old, c.decay
    rows, shape = len(idx), g[idx[0]].shape
    grad_leaves = [g[i] for i in idx]
    grads = None
    if c.donate_updates and _writable(grad_leaves[0]):  # (one dtype, and nothing is tracked)
        grads = _stacked_rows(grad_leaves)
    grads_kept = grads is not None
    moments = []
    in_place = []
    for old in (nu_old, mu_old):
        leaves = [old[i] for i in idx]
        base = _stacked_rows(leaves) if c.donate else None
        in_place.append(base is not None)
        moments.append(base if base is not None else _stack_rows(leaves))
    nu, mu = moments
    agc_off = isinstance(h.agc, (int, float)) and h.agc == 0
    params = None
    params_own = False  # whether ``params`` is a fresh copy (free to take the update)
    if not (agc_off and decay is None):
        param_leaves = [p[i] for i in idx]
        params = _stacked_rows(param_leaves)
        if params is None:
            params, params_own = _stack_rows(param_leaves), True
    factor = torch.ones((rows, 1), dtype=nu.dtype, device=nu.device)
    if not agc_off and params is not None:
        pnorm = torch.linalg.vector_norm(params, dim=1, dtype=nu.dtype)
        if grads is None:
            grads = _stack_rows(grad_leaves, params if params_own and decay is None else None)
        unorm = torch.linalg.vector_norm(grads, dim=1, dtype=nu.dtype)
        factor = agc_factors_from_norms(unorm, pnorm, h.agc, h.pmin).view(rows, 1)
    if grads is None:
        grads = _stack_rows(grad_leaves)
    # per row, like the factor: a 0-d step would split the kernel's loops in two
    step_rows = c.step.to(nu.dtype).expand(rows, 1).contiguous()
    args: tuple[Tensor, ...] = (grads, nu, mu, factor, step_rows, c.inv_bc2, *c.scalars)
    if decay is not None and params is not None:
        args = (*args, params, decay.to(nu.dtype).expand(rows, 1).contiguous())
    _kernels.call(_kernels.update_kernel_in_place, *args)
    olds: tuple[list[Tensor], ...] = (g, nu_old, mu_old)
    for target, buffer, old, kept in zip(
        c.out, (grads, nu, mu), olds, (grads_kept, *in_place), strict=True
    ):
        if kept:  # the old leaves are views of the buffer just updated
            for i in idx:
                target[i] = old[i]
            continue
        for i, leaf in zip(idx, buffer.view(rows, *shape).unbind(0), strict=True):
            target[i] = leaf


def _stack_rows(xs: list[Tensor], into: Tensor | None = None) -> Tensor:
    """The tensors (one shape, contiguous) copied into the rows of a ``[len(xs), n]`` buffer:
    ``into`` when it is a buffer of that size and dtype that may be overwritten, else a new
    one."""
    if into is not None and into.dtype == xs[0].dtype and into.numel() == len(xs) * xs[0].numel():
        flat = [x.view(-1) for x in xs] if xs[0].dim() != 1 else xs
        return torch.cat(flat, out=into.view(-1)).view(len(xs), -1)
    joined = torch.cat(xs) if xs[0].dim() > 0 else torch.stack(xs)
    return joined.view(len(xs), -1)


def _leaf_norms(g: list[Tensor], p: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Stacked L2 norms of large leaves and their params: BLAS dot products for float32/64
    (full read bandwidth), one compiled reduction per leaf for 16-bit (no float32 copies); both
    more accurate than ``vector_norm``."""
    wide = (torch.float32, torch.float64)
    if all(x.dtype in wide and y.dtype == x.dtype for x, y in zip(g, p, strict=True)):
        gs = [torch.dot(x.view(-1), x.view(-1)) for x in g]
        ps = [torch.dot(y.reshape(-1), y.reshape(-1)) for y in p]
        return _lists.stack(gs).sqrt_(), _lists.stack(ps).sqrt_()
    pairs = torch.stack(
        [
            _kernels.call(
                _kernels.norm_pair, x.view(-1), y.reshape(-1), moment_dtype(x, "float32_for_16bit")
            )
            for x, y in zip(g, p, strict=True)
        ]
    )
    return pairs[:, 0], pairs[:, 1]


def _writable(x: Tensor) -> bool:
    """Whether a donated update buffer takes the new update in place: not tracked by autograd,
    and at least 32-bit (writing 16-bit data back into the buffer being read measured twice as
    slow as writing a fresh one)."""
    return x.element_size() >= 4 and not (torch.is_grad_enabled() and x.requires_grad)


def _kernel_options(h: _Hyper) -> bool:
    """Whether the compiled kernels implement these options."""
    return h.momentum and not h.nesterov


def _decays(h: _Hyper) -> bool:
    """Whether the update has a weight-decay term (a tensor weight decay may be nonzero)."""
    return not (isinstance(h.weight_decay, (int, float)) and h.weight_decay == 0)


def _kernel_routes(
    h: _Hyper, g: list[Tensor], nu: list[Tensor], mu: list[Tensor]
) -> tuple[set[int], list[list[int]]]:
    """The leaves that take the kernels: each large one alone, and the small ones in runs of at
    least ``RUN_MIN`` leaves of one shape and dtype (stacked, one kernel call per run). A leaf
    qualifies when it and its moments are plain contiguous tensors, the moments in one dtype at
    least as wide as the update's."""
    if not _kernel_options(h):
        return set(), []
    # Grouped by everything that qualifies a leaf but contiguity, with C-level attribute
    # loops (trees of thousands of small leaves are common), then checked per group.
    columns = [
        list(map(get, xs))
        for get, xs in (
            (type, g), (_SHAPE, g), (_DTYPE, g), (_DEVICE, g), (_DTYPE, nu), (_DEVICE, nu),
            (_DTYPE, mu),
        )
    ]  # fmt: skip
    groups: dict[tuple[Any, ...], list[int]] = {}
    if all(len(set(column)) == 1 for column in columns):  # the common case: one group
        groups[tuple(column[0] for column in columns)] = list(range(len(g)))
    else:
        for i, key in enumerate(zip(*columns, strict=True)):
            groups.setdefault(key, []).append(i)
    big: set[int] = set()
    runs: list[list[int]] = []
    for (kind, shape, dtype, device, nu_dtype, nu_device, mu_dtype), idx in groups.items():
        if kind is not Tensor or mu_dtype != nu_dtype or nu_device != device:
            continue
        if dtype != nu_dtype and torch.promote_types(nu_dtype, dtype) != nu_dtype:
            continue
        size = math.prod(shape)
        if size == 0 or (size < KERNEL_MIN and len(idx) < RUN_MIN):
            continue
        if not all(map(Tensor.is_contiguous, [xs[i] for xs in (g, nu, mu) for i in idx])):
            idx = [i for i in idx if g[i].is_contiguous() and nu[i].is_contiguous()]
            idx = [i for i in idx if mu[i].is_contiguous()]
        if size >= KERNEL_MIN:
            big.update(idx)
        elif len(idx) >= RUN_MIN:
            runs.append(idx)
    return big, runs


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_BASE = operator.attrgetter("_base")


def _stacked_rows(xs: list[Tensor]) -> Tensor | None:
    """``[len(xs), n]`` view of the buffer ``xs`` are the consecutive rows of (as the state
    leaves this update returns for a run are), or ``None``."""
    base = xs[0]._base
    if base is None or not base.is_contiguous() or base.numel() != len(xs) * xs[0].numel():
        return None
    start, row = base.data_ptr(), xs[0].numel() * xs[0].element_size()
    if set(map(id, map(_BASE, xs))) != {id(base)}:
        return None
    if list(map(Tensor.data_ptr, xs)) != list(range(start, start + len(xs) * row, row)):
        return None
    return base.view(len(xs), -1) if all(map(Tensor.is_contiguous, xs)) else None


def _foreach_update(
    h: _Hyper,
    g: list[Tensor],
    p: list[Tensor],
    nu_old: list[Tensor],
    mu_old: list[Tensor],
    factors: list[Tensor] | None,
    count: Tensor,
    ema_count: Tensor,
    lr_step: Tensor,
    donate: bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The chain's ops in order over lists, temporaries reused: ``(u, nu, mu)`` (``mu`` empty
    without momentum)."""
    # clip_by_agc: a fresh tensor per leaf, which later steps may overwrite.
    gs = _lists.mul(g, factors) if factors is not None else list(g)
    # scale_by_rms(beta2, eps, eps_in_sqrt=False, bias_correction=True)
    nu = _lists.moment(nu_old, gs, h.beta2, 2, donate=donate)
    denom = bias_correction(nu, h.beta2, count)  # fresh
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, h.eps)  # type: ignore[arg-type]
    gw = _lists.like(gs, denom)
    if factors is not None and all(a is b for a, b in zip(gw, gs, strict=True)):
        torch._foreach_div_(gw, denom)  # gs is ours: r overwrites it
        r = _lists.like(gw, g)
    else:
        r = _lists.like(_lists.div(gw, denom), g)
    out = r
    mu: list[Tensor] = []
    if h.momentum:
        mu = _lists.moment(mu_old, r, h.beta1, 1, donate=donate)
        out = _lists.moment(mu, r, h.beta1, 1) if h.nesterov else mu
        out = _lists.like(bias_correction(out, h.beta1, ema_count), g)
        mu = _lists.like(mu, mu_old)
    if not (isinstance(h.weight_decay, (int, float)) and h.weight_decay == 0):
        out = _lists.like(_lists.add(out, _lists.like(p, out), alpha=h.weight_decay), out)
    return _lists.mul(out, lr_step), _lists.like(nu, nu_old), mu
