"""Moment estimates: ``scale_by_rms``, ``scale_by_stddev``, ``scale_by_adam``, ``trace``
(momentum) and ``ema``.

Moments are stored in the dtype chosen at ``init`` and keep it on every update; the returned
updates keep each incoming update's dtype.
"""

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

__all__ = [
    "EmaState",
    "MomentDtype",
    "ScaleByAdamState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "TraceState",
    "bias_correction",
    "ema",
    "moment_dtype",
    "scale_by_adam",
    "scale_by_rms",
    "scale_by_stddev",
    "trace",
]

MomentDtype = torch.dtype | None | Literal["float32_for_16bit"]
"""Dtype of a moment buffer: a fixed dtype, ``None`` (the param's dtype), or
``"float32_for_16bit"`` (float32 for float16/bfloat16 params, the param's dtype otherwise)."""


def moment_dtype(param: Tensor, spec: MomentDtype) -> torch.dtype:
    """The dtype of a moment buffer for ``param`` under ``spec``."""
    if spec is None:
        return param.dtype
    if spec == "float32_for_16bit":
        return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype
    assert isinstance(spec, torch.dtype)
    return spec


def _full_like(params: Params, value: float, spec: MomentDtype) -> PyTree:
    return tree.map_params(
        lambda p: torch.full_like(p, value, dtype=moment_dtype(p, spec)), params, elementwise=True
    )


def bias_correction(xs: list[Tensor], decay: float | Tensor, count: Tensor) -> list[Tensor]:
    """``x / (1 - decay**count)`` for each moment ``x`` (``count`` >= 1), computed as ``x`` times
    the correction's reciprocal (in float64, then rounded to ``x``'s dtype: two roundings, as
    the division's are). A multiplication, because compiled over a buffer a division by a
    scalar stays a vector division per element, several times the cost of a multiplication:
    with three of them per element DreamerV3's compiled update was compute-bound."""
    return _lists.mul(xs, 1 / (1 - decay ** count.to(torch.float64)))


_debias = bias_correction  # scale_by_rms's ``bias_correction`` argument shadows the name


class ScaleByRmsState(NamedTuple):
    """``nu``: running average of squared updates."""

    nu: PyTree


class ScaleByRmsWithCountState(NamedTuple):
    """``count`` of updates and ``nu``, the running average of squared updates."""

    count: Tensor  # type: ignore[assignment]
    nu: PyTree


def scale_by_rms(
    decay: float | Tensor = 0.9,
    eps: float | Tensor = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
    *,
    _moment_dtype: MomentDtype = None,
) -> GradientTransformation:
    """RMSProp scaling.

    ``nu <- decay * nu + (1 - decay) * u**2``; ``nu_hat = nu / (1 - decay**t)`` if
    ``bias_correction`` else ``nu``; ``u -> u / sqrt(nu_hat + eps)`` (``eps_in_sqrt``) or
    ``u -> u / (sqrt(nu_hat) + eps)``. ``nu`` starts at ``initial_scale``.
    """
    _validate.unit_interval("decay", decay)
    _validate.non_negative("eps", eps)
    _validate.non_negative("initial_scale", initial_scale)
    _validate.boolean("eps_in_sqrt", eps_in_sqrt)
    _validate.boolean("bias_correction", bias_correction)
    debias = bias_correction

    def init_fn(params: Params) -> ScaleByRmsState | ScaleByRmsWithCountState:
        nu = _full_like(params, initial_scale, _moment_dtype)
        return ScaleByRmsWithCountState(zero_count(), nu) if debias else ScaleByRmsState(nu)

    def update_fn(
        updates: Updates,
        state: ScaleByRmsState | ScaleByRmsWithCountState,
        params: Params | None = None,
        **extra: Any,
    ) -> tuple[Updates, ScaleByRmsState | ScaleByRmsWithCountState]:
        del params
        check_extra(extra, "scale_by_rms")
        expect_state(state, ScaleByRmsWithCountState if debias else ScaleByRmsState, "scale_by_rms")
        g, at = tree.split(updates, elementwise=True)
        nu_old = at.take(state.nu, "state.nu")
        nu = _lists.moment(nu_old, g, decay, 2, donate=donating(extra))
        if isinstance(state, ScaleByRmsWithCountState):
            count = safe_increment(state.count)
            nu_hat = _debias(nu, decay, count)
        else:
            nu_hat = nu
        if eps_in_sqrt:
            denom = _lists.sqrt(_lists.add_scalar(nu_hat, eps))
        else:
            denom = _lists.add_scalar(_lists.sqrt(nu_hat), eps)
        out = _lists.like(_lists.div(_lists.like(g, denom), denom), g)
        new_nu = at.carry(state.nu, _lists.like(nu, nu_old), "state.nu")
        if isinstance(state, ScaleByRmsWithCountState):
            return at.updates(out), ScaleByRmsWithCountState(count, new_nu)
        return at.updates(out), ScaleByRmsState(new_nu)

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


