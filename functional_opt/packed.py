"""Packed trees: a pytree whose tensors are views into a few contiguous buffers.

``pack(tree)`` copies the tensors of ``tree`` into flat buffers, one per (device, dtype, leaf
size): each buffer holds the leaves of one size as the rows of a matrix (past :data:`MAX_RUNS`
sizes of a dtype, one buffer holds them all, largest first). It returns a :class:`Packed`: a
pytree node whose only child is ``tree`` rebuilt from views of those buffers. Transforms see
the same per-tensor leaves as for ``tree`` (per-tensor norms, masks and state paths are
unchanged) and their per-parameter states are packed trees of the same structure, while the
fast paths (the engine, ``apply_updates``) run over the buffers when every tree they get is
packed with one layout: a tree of 2000 small tensors then costs about what one tensor of the
same size costs, as the adapter's flat buffers do.

For ``torch.func`` (whose pytrees are ``torch.utils._pytree``'s) a ``Packed`` is a node whose
children are its buffers, so ``torch.func.grad(loss)(packed_params)`` differentiates with respect
to the buffers and returns the gradients packed with the same layout.

Buffers may have leading *batch* dimensions (``pack(stacked, batch_dims=1)``, or what
``torch.vmap`` stacks): a buffer of shape ``[*batch, n]`` holds leaves of shape
``[*batch, *shape]``, and ``torch.vmap`` over it hands the function one member's packed tree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import Tensor

from functional_opt import tree
from functional_opt.tree import PyTree

__all__ = ["ALIGN", "MAX_RUNS", "Gather", "Layout", "Packed", "Structure", "pack"]


def digest(key: Any) -> int:
    """A 128-bit digest of ``key`` (plain Python values), nonzero, for comparing structures and
    layouts inside compiled code by two ints; 0 (compare the values) when made while compiling,
    where it cannot be computed."""
    if torch.compiler.is_compiling():
        return 0
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=16).digest()) | 1


class Structure:
    """The tree structure of a packed tree: its pytree spec, each leaf's shape without the batch
    dimensions (``None`` for ``None`` leaves) and the batch shape (``torch.Size([])`` unless the
    buffers are batched). What optree compares: two packed trees of one structure match leaf
    for leaf whatever their dtypes and buffers."""

    __slots__ = ("_digest", "_hash", "_key", "batch", "indices", "shapes", "spec")

    def __init__(
        self,
        spec: optree.PyTreeSpec,
        shapes: tuple[torch.Size | None, ...],
        batch: Sequence[int] = (),
    ) -> None:
        self.spec = spec
        self.shapes = shapes
        # the tree with each leaf's index as the leaf: under torch.compile, whose pytree code
        # may visit a dict's keys in another order, leaves are placed through it by index
        self.indices = tree.unflatten(spec, list(range(len(shapes))))
        # compared as plain Python values (torch.compile cannot trace a spec's hash or equality)
        self._batch((hash(spec), str(spec), shapes), batch)

    def _batch(self, key: tuple[Any, ...], batch: Sequence[int]) -> None:
        self.batch = torch.Size(batch)
        self._key = (*key, tuple(self.batch))
        self._hash = hash(self._key)
        self._digest = digest(self._key)

    def batched(self, batch: Sequence[int]) -> Structure:
        """This structure with batch shape ``batch``."""
        if torch.Size(batch) == self.batch:
            return self
        new = object.__new__(Structure)  # (made under compile too: no spec operations here)
        new.spec, new.shapes, new.indices = self.spec, self.shapes, self.indices
        new._batch(self._key[:-1], batch)
        return new

    def with_shapes(self, shapes: tuple[torch.Size | None, ...]) -> Structure:
        """This structure with leaf shapes ``shapes`` (``None`` for leaves made ``None``: the
        structure of a masked subtree)."""
        new = object.__new__(Structure)  # (made under compile too: no spec operations here)
        new.spec, new.shapes, new.indices = self.spec, shapes, self.indices
        new._batch((*self._key[:2], shapes), self.batch)
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Structure):
            return NotImplemented
        if torch.compiler.is_compiling() and self._digest and other._digest:
            # (what a graph reads becomes its guards: two ints, not every leaf's shape, and
            # no identity test, which would guard on the objects)
            return self._hash == other._hash and self._digest == other._digest
        if self is other:
            return True
        return self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        batch = f", batch {tuple(self.batch)}" if self.batch else ""
        return f"Structure({len(self.shapes)} leaves{batch})"

    def rebuild(self, values: Sequence[Any]) -> PyTree:
        """The tree with ``values`` (in flattening order) as its leaves."""
        if torch.compiler.is_compiling():  # (dynamo's optree cannot take a spec made outside)
            return optree.tree_map(
                values.__getitem__, self.indices, none_is_leaf=True, namespace=tree.NAMESPACE
            )
        return tree.unflatten(self.spec, values)

    def leaves(self, values: PyTree) -> list[Any]:
        """The leaves of ``values``, a tree of this structure, in flattening order."""
        if not torch.compiler.is_compiling():
            return tree.leaves(values)
        out: list[Any] = [None] * len(self.shapes)

        def put(i: int, v: Any) -> None:
            out[i] = v

        optree.tree_map(put, self.indices, values, none_is_leaf=True, namespace=tree.NAMESPACE)
        return out


class Layout:
    """Where each leaf of a packed tree lives: its :class:`Structure`, and per leaf its buffer and
    element offset (``None`` for ``None`` leaves), with each buffer's size. Immutable; equal when
    all of that is equal (dtypes are not part of it: float32 params and their float32 moments
    share a layout)."""

    __slots__ = ("_batched", "_digest", "_hash", "_plans", "sizes", "slots", "structure")

    def __init__(
        self,
        structure: Structure,
        slots: tuple[tuple[int, int] | None, ...],
        sizes: tuple[int, ...],
    ) -> None:
        self.structure = structure
        self.slots = slots
        self.sizes = sizes
        self._hash = hash((structure, slots, sizes))
        self._digest = digest((structure._digest, slots, sizes)) if structure._digest else 0
        self._plans: dict[Any, Any] = {}  # derived routing, cached by the fast paths
        self._batched: dict[torch.Size, Layout] = {}

    def batched(self, batch: torch.Size) -> Layout:
        """This layout for buffers with batch shape ``batch`` (the same slots and sizes)."""
        if batch == self.structure.batch:
            return self
        if batch not in self._batched:
            structure = self.structure.batched(batch)
            self._batched[batch] = Layout(structure, self.slots, self.sizes)
        return self._batched[batch]

    @property
    def shapes(self) -> tuple[torch.Size | None, ...]:
        """Each leaf's shape (``None`` for ``None`` leaves)."""
        return self.structure.shapes

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.sizes == other.sizes
            and self.slots == other.slots
            and self.structure == other.structure
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Layout({len(self.slots)} leaves in {len(self.sizes)} buffers of {self.sizes})"

    def _runs_plan(self) -> tuple[Any, ...]:
        """Per buffer its runs ``(start, count, size)`` (consecutive leaves of one size, in
        offset order), each run's leaf positions (a slice or an index tensor into the present
        leaves in flattening order), its merged regions ``(start, end)`` without gaps, and the
        permutation from run order to leaf order (``None`` when it is the identity)."""
        plan = self._plans.get("runs")
        if plan is not None:
            return plan  # type: ignore[no-any-return]
        position = {leaf: k for k, leaf in enumerate(i for i, s in enumerate(self.slots) if s)}
        runs: list[list[tuple[int, int, int]]] = []
        by_run: list[list[slice | Tensor]] = []
        regions: list[list[tuple[int, int]]] = []
        sequence: list[int] = []
        for b in range(len(self.sizes)):
            groups: list[list[int]] = []
            for i in self.members(b):
                n = self.shapes[i].numel()  # type: ignore[union-attr]
                last = groups[-1] if groups else None
                if (
                    last is not None
                    and self.shapes[last[0]].numel() == n  # type: ignore[union-attr]
                    and self.slots[last[-1]][1] + n == self.slots[i][1]  # type: ignore[index]
                ):
                    last.append(i)
                else:
                    groups.append([i])
            runs.append([])
            by_run.append([])
            regions.append([])
            for g in groups:
                n = self.shapes[g[0]].numel()  # type: ignore[union-attr]
                start = self.slots[g[0]][1]  # type: ignore[index]
                runs[-1].append((start, len(g), n))
                ks = [position[i] for i in g]
                sequence.extend(ks)
                contiguous = ks == list(range(ks[0], ks[0] + len(ks)))
                by_run[-1].append(slice(ks[0], ks[-1] + 1) if contiguous else torch.tensor(ks))
                end = start + len(g) * n
                if end == start:
                    continue
                if regions[-1] and regions[-1][-1][1] == start:
                    regions[-1][-1] = (regions[-1][-1][0], end)
                else:
                    regions[-1].append((start, end))
        order: Tensor | None = None
        if sequence != list(range(len(sequence))):
            inverse = [0] * len(sequence)
            for j, k in enumerate(sequence):
                inverse[k] = j
            order = torch.tensor(inverse)
        plan = (runs, by_run, regions, order)
        self._plans["runs"] = plan
        return plan

    def prepare(self) -> Layout:
        """Computes the derived plans the elementwise transforms read (:meth:`present`, the
        runs), once: called before compiled code runs, so that a graph never sees them made."""
        self.present()
        self._runs_plan()
        return self

    def present(self) -> list[int]:
        """The leaves that are not ``None``, by flat position (made once per layout)."""
        index = self._plans.get("present")
        if index is None:
            index = [i for i, slot in enumerate(self.slots) if slot is not None]
            self._plans["present"] = index
        return index  # type: ignore[no-any-return]

    def runs(self, buffer: int) -> list[tuple[int, int, int]]:
        """The runs of ``buffer``: ``(start, count, size)`` for each stretch of consecutive
        leaves of one size, in offset order (the rows of a ``count x size`` matrix)."""
        return self._runs_plan()[0][buffer]  # type: ignore[no-any-return]

    def leaves_by_run(self) -> list[list[slice | Tensor]]:
        """Per buffer and run, the positions of its leaves among the present leaves in
        flattening order (a slice where they are consecutive)."""
        return self._runs_plan()[1]  # type: ignore[no-any-return]

    def regions(self, buffer: int) -> list[tuple[int, int]]:
        """The element ranges ``(start, end)`` of ``buffer`` that hold leaves (gaps left out)."""
        return self._runs_plan()[2][buffer]  # type: ignore[no-any-return]

    def run_order(self) -> Tensor | None:
        """The index that puts per-run values (runs of buffer 0, then 1, ...) in leaf order, or
        ``None`` when they already are."""
        return self._runs_plan()[3]  # type: ignore[no-any-return]

    def gather(self, values: PyTree, name: str = "tree") -> list[Tensor]:
        """The leaves of ``values`` (a tree of this layout's structure) copied into buffers of
        this layout. The leaves stored in one buffer must share a dtype and device."""
        leaves = self.structure.leaves(values)
        out = []
        for b in range(len(self.sizes)):
            members = self.members(b)
            xs = [leaves[i] for i in members]
            kinds = {(x.dtype, x.device) for x in xs if isinstance(x, Tensor)}
            if len(kinds) != 1 or len(xs) != sum(isinstance(x, Tensor) for x in xs):
                raise ValueError(
                    f"{name}: the leaves held in buffer {b} of the packed layout must be tensors "
                    f"of one dtype and device, got {sorted(map(str, kinds))}"
                )
            starts = [self.slots[i][1] for i in members]  # type: ignore[index]
            buffer = _joined(xs, starts, self.structure.batch)
            if buffer.shape[-1] < self.sizes[b]:
                pad = buffer.new_zeros(*self.structure.batch, self.sizes[b] - buffer.shape[-1])
                buffer = torch.cat([buffer, pad], dim=-1)
            out.append(buffer)
        return out

    def members(self, buffer: int) -> list[int]:
        """The leaves stored in ``buffer``, by offset."""
        inside = [(s[1], i) for i, s in enumerate(self.slots) if s is not None and s[0] == buffer]
        return [i for _, i in sorted(inside)]

    def view(self, leaf: int, buffer: Tensor) -> Tensor:
        """Leaf ``leaf`` (not a ``None`` leaf) as a view of ``buffer``, the buffer it is in."""
        shape, slot, batch = self.shapes[leaf], self.slots[leaf], self.structure.batch
        assert shape is not None and slot is not None
        if not batch:
            return buffer[slot[1] : slot[1] + shape.numel()].view(shape)
        return buffer[..., slot[1] : slot[1] + shape.numel()].view(*batch, *shape)

    def views(self, buffers: Sequence[Tensor]) -> list[Tensor | None]:
        """Each leaf as a view of its buffer (``None`` leaves stay ``None``)."""
        return [
            None if slot is None else self.view(i, buffers[slot[0]])
            for i, slot in enumerate(self.slots)
        ]


