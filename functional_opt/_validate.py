"""Build-time checks of hyperparameters. Tensors (injected hyperparameters) are not inspected."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

__all__ = ["at_least", "finite", "int_at_least", "non_negative", "positive", "unit_interval"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(name: str, value: Any, ok: bool, what: str) -> None:
    if isinstance(value, Tensor) or callable(value):
        return
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def finite(name: str, value: Any) -> None:
    """Raises ``ValueError`` unless ``value`` is a finite number."""
    _check(name, value, _is_number(value) and math.isfinite(value), "finite")


def non_negative(name: str, value: Any) -> None:
    """Raises ``ValueError`` unless ``value >= 0``."""
    _check(name, value, _is_number(value) and value >= 0 and math.isfinite(value), ">= 0")


def positive(name: str, value: Any) -> None:
    """Raises ``ValueError`` unless ``value > 0``."""
    _check(name, value, _is_number(value) and value > 0 and math.isfinite(value), "> 0")


def at_least(name: str, value: Any, low: float) -> None:
    """Raises ``ValueError`` unless ``value >= low``."""
    _check(name, value, _is_number(value) and value >= low and math.isfinite(value), f">= {low}")


def unit_interval(name: str, value: Any) -> None:
    """Raises ``ValueError`` unless ``0 <= value < 1`` (a decay rate)."""
    _check(name, value, _is_number(value) and 0 <= value < 1, "in [0, 1)")


def int_at_least(name: str, value: Any, low: int) -> None:
    """Raises ``ValueError`` unless ``value`` is an integer ``>= low``."""
    if isinstance(value, Tensor) or callable(value):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
