"""The rule for comparing floating-point results, and its helpers.

Every numerical comparison is one of two kinds:

1. **The same kernel on the same inputs: bit for bit** (:func:`assert_bitwise`). Pure vs donated
   updates, a restored checkpoint vs the original, a repeated call: any difference is a bug, so
   no tolerance is allowed. (NaNs must sit in the same places; their payloads are not compared.)

2. **Two implementations of the same math: a bound derived from rounding**
   (:func:`assert_close_rounding`). Compiled vs eager, vmapped vs per member, a transform vs a
   float64 reference formula. The bound is::

       |actual - expected| <= ops * eps(dtype) * scale  (+ ops * eps(dtype) * tiny(dtype))

   * ``eps(dtype)`` is ``torch.finfo(dtype).eps``, twice the unit roundoff ``u``: one correctly
     rounded operation (``+ - * / sqrt``, a cast to ``dtype``) errs by at most ``u`` relative.
   * ``ops`` counts the roundings to ``dtype`` on the way from the inputs to the compared value
     (casts of a hyperparameter included). Two implementations that each round ``k`` times agree
     to ``k eps`` (first order); one compared with a float64 reference does too, with room. A
     sum of ``n`` terms counts ``n`` roundings whatever its order (Higham, *Accuracy and
     Stability of Numerical Algorithms*, 4.2); a sequence of steps adds the steps' counts
     (errors carried in state add up). Roundings in several dtypes are counted per dtype:
     ``ops={torch.bfloat16: 3, torch.float32: 20}``.
   * ``scale`` is the magnitude of the terms the value is computed from (rounding errors are
     relative to the terms, not to a result that cancellation made small). By default it is the
     largest magnitude in the expected tensor (norm-wise, per tensor); :class:`MagnitudeRun`
     and :func:`abs_run` compute the terms' magnitudes by running the same math on absolute
     values.
   * ``tiny(dtype)`` is the smallest normal number: below it each rounding may add an absolute
     ``eps * tiny`` (gradual underflow).

A count is never raised to make a comparison pass on one machine: if a bound derived this way
fails, either the count missed an operation or the code has a bug.

Failures are ``AssertionError``\\ s that name the leaf by its dotted path (as
:func:`functional_opt.state_to_dict` names state entries, e.g. ``1.nu.w``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from functional_opt import tree
from functional_opt.checkpoint import state_paths

__all__ = [
    "MagnitudeRun",
    "Ops",
    "abs_run",
    "assert_bitwise",
    "assert_close_rounding",
    "eps",
    "rounding_bound",
]

Ops = float | Mapping[torch.dtype, float]
"""A count of roundings to one dtype, or a mapping of dtypes to their counts."""


def eps(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).eps``: twice the unit roundoff of ``dtype``."""
    return float(torch.finfo(dtype).eps)


def rounding_bound(dtype: torch.dtype, ops: Ops, scale: float = 1.0) -> float:
    """The rule's bound for one magnitude: ``sum(ops * eps) * scale`` plus the underflow term.
    ``ops`` counts roundings to ``dtype``, or maps dtypes to their counts."""
    counts = {dtype: float(ops)} if not isinstance(ops, Mapping) else dict(ops)
    if any(n < 0 or not math.isfinite(n) for n in counts.values()):
        raise ValueError(f"ops must be finite counts >= 0, got {ops!r}")
    rel = sum(n * eps(dt) for dt, n in counts.items())
    floor = sum(n * eps(dt) * float(torch.finfo(dt).tiny) for dt, n in counts.items())
    return rel * scale + floor


class _Names:
    """The dotted paths of a tree's leaves, computed when a message needs one."""

    __slots__ = ("_names", "_value", "where")

    def __init__(self, value: Any, where: str) -> None:
        self._value, self.where = value, where
        self._names: list[str] | None = None

    def __call__(self, i: int) -> str:
        if self._names is None:
            self._names = state_paths(self._value)
        return f"{self.where}leaf {self._names[i]}"