class Packed:
    """A pytree stored as views of a few flat buffers (see :func:`pack`).

    Made by :func:`pack`, and by transforms (their outputs for packed inputs are ``Packed``).
    ``tree`` is the tree of tensors. A packed tree made from buffers has a ``layout`` and its
    ``buffers`` (of shape ``[*structure.batch, n]``); one a generic transform rebuilt from
    separate tensors is *loose* (both ``None``) until ``repack()`` copies it into buffers.
    """

    __slots__ = ("_buffers", "_items", "_tree", "layout", "structure")

    def __init__(
        self,
        layout: Layout | Structure,
        *,
        buffers: Sequence[Tensor] | None = None,
        tree: PyTree = None,
    ) -> None:
        if (buffers is None) == (tree is None):
            raise ValueError("Packed takes exactly one of buffers= (with a Layout) and tree=")
        self._tree = tree
        self._items: tuple[Any, ...] | None = None
        self.structure = layout if isinstance(layout, Structure) else layout.structure
        self.layout: Layout | None = None  # loose: the tree's leaves are separate tensors
        self._buffers: tuple[Tensor, ...] | None = None
        if buffers is None:
            return
        if not isinstance(layout, Layout):
            raise ValueError("Packed with buffers= needs a Layout, not a Structure")
        self.layout, self._buffers = layout, tuple(buffers)
        if len(self._buffers) != len(layout.sizes):
            raise ValueError(f"the layout has {len(layout.sizes)} buffers, got {len(buffers)}")
        batch = self.structure.batch
        for i, (b, n) in enumerate(zip(self._buffers, layout.sizes, strict=True)):
            if not isinstance(b, Tensor) or b.shape != (*batch, n):
                got = tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__
                raise ValueError(f"buffer {i} must be a tensor of shape {(*batch, n)}, got {got}")

    @classmethod
    def _holding(cls, layout: Layout, items: Sequence[Any]) -> Packed:
        """A node holding ``items`` in place of its buffers, as torch's pytree utilities build
        when they rebuild a spec around other values (``vmap``'s ``in_dims``, a ``tree_map`` to
        non-tensors). It flattens back to ``items`` and has no tree."""
        new = cls.__new__(cls)
        new._tree = new._buffers = None
        new.structure, new.layout, new._items = layout.structure, layout, tuple(items)
        return new

    @property
    def buffers(self) -> tuple[Tensor, ...] | None:
        """The flat buffers (one per device and dtype, in order of first use), or ``None``."""
        return self._buffers

    @property
    def tree(self) -> PyTree:
        """The tree: for a packed one its leaves are views of the buffers (built once)."""
        if self._items is not None:
            kinds = sorted({type(x).__name__ for x in self._items})
            raise TypeError(
                f"this Packed holds {', '.join(kinds)} values in place of its buffers (a torch "
                "pytree utility rebuilt it around other values, as vmap does with in_dims): "
                "it has no tree"
            )
        if self._tree is None:
            assert self._buffers is not None and self.layout is not None
            self._tree = self.structure.rebuild(self.layout.views(self._buffers))
        return self._tree

    def repack(self) -> Packed:
        """``self`` if its leaves are in buffers, else ``pack(self.tree)`` (with the same batch
        dimensions)."""
        if self._buffers is not None or self._items is not None:
            return self
        return _pack(self._tree, len(self.structure.batch), self.structure)

    def __repr__(self) -> str:
        if self._items is not None:
            where = f"holding {self._items!r}"
        else:
            where = "loose" if self._buffers is None else ", ".join(map(_describe, self._buffers))
        batch = f"batch {tuple(self.structure.batch)}; " if self.structure.batch else ""
        return f"Packed({len(self.structure.shapes)} leaves; {batch}{where})"


