"""Decoupled weight decay: ``add_decayed_weights``."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import GradientTransformation, Params, Updates, stateless
from functional_opt.transforms.combinators import masked
from functional_opt.tree import PyTree

__all__ = ["add_decayed_weights"]


def add_decayed_weights(
    weight_decay: float | Tensor = 0.0,
    mask: PyTree | Callable[[Params], PyTree] | None = None,
) -> GradientTransformation:
    """``u -> u + weight_decay * p``, only where ``mask`` is true when a mask is given."""
    _validate.non_negative("weight_decay", weight_decay)

    def apply(updates: Updates, params: Params | None) -> Updates:
        if isinstance(weight_decay, (int, float)) and weight_decay == 0:
            return updates
        if params is None:
            raise ValueError(
                "add_decayed_weights needs params: call update(updates, state, params)"
            )
        g, at = tree.split(updates, elementwise=True)
        p = at.take(params, "params")
        return at.updates(_lists.like(_lists.add(g, _lists.like(p, g), alpha=weight_decay), g))

    tx = stateless(apply, elementwise=True, leafwise=True)
    return masked(tx, mask) if mask is not None else tx