class ScaleByRStdDevState(NamedTuple):
    """``mu``: running average of updates; ``nu``: running average of squared updates."""

    mu: PyTree
    nu: PyTree


class ScaleByRStdDevWithCountState(NamedTuple):
    """``count`` of updates, ``mu`` and ``nu`` (see :class:`ScaleByRStdDevState`)."""

    count: Tensor  # type: ignore[assignment]
    mu: PyTree
    nu: PyTree


def _inverse_stddev(
    mu: list[Tensor], nu: list[Tensor], eps: float | Tensor, eps_in_sqrt: bool
) -> list[Tensor]:
    """``1 / sqrt(v + eps)`` (``eps_in_sqrt``) or ``1 / (sqrt(v) + eps)`` with the variance
    ``v = max(nu - |mu|^2, 0)``: where the two cancel (every update alike, e.g. the first
    bias-corrected one) rounding can leave ``nu - |mu|^2`` slightly negative, whose square root
    would be NaN for good; a variance is never negative."""
    variance = [torch.clamp(v, min=0.0) for v in _lists.sub(nu, _lists.square(mu))]
    if eps_in_sqrt:
        return [torch.rsqrt(v) for v in _lists.add_scalar(variance, eps)]
    return [torch.reciprocal(v) for v in _lists.add_scalar(_lists.sqrt(variance), eps)]


