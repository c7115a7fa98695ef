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
from functional_opt.base import COUNT_DTYPE, safe_increment, zero_count
from functional_opt.tree import PyTree

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale", "all_finite"]


def all_finite(updates: PyTree) -> Tensor:
    """A 0-d bool tensor: every element of every tensor leaf is finite (``None`` ignored;
    integer and bool tensors are finite). A leaf that is not a tensor is a ``TypeError`` naming
    its path."""
    values, _ = tree.flatten(updates)
    xs = []
    for i, x in enumerate(values):
        if x is None:
            continue
        if not isinstance(x, Tensor):
            path = optree.tree_paths(updates, none_is_leaf=True, namespace=tree.NAMESPACE)[i]
            raise TypeError(
                f"all_finite: the leaf at {tree.path_str(path)} is a {type(x).__name__}, not a "
                "tensor"
            )
        if x.is_floating_point() or x.is_complex():
            xs.append(x)
    return _lists.all_finite(xs)


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

    def adjust(self, grads_finite: Tensor | bool) -> NoOpLossScale:
        _finite_flag(grads_finite)
        return self

    def __repr__(self) -> str:
        return "NoOpLossScale()"


class StaticLossScale(_Frozen):
    """A fixed scale ``S``: ``scale(x) = x * S``, ``unscale(g) = g * (1 / S)``. ``S`` is a
    float32 value: a positive normal float32 (``1.2e-38 <= S <= 3.4e38``), or a 0-d tensor."""

    __slots__ = ("loss_scale",)
    loss_scale: Tensor

    def __init__(self, scale: float | Tensor) -> None:
        _validate.float32_magnitude("scale", scale)
        object.__setattr__(self, "loss_scale", _scale_tensor(scale))

    @classmethod
    def _make(cls, loss_scale: Any) -> StaticLossScale:
        """A loss scale around any child, unchecked (for pytree unflattening)."""
        out = object.__new__(cls)
        object.__setattr__(out, "loss_scale", loss_scale)
        return out

    def scale(self, values: PyTree) -> PyTree:
        return _times(values, self.loss_scale)

    def unscale(self, values: PyTree) -> PyTree:
        return _times(values, _reciprocal(self.loss_scale))

    def adjust(self, grads_finite: Tensor | bool) -> StaticLossScale:
        _finite_flag(grads_finite)
        return self

    def __repr__(self) -> str:
        return f"StaticLossScale({self.loss_scale!r})"


def _scale_tensor(scale: float | Tensor) -> Tensor:
    return torch.as_tensor(scale, dtype=torch.float32)


def _finite_flag(grads_finite: Tensor | bool) -> Tensor:
    """``grads_finite`` as a 0-d bool tensor. Only a bool is accepted: casting a float tensor
    to bool would read a NaN as ``True`` (finite)."""
    if isinstance(grads_finite, bool):
        return torch.tensor(grads_finite)
    if not isinstance(grads_finite, Tensor) or grads_finite.dtype != torch.bool:
        what = grads_finite.dtype if isinstance(grads_finite, Tensor) else type(grads_finite)
        raise TypeError(
            f"grads_finite must be a bool or a bool tensor (e.g. all_finite(grads)), got {what}"
        )
    if grads_finite.dim() != 0:
        raise ValueError(
            f"grads_finite must be 0-d, got a tensor of shape {tuple(grads_finite.shape)}"
        )
    return grads_finite


def _reciprocal(scale: Tensor) -> Tensor:
    # As torch.amp.GradScaler: the reciprocal in float64, rounded to float32.
    return scale.double().reciprocal().float()


