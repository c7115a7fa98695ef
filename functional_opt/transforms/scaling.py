"""Multiplicative scaling: ``scale``, ``scale_by_schedule``, ``scale_by_learning_rate``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    EXTRA_KEYWORDS,
    GradientTransformation,
    Params,
    StepSize,
    UnknownStepSize,
    Updates,
    accepting,
    constant_step_size,
    declare_fusable,
    declare_leafwise,
    declare_step_size,
    donating,
    expect_state,
    safe_increment,
    stateless,
    zero_count,
)
from functional_opt.schedules import Schedule

__all__ = ["ScaleByScheduleState", "scale", "scale_by_learning_rate", "scale_by_schedule"]


class ScaleByScheduleState(NamedTuple):
    """Number of updates applied so far (``count``)."""

    count: Tensor  # type: ignore[assignment]


def scale(step_size: float | Tensor) -> GradientTransformation:
    """``u -> step_size * u``. ``step_size`` is a finite number of either sign (float32's range)
    or a 0-d tensor."""
    _validate.finite("step_size", step_size)

    def apply(updates: Updates, params: Params | None) -> Updates:
        g, at = tree.split(updates, elementwise=True)
        return at.updates(_lists.mul(g, step_size))

    tx = stateless(apply, elementwise=True, leafwise=True)
    declare_step_size(tx.update, lambda: constant_step_size(step_size, "its scale's step size"))
    return tx


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """``u -> step_size_fn(t) * u`` with ``t`` the number of previous updates (from 0).

    ``t`` is the int32 ``count``, which saturates at ``2**31 - 1``. The schedule's values are
    the caller's promise (reading them to check would sync with the device)."""
    _validate.function("step_size_fn", step_size_fn)

    def init_fn(params: Params) -> ScaleByScheduleState:
        del params
        return ScaleByScheduleState(count=zero_count())

    def update_fn(
        updates: Updates, state: ScaleByScheduleState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByScheduleState]:
        donating(extra)  # checks the keywords (and the donation flag); nothing is donated
        expect_state(state, ScaleByScheduleState, "scale_by_schedule")
        g, at = tree.split(updates, elementwise=True)
        if params is not None:
            at.check(params, "params")  # a gradient of another shape is refused, never passed on
        step = torch.as_tensor(step_size_fn(state.count))
        return at.updates(_lists.mul(g, step)), ScaleByScheduleState(safe_increment(state.count))

    def declared() -> StepSize:
        raise UnknownStepSize("its step size is a schedule built into it")

    declare_step_size(update_fn, declared)
    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


def scale_by_learning_rate(
    learning_rate: float | Tensor | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """``u -> -lr * u`` (``+lr * u`` with ``flip_sign=False``); ``lr`` may be a schedule.

    A number ``lr`` must be finite and ``>= 0`` (as ``torch.optim`` requires: the direction is
    ``flip_sign``'s); a schedule's values are the caller's promise."""
    _validate.boolean("flip_sign", flip_sign)
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate) and not isinstance(learning_rate, Tensor):
        schedule = learning_rate
        return scale_by_schedule(lambda count: sign * torch.as_tensor(schedule(count)))
    _validate.non_negative("learning_rate", learning_rate)
    return scale(sign * learning_rate)