def scale_by_stddev(
    decay: float | Tensor = 0.9,
    eps: float | Tensor = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    """Centered RMSProp scaling, by the running standard deviation of the updates.

    ``mu <- decay * mu + (1 - decay) * u``; ``nu <- decay * nu + (1 - decay) * u**2``; hats
    divided by ``1 - decay**t`` if ``bias_correction``; ``u -> u / sqrt(nu_hat - mu_hat**2 +
    eps)`` (``eps_in_sqrt``) or ``u -> u / (sqrt(nu_hat - mu_hat**2) + eps)``, the variance
    ``nu_hat - mu_hat**2`` clamped at 0 (rounding can make it slightly negative where it
    cancels, and its square root NaN). ``nu`` starts at ``initial_scale``, ``mu`` at 0."""
    _validate.unit_interval("decay", decay)
    _validate.non_negative("eps", eps)
    _validate.non_negative("initial_scale", initial_scale)
    _validate.boolean("eps_in_sqrt", eps_in_sqrt)
    _validate.boolean("bias_correction", bias_correction)
    debias = bias_correction
    State = ScaleByRStdDevWithCountState if debias else ScaleByRStdDevState

    def init_fn(params: Params) -> ScaleByRStdDevState | ScaleByRStdDevWithCountState:
        mu = _full_like(params, 0.0, None)
        nu = _full_like(params, initial_scale, None)
        if debias:
            return ScaleByRStdDevWithCountState(zero_count(), mu, nu)
        return ScaleByRStdDevState(mu, nu)

    def update_fn(
        updates: Updates,
        state: ScaleByRStdDevState | ScaleByRStdDevWithCountState,
        params: Params | None = None,
        **extra: Any,
    ) -> tuple[Updates, ScaleByRStdDevState | ScaleByRStdDevWithCountState]:
        del params
        check_extra(extra, "scale_by_stddev")
        expect_state(state, State, "scale_by_stddev")
        donate = donating(extra)
        g, at = tree.split(updates, elementwise=True)
        mu_old = at.take(state.mu, "state.mu")
        nu_old = at.take(state.nu, "state.nu")
        mu = _lists.moment(mu_old, g, decay, 1, donate=donate)
        nu = _lists.moment(nu_old, g, decay, 2, donate=donate)
        if isinstance(state, ScaleByRStdDevWithCountState):
            count = safe_increment(state.count)
            mu_hat, nu_hat = _debias(mu, decay, count), _debias(nu, decay, count)
        else:
            mu_hat, nu_hat = mu, nu
        scaling = _inverse_stddev(mu_hat, nu_hat, eps, eps_in_sqrt)
        out = _lists.like(_lists.mul(_lists.like(g, scaling), scaling), g)
        new_mu = at.carry(state.mu, _lists.like(mu, mu_old), "state.mu")
        new_nu = at.carry(state.nu, _lists.like(nu, nu_old), "state.nu")
        if isinstance(state, ScaleByRStdDevWithCountState):
            return at.updates(out), ScaleByRStdDevWithCountState(count, new_mu, new_nu)
        return at.updates(out), ScaleByRStdDevState(new_mu, new_nu)

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


class ScaleByAdamState(NamedTuple):
    """``count`` of updates, first moment ``mu`` and second moment ``nu``."""

    count: Tensor  # type: ignore[assignment]
    mu: PyTree
    nu: PyTree


def scale_by_adam(
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-8,
    eps_root: float | Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Adam scaling (Kingma & Ba 2014).

    ``mu <- b1 mu + (1-b1) u``; ``nu <- b2 nu + (1-b2) u**2``;
    ``mu_hat = mu / (1 - b1**t)`` (Nesterov: ``b1 mu/(1-b1**(t+1)) + (1-b1) u/(1-b1**t)``);
    ``nu_hat = nu / (1 - b2**t)``; ``u -> mu_hat / (sqrt(nu_hat + eps_root) + eps)``.
    """
    _validate.unit_interval("b1", b1)
    _validate.unit_interval("b2", b2)
    _validate.non_negative("eps", eps)
    _validate.non_negative("eps_root", eps_root)
    _validate.float_dtype("mu_dtype", mu_dtype)
    _validate.boolean("nesterov", nesterov)

    def init_fn(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(
            zero_count(), _full_like(params, 0.0, mu_dtype), _full_like(params, 0.0, None)
        )

    def update_fn(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ScaleByAdamState]:
        del params
        check_extra(extra, "scale_by_adam")
        expect_state(state, ScaleByAdamState, "scale_by_adam")
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
        denom = _lists.add_scalar(_lists.sqrt(_lists.add_scalar(nu_hat, eps_root)), eps)
        out = _lists.like(_lists.div(_lists.like(mu_hat, denom), denom), g)
        return at.updates(out), ScaleByAdamState(
            count,
            at.carry(state.mu, _lists.like(mu, mu_old), "state.mu"),
            at.carry(state.nu, _lists.like(nu, nu_old), "state.nu"),
        )

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


class TraceState(NamedTuple):
    """``trace``: the momentum buffer."""

    trace: PyTree


def trace(
    decay: float | Tensor,
    nesterov: bool = False,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Momentum: ``m <- u + decay * m``; ``u -> m`` (Nesterov: ``u -> u + decay * m``)."""
    _validate.unit_interval("decay", decay)
    _validate.boolean("nesterov", nesterov)
    _validate.float_dtype("accumulator_dtype", accumulator_dtype)

    def init_fn(params: Params) -> TraceState:
        return TraceState(_full_like(params, 0.0, accumulator_dtype))

    def update_fn(
        updates: Updates, state: TraceState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, TraceState]:
        del params
        check_extra(extra, "trace")
        expect_state(state, TraceState, "trace")
        g, at = tree.split(updates, elementwise=True)
        old = at.take(state.trace, "state.trace")
        new = _lists.decay_add(old, g, decay, donate=donating(extra))
        out = _lists.add(_lists.like(g, new), new, alpha=decay) if nesterov else new
        stored = _lists.like(new, old)
        # Without Nesterov the update is the new trace: a copy of it, never the state itself.
        out = _lists.unshared(_lists.like(out, g), stored)
        return at.updates(out), TraceState(at.carry(state.trace, stored, "state.trace"))

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


class EmaState(NamedTuple):
    """``count`` of updates and the moving average ``ema``."""

    count: Tensor  # type: ignore[assignment]
    ema: PyTree


def ema(
    decay: float | Tensor,
    debias: bool = True,
    accumulator_dtype: torch.dtype | None = None,
    *,
    _moment_dtype: MomentDtype = None,
    _nesterov: bool = False,
) -> GradientTransformation:
    """Exponential moving average: ``m <- decay * m + (1 - decay) * u``; ``u -> m``, divided by
    ``1 - decay**t`` when ``debias``."""
    _validate.unit_interval("decay", decay)
    _validate.boolean("debias", debias)
    _validate.float_dtype("accumulator_dtype", accumulator_dtype)
    spec: MomentDtype = accumulator_dtype if accumulator_dtype is not None else _moment_dtype

    def init_fn(params: Params) -> EmaState:
        return EmaState(zero_count(), _full_like(params, 0.0, spec))

    def update_fn(
        updates: Updates, state: EmaState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, EmaState]:
        del params
        check_extra(extra, "ema")
        expect_state(state, EmaState, "ema")
        g, at = tree.split(updates, elementwise=True)
        old = at.take(state.ema, "state.ema")
        new = _lists.moment(old, g, decay, 1, donate=donating(extra))
        count = safe_increment(state.count)
        out = _lists.moment(new, g, decay, 1) if _nesterov else new
        if debias:
            out = bias_correction(out, decay, count)
        stored = _lists.like(new, old)
        # Without debiasing (or Nesterov) the update is the new average: a copy of it, never
        # the state itself.
        out = _lists.unshared(_lists.like(out, g), stored)
        return at.updates(out), EmaState(count, at.carry(state.ema, stored, "state.ema"))

    declare_fusable(update_fn)
    declare_leafwise(update_fn)
    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))
