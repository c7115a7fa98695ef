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

from functional_opt import _lists

PyTree = Any
_SHAPE = operator.attrgetter("shape")
_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_REAL = object()  # every update is real floating point
_OTHER = object()  # some updates are complex, or of other floating-point dtypes
NAMESPACE = "functional_opt"
"""optree namespace of the pytree node types this package registers (loss scales)."""

__all__ = [
    "NAMESPACE",
    "Leaves",
    "PyTree",
    "difference",
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
    """Path of the first place where the structures of ``a`` and ``b`` differ (``<root>`` when
    no place can be named)."""
    return difference(a, b) or "<root>"


def difference(a: PyTree, b: PyTree) -> str | None:
    """Path of the first place where the structures of ``a`` and ``b`` differ, or ``None``
    when they have the same leaf paths, node types and node data. For a node whose data carry
    leaf shapes (a packed tree's structure) the first leaf of another shape is named, with both
    shapes."""
    paths_a = optree.tree_paths(a, none_is_leaf=True, namespace=NAMESPACE)
    paths_b = optree.tree_paths(b, none_is_leaf=True, namespace=NAMESPACE)
    for pa, pb in zip(paths_a, paths_b, strict=False):
        if pa != pb:
            return path_str(min(pa, pb, key=_path_sort_key))
    if len(paths_a) != len(paths_b):
        longer = paths_a if len(paths_a) > len(paths_b) else paths_b
        return path_str(longer[min(len(paths_a), len(paths_b))])
    # Same leaf paths but different node types (e.g. list vs tuple) or node data: the first node.
    nodes_a = _node_types(a)
    nodes_b = _node_types(b)
    for (pa, ta, ma), (pb, tb, mb) in zip(nodes_a, nodes_b, strict=False):
        if pa != pb or ta != tb:
            return path_str(pa)
        if ta is not None and not _same_data(ma, mb):
            return path_str(pa) + _shape_difference(ma, mb, pa, a)
    return None


def _same_data(x: Any, y: Any) -> bool:
    try:
        return bool(x == y)
    except Exception:  # node data without a usable equality: not evidence of a difference
        return True


def _shape_difference(ma: Any, mb: Any, path: tuple[Any, ...], a: PyTree) -> str:
    """`` (in the leaf at ...: shape ... vs ...)`` when the node data of both trees carry
    per-leaf ``shapes`` that differ; else ``""``."""
    sa, sb = getattr(ma, "shapes", None), getattr(mb, "shapes", None)
    if not (isinstance(sa, tuple) and isinstance(sb, tuple) and len(sa) == len(sb)):
        return ""
    node = a
    for entry in path:
        flat = optree.tree_flatten_one_level(node, none_is_leaf=True, namespace=NAMESPACE)
        node = flat.children[list(flat.entries).index(entry)]
    inner = optree.tree_paths(node, none_is_leaf=True, namespace=NAMESPACE)
    for k, (x, y) in enumerate(zip(sa, sb, strict=True)):
        if x != y and k < len(inner):
            show = [None if z is None else tuple(z) for z in (x, y)]
            return f" (the leaf {path_str(inner[k])} in it: shape {show[0]} vs {show[1]})"
    return ""


def _path_sort_key(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(repr(p) for p in path)


def _node_types(
    tree: PyTree, prefix: tuple[Any, ...] = ()
) -> list[tuple[tuple[Any, ...], type | None, Any]]:
    # Leaves are recorded as ``None``: only node types are structure (a bool mask leaf and a
    # tensor leaf, or ``None`` and a tensor, sit at the same place in the same structure).
    if tree is None or isinstance(tree, Tensor):
        return [(prefix, None, None)]
    try:
        flat = optree.tree_flatten_one_level(tree, none_is_leaf=True, namespace=NAMESPACE)
    except (ValueError, TypeError):
        return [(prefix, None, None)]
    out: list[tuple[tuple[Any, ...], type | None, Any]] = [(prefix, type(tree), flat.metadata)]
    for entry, child in zip(flat.entries, flat.children, strict=True):
        out.extend(_node_types(child, (*prefix, entry)))
    return out


class Leaves:
    """Where the present (non-``None``) leaves of an updates tree sit.

    Built by :func:`split`. ``index`` lists the flat positions of the present updates.
    """

    __slots__ = (
        "_flattened",
        "_kinds",
        "_present",
        "_shapes",
        "complete",
        "index",
        "kind",
        "reference",
        "spec",
        "values",
    )

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
        self._present: list[Any] | None = None  # the present updates, once needed
        self._shapes: list[torch.Size] | None = None  # of the present updates, once needed
        self._kinds: object = None  # ``_REAL`` or ``_OTHER``, once needed

    def flat(self, tree: PyTree, name: str) -> list[Any]:
        """All leaves of ``tree``, after checking it has the structure of the updates."""
        compiling = torch.compiler.is_compiling()  # ids would become guards of the graph
        seen = None if compiling else self._flattened.get(id(tree))
        if seen is not None:
            return seen[1]
        values, spec = flatten(tree)
        if spec != self.spec:
            where = difference(self.reference, tree)
            # (After a graph break torch.compile may compare one of its own specs with one made
            # outside: unequal whatever they describe. The trees themselves then decide.)
            if where is not None or not compiling:
                specs = "" if compiling else f" ({self.kind}: {self.spec}, {name}: {spec})"
                raise ValueError(
                    f"{name} does not have the structure of the {self.kind}: they first differ "
                    f"at {where or '<root>'}{specs}"
                )
        if not compiling:
            self._flattened[id(tree)] = (tree, values)
        return values

    def take(self, tree: PyTree, name: str) -> list[Tensor]:
        """Leaves of ``tree`` (same structure as the updates) at the present positions.

        Each must be a tensor of its update's shape (nothing is broadcast), and complex where
        the update is complex (a real one would silently drop the imaginary part); the updates
        must be floating point or complex. A ``ValueError``/``TypeError`` names the first leaf
        that is not. The checks compare lists of shapes (and, once per record, the set of the
        updates' dtypes): a Python comparison per leaf, no tensor is read."""
        values = self.flat(tree, name)
        out = list(values) if self.complete else [values[i] for i in self.index]
        if any(map(operator.is_, out, itertools.repeat(None))):
            missing = next(i for i in self.index if values[i] is None)
            raise ValueError(
                f"{name} is None at {self.path(missing)}, where the update is a tensor"
            )
        if self._checked(out, name) != self.shapes():
            self._shape_error(out, name)
        if self.kinds() is not _REAL:
            self._dtype_check(out, name)
        return out

    def present(self) -> list[Any]:
        """The present update values, in order (one list, made once: do not modify it)."""
        if self._present is None:
            values = self.values
            self._present = values if self.complete else [values[i] for i in self.index]
        return self._present

    def shapes(self) -> list[torch.Size]:
        """The shapes of the present updates (computed once per record)."""
        if self._shapes is None:
            self._shapes = self._checked(self.present(), self.kind)
        return self._shapes

    def kinds(self) -> object:
        """``_REAL`` when every present update is a real floating-point tensor of the usual
        dtypes, ``_OTHER`` when some are complex (or of another floating-point dtype); raises
        ``TypeError`` at the first that is neither (an integer or bool update would be
        truncated by the float math)."""
        if self._kinds is None:
            present = self.present()
            dtypes: set[torch.dtype] | None
            try:
                dtypes = set(_lists.column(present, "dtype"))
            except AttributeError:
                dtypes = None  # a leaf that is not a tensor: named below
            if dtypes is not None and dtypes <= _FLOATS:
                self._kinds = _REAL
            else:
                for i in self.index:
                    if not isinstance(self.values[i], Tensor):
                        raise TypeError(
                            f"the {self.kind} at {self.path(i)} are a "
                            f"{type(self.values[i]).__name__}, not a tensor"
                        )
                    dtype = self.values[i].dtype
                    if not (dtype.is_floating_point or dtype.is_complex):
                        raise TypeError(
                            f"the {self.kind} at {self.path(i)} have dtype {dtype}: they must "
                            "be floating point or complex"
                        )
                self._kinds = _OTHER
        return self._kinds

    def path(self, i: int) -> str:
        """Readable path of flat position ``i`` (in the updates, and in every tree of their
        structure)."""
        return path_str(
            optree.tree_paths(self.reference, none_is_leaf=True, namespace=NAMESPACE)[i]
        )

    def _checked(self, xs: list[Any], name: str) -> list[torch.Size]:
        """The shapes of ``xs``; a ``TypeError`` naming the first leaf that is not a tensor."""
        if torch.compiler.is_compiling():
            return [x.shape for x in xs]
        try:
            return list(map(_SHAPE, xs))  # a C-level loop (trees of thousands of leaves)
        except AttributeError:
            pass
        for i, x in zip(self.index, xs, strict=True):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} at {self.path(i)} is a {type(x).__name__}, not a tensor")
        return list(map(_SHAPE, xs))

    def _shape_error(self, xs: list[Tensor], name: str) -> None:
        for i, x, want in zip(self.index, xs, self.shapes(), strict=True):
            if x.shape != want:
                raise ValueError(
                    f"{name} at {self.path(i)} has shape {tuple(x.shape)}, but the {self.kind} "
                    f"have shape {tuple(want)} there: shapes must be equal (nothing is broadcast)"
                )

    def _dtype_check(self, xs: list[Tensor], name: str) -> None:
        """Where an update is complex, the leaf of ``xs`` must be complex too."""
        for i, x in zip(self.index, xs, strict=True):
            dtype = self.values[i].dtype
            if dtype.is_complex and not x.dtype.is_complex:
                raise TypeError(
                    f"{name} at {self.path(i)} has the real dtype {x.dtype}, but the "
                    f"{self.kind} there are complex ({dtype}): the imaginary part would be lost"
                )

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
    """Flatten ``updates`` into its present tensors and the :class:`Leaves` record.

    Raises ``TypeError`` naming the first present leaf that is not a floating-point or complex
    tensor (one comparison of the set of dtypes)."""
    values, spec = flatten(updates)
    where = Leaves(values, spec, updates)
    where.kinds()  # updates are floating point or complex: an integer one would be truncated
    return list(where.present()), where
