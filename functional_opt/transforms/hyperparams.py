"""``inject_hyperparams``: hyperparameters as tensors in the state, changeable without rebuilding
(and without recompiling under ``torch.compile``)."""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _validate, tree
from functional_opt.base import (
    GradientTransformation,
    Params,
    Updates,
    accepting,
    check_extra,
    declare_fusable,
    declare_leafwise,
    declare_member_labels,
    expect_state,
    extra_keywords,
    fusable,
    leafwise_level,
    safe_increment,
    zero_count,
)

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]


class InjectHyperparamsState(NamedTuple):
    """``count`` of updates, the current ``hyperparams`` (0-d tensors) and the ``inner_state``."""

    count: Tensor  # type: ignore[assignment]
    hyperparams: dict[str, Tensor]
    inner_state: Any


def _highest_float_dtype(params: Params) -> torch.dtype:
    dtypes = [
        p.dtype for p in tree.leaves(params) if isinstance(p, Tensor) and p.is_floating_point()
    ]
    if not dtypes:
        return torch.get_default_dtype()
    # At least float32: 16-bit hyperparameters would round e.g. b2=0.999 to 1.0.
    return max([torch.float32, *dtypes], key=lambda d: torch.finfo(d).bits)


def _as_tensor(value: Any, dtype: torch.dtype, name: str = "value") -> Tensor:
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if not isinstance(value, numbers.Integral):  # a float (numpy's too)
        return torch.tensor(float(value), dtype=dtype)
    if not -(2**63) <= int(value) < 2**63:
        raise ValueError(f"{name} must fit an int64 tensor to be injected, got {value!r}")
    return torch.tensor(int(value), dtype=torch.int64)


def _placeholder(value: Any) -> Any:
    """What the factory is built with, at construction, for a schedule: a 0-d tensor (whose
    value is not checked)."""
    del value
    return torch.zeros(())


def _check_rounded(
    factory: Callable[..., GradientTransformation],
    fixed: dict[str, Any],
    numeric: dict[str, Any],
    schedules: dict[str, Any],
    dtype: torch.dtype,
) -> None:
    """Builds ``factory`` with the Python floats of ``numeric`` rounded to ``dtype`` (the
    dtype they are stored in): a value valid as given can become invalid there (``b2 =
    0.99999999`` is 1.0 in float32, and then ``1 - b2**t`` is 0). Raises ``ValueError``
    naming the first such value."""

    def is_float(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral)

    rounded = {
        k: torch.tensor(float(v), dtype=dtype).item() if is_float(v) else v
        for k, v in numeric.items()
    }
    changed = [k for k, v in numeric.items() if is_float(v) and rounded[k] != v]
    if not changed:
        return
    stand_ins = {k: _placeholder(v) for k, v in schedules.items()}
    try:
        factory(**fixed, **rounded, **stand_ins)
    except ValueError as err:
        culprits = changed
        for k in changed:  # name the value that fails on its own, where one does
            try:
                factory(**fixed, **{**numeric, k: rounded[k]}, **stand_ins)
            except ValueError:
                culprits = [k]
                break
        raise ValueError(
            f"{', '.join(f'{k}={numeric[k]!r}' for k in culprits)} rounds to "
            f"{', '.join(repr(rounded[k]) for k in culprits)} in {dtype}, the dtype injected "
            f"hyperparameters are stored in, which is invalid: {err}"
        ) from err


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: torch.dtype | None = None,
) -> Callable[..., GradientTransformation]:
    """Wraps a transform factory so that its numeric arguments live in the state.

    Numbers (and 0-d tensors) become ``state.hyperparams[name]`` tensors; callables other than
    ``static_args`` are schedules evaluated at ``state.count`` each update; bools, strings and
    ``static_args`` stay fixed. Floats use ``hyperparam_dtype`` (default: the params' widest
    float dtype, at least float32). Change a value by replacing it in ``state.hyperparams``.

    Validation: the wrapped factory gets the plain factory's checks. Calling it builds
    ``inner_factory`` once with the given values (schedules stand in as 0-d tensors), so a bad
    Python value raises the factory's own error right there; ``init`` checks again with the
    floats rounded to the dtype they are stored in (a decay of ``0.99999999`` is 1.0 in
    float32). Tensors, given here or written into ``state.hyperparams`` later, and the values
    of schedules are the caller's promise: reading them would sync with the device.
    """
    _validate.function("inner_factory", inner_factory)
    _validate.float_dtype("hyperparam_dtype", hyperparam_dtype)
    if isinstance(static_args, str):
        static = {static_args}
    else:
        static = set(static_args)
        for name in static:
            if not isinstance(name, str):
                raise TypeError(f"static_args must be names (str), got {name!r}")
    signature = inspect.signature(inner_factory)
    unknown = static - set(signature.parameters)
    if unknown:
        raise ValueError(
            f"static_args {sorted(unknown)} are not parameters of {inner_factory.__name__} "
            f"(it takes {list(signature.parameters)})"
        )

    @functools.wraps(inner_factory)
    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        schedules: dict[str, Callable[[Tensor], Any]] = {}
        numeric: dict[str, Any] = {}
        fixed: dict[str, Any] = {}
        for name, value in arguments.items():
            if name in static or isinstance(value, bool) or name.startswith("_"):
                fixed[name] = value
            elif callable(value):
                schedules[name] = value
            elif isinstance(value, numbers.Real) or (
                isinstance(value, Tensor) and value.dim() == 0
            ):
                numeric[name] = value
            else:
                fixed[name] = value
        # The plain factory's checks, on the values as given (building a transform only makes
        # closures); it also tells which extra keywords the inner transform takes.
        probe = inner_factory(
            **fixed, **numeric, **{k: _placeholder(v) for k, v in schedules.items()}
        )
        accepted = extra_keywords(probe)
        where = f"inject_hyperparams({getattr(inner_factory, '__name__', 'inner_factory')})"

        def current(
            count: Tensor, stored: dict[str, Tensor], dtype: torch.dtype
        ) -> dict[str, Tensor]:
            values = dict(stored)
            for name, fn in schedules.items():
                values[name] = _as_tensor(torch.as_tensor(fn(count)), dtype)
            return values

        def init_fn(params: Params) -> InjectHyperparamsState:
            dtype = hyperparam_dtype or _highest_float_dtype(params)
            if not torch.compiler.is_compiling():
                _check_rounded(inner_factory, fixed, numeric, schedules, dtype)
            count = zero_count()
            stored = {k: _as_tensor(v, dtype, k) for k, v in numeric.items()}
            values = current(count, stored, dtype)
            inner = inner_factory(**fixed, **values)
            return InjectHyperparamsState(count, values, inner.init(params))

        def update_fn(
            updates: Updates,
            state: InjectHyperparamsState,
            params: Params | None = None,
            **extra: Any,
        ) -> tuple[Updates, InjectHyperparamsState]:
            check_extra(extra, where, accepted)
            expect_state(state, InjectHyperparamsState, where)
            stored = state.hyperparams
            dtype = next(
                (v.dtype for v in stored.values() if v.is_floating_point()),
                hyperparam_dtype or torch.get_default_dtype(),
            )
            values = current(state.count, stored, dtype)
            inner = inner_factory(**fixed, **values)
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
            return updates, InjectHyperparamsState(safe_increment(state.count), values, inner_state)

        declare_fusable(update_fn, lambda: fusable(probe))
        declare_leafwise(update_fn, lambda: leafwise_level(probe))
        declare_member_labels(update_fn, lambda: (probe,))
        return GradientTransformation(init_fn, accepting(update_fn, accepted))

    return wrapped
