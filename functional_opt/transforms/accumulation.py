"""Gradient accumulation: ``MultiSteps`` and its transform form ``multi_steps``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    COUNT_DTYPE,
    GradientTransformation,
    Params,
    Stages,
    Updates,
    accepting,
    current_stage,
    declare_fusable,
    declare_leafwise,
    declare_member_labels,
    declare_stages,
    declare_step_size,
    declare_zero_updates,
    donating,
    expect_state,
    extra_keywords,
    fusable,
    inner_step_size,
    leafwise_level,
    safe_increment,
    stages,
    state_donation,
    without_donation,
    zero_count,
)
from functional_opt.transforms.finite import negative_zeros_like, select_tree
from functional_opt.tree import PyTree

__all__ = ["MultiSteps", "MultiStepsState", "ShouldSkipUpdateFn", "multi_steps"]

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class MultiStepsState(NamedTuple):
    """``mini_step`` within the window, ``gradient_step`` (inner updates so far), the inner
    transform's state, the accumulated gradients ``acc_grads`` (the running mean of the window
    so far, or its sum) and ``skip_state``, what ``should_skip_update_fn`` returned last (``()``
    without one)."""

    mini_step: Tensor
    gradient_step: Tensor
    inner_opt_state: Any
    acc_grads: PyTree
    skip_state: PyTree = ()


ShouldSkipUpdateFn = Callable[[Updates, Tensor, Params | None], tuple[Any, PyTree]]
"""``should_skip_update_fn(updates, gradient_step, params) -> (should_skip, skip_state)``:
``should_skip`` a 0-d bool tensor (or a Python bool), ``skip_state`` any tree of tensors."""


def _eager(counter: Tensor) -> bool:
    """Whether ``counter`` can be read in Python at all (eager mode, not inside ``vmap``)."""
    return not torch.compiler.is_compiling() and not _is_wrapped(counter)


def _can_branch(counter: Tensor) -> bool:
    """Whether reading ``counter`` in Python is free: eager mode, a plain CPU tensor."""
    return _eager(counter) and counter.device.type == "cpu"


def _nonzero(xs: list[Tensor]) -> list[bool]:
    """For each tensor, whether it has an element that is not 0 (NaN counts): one host read per
    device."""
    flags = [torch.any(x != 0) for x in xs]
    out: dict[int, bool] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    for index in by_device.values():
        values = torch.stack([flags[i] for i in index]).tolist()
        out.update(zip(index, map(bool, values), strict=True))
    return [out[i] for i in range(len(flags))]


def _aliases(updates: Updates, buffers: list[Tensor]) -> bool:
    """Whether the buffers of packed ``updates`` include one of ``buffers`` (an inner transform
    that passed its input through, as ``identity`` does)."""
    held = updates.buffers if tree._is_buffered(updates) else ()
    return any(x is b for x in held for b in buffers)


def _buffered_like(updates: Updates, acc: PyTree) -> bool:
    """Whether the updates and the accumulators are packed trees held in buffers of one layout
    (then no leaf is ``None`` in one and present in the other). The params are only passed on
    to the inner transform, whatever they are."""
    return (
        tree._is_buffered(updates)
        and tree._is_buffered(acc)
        and tree._same_layout(updates.layout, acc.layout)
    )


class MultiSteps:
    """Accumulates ``k`` mini-batch gradients, then applies ``opt`` to their mean (or sum).

    ``acc <- acc + (g - acc) / (m + 1)`` (mean) or ``acc <- acc + g`` (sum) with ``m`` the
    mini-step; on the ``k``-th mini-step ``u = opt(acc)``, else ``u = 0`` with ``opt``'s state
    untouched. ``k = every_k_schedule(gradient_step)`` may vary. In eager mode the inner
    transform only runs on the emitting mini-step; under ``torch.compile``/``vmap`` both branches
    are computed and selected with ``torch.where``. Updates keep their dtype either way.
    The accumulator has the promoted dtype of ``accumulator_dtype`` and the param's (by default
    16-bit gradients accumulate in float32 and float64 ones stay float64).

    The zero updates of a non-emitting mini-step are negative zeros, so ``apply_updates`` leaves
    every param bit for bit as it was (``-0.0 + 0.0`` would be ``+0.0``).

    **Skipping mini-steps** (optax's ``should_skip_update_fn``). Given, it is called on every
    mini-step as ``should_skip_update_fn(updates, gradient_step, params)`` with the incoming
    updates and returns ``(should_skip, skip_state)``: ``should_skip`` a 0-d bool tensor (or a
    Python bool; else ``ValueError``), ``skip_state`` any tree of tensors, stored in
    ``state.skip_state`` (for monitoring; ``init`` calls the function on zero updates to make
    its first value). A skipped mini-step never happened: the updates are negative zeros and
    the state is the old one bit for bit (``mini_step``, ``gradient_step``, accumulators and the
    inner state) except ``skip_state``. :func:`~functional_opt.skip_not_finite` and
    :func:`~functional_opt.skip_large_updates` are ready-made functions. In eager mode with a
    CPU flag the skipped mini-step does no other work; otherwise (an accelerator's flag,
    ``torch.compile``, ``vmap``) the mini-step is computed and the old state selected with
    ``torch.where``, without reading the flag on the host.

    **The window.** ``k`` is compared with the int32 ``mini_step``: an int ``every_k_schedule``
    (or an int returned by a schedule, checked at each update) must be in ``[1, 2**31 - 1]``,
    else ``ValueError``; a tensor returned by a schedule is the caller's promise (it is rounded
    toward zero and clamped into that range, never read on the host). Each window's gradient is
    emitted at the end of that window and never carried into the next: every leaf's accumulator
    is cleared at each emission.

    **``None`` gradients.** A ``None`` leaf on a mini-step counts as a zero gradient of that
    mini-step: the mean is the sum of the leaf's gradients in the window divided by ``k`` (what
    ``p.grad`` holds after ``k`` backward passes of ``loss / k``; the running mean is multiplied
    by ``m / (m + 1)`` on such a mini-step), the sum is their sum. A leaf ``None`` on every
    mini-step of a window emits ``None`` and ``opt``'s state for it is left as it was (a frozen
    parameter). A leaf that is ``None`` on the emitting mini-step but has a nonzero accumulated
    gradient (it had gradients earlier in the window) emits its window's mean (or sum) like any
    other leaf: its update is a tensor although its gradient was ``None``. Telling the two apart
    reads, on the emitting mini-step, whether those leaves' accumulators are nonzero: a host
    read (one device sync for accelerator tensors), made only on an emitting mini-step with
    ``None`` leaves. A leaf whose accumulated gradient is exactly 0 counts as having had none
    (the state has no other record of it: its layout is optax's). Under ``torch.compile`` and
    ``vmap`` nothing can be read and the structure of the updates follows the emitting
    mini-step's: there a leaf ``None`` on the emitting mini-step emits ``None``, and the
    gradients it had earlier in that window are dropped (cleared, never carried into the next
    window). Traced code should keep each leaf's ``None`` pattern fixed within a window
    (``None`` on every mini-step for a frozen parameter).
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: int | Callable[[Tensor], int | Tensor],
        use_grad_mean: bool = True,
        should_skip_update_fn: ShouldSkipUpdateFn | None = None,
        accumulator_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        if not isinstance(opt, GradientTransformation):
            raise TypeError(f"opt must be a GradientTransformation, got {type(opt).__name__}")
        if not callable(every_k_schedule):
            _validate.counter("every_k_schedule", every_k_schedule, 1)
            k = int(every_k_schedule)  # a numpy integer too
            self._every_k: Callable[[Tensor], int | Tensor] = lambda step: k
        else:
            self._every_k = every_k_schedule
        _validate.boolean("use_grad_mean", use_grad_mean)
        if should_skip_update_fn is not None:
            _validate.function("should_skip_update_fn", should_skip_update_fn)
        _validate.float_dtype("accumulator_dtype", accumulator_dtype)
        self._should_skip = should_skip_update_fn
        self._opt = opt
        self._accepted = extra_keywords(opt)  # the keywords ``opt`` takes, and no others
        self._use_grad_mean = use_grad_mean
        self._accumulator_dtype = accumulator_dtype
        self._stage_key = id(self)  # its key among the engine's stages (a plain int to trace)

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def _window(self, gradient_step: Tensor) -> int | Tensor:
        """``k`` for this window: a checked int, or an int32 tensor clamped into range."""
        k = self._every_k(gradient_step)
        if isinstance(k, Tensor):
            if k.dim() != 0:
                raise ValueError(
                    f"every_k_schedule must return an int or a 0-d tensor, got shape "
                    f"{tuple(k.shape)}"
                )
            top = _validate.counter_max()
            return torch.clamp(k.to(torch.int64), 1, top).to(COUNT_DTYPE)
        _validate.counter("every_k_schedule", k, 1)
        return int(k)

    def init(self, params: Params) -> MultiStepsState:
        want = self._accumulator_dtype
        # Never narrower than the param: the float32 default must not round float64 gradients.
        # (elementwise: a packed tree's accumulators are buffers of its layout, one dtype each)
        acc = tree.map_params(
            lambda p: torch.zeros_like(p, dtype=torch.promote_types(want or p.dtype, p.dtype)),
            params,
            elementwise=True,
        )
        skip_state: PyTree = ()
        if self._should_skip is not None:  # its state's structure, from zero updates (optax)
            zeros = tree.map_params(torch.zeros_like, params)
            _, skip_state = self._skip(self._should_skip, zeros, zero_count(), params)
        return MultiStepsState(zero_count(), zero_count(), self._opt.init(params), acc, skip_state)

    def _skip(
        self, fn: ShouldSkipUpdateFn, updates: Updates, gradient_step: Tensor, params: Params | None
    ) -> tuple[Tensor, PyTree]:
        """``should_skip_update_fn``'s answer, checked: a 0-d bool tensor and the skip state."""
        out = fn(updates, gradient_step, params)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "should_skip_update_fn must return a pair (should_skip, skip_state), got "
                f"{type(out).__name__}"
            )
        skip, skip_state = out
        if isinstance(skip, bool):
            skip = torch.tensor(skip)
        if not isinstance(skip, Tensor) or skip.dtype != torch.bool or skip.dim() != 0:
            got = (
                f"a {skip.dtype} tensor of shape {tuple(skip.shape)}"
                if isinstance(skip, Tensor)
                else f"a {type(skip).__name__}"
            )
            raise ValueError(
                "should_skip_update_fn must return should_skip as a 0-d bool tensor (or a "
                f"Python bool), got {got}"
            )
        return skip, skip_state

    def update(
        self, updates: Updates, state: MultiStepsState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MultiStepsState]:
        # Keywords are checked on every mini-step, also those where ``opt`` does not run.
        donate = donating(extra, self._accepted)
        expect_state(state, MultiStepsState, "MultiSteps")
        fn = self._should_skip
        if fn is None:
            return self._accumulate(updates, state, params, extra, donate)
        skip, skip_state = self._skip(fn, updates, state.gradient_step, params)
        if _can_branch(skip):  # a CPU flag in eager mode: reading it is free
            if bool(skip):
                g, at = tree.split(updates)
                at.take(state.acc_grads, "state.acc_grads")  # a mini-step's checks
                zeros = at.updates(negative_zeros_like(g))
                return zeros, state._replace(skip_state=skip_state)
            out, new = self._accumulate(updates, state, params, extra, donate)
            return out, new._replace(skip_state=skip_state)
        # Both outcomes computed and selected: the old state may be kept, so nothing donates.
        out, new = self._accumulate(updates, state, params, without_donation(extra), False)
        values, where = tree.split(out)
        kept = select_tree(skip, state._replace(skip_state=()), new._replace(skip_state=()))
        return where.updates(
            _lists.where(skip, negative_zeros_like(values), values)
        ), kept._replace(skip_state=skip_state)

    def _accumulate(
        self,
        updates: Updates,
        state: MultiStepsState,
        params: Params | None,
        extra: dict[str, Any],
        donate: bool,
    ) -> tuple[Updates, MultiStepsState]:
        """A mini-step that is not skipped."""
        if _buffered_like(updates, state.acc_grads):
            return self._accumulate_buffers(updates, state, params, extra, donate)
        g, at = tree.split(updates)
        old = at.take(state.acc_grads, "state.acc_grads")
        acc_all = at.flat(state.acc_grads, "state.acc_grads")
        # Leaves without a gradient on this mini-step (that have an accumulator).
        absent = [
            i
            for i, (u, a) in enumerate(zip(at.values, acc_all, strict=True))
            if u is None and a is not None
        ]
        mini = state.mini_step
        k = self._window(state.gradient_step)
        dtypes = _lists.promoted(old, g)
        acc_w, g_w = _lists.cast(old, dtypes), _lists.cast(g, dtypes)
        n = safe_increment(mini).to(torch.float64)
        step = _lists.div_scalar(_lists.sub(g_w, acc_w), n) if self._use_grad_mean else g_w
        # Donation: the old accumulator is never selected again, so it may take the new value.
        in_place = donate and _lists.use_foreach(acc_w)
        if in_place and acc_w and all(a is o for a, o in zip(acc_w, old, strict=True)):
            torch._foreach_add_(acc_w, step)
            acc = acc_w
        else:
            acc = _lists.add(acc_w, step)
        emit = mini == k - 1
        next_mini = safe_increment(mini) % k
        next_gradient = torch.where(emit, safe_increment(state.gradient_step), state.gradient_step)

        # The new accumulators of every leaf. A None leaf adds a zero gradient to the running
        # mean (acc <- acc * m / (m + 1)); the sum does not change.
        running = list(acc_all)
        for i, v in zip(at.index, _lists.like(acc, old), strict=True):
            running[i] = v
        first = _can_branch(mini) and not bool(mini)  # accumulators are 0 on a first mini-step
        if absent and self._use_grad_mean and not first:
            olds = [acc_all[i] for i in absent]
            filled = _lists.like(_lists.mul(olds, mini.to(torch.float64) / n), olds)
            for i, v in zip(absent, filled, strict=True):
                running[i] = v
        running_tree = tree.unflatten(at.spec, running)
        cleared = tree.unflatten(
            at.spec, [None if a is None else torch.zeros_like(a) for a in running]
        )

        # Host reads: free on a CPU counter; with None leaves also made on another device (one
        # sync), since the updates' structure then depends on them. Never under compile or vmap,
        # where the stage the engine compiles for (every leaf present) tells instead.
        known = current_stage(self._stage_key) if torch.compiler.is_compiling() else None
        if absent:
            known = None
        branch = known is not None or _can_branch(mini) or (bool(absent) and _eager(mini))
        if branch and not (bool(emit) if known is None else known):
            # Eager mini-step: nothing is emitted, so the inner transform does not run.
            zeros = at.updates(negative_zeros_like(g))
            return zeros, MultiStepsState(
                next_mini, next_gradient, state.inner_opt_state, running_tree
            )

        # The inner transform's input: the mean (or sum) of each leaf present on this mini-step
        # and, in eager mode, of each None leaf with a nonzero accumulated gradient.
        inner_in: list[Any] = [None] * len(at.values)
        for i, v in zip(at.index, _lists.like(acc, g), strict=True):
            inner_in[i] = v
        if branch and absent:
            pvals = None if params is None else at.flat(params, "params")
            pending = [running[i] for i in absent]
            for i, value, nonzero in zip(absent, pending, _nonzero(pending), strict=True):
                if nonzero:
                    ref = pvals[i] if pvals is not None and pvals[i] is not None else value
                    inner_in[i] = value.to(ref.dtype)  # the dtype its gradient would have had
        inner_updates, inner_state = self._opt.update(
            tree.unflatten(at.spec, inner_in),
            state.inner_opt_state,
            params,
            **(extra if branch else without_donation(extra)),  # the where-path keeps the old
        )
        if branch:
            return inner_updates, MultiStepsState(next_mini, next_gradient, inner_state, cleared)
        out, where = tree.split(inner_updates)
        return where.updates(_lists.where(emit, out, negative_zeros_like(out))), MultiStepsState(
            next_mini,
            next_gradient,
            select_tree(emit, inner_state, state.inner_opt_state),
            select_tree(emit, cleared, running_tree),
        )

    def _emits(self, state: MultiStepsState) -> bool | None:
        """Whether the next mini-step emits, when that can be read for free (eager mode, CPU
        counters, an int ``k`` or a CPU tensor); else ``None``."""
        mini = state.mini_step
        if not (isinstance(mini, Tensor) and _can_branch(mini)):
            return None
        step = state.gradient_step
        if not (isinstance(step, Tensor) and _can_branch(step)):
            return None
        k = self._window(step)
        if isinstance(k, Tensor) and not _can_branch(k):
            return None
        return bool(mini == k - 1)

    def stages(self, state: Any) -> Stages:
        """The engine's stages (:func:`functional_opt.base.declare_stages`): whether this
        mini-step emits, when that can be read for free, and the inner transform's own."""
        if self._should_skip is not None or not isinstance(state, MultiStepsState):
            return ()
        emits = self._emits(state)
        mine: Stages = () if emits is None else ((self._stage_key, emits),)
        return mine + stages(self._opt, state.inner_opt_state)

    def _accumulate_buffers(
        self,
        updates: Updates,
        state: MultiStepsState,
        params: Params | None,
        extra: dict[str, Any],
        donate: bool,
    ) -> tuple[Updates, MultiStepsState]:
        """A mini-step over packed trees held in buffers of one layout (updates, accumulators
        and the params if given): the accumulation is a few ops per buffer, and where the
        emission is known in Python (eager CPU counters, or the stage the engine compiles for)
        a mini-step that emits nothing is that accumulation alone."""
        g, at = tree.split(updates, elementwise=True)
        old = at.take(state.acc_grads, "state.acc_grads")
        mini = state.mini_step
        k = self._window(state.gradient_step)
        dtypes = _lists.promoted(old, g)
        acc_w, g_w = _lists.cast(old, dtypes), _lists.cast(g, dtypes)
        n = safe_increment(mini).to(torch.float64)
        step = _lists.div_scalar(_lists.sub(g_w, acc_w), n) if self._use_grad_mean else g_w
        if (
            donate
            and _lists.use_foreach(acc_w)
            and all(a is o for a, o in zip(acc_w, old, strict=True))
        ):
            torch._foreach_add_(acc_w, step)
            acc = acc_w
        else:
            acc = _lists.add(acc_w, step)
        acc = _lists.like(acc, old)
        emit = mini == k - 1
        next_mini = safe_increment(mini) % k
        next_gradient = torch.where(emit, safe_increment(state.gradient_step), state.gradient_step)
        known = current_stage(self._stage_key) if torch.compiler.is_compiling() else None
        if known is None and _can_branch(mini):
            known = bool(emit)
        if known is False:  # the accumulation alone: the inner transform does not run
            return at.updates(negative_zeros_like(g)), MultiStepsState(
                next_mini,
                next_gradient,
                state.inner_opt_state,
                at.carry(state.acc_grads, acc, "state.acc_grads"),
            )
        inner_in = at.updates(_lists.like(acc, g))
        # With the state donated, the accumulators are cleared (or kept) in their own buffers;
        # the inner transform then may not write its updates into them (its input).
        reuse = (
            donate
            and _lists.use_foreach(old)
            and not (torch.is_grad_enabled() and _lists.tracked(old))
        )
        if known is True:
            inner_updates, inner_state = self._opt.update(
                inner_in,
                state.inner_opt_state,
                params,
                **(state_donation(extra) if reuse else extra),
            )
            if reuse and not _aliases(inner_updates, old):
                for a in old:
                    a.zero_()
                cleared = at.carry(state.acc_grads, old, "state.acc_grads")
            else:
                cleared = at.carry(state.acc_grads, [torch.zeros_like(a) for a in acc])
            return inner_updates, MultiStepsState(next_mini, next_gradient, inner_state, cleared)
        # Not known (an accelerator's counter, torch.compile without the engine's stage, vmap):
        # both outcomes computed and selected; the old inner state may be kept, so the inner
        # transform does not donate it (the selected one is written into it when donated).
        inner_updates, inner_state = self._opt.update(
            inner_in, state.inner_opt_state, params, **without_donation(extra)
        )
        out, where = tree.split(inner_updates, elementwise=True)
        out = _lists.where(emit, out, negative_zeros_like(out))  # (before acc is written)
        kept = [torch.where(emit, torch.zeros_like(a), a) for a in acc]
        if reuse:
            for a, new in zip(old, kept, strict=True):
                a.copy_(new)
            kept = old
        return where.updates(out), MultiStepsState(
            next_mini,
            next_gradient,
            select_tree(emit, inner_state, state.inner_opt_state, into=donate),
            at.carry(state.acc_grads, kept, "state.acc_grads"),
        )

    def has_updated(self, state: MultiStepsState) -> Tensor:
        """True right after a mini-step that applied the inner transform."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        def update(
            updates: Updates, state: MultiStepsState, params: Params | None = None, **extra: Any
        ) -> tuple[Updates, MultiStepsState]:
            return self.update(updates, state, params, **extra)

        declare_step_size(update, inner_step_size(self._opt))  # emits 0 or the inner update
        # Over packed trees held in buffers the accumulation is elementwise; a should-skip
        # function is the user's and sees leaves.
        declare_fusable(update, lambda: self._should_skip is None and fusable(self._opt))
        declare_stages(update, self.stages)
        # a mini-step known not to emit returns negative zeros (see update)
        declare_zero_updates(update, lambda found: (self._stage_key, False) in found)
        # each leaf's accumulator and inner update are its own (the counters are shared); a
        # should-skip function sees the whole tree
        declare_leafwise(
            update, lambda: 0 if self._should_skip is not None else leafwise_level(self._opt)
        )
        if self._should_skip is None:
            declare_member_labels(update, lambda: (self._opt,))
        return GradientTransformation(self.init, accepting(update, self._accepted))


def multi_steps(
    opt: GradientTransformation,
    every_k_schedule: int | Callable[[Tensor], int | Tensor],
    use_grad_mean: bool = True,
    should_skip_update_fn: ShouldSkipUpdateFn | None = None,
    accumulator_dtype: torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """The transform form of :class:`MultiSteps`."""
    return MultiSteps(
        opt, every_k_schedule, use_grad_mean, should_skip_update_fn, accumulator_dtype
    ).gradient_transformation()
