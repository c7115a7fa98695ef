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

_PACKED: Any = None  # functional_opt.packed.Packed, set when that module is imported

__all__ = [
    "NAMESPACE",
    "BufferLeaves",
    "Leaves",
    "PyTree",
    "difference",
    "first_difference",
    "flatten",
    "global_norm",
    "leaves",
    "map_params",
    "path_str",
    "split",
    "tree_map",
    "unflatten",
]


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` keeping ``None`` as a leaf (a parameter without a gradient)."""
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, values: Sequence[Any]) -> PyTree:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, list(values))


def flatten_buffered(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Like :func:`flatten`, with each packed tree held in buffers (no batch dimensions) kept
    whole as a leaf (for functions that treat it buffer by buffer)."""
    return optree.tree_flatten(tree, is_leaf=_is_buffered, none_is_leaf=True, namespace=NAMESPACE)


def leaves(tree: PyTree) -> list[Any]:
    """Leaves of ``tree`` in flattening order, ``None`` included."""
    if torch.compiler.is_compiling():  # (a list of leaves without optree: see _leaf_list)
        listed = _leaf_list(tree)
        if listed is not None:
            return listed
    return optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)


def map_params(fn: Callable[[Tensor], Any], params: PyTree, *, elementwise: bool = False) -> PyTree:
    """``fn`` on every tensor leaf of ``params``; ``None`` leaves stay ``None``.

    With ``elementwise=True`` (``fn`` returns a tensor of its argument's shape whose elements
    depend only on the argument's elements at the same place, e.g. ``torch.zeros_like`` or a
    cast) a packed tree (:mod:`functional_opt.packed`) is mapped buffer by buffer: the result is
    packed with the same layout, so the elementwise transforms run over its buffers."""
    if elementwise and _is_buffered(params):
        return _PACKED(params.layout, buffers=[fn(b) for b in params.buffers])  # type: ignore[misc]
    return optree.tree_map(
        lambda x: None if x is None else fn(x), params, none_is_leaf=True, namespace=NAMESPACE
    )


def tree_map(
    fn: Callable[..., Any], tree: PyTree, *rest: PyTree, elementwise: bool = False
) -> PyTree:
    """``fn(x, *ys)`` at every tensor leaf ``x`` of ``tree`` (with the leaves of ``rest`` at
    the same place), for writing transforms: it knows the library's node types (packed trees,
    the adapters' param slots, loss scales), and a ``None`` leaf of ``tree`` (no gradient) stays
    ``None`` without calling ``fn``.

    With ``elementwise=True`` (``fn`` computes each element from the elements at the same
    place, like ``torch.sign`` or ``a + 0.1 * b``) packed trees held in buffers with one layout
    are mapped buffer by buffer: a few ops whatever the number of leaves, which the engine
    (:func:`functional_opt.fused`) compiles into single-pass kernels."""
    if elementwise and _is_buffered(tree):
        others: list[Any] = list(rest)
        if all(_is_buffered(o) and _same_layout(o.layout, tree.layout) for o in others):
            buffers = [
                fn(*xs) for xs in zip(tree.buffers, *(o.buffers for o in others), strict=True)
            ]
            return _PACKED(tree.layout, buffers=buffers)
    return optree.tree_map(
        lambda x, *ys: None if x is None else fn(x, *ys),
        tree,
        *rest,
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def global_norm(tree: PyTree) -> Tensor:
    """``sqrt(sum ||x||^2)`` over the tensor leaves of ``tree`` (``None`` leaves ignored), in at
    least float32; over the buffers of a packed tree, the gaps between leaves left out."""
    xs, at = split(tree, elementwise=True)
    norm: Tensor = at.global_norm(xs)
    return norm


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

    Built by :func:`split`. ``index`` lists the flat positions of the present updates;
    ``spec`` is their structure (for a list of leaves under ``torch.compile``, made only when
    asked for: see :func:`_leaf_list`).
    """

    __slots__ = (
        "_flattened",
        "_kinds",
        "_present",
        "_shapes",
        "_spec",
        "complete",
        "index",
        "kind",
        "reference",
        "values",
    )

    def __init__(
        self,
        values: list[Any],
        spec: optree.PyTreeSpec | None,
        reference: PyTree,
        kind: str = "updates",
    ) -> None:
        self.values = values
        self._spec = spec
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

    @property
    def spec(self) -> optree.PyTreeSpec:
        """The updates' structure (made when first asked for, for a list of leaves under
        ``torch.compile``: see :func:`_leaf_list`)."""
        if self._spec is None:
            self._spec = flatten(self.reference)[1]
        return self._spec

    def flat(self, tree: PyTree, name: str) -> list[Any]:
        """All leaves of ``tree``, after checking it has the structure of the updates."""
        compiling = torch.compiler.is_compiling()  # ids would become guards of the graph
        seen = None if compiling else self._flattened.get(id(tree))
        if seen is not None:
            return seen[1]
        if self._spec is None:  # (the updates: a list of leaves, see _leaf_list)
            same = _leaf_list(tree)
            if same is not None and len(same) == len(self.values):
                return same
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

    def flat_buffered(self, tree: PyTree, name: str) -> list[Any]:
        """Like :meth:`flat` for a record made from :func:`flatten_buffered`'s leaves: packed
        trees held in buffers stay whole (and must have the layout of the updates' there)."""
        if self._spec is None:
            return self.flat(tree, name)  # (updates of no packed tree: nothing else to check)
        values, spec = flatten_buffered(tree)
        if spec != self.spec:
            return self.flat(tree, name)  # (raises, naming the first difference)
        for x, y in zip(self.values, values, strict=True):
            if _is_buffered(x) and not (_is_buffered(y) and _same_layout(x.layout, y.layout)):
                raise ValueError(f"{name}: a packed tree in it is not packed like the other")
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

    def check(self, tree: PyTree, name: str) -> None:
        """Raises as :meth:`take` does when ``tree`` does not match the updates."""
        self.take(tree, name)

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

    # Reductions, for transforms whose math is elementwise (``split(..., elementwise=True)``):
    # per leaf here; over the buffers' runs of leaves in :class:`BufferLeaves`.

    def norms(self, xs: Sequence[Tensor]) -> list[Tensor]:
        """The L2 norm of each present leaf (0-d, at least float32)."""
        return _lists.norms(xs)

    def norm_vector(self, xs: Sequence[Tensor]) -> Tensor:
        """The L2 norm of each present leaf as one vector (at least float32)."""
        return _lists.stack(_lists.norms(xs))

    def norm_vectors(self, xs: Sequence[Tensor], ys: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """:meth:`norm_vector` of two lists of the present leaves (e.g. updates and params),
        computed together: for sharded leaves one collective resolves both."""
        both = _lists.stack(_lists.norms([*xs, *ys]))
        return both[: len(xs)], both[len(xs) :]

    def global_norm(self, xs: Sequence[Tensor]) -> Tensor:
        """``sqrt(sum_i ||x_i||^2)`` over the present leaves."""
        return _lists.global_norm(xs)

    def all_finite(self, xs: Sequence[Tensor]) -> Tensor:
        """A 0-d bool tensor: every element of every present leaf is finite."""
        return _lists.all_finite(xs)

    def scale_leaves(
        self, xs: Sequence[Tensor], factors: Sequence[Tensor] | Tensor
    ) -> list[Tensor]:
        """Each present leaf times its own factor (0-d tensors in leaf order, or one vector)."""
        if isinstance(factors, Tensor):
            factors = list(factors.unbind())
        return _lists.mul(xs, list(factors))

    def updates(self, present: Sequence[Tensor]) -> PyTree:
        """A tree shaped like the updates: ``present`` at their positions, ``None`` elsewhere."""
        values = self._place(present, [None] * len(self.values))
        return values if self._spec is None else unflatten(self._spec, values)

    def carry(self, old: PyTree, present: Sequence[Tensor], name: str = "state") -> PyTree:
        """``old`` with its leaves at the present positions replaced by ``present``."""
        values = self._place(present, self.flat(old, name))
        return values if self._spec is None else unflatten(self._spec, values)

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


def _leaf_list(tree: PyTree) -> list[Any] | None:
    """``tree``'s leaves when it is a ``list`` of tensors and ``None``s (its structure is then
    its length), else ``None``. Under ``torch.compile`` a :class:`Leaves` record of such
    updates keeps no ``optree`` structure until it meets a tree of another kind: dynamo traces
    ``optree``'s flattening bytecode by bytecode (about 900 for a one-leaf list, 40% of what
    it traced for ``TransformOptimizer``'s steps), and the engine's one-param steps flatten a
    one-leaf list a few times per transform."""
    if type(tree) is not list:
        return None
    for x in tree:
        if x is not None and not isinstance(x, Tensor):
            return None
    return list(tree)


def _is_buffered(x: Any) -> bool:
    """Whether ``x`` is a packed tree held in buffers, without batch dimensions."""
    return (
        _PACKED is not None
        and type(x) is _PACKED
        and x.buffers is not None
        and not x.structure.batch
    )


def split(updates: PyTree, *, elementwise: bool = False) -> tuple[list[Tensor], Any]:
    """Flatten ``updates`` into its present tensors and the :class:`Leaves` record.

    With ``elementwise=True`` the caller promises that its math on the returned tensors is
    elementwise (it may mix them with scalars and with the tensors ``take`` returns, and reduce
    them only through the record's ``norms``/``global_norm``/``all_finite``/``scale_leaves``):
    then a packed tree held in buffers comes back as its **buffers** (one tensor per device and
    dtype) with a :class:`BufferLeaves` record, and the transform runs a few ops over whole
    buffers whatever the number of leaves. Otherwise (and for every other tree) the tensors are
    the leaves.

    Raises ``TypeError`` naming the first present leaf that is not a floating-point or complex
    tensor (one comparison of the set of dtypes)."""
    if elementwise and _is_buffered(updates):
        record = BufferLeaves(updates)
        return list(updates.buffers), record
    listed = _leaf_list(updates) if torch.compiler.is_compiling() else None
    if listed is not None:
        where = Leaves(listed, None, updates)
    else:
        values, spec = flatten(updates)
        where = Leaves(values, spec, updates)
    where.kinds()  # updates are floating point or complex: an integer one would be truncated
    return list(where.present()), where


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two layouts are equal. Under ``torch.compile`` compared by value only (no
    identity shortcut, which would become a guard on the objects and recompile when an equal
    layout of another packed tree comes in), by their digests where both have one: what the
    graph reads becomes its guards, checked on every call (every leaf's slot, for a tree of
    thousands of leaves, cost milliseconds)."""
    if a is None or b is None:
        return False
    if not torch.compiler.is_compiling():
        return bool(a == b)
    if a._digest and b._digest:
        return bool(a._hash == b._hash and a._digest == b._digest and a.sizes == b.sizes)
    return bool(a._hash == b._hash and a.sizes == b.sizes and a.slots == b.slots)


class BufferLeaves:
    """The record of :func:`split` ``(elementwise=True)`` for a packed tree held in buffers: the
    tensors are the buffers (see :mod:`functional_opt.packed`) and every other tree the transform
    reads must be packed with the same layout (a packed tree of the same structure in another
    layout is copied into this one). Reductions run over the buffers' *runs* (consecutive leaves
    of one size, the rows of a matrix), never over the gaps between them, whose values are
    meaningless."""

    __slots__ = ("complete", "index", "kind", "layout", "reference")

    def __init__(self, packed: Any, kind: str = "updates") -> None:
        self.layout = packed.layout
        self.reference = packed
        self.kind = kind
        self.index = self.layout.present()
        self.complete = True
        for b in packed.buffers:
            if not (b.dtype.is_floating_point or b.dtype.is_complex):
                raise TypeError(
                    f"the {kind} hold leaves of dtype {b.dtype}: they must be floating point or "
                    "complex"
                )

    def path(self, i: int) -> str:
        """Readable path of leaf ``i``."""
        return path_str(
            optree.tree_paths(self.reference, none_is_leaf=True, namespace=NAMESPACE)[i]
        )

    def take(self, tree: PyTree, name: str) -> list[Tensor]:
        """The buffers of ``tree``, packed with this layout (copied into it when ``tree`` is a
        packed tree of the same structure held otherwise)."""
        layout = self.layout
        other: Any = tree
        if type(other) is _PACKED:
            if _same_layout(other.layout, layout):
                return list(other.buffers)
            if other.structure == layout.structure:
                gathered: list[Tensor] = layout.gather(other.tree, name)
                return gathered
        where = difference(self.reference, tree) if not torch.compiler.is_compiling() else None
        raise ValueError(
            f"{name} does not have the structure of the {self.kind} (a packed tree of "
            f"{len(layout.slots)} leaves): they first differ at {where or '<root>'}"
        )

    def check(self, tree: PyTree, name: str) -> None:
        """Raises unless ``tree`` could be taken (:meth:`take`), without copying anything: a
        packed tree of the same structure passes as it is."""
        other: Any = tree
        if type(other) is _PACKED and other.structure == self.layout.structure:
            return
        self.take(tree, name)

    def updates(self, present: Sequence[Tensor]) -> PyTree:
        """The packed tree with buffers ``present``."""
        return _PACKED(self.layout, buffers=list(present))  # type: ignore[misc]

    def carry(self, old: PyTree, present: Sequence[Tensor], name: str = "state") -> PyTree:
        """``old``'s successor: the packed tree with buffers ``present``, in ``old``'s layout
        object when it has one (equal to this one), so a state keeps the layout it was made
        with from step to step (under ``torch.compile`` which objects are the same is part of
        what a compiled graph assumes)."""
        del name
        layout = old.layout if _is_buffered(old) else self.layout
        return _PACKED(layout, buffers=list(present))  # type: ignore[misc]

    def _leaf_vector(self, pieces: list[Tensor]) -> Tensor:
        """Per-run values (concatenated in run order) put back in leaf order."""
        vec = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        order = self.layout.run_order()
        return vec if order is None else vec[order]

    def norms(self, xs: Sequence[Tensor]) -> list[Tensor]:
        """The L2 norm of each leaf (0-d, at least float32), in leaf order."""
        if not self.index:
            return []
        return list(self.norm_vector(xs).unbind())

    def norm_vector(self, xs: Sequence[Tensor]) -> Tensor:
        """The L2 norm of each leaf as one vector (at least float32), in leaf order (within
        :func:`functional_opt._lists.sharded_reductions`, of the whole tensors whose local
        shards the leaves are: their squares summed over the ranks in leaf order, one
        collective)."""
        if _lists.sharded_group() is None:
            return self._norms(xs, squared=False)
        return _lists.sum_over_shards(self._norms(xs, squared=True)).sqrt()

    def _norms(self, xs: Sequence[Tensor], squared: bool) -> Tensor:
        """Each leaf's L2 norm (its square with ``squared``), one vector in leaf order."""
        pieces = []
        for b, x in enumerate(xs):
            dtype = torch.promote_types(x.dtype, torch.float32) if not x.is_complex() else None
            for start, count, size in self.layout.runs(b):
                rows = x[start : start + count * size].view(count, size)
                norm = torch.linalg.vector_norm(rows, dim=1, dtype=dtype)
                pieces.append(norm.square() if squared else norm)
        return self._leaf_vector(pieces)

    def norm_vectors(self, xs: Sequence[Tensor], ys: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """:meth:`norm_vector` of two lists of buffers (sharded: one collective for both)."""
        if _lists.sharded_group() is None:
            return self.norm_vector(xs), self.norm_vector(ys)
        a, b = self._norms(xs, squared=True), self._norms(ys, squared=True)
        both = _lists.sum_over_shards(torch.cat([a, b])).sqrt()
        return both[: a.numel()].to(a.dtype), both[a.numel() :].to(b.dtype)

    def _regions(self, xs: Sequence[Tensor]) -> list[Tensor]:
        return [x[start:end] for b, x in enumerate(xs) for start, end in self.layout.regions(b)]

    def global_norm(self, xs: Sequence[Tensor]) -> Tensor:
        """``sqrt(sum_i ||x_i||^2)`` over all leaves (the gaps left out; sharded: the squares
        summed over the ranks, one collective even where this rank holds no element)."""
        regions = self._regions(xs)
        if _lists._ACROSS is not None:  # (a part of the tree: see _lists.Across)
            return _lists.global_norm(regions)
        if _lists.sharded_group() is not None:
            dtype = torch.float32
            for x in xs:
                dtype = torch.promote_types(dtype, x.real.dtype)
            local = [n.square() for n in _lists.local_norms(regions)]
            total = _lists.stack(local).sum() if local else torch.zeros((), dtype=dtype)
            return _lists.sum_over_shards(total.to(dtype)).sqrt()
        if not regions:
            return torch.zeros(())
        norm: Tensor = torch.linalg.vector_norm(_lists.stack(_lists.norms(regions)))
        return norm

    def all_finite(self, xs: Sequence[Tensor]) -> Tensor:
        """A 0-d bool tensor: every element of every leaf is finite (the gaps left out;
        sharded: on every rank, one collective); see :func:`functional_opt._lists.all_finite`."""
        return _lists.all_finite(self._regions(xs))

    def scale_leaves(
        self, xs: Sequence[Tensor], factors: Sequence[Tensor] | Tensor
    ) -> list[Tensor]:
        """Each leaf times its own factor (0-d tensors in leaf order, or one vector), in the
        leaf's dtype; the gaps become 0."""
        vec = factors if isinstance(factors, Tensor) else _lists.stack(list(factors))
        by_run = self.layout.leaves_by_run()
        compiling = torch.compiler.is_compiling()
        vec = _lists.once_per_leaf(vec)
        out = []
        for b, x in enumerate(xs):
            pieces, end = [], 0
            for (start, count, size), leaves in zip(self.layout.runs(b), by_run[b], strict=True):
                if start > end:
                    pieces.append(x.new_zeros(start - end))
                f = vec[leaves]
                if compiling and start == 0 and count * size == x.shape[-1]:
                    # the whole buffer is this run (``pack``'s buffer per leaf size): the factor
                    # expanded to one per element, which inductor computes inside the kernel
                    # that uses the result (a [count, size] product reshaped to 1-D would be
                    # written out first)
                    scale = f[:, None].expand(count, size).reshape(-1)
                    pieces.append((x * scale).to(x.dtype))
                else:
                    rows = x[start : start + count * size].view(count, size)
                    pieces.append((rows * f[:, None]).to(x.dtype).reshape(-1))
                end = start + count * size
            if end < x.shape[-1]:
                pieces.append(x.new_zeros(x.shape[-1] - end))
            out.append(torch.cat(pieces) if len(pieces) != 1 else pieces[0])
        return out