def _describe(b: Tensor) -> str:
    return f"{b.shape[-1]} x {str(b.dtype).removeprefix('torch.')} on {b.device}"


MAX_RUNS = 64
"""The most leaf sizes of one device and dtype that :func:`pack` puts in buffers of their own
(one per size); past it they share one buffer. A buffer per size lets compiled code take each
leaf as a row of a ``[count, size]`` matrix, so a per-leaf factor is computed in the kernel that
uses it; but a compiled step over many buffers takes long to compile."""

ALIGN = 16
"""A leaf of at least this many elements starts at a multiple of it in its buffer (at least 16
bytes: compiled kernels copy a misaligned input before using it), unless it continues a run of
leaves of its size (runs stay dense, so that kernels take them as the rows of a matrix)."""


def _joined(members: list[Tensor], starts: list[int], batch: torch.Size) -> Tensor:
    """``members`` flattened (after the batch dimensions) into one buffer, each at its start
    (zeros in the gaps): one ``torch.cat``, which autograd and ``torch.func`` transforms follow."""
    pieces: list[Tensor] = []
    end = 0
    for x, start in zip(members, starts, strict=True):
        if start > end:
            pieces.append(x.new_zeros(*batch, start - end))
        n = x.shape[len(batch) :].numel()
        pieces.append(x.reshape(*batch, n))
        end = start + n
    return torch.cat(pieces, dim=-1)


