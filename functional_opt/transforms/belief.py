"""AdaBelief's scaling by the belief in the gradient: ``scale_by_belief`` (Zhuang et al. 2020)."""

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
    safe_increment,
    zero_count,
)
from functional_opt.transforms.moments import bias_correction
from functional_opt.tree import PyTree

__all__ = ["ScaleByBeliefState", "scale_by_belief"]


class ScaleByBeliefState(NamedTuple):
    """``count`` of updates, first moment ``mu`` and ``nu``, the running average of the squared
    prediction error ``(u - mu)**2`` (plus ``eps_root``)."""

    count: Tensor  # type: ignore[assignment]
    mu: PyTree
    nu: PyTree


def scale_by_belief(
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-16,
    eps_root: float | Tensor = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdaBelief scaling: ``mu <- b1 mu + (1-b1) u``;
    ``nu <- b2 nu + (1-b2) (u - mu)**2 + eps_root`` (with the new ``mu``);
    ``u -> mu_hat / (sqrt(nu_hat) + eps)`` with Adam's bias corrections (and Nesterov's
    ``mu_hat`` as in :func:`~functional_opt.scale_by_adam`).

    ``b1``, ``b2`` in ``[0, 1)``; ``eps``, ``eps_root`` finite and ``>= 0``."""
    _validate.unit_interval("b1", b1)
    _validate.unit_interval("b2", b2)
    _validate.non_negative("eps", eps)
    _validate.non_negative("eps_root", eps_root)
    _validate.boolean("nesterov", nesterov)

    def init_fn(params: Params) -> ScaleByBeliefState:
        return ScaleByBeliefState(
            zero_count(),
            tree.map_params(torch.zeros_like, params, elementwise=True),
            tree.map_params(torch.zeros_like, params, elementwise=True),
        )

    def update_fn(
        updates: Updates, state: ScaleByBeliefState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByBeliefState]:
        del params
        check_extra(extra, "scale_by_belief")
        expect_state(state, ScaleByBeliefState, "scale_by_belief")
        donate = donating(extra)
        g, at = tree.split(updates, elementwise=True)
        mu_old = at.take(state.mu, "state.mu")
        nu_old = at.take(state.nu, "state.nu")
        mu = _lists.moment(mu_old, g, b1, 1, donate=donate)
        error = _lists.sub(_lists.like(g, mu), mu)
        nu = _lists.add_scalar(_lists.moment(nu_old, error, b2, 2, donate=donate), eps_root)
        count = safe_increment(state.count)
        if nesterov:
            mu_hat = _lists.add(
                _lists.mul(bias_correction(mu, b1, safe_increment(count)), b1),
                bias_correction(_lists.like(g, mu), b1, count),
                alpha=1.0 - b1,
            )
        else:
            mu_hat = bias_correction(mu, b1, count)
        nu_hat = bias_correction(nu, b2, count)
        denom = _lists.add_scalar(_lists.sqrt(nu_hat), eps)
        out = _lists.like(_lists.div(_lists.like(mu_hat, denom), denom), g)
        return at.updates(out), ScaleByBeliefState(
            count,
            at.carry(state.mu, _lists.like(mu, mu_old), "state.mu"),
            at.carry(state.nu, _lists.like(nu, nu_old), "state.nu"),
        )

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))
