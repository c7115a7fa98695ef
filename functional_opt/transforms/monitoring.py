"""Monitoring: ``snapshot``, ``monitor`` and ``measure_with_ema`` record quantities of the
updates in the state, as tensors, with no host sync; ``measurements`` collects them.

Ready-made measures: :func:`update_norm`, :func:`update_rms`, :func:`update_not_finite`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    EXTRA_KEYWORDS,
    EmptyState,
    GradientTransformation,
    Params,
    Updates,
    accepting,
    check_extra,
    expect_state,
    extra_keywords,
    state_donation,
)
from functional_opt.transforms.moments import ema
from functional_opt.tree import PyTree

__all__ = [
    "Measure",
    "MonitorState",
    "SnapshotState",
    "measure_with_ema",
    "measurements",
    "monitor",
    "snapshot",
    "update_norm",
    "update_not_finite",
    "update_rms",
]

Measure = Callable[[Updates], PyTree]
"""A measure: a function of the updates (``None`` leaves included) returning a tensor or a tree
of tensors, computed without reading tensors on the host."""


def update_norm(updates: Updates) -> Tensor:
    """The global L2 norm ``sqrt(sum_i sum |u_i|^2)`` of the updates (``None`` leaves left
    out), a 0-d tensor in at least float32. First in a chain, the gradient's norm."""
    return _lists.global_norm(tree.split(updates)[0])


def update_rms(updates: Updates) -> Tensor:
    """The root mean square ``sqrt(sum_i sum |u_i|^2 / n)`` over the ``n`` elements of the
    updates (``None`` leaves left out; 0 when there are none), a 0-d tensor in at least
    float32."""
    g = tree.split(updates)[0]
    n = sum(x.numel() for x in g)
    norm = _lists.global_norm(g)
    return norm / math.sqrt(n) if n else torch.zeros_like(norm)


def update_not_finite(updates: Updates) -> Tensor:
    """A 0-d bool tensor: some element of the updates is NaN or infinite. Placed before
    ``apply_if_finite`` (or ``MultiSteps(..., should_skip_update_fn=skip_not_finite)``), the
    flag of a skipped step."""
    return torch.logical_not(_lists.all_finite(tree.split(updates)[0]))


def _owned(value: PyTree, *sources: PyTree) -> PyTree:
    """``value`` with a copy in place of each tensor that is a leaf of ``sources`` itself (a
    measure returning the updates): the state never shares a tensor with the returned updates
    or the params."""
    leaves, spec = tree.flatten(value)
    if not any(isinstance(x, Tensor) for x in leaves):
        return value
    inputs = [x for s in sources for x in tree.leaves(s) if isinstance(x, Tensor)]
    if torch.compiler.is_compiling():  # ids would become guards of the graph: compare with is
        return tree.unflatten(
            spec,
            [
                x.clone() if isinstance(x, Tensor) and any(x is y for y in inputs) else x
                for x in leaves
            ],
        )
    seen = set(map(id, inputs))
    return tree.unflatten(
        spec, [x.clone() if isinstance(x, Tensor) and id(x) in seen else x for x in leaves]
    )


def _keep_absent(value: PyTree, old: PyTree) -> PyTree:
    """``value`` with the old measurement's leaf wherever ``value`` has ``None`` and the old one
    a tensor (a measure of updates with ``None`` leaves, e.g. ``lambda u: u``): a ``None``
    gradient keeps its state, and the state keeps its structure (checkpoints, compiled
    graphs). Trees of other structures are left as they are."""
    new_leaves, spec = tree.flatten(value)
    if not any(x is None for x in new_leaves):
        return value
    old_leaves, old_spec = tree.flatten(old)
    if old_spec != spec:
        return value
    return tree.unflatten(
        spec, [o if n is None else n for n, o in zip(new_leaves, old_leaves, strict=True)]
    )


def _check_params(updates: Updates, params: Params | None) -> None:
    """Given ``params``, refuses updates of another structure or shape (naming the leaf), as
    every transform does (a monitor passes them on unchanged)."""
    if params is not None:
        tree.split(updates)[1].take(params, "params")


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise _validate.HyperparameterTypeError(
            f"{what} must be a non-empty str, got {type(name).__name__}: {name!r}"
        )