def _path(values: PyTree, i: int) -> str:
    return tree.path_str(optree.tree_paths(values, none_is_leaf=True, namespace=tree.NAMESPACE)[i])


def pack(values: PyTree, batch_dims: int = 0) -> Packed:
    """``values`` copied into flat buffers, as a :class:`Packed`.

    Leaves are tensors or ``None``. One buffer per (device, dtype, leaf size), largest sizes
    first: the leaves of one size, wherever they are in the tree, form one *run*, the rows of a
    matrix, in tree order. A compiled step then takes a per-leaf factor (``clip_by_agc``) as a
    per-row one, inside the kernel that uses it. A dtype with more than :data:`MAX_RUNS` leaf
    sizes (where compiling one kernel per buffer would take long) gets one buffer for all its
    leaves instead, largest first, each new size aligned (:data:`ALIGN`).

    With ``batch_dims=k`` every leaf's first ``k`` dimensions are a batch shape they all share
    (e.g. stacked ensemble members): the buffers have shape ``[*batch, n]`` and ``torch.vmap``
    over them maps over the members. The copy is a ``torch.cat``, so autograd tracks it like any
    op (pack detached tensors to get trainable buffers)."""
    return _pack(values, batch_dims, None)


def _pack(values: PyTree, batch_dims: int, known: Structure | None) -> Packed:
    """:func:`pack`, with the structure of ``values`` taken from ``known`` when its leaf shapes
    are those of ``values`` (a loose packed tree's own: under ``torch.compile``, where a spec
    cannot be hashed or unflattened, that is the only way to repack one)."""
    if isinstance(batch_dims, bool) or not isinstance(batch_dims, int) or batch_dims < 0:
        raise ValueError(f"pack: batch_dims must be an int >= 0, got {batch_dims!r}")
    if torch.compiler.is_compiling():
        if known is None:
            raise RuntimeError(
                "pack cannot run under torch.compile: pack outside the compiled code"
            )
        leaves, spec = known.leaves(values), known.spec
    else:
        leaves, spec = tree.flatten(values)
    keys: dict[tuple[torch.device, torch.dtype], int] = {}
    groups: list[list[int]] = []  # per buffer: its leaves
    batch: torch.Size | None = None
    for i, v in enumerate(leaves):
        if v is None:
            continue
        if not isinstance(v, Tensor):
            raise TypeError(
                f"pack: the leaf at {_path(values, i)} is a {type(v).__name__}, not a tensor"
            )
        if v.dim() < batch_dims:
            raise ValueError(
                f"pack: the leaf at {_path(values, i)} has {v.dim()} dimensions, fewer than "
                f"batch_dims={batch_dims}"
            )
        if batch is None:
            batch = v.shape[:batch_dims]
        elif v.shape[:batch_dims] != batch:
            raise ValueError(
                f"pack: the leaf at {_path(values, i)} has batch shape "
                f"{tuple(v.shape[:batch_dims])}, the leaves before it {tuple(batch)}"
            )
        b = keys.setdefault((v.device, v.dtype), len(keys))
        if b == len(groups):
            groups.append([])
        groups[b].append(i)
    batch = torch.Size() if batch is None else batch
    shapes = tuple(None if v is None else v.shape[batch_dims:] for v in leaves)
    slots: list[tuple[int, int] | None] = [None] * len(leaves)
    sizes: list[int] = []
    buffers: list[Tensor] = []
    numel = {i: s.numel() for i, s in enumerate(shapes) if s is not None}
    for members in groups:
        members.sort(key=lambda i: -numel[i])  # stable: leaf order within a size
    groups = [run for members in groups for run in _by_size(members, numel)]
    for b, members in enumerate(groups):
        size, last, starts = 0, -1, []
        for i in members:
            n = numel[i]
            if n >= ALIGN and n != last:
                size += -size % ALIGN
            slots[i] = (b, size)
            starts.append(size)
            size, last = size + n, n
        sizes.append(size)
        buffers.append(_joined([leaves[i] for i in members], starts, batch))
    if known is None or known.shapes != shapes:
        known = Structure(spec, shapes)
    layout = Layout(known.batched(batch), tuple(slots), tuple(sizes))
    if not torch.compiler.is_compiling():
        # (its plans made now: a compiled step that made them while tracing would find them
        # made on its next call, and compile again)
        layout.prepare()
    return Packed(layout, buffers=buffers)


