"""Pytree structure helpers: flattening with ``None`` as "no gradient", and clear mismatch errors.

Every transform flattens its ``updates`` once with :func:`split`, which returns the present
(non-``None``) update tensors plus a :class:`Leaves` record of where they sit. The record then
pulls the matching per-parameter state and params out of other trees (checking that their
structure agrees, and naming the first differing path when it does not), and puts results back:
``None`` where the update was ``None`` and the old state carried over unchanged.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

PyTree = Any
NAMESPACE = "functional_opt"
"""optree namespace of the pytree node types this package registers (loss scales)."""

__all__ = [
    "NAMESPACE",
    "Leaves",
    "PyTree",
    "first_difference",
    "flatten",
    "leaves",
    "map_params",
    "path_str",
    "split",
    "unflatten",
]


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` keeping ``None`` as a leaf (a parameter without a gradient)."""
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, values: Sequence[Any]) -> PyTree:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, list(values))


def leaves(tree: PyTree) -> list[Any]:
    """Leaves of ``tree`` in flattening order, ``None`` included."""
    return optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)


def map_params(fn: Callable[[Tensor], Any], params: PyTree) -> PyTree:
    """``fn`` on every tensor leaf of ``params``; ``None`` leaves stay ``None``."""
    return optree.tree_map(
        lambda x: None if x is None else fn(x), params, none_is_leaf=True, namespace=NAMESPACE
    )


def path_str(path: tuple[Any, ...]) -> str:
    """Readable form of an optree path, e.g. ``['layer'][0]``; the root is ``<root>``."""
    if not path:
        return "<root>"
    return "".join(f"[{key!r}]" for key in path)


def first_difference(a: PyTree, b: PyTree) -> str:
    """Path of the first place where the structures of ``a`` and ``b`` differ."""
    paths_a = optree.tree_paths(a, none_is_leaf=True, namespace=NAMESPACE)
    paths_b = optree.tree_paths(b, none_is_leaf=True, namespace=NAMESPACE)
    for pa, pb in zip(paths_a, paths_b, strict=False):
        if pa != pb:
            return path_str(min(pa, pb, key=_path_sort_key))
    if len(paths_a) != len(paths_b):
        longer = paths_a if len(paths_a) > len(paths_b) else paths_b
        return path_str(longer[min(len(paths_a), len(paths_b))])
    # Same leaf paths but different node types (e.g. list vs tuple): find the first node.
    nodes_a = _node_types(a)
    nodes_b = _node_types(b)
    for (pa, ta), (pb, tb) in zip(nodes_a, nodes_b, strict=False):
        if pa != pb or ta != tb:
            return path_str(pa)
    return "<root>"


def _path_sort_key(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(repr(p) for p in path)


def _node_types(
    tree: PyTree, prefix: tuple[Any, ...] = ()
) -> list[tuple[tuple[Any, ...], type | None]]:
    # Leaves are recorded as ``None``: only node types are structure (a bool mask leaf and a
    # tensor leaf, or ``None`` and a tensor, sit at the same place in the same structure).
    if tree is None or isinstance(tree, Tensor):
        return [(prefix, None)]
    try:
        flat = optree.tree_flatten_one_level(tree, none_is_leaf=True, namespace=NAMESPACE)
    except (ValueError, TypeError):
        return [(prefix, None)]
    out: list[tuple[tuple[Any, ...], type | None]] = [(prefix, type(tree))]
    for entry, child in zip(flat.entries, flat.children, strict=True):
        out.extend(_node_types(child, (*prefix, entry)))
    return out


class Leaves:
    """Where the present (non-``None``) leaves of an updates tree sit.

    Built by :func:`split`. ``index`` lists the flat positions of the present updates.
    """

    __slots__ = ("_flattened", "complete", "index", "kind", "reference", "spec", "values")

    def __init__(
        self, values: list[Any], spec: optree.PyTreeSpec, reference: PyTree, kind: str = "updates"
    ) -> None:
        self.values = values
        self.spec = spec
        self.reference = reference
        self.kind = kind  # what ``reference`` is, for error messages
        self.index = [i for i, v in enumerate(values) if v is not None]
        self.complete = len(self.index) == len(values)  # no None: positions are the identity
        # trees already flattened by this record, by id (each kept alive with its leaves, so
        # an id is never reused): ``carry`` after ``take`` of one state flattens it once
        self._flattened: dict[int, tuple[PyTree, list[Any]]] = {}

    def flat(self, tree: PyTree, name: str) -> list[Any]:
        """All leaves of ``tree``, after checking it has the structure of the updates."""
        compiling = torch.compiler.is_compiling()  # ids would become guards of the graph
        seen = None if compiling else self._flattened.get(id(tree))
        if seen is not None:
            return seen[1]
        values, spec = flatten(tree)
        if spec != self.spec:
            where = first_difference(self.reference, tree)
            raise ValueError(
                f"{name} does not have the structure of the {self.kind}: they first differ at "
                f"{where} ({self.kind}: {self.spec}, {name}: {spec})"
            )
        if not compiling:
            self._flattened[id(tree)] = (tree, values)
        return values

    def take(self, tree: PyTree, name: str) -> list[Tensor]:
        """Leaves of ``tree`` (same structure as the updates) at the present positions."""
        values = self.flat(tree, name)
        out = list(values) if self.complete else [values[i] for i in self.index]
        if any(map(operator.is_, out, itertools.repeat(None))):
            missing = next(i for i in self.index if values[i] is None)
            path = optree.tree_paths(tree, none_is_leaf=True, namespace=NAMESPACE)[missing]
            raise ValueError(f"{name} is None at {path_str(path)}, where the update is a tensor")
        return out

    def updates(self, present: Sequence[Tensor]) -> PyTree:
        """A tree shaped like the updates: ``present`` at their positions, ``None`` elsewhere."""
        return unflatten(self.spec, self._place(present, [None] * len(self.values)))

    def carry(self, old: PyTree, present: Sequence[Tensor], name: str = "state") -> PyTree:
        """``old`` with its leaves at the present positions replaced by ``present``."""
        return unflatten(self.spec, self._place(present, self.flat(old, name)))

    def _place(self, present: Sequence[Any], base: list[Any]) -> list[Any]:
        """A copy of ``base`` with ``present`` at the present positions."""
        if len(present) != len(self.index):
            raise ValueError(f"expected {len(self.index)} present leaves, got {len(present)}")
        if self.complete:
            return list(present)
        values = list(base)
        for i, v in zip(self.index, present, strict=True):
            values[i] = v
        return values


def split(updates: PyTree) -> tuple[list[Tensor], Leaves]:
    """Flatten ``updates`` into its present tensors and the :class:`Leaves` record."""
    values, spec = flatten(updates)
    where = Leaves(values, spec, updates)
    return [values[i] for i in where.index], where
