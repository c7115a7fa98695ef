"""Packed trees: a pytree whose tensors are views into a few contiguous buffers.

``pack(tree)`` copies the tensors of ``tree`` into one flat buffer per (device, dtype), largest
leaves first, and returns a :class:`Packed`: a pytree node whose only child is ``tree`` rebuilt
from views of those buffers. Transforms see the same per-tensor leaves as for ``tree`` (per-tensor
norms, masks and state paths are unchanged) and their per-parameter states are packed trees of
the same structure, while the fast paths (``dreamerv3``'s update, ``apply_updates``) run over the
buffers when every tree they get is packed with one layout: a tree of 2000 small tensors then
costs about what one tensor of the same size costs, as the adapter's flat buffers do.

For ``torch.func`` (whose pytrees are ``torch.utils._pytree``'s) a ``Packed`` is a node whose
children are its buffers, so ``torch.func.grad(loss)(packed_params)`` differentiates with respect
to the buffers and returns the gradients packed with the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import Tensor

from functional_opt import tree
from functional_opt.tree import PyTree

__all__ = ["ALIGN", "Layout", "Packed", "Structure", "pack"]


class Structure:
    """The tree structure of a packed tree: its pytree spec and each leaf's shape (``None`` for
    ``None`` leaves). What optree compares: two packed trees of one structure match leaf for
    leaf whatever their dtypes and buffers."""

    __slots__ = ("_hash", "_key", "shapes", "spec", "template")

    def __init__(self, spec: optree.PyTreeSpec, shapes: tuple[torch.Size | None, ...]) -> None:
        self.spec = spec
        self.shapes = shapes
        self.template = tree.unflatten(spec, [None] * len(shapes))  # rebuilt under compile
        # compared as plain Python values (torch.compile cannot trace a spec's comparison)
        self._key = (hash(spec), str(spec), shapes)
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Structure):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Structure({len(self.shapes)} leaves)"

    def rebuild(self, values: Sequence[Any]) -> PyTree:
        """The tree with ``values`` as its leaves."""
        if torch.compiler.is_compiling():  # (dynamo's optree cannot take a spec made outside)
            it = iter(values)
            return optree.tree_map(
                lambda _: next(it), self.template, none_is_leaf=True, namespace=tree.NAMESPACE
            )
        return tree.unflatten(self.spec, values)


class Layout:
    """Where each leaf of a packed tree lives: its :class:`Structure`, and per leaf its buffer and
    element offset (``None`` for ``None`` leaves), with each buffer's size. Immutable; equal when
    all of that is equal (dtypes are not part of it: float32 params and their float32 moments
    share a layout)."""

    __slots__ = ("_hash", "_plans", "sizes", "slots", "structure")

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
        self._plans: dict[Any, Any] = {}  # derived routing, cached by the fast paths

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

    def members(self, buffer: int) -> list[int]:
        """The leaves stored in ``buffer``, by offset."""
        inside = [(s[1], i) for i, s in enumerate(self.slots) if s is not None and s[0] == buffer]
        return [i for _, i in sorted(inside)]

    def view(self, leaf: int, buffer: Tensor) -> Tensor:
        """Leaf ``leaf`` (not a ``None`` leaf) as a view of ``buffer``, the buffer it is in."""
        shape, slot = self.shapes[leaf], self.slots[leaf]
        assert shape is not None and slot is not None
        return buffer[slot[1] : slot[1] + shape.numel()].view(shape)

    def views(self, buffers: Sequence[Tensor]) -> list[Tensor | None]:
        """Each leaf as a view of its buffer (``None`` leaves stay ``None``)."""
        return [
            None if slot is None else self.view(i, buffers[slot[0]])
            for i, slot in enumerate(self.slots)
        ]


class Packed:
    """A pytree stored as views of one flat buffer per (device, dtype).

    Made by :func:`pack`, and by transforms (their outputs for packed inputs are ``Packed``).
    ``tree`` is the tree of tensors. A packed tree made from buffers has a ``layout`` and its
    ``buffers``; one a generic transform rebuilt from separate tensors is *loose* (both
    ``None``) until ``repack()`` copies it into buffers.
    """

    __slots__ = ("_buffers", "_tree", "layout", "structure")

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
        for i, (b, n) in enumerate(zip(self._buffers, layout.sizes, strict=True)):
            if not isinstance(b, Tensor) or b.dim() != 1 or b.shape[0] != n:
                got = tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__
                raise ValueError(f"buffer {i} must be a 1-d tensor of {n} elements, got {got}")

    @property
    def buffers(self) -> tuple[Tensor, ...] | None:
        """The flat buffers (one per device and dtype, in order of first use), or ``None``."""
        return self._buffers

    @property
    def tree(self) -> PyTree:
        """The tree: for a packed one its leaves are views of the buffers (built once)."""
        if self._tree is None:
            assert self._buffers is not None and self.layout is not None
            self._tree = self.structure.rebuild(self.layout.views(self._buffers))
        return self._tree

    def repack(self) -> Packed:
        """``self`` if its leaves are in buffers, else ``pack(self.tree)``."""
        return self if self._buffers is not None else pack(self._tree)

    def __repr__(self) -> str:
        where = "loose" if self._buffers is None else ", ".join(_describe(b) for b in self._buffers)
        return f"Packed({len(self.structure.shapes)} leaves; {where})"


def _describe(b: Tensor) -> str:
    return f"{b.numel()} x {str(b.dtype).removeprefix('torch.')} on {b.device}"


ALIGN = 16
"""A leaf of at least this many elements starts at a multiple of it in its buffer (at least 16
bytes: compiled kernels copy a misaligned input before using it), unless it continues a run of
leaves of its size (runs stay dense, so that kernels take them as the rows of a matrix)."""


def _joined(members: list[Tensor], starts: list[int]) -> Tensor:
    """``members`` flattened into one buffer, each at its start (zeros in the gaps): one
    ``torch.cat``, which autograd and ``torch.func`` transforms follow."""
    pieces: list[Tensor] = []
    end = 0
    for x, start in zip(members, starts, strict=True):
        if start > end:
            pieces.append(x.new_zeros(start - end))
        pieces.append(x.reshape(-1))
        end = start + x.numel()
    return torch.cat(pieces)


def pack(values: PyTree) -> Packed:
    """``values`` copied into one flat buffer per (device, dtype), as a :class:`Packed`.

    Leaves are tensors or ``None``. A buffer holds its leaves by size, largest first (leaves of
    one size, wherever they are in the tree, form one run: the rows of a matrix), each new size
    aligned (:data:`ALIGN`). The copy is a ``torch.cat``, so autograd tracks it like any op
    (pack detached tensors to get trainable buffers)."""
    leaves, spec = tree.flatten(values)
    keys: dict[tuple[torch.device, torch.dtype], int] = {}
    groups: list[list[int]] = []  # per buffer: its leaves
    for i, v in enumerate(leaves):
        if v is None:
            continue
        if not isinstance(v, Tensor):
            path = optree.tree_paths(values, none_is_leaf=True, namespace=tree.NAMESPACE)[i]
            raise TypeError(
                f"pack: the leaf at {tree.path_str(path)} is a {type(v).__name__}, not a tensor"
            )
        b = keys.setdefault((v.device, v.dtype), len(keys))
        if b == len(groups):
            groups.append([])
        groups[b].append(i)
    slots: list[tuple[int, int] | None] = [None] * len(leaves)
    sizes: list[int] = []
    buffers: list[Tensor] = []
    for b, members in enumerate(groups):
        members.sort(key=lambda i: -leaves[i].numel())  # stable: leaf order within a size
        size, last, starts = 0, -1, []
        for i in members:
            n = leaves[i].numel()
            if n >= ALIGN and n != last:
                size += -size % ALIGN
            slots[i] = (b, size)
            starts.append(size)
            size, last = size + n, n
        sizes.append(size)
        buffers.append(_joined([leaves[i] for i in members], starts))
    shapes = tuple(None if v is None else v.shape for v in leaves)
    layout = Layout(Structure(spec, shapes), tuple(slots), tuple(sizes))
    return Packed(layout, buffers=buffers)


def _optree_flatten(p: Packed) -> tuple[tuple[PyTree], Structure, tuple[str]]:
    return (p.tree,), p.structure, ("tree",)


def _optree_unflatten(structure: Structure, children: Sequence[PyTree]) -> Packed:
    return Packed(structure, tree=children[0])


def _torch_flatten(p: Packed) -> tuple[list[Tensor], Layout]:
    packed = p.repack()
    assert packed.buffers is not None and packed.layout is not None
    return list(packed.buffers), packed.layout


def _torch_unflatten(buffers: Sequence[Tensor], layout: Layout) -> Packed:
    return Packed(layout, buffers=list(buffers))


optree.register_pytree_node(
    Packed,  # type: ignore[arg-type]
    _optree_flatten,  # type: ignore[arg-type]
    _optree_unflatten,  # type: ignore[arg-type]
    namespace=tree.NAMESPACE,
)
torch_pytree.register_pytree_node(
    Packed,
    _torch_flatten,  # type: ignore[arg-type]
    _torch_unflatten,  # type: ignore[arg-type]
    serialized_type_name="functional_opt.packed.Packed",
)
