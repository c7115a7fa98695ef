"""Step-size schedules: functions from an integer step count to a value (optax semantics).

Every schedule accepts a Python int or an integer tensor (a transform's counter) and returns a
0-d float64 tensor on the count's device, computed without host syncs, so schedules work under
``torch.compile``, ``torch.func.vmap`` and ``torch.func.grad``.

Arguments are checked when a schedule is built: values are finite numbers (or 0-d tensors,
whose values are the caller's promise) and steps are Python ints that an int32 step counter
reaches (at most ``2**31 - 1``); a schedule that would compute inf/NaN from finite arguments
(an overflowing difference or ratio) is refused. Errors are ``ValueError``, or
``HyperparameterTypeError`` (both ``TypeError`` and ``ValueError``) for a wrong type, and name
the argument.
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


_INT32_MIN = -(2**31)


def _count(count: int | Tensor) -> Tensor:
    if isinstance(count, Tensor):
        return count.to(torch.float64)
    _validate.finite("count", count)
    return torch.tensor(float(count), dtype=torch.float64)


def _steps(name: str, value: int, low: int) -> None:
    """A number of steps (or a step): a Python int in ``[low, 2**31 - 1]``, the range of the
    int32 counters that schedules are called with (a later step is never reached)."""
    if isinstance(value, Tensor):
        raise _validate.HyperparameterTypeError(
            f"{name} must be a Python int (schedules branch on it when built), got a tensor"
        )
    _validate.int_in_range(
        name, value, low, _validate.counter_max(), " (a step of an int32 step counter)"
    )


def _finite_result(what: str, value: float, names: str) -> None:
    """Raises unless an intermediate value of a schedule, computed from Python arguments, is
    finite (e.g. ``init_value - end_value`` overflowing to inf would give NaN later)."""
    if not math.isfinite(value):
        raise ValueError(f"{what} overflows ({names}): the schedule would give inf/NaN values")


def constant_schedule(value: ScheduleValue) -> Schedule:
    """The constant schedule ``f(t) = value`` for every step count ``t``. ``value`` is a finite
    number or a 0-d tensor."""
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
    ``transition_begin`` counts as 0. Checked: the values are finite (numbers or 0-d tensors),
    the steps are Python ints in ``[-2**31, 2**31 - 1]`` and the transition ends at a step an
    int32 counter reaches (``begin + steps <= 2**31 - 1``).
    """
    _validate.finite("init_value", init_value)
    _validate.finite("end_value", end_value)
    _steps("transition_steps", transition_steps, _INT32_MIN)
    _steps("transition_begin", transition_begin, _INT32_MIN)
    if transition_steps <= 0:
        return constant_schedule(init_value)
    begin = max(transition_begin, 0)
    if begin + transition_steps > _validate.counter_max():
        raise ValueError(
            f"transition_begin + transition_steps must be <= {_validate.counter_max()} (the "
            f"last step of an int32 counter), got transition_begin={transition_begin!r}, "
            f"transition_steps={transition_steps!r}"
        )
    if not isinstance(init_value, Tensor) and not isinstance(end_value, Tensor):
        _finite_result("init_value - end_value", init_value - end_value, "init_value, end_value")

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

    ``alpha`` is the floor as a *fraction* of ``init_value``; ``decay_steps`` (T) is a Python
    int in ``[1, 2**31 - 1]``; ``exponent`` is finite and ``>= 0`` (a negative one gives
    ``0**exponent = inf`` at ``T``).
    """
    _validate.finite("init_value", init_value)
    _validate.finite("alpha", alpha)
    _validate.non_negative("exponent", exponent)
    _steps("decay_steps", decay_steps, 1)
    if not isinstance(init_value, Tensor) and not isinstance(alpha, Tensor):
        _finite_result("init_value * alpha", init_value * alpha, "init_value, alpha")
        _finite_result("init_value * (1 - alpha)", init_value * (1 - alpha), "init_value, alpha")

    def schedule(count: int | Tensor) -> Tensor:
        t = torch.clamp(_count(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs ``schedules[i]`` from ``boundaries[i-1]`` on, fed ``t - boundaries[i-1]``.

    ``boundaries`` are Python ints in ``[0, 2**31 - 1]`` in non-decreasing order, one fewer
    than ``schedules`` (each callable).
    """
    schedules = list(schedules)
    boundaries = list(boundaries)
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules needs one more schedule than boundaries, got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries"
        )
    for i, fn in enumerate(schedules):
        _validate.function(f"schedules[{i}]", fn)
    for i, b in enumerate(boundaries):
        _steps(f"boundaries[{i}]", b, 0)
    if boundaries != sorted(boundaries):
        raise ValueError(f"boundaries must be in non-decreasing order, got {boundaries}")

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
    decay to ``end_value`` at ``decay_steps`` (counted from 0, warm-up included).

    Steps are Python ints with ``0 <= warmup_steps < decay_steps <= 2**31 - 1``; values are
    finite numbers (or 0-d tensors) whose ratio ``end_value / peak_value`` is finite."""
    _validate.finite("init_value", init_value)
    _validate.finite("peak_value", peak_value)
    _validate.finite("end_value", end_value)
    _steps("warmup_steps", warmup_steps, 0)
    _steps("decay_steps", decay_steps, 0)  # >= 1: it must exceed warmup_steps
    if not decay_steps > warmup_steps:
        raise ValueError(
            f"decay_steps must be > warmup_steps, got decay_steps={decay_steps!r}, "
            f"warmup_steps={warmup_steps!r}"
        )
    alpha: ScheduleValue
    if isinstance(peak_value, Tensor) or isinstance(end_value, Tensor):
        # No Python branch on a tensor's value (a host sync; impossible under compile/vmap).
        peak = torch.as_tensor(peak_value, dtype=torch.float64)
        ratio = torch.as_tensor(end_value, dtype=torch.float64) / peak
        alpha = torch.where(peak == 0, torch.zeros_like(ratio), ratio)
    else:
        alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
        _finite_result("end_value / peak_value", alpha, "end_value, peak_value")
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent),
        ],
        [warmup_steps],
    )
