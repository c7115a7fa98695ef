"""Rectified Adam: ``scale_by_radam`` (Liu et al. 2020, "On the Variance of the Adaptive
Learning Rate and Beyond")."""

from __future__ import annotations

from typing import Any

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
from functional_opt.transforms.moments import ScaleByAdamState, bias_correction

__all__ = ["rectification", "scale_by_radam"]


def rectification(
    b2: float | Tensor, count: Tensor, threshold: float | Tensor
) -> tuple[Tensor, Tensor]:
    """RAdam's switch and factor after ``count`` (>= 1) updates, as float64 0-d tensors:
    ``rho = rho_inf - 2 t b2**t / (1 - b2**t)`` with ``rho_inf = 2 / (1 - b2) - 1``; the switch
    is ``rho >= threshold`` and the factor
    ``r = sqrt((rho - 4)(rho - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho))``. Computed from
    the counter on its device, without a host sync (``r`` is meaningful only where the switch
    is on)."""
    t = count.to(torch.float64)
    b2_t = b2**t
    rho_inf = 2.0 / (1.0 - b2) - 1.0
    rho = rho_inf - 2.0 * t * b2_t / (1.0 - b2_t)
    r = torch.sqrt((rho - 4.0) * (rho - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho))
    return rho >= threshold, r


def scale_by_radam(
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-8,
    eps_root: float | Tensor = 0.0,
    threshold: float | Tensor = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Rectified Adam scaling: Adam's moments and bias corrections (``mu_hat``, ``nu_hat``, with
    Nesterov's ``mu_hat`` as in :func:`~functional_opt.scale_by_adam`); while the variance
    estimate is intractable (``rho_t < threshold``, see :func:`rectification`) ``u -> mu_hat``,
    then ``u -> r_t * mu_hat / (sqrt(nu_hat + eps_root) + eps)``.

    The switch is a ``torch.where`` on the counter (no host sync). ``threshold`` is finite and
    ``>= 4``: below 4 the factor ``r_t`` is the root of a negative number (NaN) on the steps
    where ``2 < rho_t < 4``."""
    _validate.unit_interval("b1", b1)
    _validate.unit_interval("b2", b2)
    _validate.non_negative("eps", eps)
    _validate.non_negative("eps_root", eps_root)
    _validate.at_least("threshold", threshold, 4.0)
    _validate.boolean("nesterov", nesterov)

    def init_fn(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(
            zero_count(),
            tree.map_params(torch.zeros_like, params, elementwise=True),
            tree.map_params(torch.zeros_like, params, elementwise=True),
        )

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByAdamState]:
        del params
        check_extra(extra, "scale_by_radam")
        expect_state(state, ScaleByAdamState, "scale_by_radam")
        donate = donating(extra)
        g, at = tree.split(updates, elementwise=True)
        mu_old = at.take(state.mu, "state.mu")
        nu_old = at.take(state.nu, "state.nu")
        mu = _lists.moment(mu_old, g, b1, 1, donate=donate)
        nu = _lists.moment(nu_old, g, b2, 2, donate=donate)
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
        rectified, r = rectification(b2, count, threshold)
        denom = _lists.add_scalar(_lists.sqrt(_lists.add_scalar(nu_hat, eps_root)), eps)
        scaled = _lists.div(_lists.mul(mu_hat, r), _lists.like(denom, mu_hat))
        out = _lists.like(_lists.where(rectified, scaled, mu_hat), g)
        return at.updates(out), ScaleByAdamState(
            count,
            at.carry(state.mu, _lists.like(mu, mu_old), "state.mu"),
            at.carry(state.nu, _lists.like(nu, nu_old), "state.nu"),
        )

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))