class SnapshotState(NamedTuple):
    """``measurement``: ``{measure_name: measure(updates)}`` of the last update (of the params
    after ``init``)."""

    measurement: dict[str, PyTree]


def snapshot(measure_name: str, measure: Measure) -> GradientTransformation:
    """Records ``measure(updates)`` in the state under ``measure_name`` and passes the updates
    unchanged (optax's ``snapshot``). In a chain it sees the updates as transformed so far.

    ``init`` stores ``measure(params)`` (as optax), which fixes the state's structure from the
    start. A tensor the measure returns that is a leaf of the updates (``lambda u: u``) is stored
    as a copy: the state never shares memory with the updates; where the measurement has a
    ``None`` leaf (a ``None`` update) the last value of that leaf is kept. Read it with
    ``state.measurement[measure_name]`` or :func:`measurements`."""
    _check_name(measure_name, "measure_name")
    _validate.function("measure", measure)

    def init_fn(params: Params) -> SnapshotState:
        return SnapshotState({measure_name: _owned(measure(params), params)})

    def update_fn(
        updates: Updates, state: SnapshotState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, SnapshotState]:
        check_extra(extra, "snapshot")
        _check_params(updates, params)
        expect_state(state, SnapshotState, "snapshot")
        if not isinstance(state.measurement, dict) or list(state.measurement) != [measure_name]:
            got = (
                list(state.measurement)
                if isinstance(state.measurement, dict)
                else type(state.measurement).__name__
            )
            raise ValueError(
                f"snapshot: the state must hold the measurement [{measure_name!r}], got {got} "
                "(the state of another snapshot?)"
            )
        value = _keep_absent(_owned(measure(updates), updates), state.measurement[measure_name])
        return updates, SnapshotState({measure_name: value})

    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


class MonitorState(NamedTuple):
    """``measurements``: ``{name: value}`` of the last update; ``measure_states``: the states
    of the measures, in the order of their names (``EmptyState()`` for a plain function)."""

    measurements: dict[str, PyTree]
    measure_states: tuple[Any, ...]


def _as_transform(name: str, measure: Any) -> GradientTransformation:
    """A measure as a transform whose ``update`` returns ``(measurement, state)``."""
    if isinstance(measure, GradientTransformation):
        return measure
    if not callable(measure) or isinstance(measure, Tensor):
        raise _validate.HyperparameterTypeError(
            f"measures[{name!r}] must be a function of the updates or a GradientTransformation, "
            f"got a {type(measure).__name__}"
        )

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: Any, params: Params | None = None, **extra: Any
    ) -> tuple[PyTree, EmptyState]:
        del params
        check_extra(extra, f"monitor[{name!r}]")
        return measure(updates), EmptyState()

    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