def _by_size(members: list[int], numel: dict[int, int]) -> list[list[int]]:
    """The leaves of one device and dtype (largest first) as the leaves of each buffer: one
    buffer per leaf size (a run: the rows of a matrix), or all in one past :data:`MAX_RUNS`
    sizes."""
    runs: list[list[int]] = []
    for i in members:
        if runs and numel[runs[-1][0]] == numel[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs if len(runs) <= MAX_RUNS else [members]


def _optree_flatten(p: Packed) -> tuple[tuple[PyTree], Structure, tuple[str]]:
    return (p.tree,), p.structure, ("tree",)


def _optree_unflatten(structure: Structure, children: Sequence[PyTree]) -> Packed:
    return Packed(structure, tree=children[0])


def _torch_flatten(p: Packed) -> tuple[list[Any], Layout]:
    if p._items is not None:
        assert p.layout is not None
        return list(p._items), p.layout
    packed = p.repack()
    assert packed.buffers is not None and packed.layout is not None
    return list(packed.buffers), packed.layout


def _torch_unflatten(children: Sequence[Any], layout: Layout) -> Packed:
    """A packed tree of ``children`` as its buffers, with the batch shape they have (what
    ``torch.vmap`` stacks, or one member inside it); a node holding them if they are not all
    tensors (torch's pytree utilities rebuild specs around any values)."""
    values = list(children)
    if not all(isinstance(b, Tensor) for b in values):
        return Packed._holding(layout, values)
    if values:
        if values[0].dim() == 0:
            raise ValueError(
                "buffer 0 of a packed tree became a 0-d tensor, as inside torch.vmap over a packed "
                "tree without batch dimensions: pass it with in_dims=None to share it, or pack "
                "a stacked tree with pack(stacked, batch_dims=1) to map over its members"
            )
        layout = layout.batched(values[0].shape[:-1])
    return Packed(layout, buffers=values)


optree.register_pytree_node(
    Packed,  # type: ignore[arg-type]
    _optree_flatten,  # type: ignore[arg-type]
    _optree_unflatten,  # type: ignore[arg-type]
    namespace=tree.NAMESPACE,
)
tree._PACKED = Packed
torch_pytree.register_pytree_node(
    Packed,
    _torch_flatten,  # type: ignore[arg-type]
    _torch_unflatten,  # type: ignore[arg-type]
    serialized_type_name="functional_opt.packed.Packed",
)


class Gather:
    """How leaves are copied into buffers of a layout, every step: each run of leaves of one
    shape with one ``torch.cat`` into its stretch of the buffer, the others with one
    ``torch._foreach_copy_`` into their views (over thousands of small leaves a per-tensor
    copy's dispatch, about 1.5 us, costs more than the copy). ``Gather(layout, buffers)(leaves)``
    takes the leaves in flattening order (no ``None`` leaves)."""

    def __init__(self, layout: Layout, buffers: list[Tensor]) -> None:
        self.cats: list[tuple[slice | list[int], Tensor]] = []
        self.rest: list[int] = []
        shapes = layout.shapes
        for b, members in enumerate(layout.leaves_by_run()):
            for (start, count, size), where in zip(layout.runs(b), members, strict=True):
                ids = (
                    list(range(where.start, where.stop))
                    if isinstance(where, slice)
                    else [int(k) for k in where]
                )
                first = shapes[ids[0]]
                assert first is not None
                if first.numel() and len(first) and all(shapes[i] == first for i in ids):
                    out = buffers[b][start : start + count * size].view(
                        count * first[0], *first[1:]
                    )
                    self.cats.append((where if isinstance(where, slice) else ids, out))
                else:
                    self.rest.extend(ids)
        views = layout.views(buffers)
        self.views = [cast(Tensor, views[i]) for i in self.rest]

    def __call__(self, leaves: list[Tensor]) -> None:
        for where, out in self.cats:
            members = leaves[where] if isinstance(where, slice) else [leaves[i] for i in where]
            torch.cat(members, out=out)
        if self.rest:
            torch._foreach_copy_(self.views, [leaves[i] for i in self.rest])
