"""Multiplicative scaling: ``scale``, ``scale_by_schedule``, ``scale_by_learning_rate``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    GradientTransformation,
    Params,
    Updates,
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
    """``u -> step_size * u``."""
    _validate.finite("step_size", step_size)

    def apply(updates: Updates, params: Params | None) -> Updates:
        g, at = tree.split(updates)
        return at.updates(_lists.mul(g, step_size))

    return stateless(apply)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """``u -> step_size_fn(t) * u`` with ``t`` the number of previous updates (from 0)."""
    if not callable(step_size_fn):
        raise ValueError(f"step_size_fn must be callable, got {step_size_fn!r}")

    def init_fn(params: Params) -> ScaleByScheduleState:
        del params
        return ScaleByScheduleState(count=zero_count())

    def update_fn(
        updates: Updates, state: ScaleByScheduleState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByScheduleState]:
        del params, extra
        g, at = tree.split(updates)
        step = torch.as_tensor(step_size_fn(state.count))
        return at.updates(_lists.mul(g, step)), ScaleByScheduleState(safe_increment(state.count))

    return GradientTransformation(init_fn, update_fn)


def scale_by_learning_rate(
    learning_rate: float | Tensor | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """``u -> -lr * u`` (``+lr * u`` with ``flip_sign=False``); ``lr`` may be a schedule."""
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        schedule = learning_rate
        return scale_by_schedule(lambda count: sign * torch.as_tensor(schedule(count)))
    _validate.finite("learning_rate", learning_rate)
    return scale(sign * learning_rate)
