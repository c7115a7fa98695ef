"""Ready-made optimizers built from transforms: ``adam``, ``adamw``, ``sgd``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from functional_opt import _validate
from functional_opt.base import GradientTransformation, Params, chain, identity
from functional_opt.schedules import Schedule
from functional_opt.transforms.moments import scale_by_adam, trace
from functional_opt.transforms.scaling import scale_by_learning_rate
from functional_opt.transforms.weight_decay import add_decayed_weights
from functional_opt.tree import PyTree

__all__ = ["adam", "adamw", "sgd"]

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