def _flat(value: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves (``None`` included; through packed trees and the library's node types) and the
    spec."""
    return tree.flatten(value)


def _wide(x: Tensor) -> Tensor:
    x = x.detach()
    return x.to(torch.complex128) if x.is_complex() else x.to(torch.float64)


def _bits(x: Tensor) -> Tensor:
    """The tensor's bits as integers (NaNs mapped to one pattern)."""
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():
        return x
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    canonical = torch.where(x.isnan(), torch.full_like(x, float("nan")), x)
    return canonical.contiguous().view(ints)


def _structure(a_spec: Any, e_spec: Any, actual: Any, expected: Any, where: str) -> None:
    if a_spec != e_spec:
        place = tree.difference(actual, expected) or "<root>"
        raise AssertionError(
            f"{where}the structures first differ at {place} (actual {a_spec}, expected {e_spec})"
        )


def assert_bitwise(actual: Any, expected: Any, msg: str = "") -> None:
    """Rule 1: the same structure, ``None`` where ``expected`` has ``None``, and tensors of the
    same dtype, shape and bits (signed zeros told apart; NaNs in the same places). Other
    leaves must be equal and of the same type. ``msg`` prefixes the failure message, which
    names the leaf."""
    a_leaves, a_spec = _flat(actual)
    e_leaves, e_spec = _flat(expected)
    where = f"{msg}: " if msg else ""
    _structure(a_spec, e_spec, actual, expected, where)
    name = _Names(expected, where)
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        same = isinstance(e, Tensor) and isinstance(a, Tensor) and a.dtype == e.dtype
        if same and a.shape == e.shape and torch.equal(_bits(a), _bits(e)):
            continue
        at = name(i)
        if not isinstance(e, Tensor):
            assert type(a) is type(e) and a == e, f"{at}: {a!r} != {e!r}"
            continue
        assert isinstance(a, Tensor), f"{at} is {a!r}, not a tensor"
        assert (a.dtype, a.shape) == (e.dtype, e.shape), (
            f"{at}: {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}"
        )
        a_bits, e_bits = _bits(a), _bits(e)
        if not torch.equal(a_bits, e_bits):
            diff = (a_bits != e_bits).nonzero()
            first = tuple(diff[0].tolist())
            pos = first[: a.dim()]
            raise AssertionError(
                f"{at}: {len(diff)} of {a_bits.numel()} values differ in their bits; "
                f"first at {pos}: {a.detach()[pos].item()!r} vs {e.detach()[pos].item()!r}"
            )


class _Lazy:
    """A leaf's name for a message, formatted only when the message is."""

    __slots__ = ("i", "name")

    def __init__(self, name: _Names, i: int) -> None:
        self.name, self.i = name, i

    def __format__(self, spec: str) -> str:
        return self.name(self.i)


def _scale_for(e: Tensor, scale: Any) -> Tensor:
    """The magnitudes the bound is relative to: never below the expected values' own, and
    where a given magnitude is not finite (a step whose values are not finite in a magnitude
    run), the leaf's largest finite magnitude (never a NaN bound, which nothing exceeds)."""
    finite = e[torch.isfinite(e)].abs()
    largest = finite.max() if finite.numel() else torch.zeros((), dtype=torch.float64)
    if scale is None:  # norm-wise: the largest finite magnitude in the expected tensor
        return largest
    if isinstance(scale, Tensor):
        s = _wide(scale).abs().to(torch.float64)
    else:
        s = torch.tensor(abs(float(scale)), dtype=torch.float64)
    if not torch.isfinite(s).all():
        s_finite = s[torch.isfinite(s)]
        if s_finite.numel():
            largest = torch.maximum(largest, s_finite.max())
        s = torch.where(torch.isfinite(s), s, largest)
    return torch.maximum(s, e.abs().nan_to_num(0.0, 0.0, 0.0))


def assert_close_rounding(
    actual: Any,
    expected: Any,
    *,
    dtype: torch.dtype,
    ops: Ops | Callable[[Tensor], Ops],
    scale: Any = None,
    check_dtype: bool = True,
    msg: str = "",
) -> None:
    """Rule 2: ``|actual - expected| <= ops * eps(dtype) * scale`` per element (see the module
    docstring for ``ops`` and ``scale``), compared in float64.

    ``actual``/``expected`` are tensors or trees of them (``None`` leaves must match); ``ops``
    is a count, a mapping of dtypes to counts, or a function of the expected tensor returning
    one (a count that depends on the leaf's size); ``scale`` is ``None`` (per tensor, its
    largest expected magnitude), a number, a tensor broadcasting against the values, or a tree
    of those matching ``expected``. NaNs must be in the same places and infinities equal.
    ``check_dtype=False`` allows a reference in another dtype (a float64 oracle). ``msg``
    prefixes the failure message, which names the leaf and the worst element."""
    a_leaves, a_spec = _flat(actual)
    e_leaves, e_spec = _flat(expected)
    where = f"{msg}: " if msg else ""
    _structure(a_spec, e_spec, actual, expected, where)
    if isinstance(scale, Tensor) or scale is None or isinstance(scale, (int, float)):
        scales = [scale] * len(e_leaves)
    else:
        scales, s_spec = _flat(scale)
        if s_spec != e_spec:
            raise AssertionError(f"{where}scale's structure {s_spec} != {e_spec}")
    name = _Names(expected, where)
    for i, (a, e, s) in enumerate(zip(a_leaves, e_leaves, scales, strict=True)):
        at = _Lazy(name, i)
        if e is None:
            assert a is None, f"{at}: expected None, got {a!r}"
            continue
        assert isinstance(a, Tensor), f"{at}: {a!r} is not a tensor"
        assert a.shape == e.shape, f"{at}: shape {list(a.shape)} != {list(e.shape)}"
        if check_dtype:
            assert a.dtype == e.dtype, f"{at}: dtype {a.dtype} != {e.dtype}"
        x, y = _wide(a), _wide(e)
        assert torch.equal(x.isnan(), y.isnan()), f"{at}: NaNs in other places"
        inf = y.isinf()
        assert torch.equal(x[inf], y[inf]) and not x[~inf].isinf().any(), f"{at}: infinities differ"
        ok = torch.isfinite(y)
        leaf_ops = ops(e) if callable(ops) else ops
        bound = rounding_bound(dtype, leaf_ops, 1.0)
        floor = rounding_bound(dtype, leaf_ops, 0.0)
        limit = (bound - floor) * _scale_for(y, s) + floor
        err = (x - y).abs()
        limit = torch.broadcast_to(limit, err.shape)
        bad = ok & (err > limit)
        if bad.any():
            ratio = torch.where(ok, err / limit.clamp_min(floor or 1e-300), 0.0)
            k = int(ratio.reshape(-1).argmax())
            where_t = torch.unravel_index(torch.tensor(k), err.shape) if err.dim() else ()
            pos = tuple(int(p) for p in where_t)
            raise AssertionError(
                f"{at}: {int(bad.sum())} of {err.numel()} values outside the rounding bound "
                f"(dtype={dtype}, ops={leaf_ops}); worst at {pos}: {x[pos].item()!r} vs "
                f"{y[pos].item()!r}, |diff| {err[pos].item():.3g} > bound "
                f"{limit[pos].item():.3g} ({ratio[pos].item():.3g}x)"
            )


def _abs64(value: Any) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point():
            return x.detach().to(torch.float64).abs()
        return x

    return optree.tree_map(one, value, none_is_leaf=True, namespace=tree.NAMESPACE)


def abs_run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn`` run in float64 on the absolute values of its tensor arguments (trees allowed):
    for math built from sums and products with nonnegative coefficients, plus divisions and
    square roots of positive values, the result is the magnitude of the terms each output is
    computed from, the ``scale`` of the rounding rule where results may cancel."""
    return fn(*_abs64(args))


class MagnitudeRun:
    """A transform run alongside a comparison in float64 on the absolute values of its
    gradients and params: its updates and state are the magnitudes of the terms the compared
    values are sums of (the rule's ``scale`` where moments average gradients of both signs).

    The transform must be built from sums and products with nonnegative coefficients,
    divisions and square roots (every transform of the library is, up to the signs of its
    learning rates)."""

    def __init__(self, tx: Any, params: Any) -> None:
        self.tx = tx
        self.state = tx.init(_abs64(params))

    def update(self, updates: Any, params: Any = None) -> tuple[Any, Any]:
        """The magnitudes of the next update and state (absolute values, float64)."""
        wide_params = None if params is None else _abs64(params)
        u, self.state = self.tx.update(_abs64(updates), self.state, wide_params)
        return _abs64(u), _abs64(self.state)
