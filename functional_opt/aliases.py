"""Ready-made optimizers built from transforms (optax's names, arguments and defaults):
``adam``, ``adamw``, ``nadam``, ``radam``, ``adabelief``, ``lamb``, ``lion``, ``rmsprop``,
``adagrad``, ``sgd``. Each is a ``chain`` of small transforms ending in the learning rate, and
declares its step size (``functional_opt.base.step_size``) so that ``TransformOptimizer``'s
``group["lr"]`` drives it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from functional_opt import _validate
from functional_opt.base import (
    GradientTransformation,
    Params,
    StepSize,
    chain,
    declare_step_size,
    identity,
    step_size,
)
from functional_opt.schedules import Schedule
from functional_opt.transforms.adagrad import scale_by_rss
from functional_opt.transforms.belief import scale_by_belief
from functional_opt.transforms.lion import scale_by_lion
from functional_opt.transforms.moments import scale_by_adam, scale_by_rms, scale_by_stddev, trace
from functional_opt.transforms.radam import scale_by_radam
from functional_opt.transforms.scaling import scale_by_learning_rate
from functional_opt.transforms.trust_ratio import scale_by_trust_ratio
from functional_opt.transforms.weight_decay import add_decayed_weights
from functional_opt.tree import PyTree

__all__ = [
    "adabelief",
    "adagrad",
    "adam",
    "adamw",
    "lamb",
    "lion",
    "nadam",
    "radam",
    "rmsprop",
    "sgd",
]

LearningRate = float | Tensor | Schedule


def _learning_rate(learning_rate: LearningRate) -> None:
    if not callable(learning_rate) or isinstance(learning_rate, Tensor):
        _validate.non_negative("learning_rate", learning_rate)


def adam(
    learning_rate: LearningRate,
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-8,
    eps_root: float | Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Adam: ``chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(lr))``, i.e.
    ``u = -lr * mu_hat / (sqrt(nu_hat + eps_root) + eps)``.

    A number ``learning_rate`` must be finite and ``>= 0`` (as in ``torch.optim``)."""
    _learning_rate(learning_rate)
    _validate.float_dtype("mu_dtype", mu_dtype)
    _validate.boolean("nesterov", nesterov)
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: LearningRate,
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-8,
    eps_root: float | Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float | Tensor = 1e-4,
    mask: PyTree | Callable[[Params], PyTree] | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdamW (decoupled weight decay):
    ``u = -lr * (mu_hat / (sqrt(nu_hat + eps_root) + eps) + weight_decay * p)``.

    A number ``learning_rate`` must be finite and ``>= 0`` (as in ``torch.optim``)."""
    _learning_rate(learning_rate)
    _validate.float_dtype("mu_dtype", mu_dtype)
    _validate.boolean("nesterov", nesterov)
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def sgd(
    learning_rate: LearningRate,
    momentum: float | Tensor | None = None,
    nesterov: bool = False,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """SGD, with optional (Nesterov) momentum: ``m <- g + momentum * m``; ``u = -lr * m``.

    A number ``learning_rate`` must be finite and ``>= 0`` (as in ``torch.optim``); ``momentum``
    is ``None`` or in ``[0, 1)``."""
    _learning_rate(learning_rate)
    if momentum is not None:
        _validate.unit_interval("momentum", momentum)
    _validate.boolean("nesterov", nesterov)
    _validate.float_dtype("accumulator_dtype", accumulator_dtype)
    return chain(
        trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity(),
        scale_by_learning_rate(learning_rate),
    )


def nadam(
    learning_rate: LearningRate,
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-8,
    eps_root: float | Tensor = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
) -> GradientTransformation:
    """NAdam (Dozat 2016): :func:`adam` with Nesterov's momentum on by default,
    ``mu_hat = b1 mu / (1 - b1**(t+1)) + (1 - b1) u / (1 - b1**t)``;
    ``u = -lr * mu_hat / (sqrt(nu_hat + eps_root) + eps)``.

    A number ``learning_rate`` must be finite and ``>= 0`` (as in ``torch.optim``)."""
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)


def radam(
    learning_rate: LearningRate,
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-8,
    eps_root: float | Tensor = 0.0,
    threshold: float | Tensor = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """RAdam (Liu et al. 2020): ``chain(scale_by_radam(...), scale_by_learning_rate(lr))``:
    ``u = -lr * mu_hat`` while ``rho_t < threshold``, then
    ``u = -lr * r_t * mu_hat / (sqrt(nu_hat + eps_root) + eps)`` (see
    :func:`~functional_opt.transforms.radam.scale_by_radam`).

    A number ``learning_rate`` must be finite and ``>= 0``; ``threshold >= 4``."""
    _learning_rate(learning_rate)
    return chain(
        scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


def adabelief(
    learning_rate: LearningRate,
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-16,
    eps_root: float | Tensor = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdaBelief (Zhuang et al. 2020): ``chain(scale_by_belief(...),
    scale_by_learning_rate(lr))``: ``s <- b2 s + (1-b2) (u - mu)**2 + eps_root``;
    ``u = -lr * mu_hat / (sqrt(s_hat) + eps)``.

    A number ``learning_rate`` must be finite and ``>= 0``."""
    _learning_rate(learning_rate)
    return chain(
        scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


def lamb(
    learning_rate: LearningRate,
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-6,
    eps_root: float | Tensor = 0.0,
    weight_decay: float | Tensor = 0.0,
    mask: PyTree | Callable[[Params], PyTree] | None = None,
) -> GradientTransformation:
    """LAMB (You et al. 2019): Adam's step plus decoupled weight decay, rescaled per tensor by
    its trust ratio: ``a = mu_hat / (sqrt(nu_hat + eps_root) + eps) + weight_decay * p``;
    ``u = -lr * (||p|| / ||a||) * a`` (ratio 1 where either norm is 0).

    ``chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, scale_by_learning_rate)``.
    A number ``learning_rate`` must be finite and ``>= 0``."""
    _learning_rate(learning_rate)
    return chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )


def lion(
    learning_rate: LearningRate,
    b1: float | Tensor = 0.9,
    b2: float | Tensor = 0.99,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float | Tensor = 1e-3,
    mask: PyTree | Callable[[Params], PyTree] | None = None,
) -> GradientTransformation:
    """Lion (Chen et al. 2023): ``u = -lr * (sign(b1 mu + (1 - b1) g) + weight_decay * p)``,
    then ``mu <- b2 mu + (1 - b2) g``.

    ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)``. Lion's updates are
    all of magnitude ``lr``: it wants a learning rate 3-10 times smaller than AdamW's and a
    weight decay as many times larger. A number ``learning_rate`` must be finite and
    ``>= 0``."""
    _learning_rate(learning_rate)
    return chain(
        scale_by_lion(b1, b2, mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def rmsprop(
    learning_rate: LearningRate,
    decay: float | Tensor = 0.9,
    eps: float | Tensor = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: float | Tensor | None = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformation:
    """RMSProp (Hinton 2012): ``u = -lr * g / sqrt(nu + eps)`` (see
    :func:`~functional_opt.scale_by_rms` for ``eps_in_sqrt``, ``initial_scale`` and
    ``bias_correction``); ``centered`` divides by the running standard deviation instead
    (:func:`~functional_opt.scale_by_stddev`); a ``momentum`` in ``[0, 1)`` then traces the
    scaled steps (``trace(momentum, nesterov)``, after the learning rate, as optax orders it).

    A number ``learning_rate`` must be finite and ``>= 0``. The step size it declares is the
    learning rate's (the trace is linear in its input)."""
    _learning_rate(learning_rate)
    _validate.boolean("centered", centered)
    if momentum is not None:
        _validate.unit_interval("momentum", momentum)
    _validate.boolean("nesterov", nesterov)
    scaling = (scale_by_stddev if centered else scale_by_rms)(
        decay, eps, initial_scale, eps_in_sqrt, bias_correction
    )
    lr = scale_by_learning_rate(learning_rate)
    if momentum is None:
        return chain(scaling, lr)
    tx = chain(scaling, lr, trace(momentum, nesterov))
    # trace(c * u) = c * trace(u) (its buffer starts at 0): the learning rate's factor.
    declare_step_size(tx.update, lambda: StepSize(step_size(lr).factor, False))
    return tx


def adagrad(
    learning_rate: LearningRate,
    initial_accumulator_value: float | Tensor = 0.1,
    eps: float | Tensor = 1e-7,
) -> GradientTransformation:
    """Adagrad (Duchi et al. 2011): ``s <- s + g**2``; ``u = -lr * g / sqrt(s + eps)`` (0 where
    ``s`` is 0), ``s`` starting at ``initial_accumulator_value``.

    A number ``learning_rate`` must be finite and ``>= 0``."""
    _learning_rate(learning_rate)
    return chain(
        scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate)
    )
