"""DreamerV3's update in fewer passes: the fused eager path over lists of leaves.

:func:`fused_update` runs the chain's math on the present leaves of an update: large leaves
through one compiled kernel call each, runs of small leaves of one shape stacked into one call,
the rest through multi-tensor ops in the chain's order (see :mod:`functional_opt._kernels`).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _kernels, _lists, tree
from functional_opt.base import (
    EmptyState,
    OptState,
    Params,
    Updates,
    describe,
    safe_increment,
)
from functional_opt.schedules import Schedule
from functional_opt.transforms.clipping import agc_factors, agc_factors_from_norms
from functional_opt.transforms.moments import (
    EmaState,
    ScaleByRmsWithCountState,
    bias_correction,
    moment_dtype,
)
from functional_opt.transforms.scaling import ScaleByScheduleState

Number = float | int | Tensor
"""A hyperparameter: a Python number or a tensor (injected hyperparameters are 0-d tensors)."""


class Hyper(NamedTuple):
    """dreamerv3's hyperparameters, as the fused paths read them."""

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


def check_state(h: Hyper, state: OptState) -> None:
    """Raises a ``ValueError`` naming the first place where ``state`` is not a state of
    dreamerv3 with these options (its chain's states: ``EmptyState()`` for ``clip_by_agc``,
    ``ScaleByRmsWithCountState``, ``EmaState`` with momentum, ``EmptyState()`` for the weight
    decay and ``ScaleByScheduleState``). A few ``isinstance`` checks, once per update; the
    per-parameter trees inside are checked when their leaves are taken."""
    kinds: list[type] = [EmptyState, ScaleByRmsWithCountState]
    if h.momentum:
        kinds.append(EmaState)
    kinds += [EmptyState, ScaleByScheduleState]
    if not isinstance(state, tuple) or type(state) is not tuple or len(state) != len(kinds):
        raise ValueError(
            f"dreamerv3: the state must be a tuple of {len(kinds)} states "
            f"({', '.join(k.__name__ for k in kinds)}), got {describe(state)} at <root> (the "
            "state of another transform, or of dreamerv3 with other options?)"
        )
    for i, (kind, s) in enumerate(zip(kinds, state, strict=True)):
        if not isinstance(s, kind):
            raise ValueError(
                f"dreamerv3: the state at [{i}] must be a {kind.__name__}, got {describe(s)} "
                "(the state of another transform, or of dreamerv3 with other options?)"
            )


def fused_update(
    h: Hyper,
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
    check_state(h, state)
    if params is None or torch.compiler.is_compiling():
        return None
    g, at = tree.split(updates)
    if not g:
        return None
    p = at.take(params, "params")
    rms_state: ScaleByRmsWithCountState = state[1]
    nu_old = at.take(rms_state.nu, "state[1].nu")
    if not (_lists.use_foreach(g, *h) and _lists.use_foreach(p) and _lists.use_foreach(nu_old)):
        return None
    mu_old: list[Tensor] = at.take(state[2].ema, "state[2].ema") if h.momentum else []
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
            unorm, pnorm = leaf_norms([g[i] for i in order], [p[i] for i in order])
            stacked = agc_factors_from_norms(unorm, pnorm, h.agc, h.pmin)
            for i, f in zip(order, stacked.unbind(), strict=True):
                factors[i] = f
    u: list[Tensor] = [g[0]] * len(g)
    nu: list[Tensor] = [g[0]] * len(g)
    mu: list[Tensor] = [g[0]] * len(g)
    if small:
        parts = foreach_update(
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
        step, inv_bc2, scalars, decay = kernel_scalars(h, count, ema_count, lr_step)
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


def kernel_scalars(
    h: Hyper, count: Tensor, ema_count: Tensor, lr_step: Tensor
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
    if in_place and writable(g[i]):
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


def _run_update(c: _KernelStep, h: Hyper, idx: list[int]) -> None:
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
    if c.donate_updates and writable(grad_leaves[0]):  # (one dtype, and nothing is tracked)
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
    rows_update(grads, nu, mu, factor, c.step, (c.inv_bc2, *c.scalars), params, decay)
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


def rows_update(
    grads: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step: Tensor,
    scalars: tuple[Tensor, ...],
    params: Tensor | None,
    decay: Tensor | None,
) -> None:
    """One in-place kernel call on the ``[rows, n]`` matrices of a run (``factor``:
    ``[rows, 1]``; ``scalars``: ``1/(1-b2^t), b1, b2, eps``). The 0-d step and weight decay go
    in per row, like the factor: a 0-d step would split the kernel's loops in two."""
    rows = grads.shape[0]
    per_row = step.to(nu.dtype).expand(rows, 1).contiguous()
    args: tuple[Tensor, ...] = (grads, nu, mu, factor, per_row, *scalars)
    if decay is not None and params is not None:
        args = (*args, params, decay.to(nu.dtype).expand(rows, 1).contiguous())
    _kernels.call(_kernels.update_kernel_in_place, *args)


def _stack_rows(xs: list[Tensor], into: Tensor | None = None) -> Tensor:
    """The tensors (one shape, contiguous) copied into the rows of a ``[len(xs), n]`` buffer:
    ``into`` when it is a buffer of that size and dtype that may be overwritten, else a new
    one."""
    if into is not None and into.dtype == xs[0].dtype and into.numel() == len(xs) * xs[0].numel():
        flat = [x.view(-1) for x in xs] if xs[0].dim() != 1 else xs
        return torch.cat(flat, out=into.view(-1)).view(len(xs), -1)
    joined = torch.cat(xs) if xs[0].dim() > 0 else torch.stack(xs)
    return joined.view(len(xs), -1)


def leaf_norms(g: list[Tensor], p: list[Tensor]) -> tuple[Tensor, Tensor]:
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


def writable(x: Tensor) -> bool:
    """Whether a donated update buffer takes the new update in place: not tracked by autograd,
    and at least 32-bit (writing 16-bit data back into the buffer being read measured twice as
    slow as writing a fresh one)."""
    return x.element_size() >= 4 and not (torch.is_grad_enabled() and x.requires_grad)


def kernel_options(h: Hyper) -> bool:
    """Whether the compiled kernels implement these options."""
    return h.momentum and not h.nesterov


def _decays(h: Hyper) -> bool:
    """Whether the update has a weight-decay term (a tensor weight decay may be nonzero)."""
    return not (isinstance(h.weight_decay, (int, float)) and h.weight_decay == 0)


def _kernel_routes(
    h: Hyper, g: list[Tensor], nu: list[Tensor], mu: list[Tensor]
) -> tuple[set[int], list[list[int]]]:
    """The leaves that take the kernels: each large one alone, and the small ones in runs of at
    least ``RUN_MIN`` leaves of one shape and dtype (stacked, one kernel call per run). A leaf
    qualifies when it and its moments are plain contiguous tensors, the moments in one dtype at
    least as wide as the update's."""
    if not kernel_options(h):
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
        if dtype.is_complex or nu_dtype.is_complex:
            continue  # (the kernels are real: complex leaves take the multi-tensor ops)
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


def foreach_update(
    h: Hyper,
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
