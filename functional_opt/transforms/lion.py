"""Lion's sign-of-interpolation scaling: ``scale_by_lion`` (Chen et al. 2023, "Symbolic
Discovery of Optimization Algorithms")."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    EXTRA_KEYWORDS,
    GradientTransformation,
    Params,
    Updates,
    accepting,
    check_extra,
    declare_fusable,
    declare_leafwise,
    donating,
    expect_state,
    safe_increment,
    zero_count,
)
from functional_opt.tree import PyTree

__all__ = ["LionMode", "ScaleByLionState", "scale_by_lion"]

LionMode = Literal["hard", "smooth", "refined"]
"""How ``scale_by_lion`` maps the interpolation ``c`` to an update: ``"hard"`` ``sign(c)``,
``"smooth"`` ``tanh(smooth_beta * c)``, ``"refined"`` ``c`` where ``|c| < 1``, else
``sign(c)``."""

_MODES = ("hard", "smooth", "refined")


class ScaleByLionState(NamedTuple):
    """``count`` of updates and the momentum ``mu``."""

    count: Tensor  # type: ignore[assignment]
    mu: PyTree


def _signs(xs: list[Tensor], mode: str, smooth_beta: float | Tensor) -> list[Tensor]:
    """``sign(x)`` (``x / |x|`` for a complex ``x``, 0 at 0) per ``mode``, elementwise."""
    if mode == "smooth":
        return [torch.tanh(smooth_beta * x) for x in xs]
    signs = [torch.sgn(x) for x in xs]
    if mode == "refined":
        return [torch.where(x.abs() < 1, x, s) for x, s in zip(xs, signs, strict=True)]
    return signs


def scale_by_lion(
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.99,
    mu_dtype: torch.dtype | None = None,
    *,
    mode: LionMode = "hard",
    smooth_beta: float | Tensor = 1.0,
) -> GradientTransformation:
    """Lion scaling: ``u -> sign(b1 mu + (1 - b1) u)``, then ``mu <- b2 mu + (1 - b2) u``
    (the update uses the momentum from before this step).

    ``b1`` is in ``[0, 1]`` (an interpolation weight), ``b2`` in ``[0, 1)``; ``mu_dtype`` is the
    momentum's dtype (``None``: the param's). ``mode`` (see :data:`LionMode`) replaces the sign
    by ``tanh(smooth_beta * c)`` (``"smooth"``) or keeps ``c`` where ``|c| < 1``
    (``"refined"``). Every update element has magnitude at most 1: the step size is the
    learning rate's alone."""
    _validate.finite("b1", b1)
    if not isinstance(b1, Tensor) and not 0 <= b1 <= 1:
        raise ValueError(f"b1 must be in [0, 1], got {b1!r}")
    _validate.unit_interval("b2", b2)
    _validate.float_dtype("mu_dtype", mu_dtype)
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
    _validate.finite("smooth_beta", smooth_beta)

    def init_fn(params: Params) -> ScaleByLionState:
        mu = tree.map_params(
            lambda p: torch.zeros_like(p, dtype=mu_dtype or p.dtype), params, elementwise=True
        )
        return ScaleByLionState(zero_count(), mu)

    def update_fn(
        updates: Updates, state: ScaleByLionState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByLionState]:
        del params
        check_extra(extra, "scale_by_lion")
        expect_state(state, ScaleByLionState, "scale_by_lion")
        g, at = tree.split(updates, elementwise=True)
        mu_old = at.take(state.mu, "state.mu")
        # the interpolation first: a donated momentum is overwritten by the new one below
        interpolated = _lists.moment(mu_old, g, b1, 1)
        out = _lists.like(_signs(interpolated, mode, smooth_beta), g)
        mu = _lists.moment(mu_old, g, b2, 1, donate=donating(extra))
        return at.updates(out), ScaleByLionState(
            safe_increment(state.count), at.carry(state.mu, _lists.like(mu, mu_old), "state.mu")
        )

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))