def monitor(measures: Mapping[str, Measure | GradientTransformation]) -> GradientTransformation:
    """Records several measures of the updates in the state and passes the updates unchanged
    (optax's ``monitor``).

    Each value of ``measures`` is a function of the updates (e.g. :func:`update_norm`,
    :func:`update_rms`, :func:`update_not_finite`) or a ``GradientTransformation`` whose
    ``update(updates, state, params)`` returns ``(measurement, new_state)``: a stateful
    measure such as :func:`measure_with_ema`, or ``stateless(fn)`` for a function
    ``fn(updates, params)`` of the params too. Every measurement is a tensor (or a tree of
    them) computed on the device: nothing is read on the host.

    ``init`` records the measures of the params (optax's ``monitor`` starts with an empty
    dict): the state's structure never changes, so ``torch.compile`` and ``state_from_dict``
    see one structure (a ``None`` leaf of a measurement keeps that leaf's last value). Extra
    keywords go to the transform measures that accept them (the state donated at most: the
    updates are returned unchanged). Read the values with ``state.measurements[name]`` or
    :func:`measurements`."""
    if not isinstance(measures, Mapping):
        raise _validate.HyperparameterTypeError(
            f"measures must be a dict of names to measures, got a {type(measures).__name__}"
        )
    if not measures:
        raise ValueError("measures must name at least one measure, got an empty dict")
    for name in measures:
        _check_name(name, "each key of measures")
    names = tuple(measures)
    txs = tuple(_as_transform(name, measures[name]) for name in names)
    accepts = [extra_keywords(t) for t in txs]
    accepted: frozenset[str] | None = (
        None if any(a is None for a in accepts) else EXTRA_KEYWORDS.union(*accepts)  # type: ignore[arg-type]
    )

    def init_fn(params: Params) -> MonitorState:
        states = tuple(t.init(params) for t in txs)
        values = {
            name: _owned(t.update(params, s, params)[0], params)
            for name, t, s in zip(names, txs, states, strict=True)
        }
        return MonitorState(values, states)

    def update_fn(
        updates: Updates, state: MonitorState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MonitorState]:
        check_extra(extra, "monitor", accepted)
        expect_state(state, MonitorState, "monitor")
        _check_params(updates, params)
        if len(state.measure_states) != len(txs) or not (
            isinstance(state.measurements, dict) and tuple(state.measurements) == names
        ):
            got = (
                list(state.measurements)
                if isinstance(state.measurements, dict)
                else type(state.measurements).__name__
            )
            raise ValueError(
                f"monitor: the state must hold the measures {list(names)} (one state each), got "
                f"measurements {got} and {len(state.measure_states)} states (the state of "
                "another monitor?)"
            )
        shared = state_donation(extra)  # the updates are returned: never written into
        values, states = {}, []
        for name, t, s, a in zip(names, txs, state.measure_states, accepts, strict=True):
            mine = shared if a is None else {k: v for k, v in shared.items() if k in a}
            value, s = t.update(updates, s, params, **mine)
            values[name] = _keep_absent(_owned(value, updates, params), state.measurements[name])
            states.append(s)
        return updates, MonitorState(values, tuple(states))

    return GradientTransformation(init_fn, accepting(update_fn, accepted))


def _floating(value: PyTree) -> PyTree:
    """Each tensor leaf of a measurement that is not floating point or complex (a bool flag, a
    count) as float32, for averaging."""
    return tree.map_params(
        lambda x: x if x.is_floating_point() or x.is_complex() else x.to(torch.float32), value
    )


def measure_with_ema(
    measure: Measure,
    decay: float | Tensor,
    debias: bool = True,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """A measure for :func:`monitor` that records the exponential moving average of
    ``measure(updates)`` (optax's ``measure_with_ema``): ``m <- decay * m + (1 - decay) *
    measure(u)``, divided by ``1 - decay**t`` when ``debias`` (see
    :func:`~functional_opt.ema`). A bool or integer measurement is averaged as float32 (the
    average of a flag is the recent fraction of steps where it held)."""
    _validate.function("measure", measure)
    average = ema(decay, debias, accumulator_dtype)  # checks decay, debias, accumulator_dtype

    def init_fn(params: Params) -> Any:
        return average.init(_floating(measure(params)))

    def update_fn(
        updates: Updates, state: Any, params: Params | None = None, **extra: Any
    ) -> tuple[PyTree, Any]:
        del params
        return average.update(_floating(measure(updates)), state, None, **extra)

    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


def measurements(state: Any) -> dict[str, PyTree]:
    """Every measurement recorded by the ``snapshot`` and ``monitor`` transforms in ``state``
    (found anywhere in it: in a chain, a ``named_chain``, a ``masked`` or ``partition``), by
    name, e.g. ``{"grad_norm": tensor(0.7)}``. Nothing is read on the host: the values are
    the state's tensors. Two measurements of one name are a ``ValueError``."""
    found: dict[str, PyTree] = {}

    def add(values: Mapping[str, PyTree]) -> None:
        for name, value in values.items():
            if name in found:
                raise ValueError(f"measurements: two measurements are named {name!r}")
            found[name] = value

    def walk(node: Any) -> None:
        if isinstance(node, SnapshotState):
            add(node.measurement)
        elif isinstance(node, MonitorState):
            add(node.measurements)
            walk(node.measure_states)
        elif isinstance(node, (tuple, list)):
            for child in node:
                walk(child)
        elif isinstance(node, Mapping):
            for child in node.values():
                walk(child)

    walk(state)
    return found
