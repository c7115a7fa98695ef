"""Loss scaling for float16 training: tiny immutable objects with pure methods.

``scale(tree)`` multiplies (the loss) by the current scale, ``unscale(tree)`` multiplies (the
gradients) by its reciprocal, and ``adjust(grads_finite)`` returns the next loss-scale object.
``DynamicLossScale``'s defaults are ``torch.amp.GradScaler``'s: start at ``2**16``, double after
``2000`` finite steps in a row, halve on a non-finite step (never below ``min_scale``).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.tree import PyTree

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale", "all_finite"]


def all_finite(updates: PyTree) -> Tensor:
    """A 0-d bool tensor: every element of every tensor leaf is finite (``None`` ignored)."""
    return _lists.all_finite([x for x in tree.leaves(updates) if x is not None])


def _times(values: PyTree, factor: Tensor) -> PyTree:
    xs, at = tree.split(values)
    return at.updates(_lists.like(_lists.mul(xs, factor), xs))


class _Frozen:
    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; adjust() returns a new one")


class NoOpLossScale(_Frozen):
    """No loss scaling: ``scale``/``unscale`` return their input, ``adjust`` returns ``self``."""

    __slots__ = ()

    @property
    def loss_scale(self) -> Tensor:
        return torch.ones(())

    def scale(self, values: PyTree) -> PyTree:
        return values

    def unscale(self, values: PyTree) -> PyTree:
        return values

    def adjust(self, grads_finite: Tensor) -> NoOpLossScale:
        del grads_finite
        return self

    def __repr__(self) -> str:
        return "NoOpLossScale()"


class StaticLossScale(_Frozen):
    """A fixed scale ``S``: ``scale(x) = x * S``, ``unscale(g) = g * (1 / S)``."""

    __slots__ = ("loss_scale",)
    loss_scale: Tensor

    def __init__(self, scale: float | Tensor) -> None:
        _validate.positive("scale", scale)
        object.__setattr__(self, "loss_scale", torch.as_tensor(scale, dtype=torch.float32))

    def scale(self, values: PyTree) -> PyTree:
        return _times(values, self.loss_scale)

    def unscale(self, values: PyTree) -> PyTree:
        return _times(values, _reciprocal(self.loss_scale))

    def adjust(self, grads_finite: Tensor) -> StaticLossScale:
        del grads_finite
        return self

    def __repr__(self) -> str:
        return f"StaticLossScale({self.loss_scale!r})"


def _reciprocal(scale: Tensor) -> Tensor:
    # As torch.amp.GradScaler: the reciprocal in float64, rounded to float32.
    return scale.double().reciprocal().float()


class DynamicLossScale(_Frozen):
    """A scale that backs off on overflow and grows while gradients stay finite.

    ``adjust(finite)``: if finite, ``counter += 1`` and when it reaches ``period`` the scale is
    multiplied by ``factor`` (if the result is finite) and ``counter = 0``; if not finite, the
    scale becomes ``max(min_scale, scale / factor)`` and ``counter = 0``.
    """

    __slots__ = ("counter", "factor", "loss_scale", "min_scale", "period")
    loss_scale: Tensor
    counter: Tensor
    period: int
    factor: float
    min_scale: float

    def __init__(
        self,
        scale: float | Tensor = 2.0**16,
        period: int = 2000,
        factor: float = 2.0,
        min_scale: float = 1.0,
        *,
        counter: Tensor | None = None,
    ) -> None:
        _validate.positive("scale", scale)
        _validate.int_at_least("period", period, 1)
        _validate.at_least("factor", factor, 1.0)
        _validate.positive("min_scale", min_scale)
        object.__setattr__(self, "loss_scale", torch.as_tensor(scale, dtype=torch.float32))
        object.__setattr__(
            self,
            "counter",
            torch.zeros((), dtype=torch.int32) if counter is None else torch.as_tensor(counter),
        )
        object.__setattr__(self, "period", period)
        object.__setattr__(self, "factor", float(factor))
        object.__setattr__(self, "min_scale", float(min_scale))

    def scale(self, values: PyTree) -> PyTree:
        return _times(values, self.loss_scale)

    def unscale(self, values: PyTree) -> PyTree:
        return _times(values, _reciprocal(self.loss_scale))

    def adjust(self, grads_finite: Tensor) -> DynamicLossScale:
        ok = torch.as_tensor(grads_finite, dtype=torch.bool)
        counter = self.counter + 1
        grow = counter >= self.period
        grown = self.loss_scale * self.factor
        grown = torch.where(torch.isfinite(grown), grown, self.loss_scale)
        on_finite = torch.where(grow, grown, self.loss_scale)
        on_overflow = torch.clamp(self.loss_scale / self.factor, min=self.min_scale)
        new_scale = torch.where(ok, on_finite, on_overflow)
        new_counter = torch.where(ok & ~grow, counter, torch.zeros_like(counter))
        return DynamicLossScale(
            new_scale, self.period, self.factor, self.min_scale, counter=new_counter
        )

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(scale={self.loss_scale!r}, period={self.period}, "
            f"factor={self.factor}, min_scale={self.min_scale}, counter={self.counter!r})"
        )


_register: Any = optree.register_pytree_node

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

# Loss scales are pytrees (tensors as children, settings as metadata), so they can sit in a
# state tree, be checkpointed with ``state_to_dict`` and cross ``torch.compile`` boundaries.
_register(
    NoOpLossScale,
    lambda s: ((), None, ()),
    lambda meta, children: NoOpLossScale(),
    namespace=tree.NAMESPACE,
)
_register(
    StaticLossScale,
    lambda s: ((s.loss_scale,), None, ("loss_scale",)),
    lambda meta, children: StaticLossScale(children[0]),
    namespace=tree.NAMESPACE,
)
_register(
    DynamicLossScale,
    lambda s: (
        (s.loss_scale, s.counter),
        (s.period, s.factor, s.min_scale),
        ("loss_scale", "counter"),
    ),
    lambda meta, children: DynamicLossScale(
        children[0], meta[0], meta[1], meta[2], counter=children[1]
    ),
    namespace=tree.NAMESPACE,
)
