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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_opt import _validate

__all__ = [
    "Schedule",
    "ScheduleValue",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "sgdr_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
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


_F32_MAX = float(torch.finfo(torch.float32).max)


def polynomial_schedule(
    init_value: ScheduleValue,
    end_value: ScheduleValue,
    power: float | Tensor,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """``f(t) = (init - end) * (1 - clip(t - begin, 0, steps) / steps)**power + end``.

    As in optax, ``transition_steps <= 0`` gives the constant ``init_value`` and a negative
    ``transition_begin`` counts as 0. ``power`` is a finite number ``>= 0`` (a negative one
    gives ``0**power = inf`` at the end of the transition); the rest is checked as in
    :func:`linear_schedule`."""
    _validate.finite("init_value", init_value)
    _validate.finite("end_value", end_value)
    _validate.non_negative("power", power)
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
        return (init_value - end_value) * frac**power + end_value

    return schedule


def exponential_decay(
    init_value: ScheduleValue,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: ScheduleValue | None = None,
) -> Schedule:
    """``f(t) = init * decay_rate**((t - begin) / steps)`` for ``t > begin``, ``init`` before;
    with ``staircase`` the exponent is rounded down (``floor((t - begin) / steps)``).
    ``end_value`` bounds the values: from below when ``decay_rate < 1``, from above otherwise.

    As in optax, ``transition_steps <= 0`` or ``decay_rate == 0`` gives the constant
    ``init_value``, and a negative ``transition_begin`` counts as 0. Checked: ``init_value``
    and ``end_value`` are finite (numbers or 0-d tensors); ``decay_rate`` is a finite Python
    number ``>= 0`` (a negative rate has no real non-integer powers); the steps are Python
    ints as in :func:`linear_schedule`; a growing schedule (``decay_rate > 1``) that is not
    bounded above by ``end_value`` (or starts below 0) stays within float32's range up to
    the last step of an int32 counter."""
    _validate.finite("init_value", init_value)
    if end_value is not None:
        _validate.finite("end_value", end_value)
    _validate.non_negative("decay_rate", decay_rate)
    if isinstance(decay_rate, Tensor):
        raise _validate.HyperparameterTypeError(
            "decay_rate must be a Python number (the schedule branches on it when built), got "
            "a tensor"
        )
    _steps("transition_steps", transition_steps, _INT32_MIN)
    _steps("transition_begin", transition_begin, _INT32_MIN)
    _validate.boolean("staircase", staircase)
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    begin = max(transition_begin, 0)
    rate = float(decay_rate)
    growing = rate > 1.0
    upper = rate >= 1.0  # end_value bounds from above (from below for a decaying schedule)
    capped = end_value is not None and not (not isinstance(init_value, Tensor) and init_value < 0)
    if growing and not capped and not isinstance(init_value, Tensor) and init_value != 0:
        last = (_validate.counter_max() - begin) / transition_steps
        if staircase:
            last = math.floor(last)
        if math.log(abs(init_value)) + last * math.log(rate) > math.log(_F32_MAX):
            raise ValueError(
                f"decay_rate={decay_rate!r} > 1 grows |init_value|={abs(init_value)!r} beyond "
                f"float32's range (|x| <= {_F32_MAX:.4g}) before the last step of an int32 "
                "counter; pass end_value to bound it (with init_value >= 0)"
            )

    def schedule(count: int | Tensor) -> Tensor:
        elapsed = _count(count) - begin
        p = elapsed / transition_steps
        if staircase:
            p = torch.floor(p)
        initial = torch.zeros_like(p) + init_value
        decayed = initial * torch.pow(rate, p)
        if growing:  # a power past float64's range is inf: 0 * inf would be NaN, not 0
            decayed = torch.where(initial == 0, initial, decayed)
        value = torch.where(elapsed <= 0, initial, decayed)
        if end_value is not None:
            bound = torch.zeros_like(value) + end_value
            value = torch.minimum(value, bound) if upper else torch.maximum(value, bound)
        return value

    return schedule


def warmup_exponential_decay_schedule(
    init_value: ScheduleValue,
    peak_value: ScheduleValue,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: ScheduleValue | None = None,
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    :func:`exponential_decay` from ``peak_value`` (its steps counted from the end of the
    warm-up). ``warmup_steps`` is a Python int in ``[0, 2**31 - 1]``; the rest is checked as
    in :func:`linear_schedule` and :func:`exponential_decay`."""
    # (checked here, not only by the parts: the warm-up's end is peak_value, errors name it)
    _validate.finite("init_value", init_value)
    _validate.finite("peak_value", peak_value)
    _steps("warmup_steps", warmup_steps, 0)
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            exponential_decay(
                peak_value,
                transition_steps,
                decay_rate,
                transition_begin,
                staircase,
                end_value,
            ),
        ],
        [warmup_steps],
    )


def piecewise_constant_schedule(
    init_value: ScheduleValue, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """``f(t) = init * prod(scale for boundary, scale in boundaries_and_scales if t >=
    boundary)``: the value is multiplied by each ``scale`` from its step on.

    ``boundaries_and_scales`` maps Python int steps in ``[-2**31, 2**31 - 1]`` to finite
    Python numbers ``>= 0``; every value the schedule reaches stays within float32's range."""
    _validate.finite("init_value", init_value)
    if boundaries_and_scales is None:
        boundaries_and_scales = {}
    if not isinstance(boundaries_and_scales, Mapping):
        raise _validate.HyperparameterTypeError(
            "boundaries_and_scales must be a dict of {step: scale} or None, got a "
            f"{type(boundaries_and_scales).__name__}"
        )
    items = []
    for boundary, factor in boundaries_and_scales.items():
        _steps(f"boundaries_and_scales key {boundary!r}", boundary, _INT32_MIN)
        _validate.non_negative(f"boundaries_and_scales[{boundary!r}]", factor)
        if isinstance(factor, Tensor):
            raise _validate.HyperparameterTypeError(
                f"boundaries_and_scales[{boundary!r}] must be a Python number, got a tensor"
            )
        items.append((boundary, float(factor)))
    items.sort()
    if not isinstance(init_value, Tensor):
        value = abs(float(init_value))
        for boundary, factor in items:
            value *= factor
            if value > _F32_MAX:
                raise ValueError(
                    f"boundaries_and_scales: from step {boundary} on the value "
                    f"{value:.4g} is beyond float32's range (|x| <= {_F32_MAX:.4g})"
                )

    def schedule(count: int | Tensor) -> Tensor:
        t = _count(count)
        value = torch.zeros_like(t) + init_value
        for boundary, factor in items:
            value = torch.where(t < boundary, value, value * factor)
        return value

    return schedule


_COSINE_KEYS = frozenset(
    ("init_value", "peak_value", "warmup_steps", "decay_steps", "end_value", "exponent")
)


def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    """SGD with warm restarts (Loshchilov & Hutter 2017): cycles of
    :func:`warmup_cosine_decay_schedule`, one per dict of its keyword arguments, joined with
    :func:`join_schedules`; each cycle lasts its ``decay_steps`` and the next one restarts.

    Each dict is checked as ``warmup_cosine_decay_schedule`` checks its arguments (errors name
    ``cosine_kwargs[i]``); there is at least one cycle, and the cycles end by step
    ``2**31 - 1``."""
    if isinstance(cosine_kwargs, Mapping) or not isinstance(cosine_kwargs, Iterable):
        raise _validate.HyperparameterTypeError(
            "cosine_kwargs must be a list of dicts of warmup_cosine_decay_schedule's "
            f"arguments, got a {type(cosine_kwargs).__name__}"
        )
    cycles = list(cosine_kwargs)
    if not cycles:
        raise ValueError("cosine_kwargs must hold at least one cycle, got none")
    schedules, boundaries, step = [], [], 0
    for i, kwargs in enumerate(cycles):
        if not isinstance(kwargs, Mapping):
            raise _validate.HyperparameterTypeError(
                f"cosine_kwargs[{i}] must be a dict of warmup_cosine_decay_schedule's "
                f"arguments, got a {type(kwargs).__name__}"
            )
        unknown = sorted(set(map(str, kwargs)) - _COSINE_KEYS)
        if unknown:
            raise TypeError(
                f"cosine_kwargs[{i}]: unknown arguments {unknown} of warmup_cosine_decay_schedule"
            )
        try:
            schedules.append(warmup_cosine_decay_schedule(**kwargs))
        except (TypeError, ValueError) as err:
            raise type(err)(f"cosine_kwargs[{i}]: {err}") from err
        step += kwargs["decay_steps"]
        boundaries.append(step)
    if step > _validate.counter_max():
        raise ValueError(
            f"cosine_kwargs: the cycles end at step {step}, beyond the last step of an int32 "
            f"counter ({_validate.counter_max()})"
        )
    return join_schedules(schedules, boundaries[:-1])
