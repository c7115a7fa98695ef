"""Gradient accumulation: ``MultiSteps`` and its transform form ``multi_steps``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    GradientTransformation,
    Params,
    Updates,
    donating,
    safe_increment,
    without_donation,
    zero_count,
)
from functional_opt.transforms.finite import select_tree
from functional_opt.tree import PyTree

__all__ = ["MultiSteps", "MultiStepsState", "multi_steps"]

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class MultiStepsState(NamedTuple):
    """``mini_step`` within the window, ``gradient_step`` (inner updates so far), the inner
    transform's state and the accumulated gradients ``acc_grads``."""

    mini_step: Tensor
    gradient_step: Tensor
    inner_opt_state: Any
    acc_grads: PyTree


def _can_branch(counter: Tensor) -> bool:
    """Whether reading ``counter`` in Python is free: eager mode, a plain CPU tensor."""
    return (
        not torch.compiler.is_compiling()
        and not _is_wrapped(counter)
        and counter.device.type == "cpu"
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
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: int | Callable[[Tensor], int | Tensor],
        use_grad_mean: bool = True,
        accumulator_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        if not isinstance(opt, GradientTransformation):
            raise TypeError(f"opt must be a GradientTransformation, got {type(opt).__name__}")
        if not callable(every_k_schedule):
            _validate.int_at_least("every_k_schedule", every_k_schedule, 1)
            k = every_k_schedule
            self._every_k: Callable[[Tensor], int | Tensor] = lambda step: k
        else:
            self._every_k = every_k_schedule
        self._opt = opt
        self._use_grad_mean = use_grad_mean
        self._accumulator_dtype = accumulator_dtype

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def init(self, params: Params) -> MultiStepsState:
        want = self._accumulator_dtype
        # Never narrower than the param: the float32 default must not round float64 gradients.
        acc = tree.map_params(
            lambda p: torch.zeros_like(p, dtype=torch.promote_types(want or p.dtype, p.dtype)),
            params,
        )
        return MultiStepsState(zero_count(), zero_count(), self._opt.init(params), acc)

    def update(
        self, updates: Updates, state: MultiStepsState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MultiStepsState]:
        g, at = tree.split(updates)
        old = at.take(state.acc_grads, "state.acc_grads")
        k = self._every_k(state.gradient_step)
        dtypes = _lists.promoted(old, g)
        acc_w, g_w = _lists.cast(old, dtypes), _lists.cast(g, dtypes)
        if self._use_grad_mean:
            n = (state.mini_step + 1).to(torch.float64)
            step = _lists.div_scalar(_lists.sub(g_w, acc_w), n)
        else:
            step = g_w
        # Donation: the old accumulator is never selected again, so it may take the new value.
        in_place = donating(extra) and _lists.use_foreach(acc_w)
        if in_place and acc_w and all(a is o for a, o in zip(acc_w, old, strict=True)):
            torch._foreach_add_(acc_w, step)
            acc = acc_w
        else:
            acc = _lists.add(acc_w, step)
        emit = state.mini_step == k - 1
        next_mini = safe_increment(state.mini_step) % k
        next_gradient = torch.where(emit, safe_increment(state.gradient_step), state.gradient_step)
        acc_store = _lists.like(acc, old)

        if _can_branch(state.mini_step) and not bool(emit):
            # Eager mini-step: nothing is emitted, so the inner transform does not run.
            zeros = at.updates(_lists.zeros_like(g))
            return zeros, MultiStepsState(
                next_mini,
                next_gradient,
                state.inner_opt_state,
                at.carry(state.acc_grads, acc_store),
            )

        branch = _can_branch(state.mini_step)
        inner_updates, inner_state = self._opt.update(
            at.updates(_lists.like(acc, g)),
            state.inner_opt_state,
            params,
            **(extra if branch else without_donation(extra)),  # the where-path keeps the old
        )
        out, where = tree.split(inner_updates)
        cleared = at.carry(state.acc_grads, _lists.zeros_like(acc_store))
        if branch:
            return where.updates(out), MultiStepsState(
                next_mini, next_gradient, inner_state, cleared
            )
        return where.updates(_lists.where(emit, out, _lists.zeros_like(out))), MultiStepsState(
            next_mini,
            next_gradient,
            select_tree(emit, inner_state, state.inner_opt_state),
            select_tree(emit, cleared, at.carry(state.acc_grads, acc_store)),
        )

    def has_updated(self, state: MultiStepsState) -> Tensor:
        """True right after a mini-step that applied the inner transform."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)


def multi_steps(
    opt: GradientTransformation,
    every_k_schedule: int | Callable[[Tensor], int | Tensor],
    use_grad_mean: bool = True,
    accumulator_dtype: torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """The transform form of :class:`MultiSteps`."""
    return MultiSteps(
        opt, every_k_schedule, use_grad_mean, accumulator_dtype
    ).gradient_transformation()
