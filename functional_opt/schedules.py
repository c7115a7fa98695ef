"""Step-size schedules: functions from an integer step count to a value (optax semantics).

Every schedule accepts a Python int or an integer tensor (a transform's counter) and returns a
0-d float64 tensor on the count's device, computed without host syncs, so schedules work under
``torch.compile``, ``torch.func.vmap`` and ``torch.func.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from functional_opt import _validate

__all__ = [
    "Schedule",
    "ScheduleValue",
    "constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "linear_schedule",
    "warmup_cosine_decay_schedule",
]

ScheduleValue = float | Tensor
Schedule = Callable[[int | Tensor], Tensor]


def _count(count: int | Tensor) -> Tensor:
    if isinstance(count, Tensor):
        return count.to(torch.float64)
    return torch.tensor(float(count), dtype=torch.float64)


def constant_schedule(value: ScheduleValue) -> Schedule:
    """The constant schedule ``f(t) = value`` for every step count ``t``."""
    _validate.finite("value", value)

    def schedule(count: int | Tensor) -> Tensor:
        return torch.zeros_like(_count(count)) + value

    return schedule


def linear_schedule(
    init_value: ScheduleValue,
    end_value: ScheduleValue,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """``f(t) = init + (end - init) * clip(t - begin, 0, steps) / steps``.

    As in optax, ``transition_steps <= 0`` gives the constant ``init_value`` and a negative
    ``transition_begin`` counts as 0.
    """
    _validate.finite("init_value", init_value)
    _validate.finite("end_value", end_value)
    if transition_steps <= 0:
        return constant_schedule(init_value)
    begin = max(transition_begin, 0)

    def schedule(count: int | Tensor) -> Tensor:
        t = torch.clamp(_count(count) - begin, 0, transition_steps)
        frac = 1 - t / transition_steps
        return (init_value - end_value) * frac + end_value

    return schedule


def cosine_decay_schedule(
    init_value: ScheduleValue,
    decay_steps: int,
    alpha: ScheduleValue = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """``f(t) = init * ((1 - alpha) * (0.5 * (1 + cos(pi * min(t, T) / T)))**exponent + alpha)``.

    ``alpha`` is the floor as a *fraction* of ``init_value``; ``decay_steps`` (T) must be > 0.
    """
    _validate.finite("init_value", init_value)
    _validate.finite("alpha", alpha)
    if not decay_steps > 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps!r}")

    def schedule(count: int | Tensor) -> Tensor:
        t = torch.clamp(_count(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs ``schedules[i]`` from ``boundaries[i-1]`` on, fed ``t - boundaries[i-1]``."""
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules needs one more schedule than boundaries, got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries"
        )
    schedules = list(schedules)
    boundaries = list(boundaries)

    def schedule(count: int | Tensor) -> Tensor:
        t = _count(count)
        out = schedules[0](t)
        for boundary, sched in zip(boundaries, schedules[1:], strict=True):
            out = torch.where(t < boundary, out, sched(t - boundary))
        return out

    return schedule


def warmup_cosine_decay_schedule(
    init_value: ScheduleValue,
    peak_value: ScheduleValue,
    warmup_steps: int,
    decay_steps: int,
    end_value: ScheduleValue = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at ``decay_steps`` (counted from 0, warm-up included)."""
    _validate.finite("peak_value", peak_value)
    _validate.finite("end_value", end_value)
    if not decay_steps > warmup_steps:
        raise ValueError(
            f"decay_steps must be > warmup_steps, got decay_steps={decay_steps!r}, "
            f"warmup_steps={warmup_steps!r}"
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent),
        ],
        [warmup_steps],
    )