class DynamicLossScale(_Frozen):
    """A scale that backs off on overflow and grows while gradients stay finite.

    ``adjust(finite)``: if finite, ``counter += 1`` (saturating) and when it reaches ``period``
    the scale is multiplied by ``factor`` (if the result is finite) and ``counter = 0``; if not
    finite, the scale becomes ``max(min_scale, scale / factor)`` (but never larger than it was:
    a scale below ``min_scale`` stays put) and ``counter = 0``.

    Checked at construction: ``scale`` and ``min_scale`` are float32 values, so each must be a
    positive normal float32 (``1.2e-38 <= x <= 3.4e38``: a scale that rounds to 0 or inf, or
    whose reciprocal overflows, would turn every gradient into NaN/inf); ``period`` is compared with
    the int32 ``counter``, so it is an integer in ``[1, 2**31 - 1]``; ``factor >= 1`` is finite.
    ``counter`` (to resume) is ``None``, an integer in that range or a 0-d integer tensor. Tensor
    arguments are checked for their shape and dtype only (their values are the caller's promise).
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
        counter: Tensor | int | None = None,
    ) -> None:
        _validate.float32_magnitude("scale", scale)
        _validate.counter("period", period, 1)
        _validate.at_least("factor", factor, 1.0)
        _validate.float32_magnitude("min_scale", min_scale)
        if counter is None:
            count = zero_count()
        elif isinstance(counter, Tensor):
            if counter.dim() != 0:
                raise ValueError(f"counter must be 0-d, got shape {tuple(counter.shape)}")
            if counter.is_floating_point() or counter.is_complex() or counter.dtype == torch.bool:
                raise TypeError(f"counter must be an integer tensor, got {counter.dtype}")
            count = counter
        else:
            _validate.counter("counter", counter)
            count = torch.tensor(int(counter), dtype=COUNT_DTYPE)
        period = period if isinstance(period, Tensor) else int(period)  # a numpy integer too
        self._set(_scale_tensor(scale), count, period, float(factor), float(min_scale))

    def _set(
        self, loss_scale: Tensor, counter: Tensor, period: int, factor: float, min_scale: float
    ) -> None:
        object.__setattr__(self, "loss_scale", loss_scale)
        object.__setattr__(self, "counter", counter)
        object.__setattr__(self, "period", period)
        object.__setattr__(self, "factor", factor)
        object.__setattr__(self, "min_scale", min_scale)

    @classmethod
    def _make(
        cls, loss_scale: Any, counter: Any, period: int, factor: float, min_scale: float
    ) -> DynamicLossScale:
        """A loss scale from checked settings and any children (no checks: pytree unflattening
        rebuilds it around whatever leaves a tree map produced)."""
        out = object.__new__(cls)
        out._set(loss_scale, counter, period, factor, min_scale)
        return out

    def scale(self, values: PyTree) -> PyTree:
        return _times(values, self.loss_scale)

    def unscale(self, values: PyTree) -> PyTree:
        return _times(values, _reciprocal(self.loss_scale))

    def adjust(self, grads_finite: Tensor | bool) -> DynamicLossScale:
        ok = _finite_flag(grads_finite)
        counter = safe_increment(self.counter)
        grow = counter >= self.period
        grown = self.loss_scale * self.factor
        grown = torch.where(torch.isfinite(grown), grown, self.loss_scale)
        on_finite = torch.where(grow, grown, self.loss_scale)
        # Never above the old scale: a scale that starts below min_scale must not grow on an
        # overflow (where min_scale <= scale this is max(min_scale, scale / factor) exactly).
        backed_off = torch.clamp(self.loss_scale / self.factor, min=self.min_scale)
        on_overflow = torch.minimum(backed_off, self.loss_scale)
        new_scale = torch.where(ok, on_finite, on_overflow)
        new_counter = torch.where(ok & ~grow, counter, torch.zeros_like(counter))
        return DynamicLossScale._make(
            new_scale, new_counter, self.period, self.factor, self.min_scale
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
    lambda meta, children: StaticLossScale._make(children[0]),
    namespace=tree.NAMESPACE,
)
_register(
    DynamicLossScale,
    lambda s: (
        (s.loss_scale, s.counter),
        (s.period, s.factor, s.min_scale),
        ("loss_scale", "counter"),
    ),
    lambda meta, children: DynamicLossScale._make(children[0], children[1], *meta),
    namespace=tree.NAMESPACE,
)
