"""Adagrad's scaling by the root of the sum of squares: ``scale_by_rss`` (Duchi et al. 2011)."""

from __future__ import annotations

from typing import Any, NamedTuple

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
)
from functional_opt.tree import PyTree

__all__ = ["ScaleByRssState", "scale_by_rss"]


class ScaleByRssState(NamedTuple):
    """``sum_of_squares``: the sum of the squared updates so far (plus the initial value)."""

    sum_of_squares: PyTree


def _inverse_roots(sums: list[Tensor], eps: float | Tensor) -> list[Tensor]:
    """``1 / sqrt(s + eps)`` where ``s > 0``, else 0 (a leaf that has seen only zeros)."""
    return [torch.where(s > 0, torch.rsqrt(s + eps), torch.zeros_like(s)) for s in sums]


def scale_by_rss(
    initial_accumulator_value: float | Tensor = 0.1, eps: float | Tensor = 1e-7
) -> GradientTransformation:
    """Adagrad scaling: ``s <- s + |u|^2``; ``u -> u / sqrt(s + eps)`` (0 where ``s`` is 0).

    ``s`` starts at ``initial_accumulator_value``; both arguments are finite and ``>= 0``.
    ``s`` is kept in the param's dtype; the updates keep their dtype."""
    _validate.non_negative("initial_accumulator_value", initial_accumulator_value)
    _validate.non_negative("eps", eps)

    def init_fn(params: Params) -> ScaleByRssState:
        return ScaleByRssState(
            tree.map_params(
                lambda p: torch.zeros_like(p) + initial_accumulator_value, params, elementwise=True
            )
        )

    def update_fn(
        updates: Updates, state: ScaleByRssState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByRssState]:
        del params
        check_extra(extra, "scale_by_rss")
        expect_state(state, ScaleByRssState, "scale_by_rss")
        g, at = tree.split(updates, elementwise=True)
        old = at.take(state.sum_of_squares, "state.sum_of_squares")
        squares = _lists.square(_lists.cast(g, _lists.promoted(old, g)))
        # s * 1 + |u|^2: exact in s, one rounding of the sum, written into s when donated
        sums = _lists.decay_add(old, squares, 1.0, donate=donating(extra))
        out = _lists.like(_lists.mul(_lists.like(g, sums), _inverse_roots(sums, eps)), g)
        return at.updates(out), ScaleByRssState(
            at.carry(state.sum_of_squares, _lists.like(sums, old), "state.sum_of_squares")
        )

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))
