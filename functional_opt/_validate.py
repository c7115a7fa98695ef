"""Build-time checks of hyperparameters.

Python values are checked in full: their type, NaN/inf, their range, that a float fits float32
(the narrowest dtype the math runs in: a hyperparameter beyond ``3.4e38`` would be inf there),
and for integers that meet a step counter, that they fit the counter's dtype (int32,
``functional_opt.base.COUNT_DTYPE``): a Python int compared with an int32 tensor is converted to
int32 and wraps (``2**32 + 1`` becomes 1), so an integer out of that range would silently mean
something else. Tensors (injected hyperparameters, a loss scale's state) are checked only where
that costs no device sync: they must be 0-d and real (shape and dtype are metadata); their
values are the caller's promise.

A value of the wrong type raises :class:`HyperparameterTypeError`, which is both a ``TypeError``
and a ``ValueError``; a value of the right type out of range raises ``ValueError``. Every message
names the argument and shows the value.
"""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "HyperparameterTypeError",
    "at_least",
    "boolean",
    "counter",
    "counter_max",
    "finite",
    "float32_magnitude",
    "float_dtype",
    "function",
    "int_at_least",
    "int_in_range",
    "non_negative",
    "positive",
    "unit_interval",
]

_F32 = torch.finfo(torch.float32)


class HyperparameterTypeError(TypeError, ValueError):
    """A hyperparameter of the wrong type (e.g. a string, a bool or a function where a number
    is expected). Both a ``TypeError`` and a ``ValueError``, so code that catches either sees it."""


def counter_max() -> int:
    """The largest value of a step counter (``torch.iinfo(COUNT_DTYPE).max``, 2**31 - 1)."""
    from functional_opt.base import COUNT_DTYPE  # not at import time: base may import this module

    return int(torch.iinfo(COUNT_DTYPE).max)


_REPR = reprlib.Repr()
_REPR.maxlong = 60  # an int of 400 digits is shown as its first and last digits


def _show(value: Any) -> str:
    """``repr(value)``, shortened for huge ints and long containers."""
    return _REPR.repr(value)


def _kind(value: Any) -> str:
    if callable(value) and not isinstance(value, Tensor):
        return "a function"
    return f"a {type(value).__name__}"


def _tensor(name: str, value: Tensor) -> None:
    # Only metadata: reading the value would sync with the device (and fail under vmap).
    if value.dim() != 0:
        raise ValueError(
            f"{name} must be a number or a 0-d tensor, got a tensor of shape {tuple(value.shape)}"
        )
    if value.dtype == torch.bool or value.is_complex():
        raise HyperparameterTypeError(
            f"{name} must be a real number or a 0-d real tensor, got a {value.dtype} tensor"
        )


def _number(name: str, value: Any) -> float | None:
    """``value`` as a float (``inf`` for an int too large for a float), or ``None`` for a tensor
    (checked for its shape only). Raises for anything that is not a real number."""
    if isinstance(value, Tensor):
        _tensor(name, value)
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real
        raise HyperparameterTypeError(
            f"{name} must be a number, got {_kind(value)}: {_show(value)}"
        )
    try:
        return float(value)
    except OverflowError:  # an int beyond float64: out of every range
        return math.inf if operator.gt(value, 0) else -math.inf


def _require(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {what}, got {_show(value)}")


def _real(name: str, value: Any) -> float | None:
    """``value`` as a float after checking it is a finite number within float32's range, or
    ``None`` for a 0-d tensor."""
    x = _number(name, value)
    if x is not None:
        _require(
            name,
            value,
            math.isfinite(x) and abs(x) <= _F32.max,
            f"finite, within float32's range (|x| <= {_F32.max:.4g})",
        )
    return x


def finite(name: str, value: Any) -> None:
    """Raises unless ``value`` is a finite number (or a 0-d tensor)."""
    _real(name, value)


def non_negative(name: str, value: Any) -> None:
    """Raises unless ``value`` is a finite number ``>= 0`` (or a 0-d tensor)."""
    x = _real(name, value)
    if x is not None:
        _require(name, value, x >= 0, ">= 0")


def positive(name: str, value: Any) -> None:
    """Raises unless ``value`` is a finite number ``> 0`` (or a 0-d tensor)."""
    x = _real(name, value)
    if x is not None:
        _require(name, value, x > 0, "> 0")


def at_least(name: str, value: Any, low: float) -> None:
    """Raises unless ``value`` is a finite number ``>= low`` (or a 0-d tensor)."""
    x = _real(name, value)
    if x is not None:
        _require(name, value, x >= low, f">= {low}")


def unit_interval(name: str, value: Any) -> None:
    """Raises unless ``0 <= value < 1`` (a decay rate; or a 0-d tensor)."""
    x = _real(name, value)
    if x is not None:
        _require(name, value, 0 <= x < 1, "in [0, 1)")


def float32_magnitude(name: str, value: Any) -> None:
    """Raises unless ``value`` is a positive number that float32 holds as a normal number
    (``tiny <= value <= max``): one that is combined with float32 tensors (a loss scale, a
    bound divided by a norm) and would round to 0 or overflow to inf there."""
    x = _number(name, value)
    if x is not None:
        _require(
            name,
            value,
            math.isfinite(x) and _F32.tiny <= x <= _F32.max,
            f"in [{_F32.tiny!r}, {_F32.max!r}] (a positive normal float32)",
        )


def int_in_range(name: str, value: Any, low: int, high: int, why: str = "") -> None:
    """Raises unless ``value`` is an integer (a Python or numpy one, not a bool) in
    ``[low, high]`` (or a 0-d tensor). ``why`` is appended to the message."""
    if isinstance(value, Tensor):
        _tensor(name, value)
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise HyperparameterTypeError(
            f"{name} must be an integer, got {_kind(value)}: {_show(value)}{why}"
        )
    _require(name, value, low <= int(value) <= high, f"an integer in [{low}, {high}]{why}")


def counter(name: str, value: Any, low: int = 0) -> None:
    """Raises unless ``value`` is an integer in ``[low, 2**31 - 1]``: one that is compared with
    (or combined with) an int32 step counter, which cannot count further."""
    int_in_range(name, value, low, counter_max(), " (it is compared with an int32 step counter)")


def int_at_least(name: str, value: Any, low: int) -> None:
    """Raises unless ``value`` is an integer ``>= low`` (or a 0-d tensor)."""
    int_in_range(name, value, low, math.inf)  # type: ignore[arg-type]


def boolean(name: str, value: Any) -> None:
    """Raises unless ``value`` is a Python bool (a truthy string must not switch a flag on)."""
    if not isinstance(value, bool):
        raise HyperparameterTypeError(f"{name} must be a bool, got {_kind(value)}: {_show(value)}")


def float_dtype(name: str, value: Any) -> None:
    """Raises unless ``value`` is ``None`` or a floating-point ``torch.dtype``."""
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise HyperparameterTypeError(
            f"{name} must be a torch.dtype or None, got {_kind(value)}: {_show(value)}"
        )
    _require(name, value, value.is_floating_point, "a floating-point dtype or None")


def function(name: str, value: Any) -> None:
    """Raises unless ``value`` is callable (a schedule or a factory)."""
    if not callable(value) or isinstance(value, Tensor):
        raise HyperparameterTypeError(
            f"{name} must be callable, got {_kind(value)}: {_show(value)}"
        )
