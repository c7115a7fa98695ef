"""Target networks: ``incremental_update`` (Polyak averaging) and ``periodic_update``.

Both are plain functions of trees (not transforms): they take the online network's tensors
(``new_tensors``) and the target's (``old_tensors``) and return the target's next value, a new
tree with ``old_tensors``' structure and dtypes. Neither writes into its arguments, reads a
tensor on the host or branches on a tensor's value, so both run under ``torch.compile`` and
``torch.func.vmap``.

Autograd records them like any other tensor math: call them under ``torch.no_grad()`` when
``new_tensors`` are trainable parameters (else every target would keep a graph back to all the
previous ones).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.tree import PyTree

__all__ = ["incremental_update", "periodic_update"]


def _leaves(new_tensors: PyTree, old_tensors: PyTree) -> tuple[tree.Leaves, list[Tensor]]:
    """The record of ``new_tensors``' present leaves and ``old_tensors``' leaves there (a tensor
    of the same shape at each: else a ``ValueError``/``TypeError`` naming the path)."""
    values, spec = tree.flatten(new_tensors)
    where = tree.Leaves(values, spec, new_tensors, "new_tensors")
    old_all = where.flat(old_tensors, "old_tensors")
    old = []
    for i in where.index:
        new, prev = values[i], old_all[i]
        for name, x in (("new_tensors", new), ("old_tensors", prev)):
            if not isinstance(x, Tensor):
                got = "None" if x is None else f"a {type(x).__name__}"
                raise TypeError(f"{name} at {where.path(i)} is {got}, not a tensor")
        if new.shape != prev.shape:
            raise ValueError(
                f"new_tensors at {where.path(i)} has shape {tuple(new.shape)}, but old_tensors "
                f"has shape {tuple(prev.shape)} there: shapes must be equal (nothing is "
                "broadcast)"
            )
        if new.is_complex() and not prev.is_complex():
            raise TypeError(
                f"new_tensors at {where.path(i)} is complex ({new.dtype}) but old_tensors is "
                f"real ({prev.dtype}) there: the imaginary part would be lost"
            )
        old.append(prev)
    return where, old


def incremental_update(
    new_tensors: PyTree, old_tensors: PyTree, step_size: float | Tensor
) -> PyTree:
    """Polyak averaging of a target network: ``step_size * new + (1 - step_size) * old`` for
    each leaf (optax's ``incremental_update``; DreamerV3's slow critic, the soft target updates
    of DDPG/SAC with ``step_size = tau``).

    ``step_size`` is a number in ``[0, 1]`` (1 copies ``new``, 0 keeps ``old``) or a 0-d tensor
    (the caller's promise). Each result is computed in the promoted dtype of its two leaves and
    returned in ``old``'s dtype (a bfloat16 target of a float32 network stays bfloat16). A
    ``None`` leaf of ``new_tensors`` gives ``None`` (as optax); the trees must otherwise have
    one structure and equal shapes (a ``ValueError`` names the first leaf that differs).
    """
    _validate.non_negative("step_size", step_size)
    if not isinstance(step_size, Tensor) and float(step_size) > 1:
        raise ValueError(f"step_size must be in [0, 1], got {step_size!r}")
    where, old = _leaves(new_tensors, old_tensors)
    where.kinds()  # floating point or complex: integer leaves would be truncated
    new = where.present()
    dtypes = _lists.promoted(new, old)
    mixed = _lists.add(
        _lists.mul(_lists.cast(new, dtypes), step_size),
        _lists.mul(_lists.cast(old, dtypes), 1.0 - step_size),
    )
    return where.updates(_lists.like(mixed, old))


def _integer(name: str, value: Any, low: int) -> None:
    """A Python/numpy integer ``>= low`` (below 2**63), or a 0-d integer tensor."""
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{name} must be an integer or a 0-d integer tensor, got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise _validate.HyperparameterTypeError(
                f"{name} must be an integer or a 0-d integer tensor, got a {value.dtype} tensor"
            )
        return
    _validate.int_in_range(name, value, low, 2**63 - 1)


def periodic_update(
    new_tensors: PyTree,
    old_tensors: PyTree,
    steps: int | Tensor,
    update_period: int | Tensor,
) -> PyTree:
    """A target network copied from the online one every ``update_period`` steps: ``new`` where
    ``steps % update_period == 0``, else ``old`` (optax's ``periodic_update``; DQN's target
    network).

    ``steps`` is an integer ``>= 0`` or a 0-d integer tensor (e.g. a transform's ``count``);
    ``update_period`` an integer ``>= 1`` or a 0-d integer tensor (tensors are the caller's
    promise). With a tensor the choice is ``torch.where`` per leaf: nothing is read on the host.
    The result never shares memory with ``new_tensors`` (an online network updated in place
    later must not change its target): a copy, in ``old``'s dtype. A ``None`` leaf of
    ``new_tensors`` gives ``None``, as in :func:`incremental_update`. Leaves may have any dtype
    (integer buffers too).
    """
    _integer("steps", steps, 0)
    _integer("update_period", update_period, 1)
    where, old = _leaves(new_tensors, old_tensors)
    new = where.present()
    if not isinstance(steps, Tensor) and not isinstance(update_period, Tensor):
        if int(steps) % int(update_period) != 0:
            return where.updates(old)
        return where.updates([n.to(o.dtype, copy=True) for n, o in zip(new, old, strict=True)])
    count = steps.to(torch.int64) if isinstance(steps, Tensor) else int(steps)
    period = update_period if isinstance(update_period, Tensor) else int(update_period)
    copy = torch.remainder(torch.as_tensor(count), period) == 0
    return where.updates(
        [torch.where(copy, n.to(o.dtype), o) for n, o in zip(new, old, strict=True)]
    )
