""":func:`functional_opt.fused_step` and :func:`functional_opt.fused`'s update of ``partition``
(or ``masked`` around a stateful transform) over packed trees held in buffers, at the speed of
packed trees: one compiled update per set of labels, over the buffers themselves.

A packed tree holds its leaves in one buffer per dtype and leaf size. Where every buffer's
leaves share their labels (``partition(adam: matrices, sgd: vectors)``: a buffer holds leaves of
one size, so of one kind), the leaves of one set of labels are whole buffers, and a packed tree
of just those leaves (``None`` at the others) is a tree over a subset of the buffers, with no
copy (:class:`_Part`). Each label's state keeps its per-parameter nodes over its own leaves
(``None`` elsewhere): they are packed once into that part's layout (the returned state holds
them so; the next step uses them in place), and each part's update runs compiled over its
buffers under :func:`functional_opt.base.pinned` with its labels, where each mask runs its inner
over the whole part (flag true) or passes it through (false), as
:class:`~functional_opt.plain_label_parts.PlainLabelParts` runs the parts of a plain tree. The
state that is not per parameter (counters) is given to every part as it was, and each of its
leaves is taken from the part that changes it (the plain parts' plan, found once on meta
stand-ins).

Anything else (a buffer holding leaves of two sets of labels, a per-parameter node over other
leaves than one part's, batch dimensions) is left to :meth:`PlainLabelParts.packed
<functional_opt.plain_label_parts.PlainLabelParts.packed>`, which steps the tree as the plain
tree of its leaves; that is decided before anything is written.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functional_opt import _kernels, tree
from functional_opt.base import DONATE, GradientTransformation, OptState, Stages, pinned
from functional_opt.packed import Layout, Packed, pack
from functional_opt.plain_label_parts import PlainLabelParts, _is_packed, _list_spec, _split

__all__ = ["PackedLabelParts"]


class _Part(NamedTuple):
    """One set of labels' leaves of a packed tree: whole buffers of its layout."""

    labels: Stages
    buffers: list[int]
    """The tree's buffers that hold its leaves, in its own layout's order."""
    layout: Layout | None
    """The tree's structure with ``None`` at the other leaves, over those buffers; ``None``
    for the update of no leaf under the flags of masks no leaf is in (their counters)."""


class _Plan(NamedTuple):
    parts: list[_Part]
    owners: dict[int, int]
    """Per leaf of the state that is not per parameter and that the update changes (by its
    position among the state's leaves, packed nodes as leaves): the part whose value it takes."""
    nodes: dict[int, int]
    """Per packed per-parameter node of the state (by position): the part it belongs to."""
    empty: frozenset[int]
    """The packed per-parameter nodes without a leaf (a label's state where no leaf has the
    label): given to every part as they are."""


class PackedLabelParts:
    """The step (``donate=None``) or the update over packed trees held in buffers of a
    transform with leaf labels that is not fusable over a whole tree (see the module), or
    ``None`` where it does not apply (nothing written: the caller takes the plain route)."""

    def __init__(
        self,
        tx: GradientTransformation,
        plain: PlainLabelParts,
        make_runner: Callable[[], Any],
    ) -> None:
        self.tx = tx
        self.plain = plain
        """The plain parts, whose plan (parts, owners of the counters) this one shares."""
        self.make_runner = make_runner
        self.runners: dict[Stages, Any] = {}
        """Each part's compiled update (made under its labels), by labels."""
        self.plans: dict[Any, _Plan | None] = {}
        self.labelled: tuple[list[Tensor], Layout] | None = None
        """The params' buffers and layout the plans were made for (a mask may read the params:
        other buffers make a new plan)."""
        self.equal: list[tuple[Layout, Layout]] = []

    def __call__(
        self, params: Packed, grads: Packed, state: OptState, donate: bool | str | None
    ) -> tuple[Any, OptState] | None:
        """``(updates or None, new state)``: the step (``donate is None``: the params' buffers
        take ``p + u``, the gradients' and the state's are donated) or ``tx.update(grads,
        state, params, donate=donate)`` (the updates written into the gradients' buffers where
        they are donated). ``None`` where compiled code cannot run (see
        :func:`functional_opt._kernels.compiles_here`)."""
        if not _kernels.compiles_here():
            return None
        layout = params.layout
        p_buffers, g_buffers = params.buffers, grads.buffers
        if (
            layout is None
            or p_buffers is None
            or g_buffers is None
            or params.structure.batch
            or not self._same(grads.layout, layout)
        ):
            return None
        flat, flat_spec = optree.tree_flatten(
            state, is_leaf=_is_packed, none_is_leaf=True, namespace=tree.NAMESPACE
        )
        plan = self._plan(params, flat, flat_spec)
        if plan is None:
            return None
        # the per-parameter nodes in their parts' layouts (packed once: the returned state
        # holds them so), before anything is written
        nodes = list(flat)
        for j, k in plan.nodes.items():
            node, part_layout = flat[j], plan.parts[k].layout
            assert part_layout is not None  # (a node's part has leaves)
            if node.buffers is None or not self._same(node.layout, part_layout):
                node = pack(node.tree)
                if node.layout != part_layout:
                    return None
                # (in the part's own layout object: the next step's check is an identity one)
                nodes[j] = Packed(part_layout, buffers=list(node.buffers or ()))
        new_flat = list(nodes)
        new_buffers: list[Tensor | None] = [None] * len(g_buffers)
        extra = {DONATE: True if donate is None else donate}
        for k, part in enumerate(plan.parts):
            # every part gets the counters as they were (a part may write them in place)
            given = [
                x.clone() if j in plan.owners and isinstance(x, Tensor) else x
                for j, x in enumerate(nodes)
            ]
            if part.layout is None:
                for j, x in enumerate(self._no_leaf(part.labels, given, plan, flat_spec)):
                    if plan.owners.get(j) == k:
                        new_flat[j] = x
                continue
            mine = Packed(part.layout, buffers=[g_buffers[b] for b in part.buffers])
            values = Packed(part.layout, buffers=[p_buffers[b] for b in part.buffers])
            sub_state = optree.tree_unflatten(flat_spec, given)
            with pinned(part.labels):
                runner = self.runners.get(part.labels)
                if runner is None:  # (made under the labels: fusable there)
                    runner = self.runners[part.labels] = self.make_runner()
                if donate is None:
                    targets = list(values.buffers or ())
                    updates, new_state = runner(mine, sub_state, values, extra, targets, True)
                else:
                    updates, new_state = runner(mine, sub_state, values, extra)
            out, out_spec = optree.tree_flatten(
                new_state, is_leaf=_is_packed, none_is_leaf=True, namespace=tree.NAMESPACE
            )
            if out_spec != flat_spec:
                raise RuntimeError("fused_step: a part's update changed the state's structure")
            for j, owner in plan.nodes.items():
                if owner == k:
                    new_flat[j] = out[j]
            for j, owner in plan.owners.items():
                if owner == k:
                    new_flat[j] = out[j]
            if donate is not None:
                if not isinstance(updates, Packed):
                    raise RuntimeError("fused: a part's update is not a packed tree")
                if updates.buffers is None:
                    updates = updates.repack()
                for b, u in zip(part.buffers, updates.buffers or (), strict=True):
                    new_buffers[b] = u
        new = optree.tree_unflatten(flat_spec, new_flat)
        if donate is None:
            return None, new
        done = [u for u in new_buffers if u is not None]
        if len(done) != len(g_buffers):
            raise RuntimeError("fused: the parts' updates do not cover the tree")
        if all(map(operator.is_, done, g_buffers)):
            return grads, new
        return Packed(layout, buffers=done), new

    def _same(self, a: Layout | None, b: Layout | None) -> bool:
        """``a == b``, remembered for the last pairs of objects found equal (comparing two
        layouts reads each leaf's slot: 0.1 ms over 2000 leaves)."""
        if a is b:
            return True
        for x, y in self.equal:
            if x is a and y is b:
                return True
        if a is None or b is None or a != b:
            return False
        self.equal = [(a, b), *self.equal[:7]]
        return True

    def _no_leaf(self, labels: Stages, given: list[Any], plan: _Plan, flat_spec: Any) -> list[Any]:
        """The state's leaves after the update of no leaf under ``labels`` (the flags of masks
        no leaf is in: what the whole tree's update does to their counters), eagerly; each
        per-parameter node an empty list."""
        state = optree.tree_unflatten(
            flat_spec,
            [[] if j in plan.nodes or j in plan.empty else x for j, x in enumerate(given)],
        )
        with pinned(labels):
            _, new_state = self.tx.update([], state, [])
        out, _, _ = _split(new_state, _list_spec(0), list, 0)
        if len(out) != len(given):
            raise RuntimeError("fused_step: the update changed the state's structure")
        return out

    def _plan(self, params: Packed, flat: list[Any], flat_spec: Any) -> _Plan | None:
        """The parts and where each state leaf comes from, found once per layout, buffers of
        the params and structure of the state (``None``: not this route)."""
        layout = params.layout
        buffers = list(params.buffers or ())
        assert layout is not None
        known = self.labelled
        if known is None or known[1] != layout or not all(map(operator.is_, known[0], buffers)):
            self.plans.clear()  # (a mask may read the params: new buffers, new labels)
            self.labelled = (buffers, layout)
        kinds = tuple(
            x.layout.slots if isinstance(x, Packed) and x.layout is not None else type(x)
            for x in flat
        )
        key = (flat_spec, kinds)
        if key not in self.plans:
            self.plans[key] = self._make_plan(params, flat, flat_spec)
        return self.plans[key]

    def _make_plan(self, params: Packed, flat: list[Any], flat_spec: Any) -> _Plan | None:
        layout = params.layout
        assert layout is not None and params.buffers is not None
        try:
            params_tree = params.tree
            loose = [x.tree if isinstance(x, Packed) else x for x in flat]
        except TypeError:  # (a Packed holding other values than tensors)
            return None
        ps, spec = optree.tree_flatten(params_tree, none_is_leaf=True, namespace=tree.NAMESPACE)
        if any(p is None for p in ps):
            return None
        state = optree.tree_unflatten(flat_spec, loose)
        outer, outer_spec, per = _split(state, spec, type(params_tree), len(ps))
        if [p is not None for p in per] != [isinstance(x, Packed) for x in flat]:
            return None  # (a packed node that is not per parameter, or a loose one that is)
        found = self.plain._plan(params_tree, spec, outer, outer_spec, per)
        if found is None:
            return None
        runs, owners = found
        parts: list[_Part] = []
        of_leaf: dict[frozenset[int], int] = {}
        for mine, labels in runs:
            if not mine:  # (masks no leaf is in: their counters step without leaves)
                parts.append(_Part(labels, [], None))
                continue
            part = _whole_buffers(layout, params, ps, mine)
            if part is None:
                return None
            parts.append(_Part(_one_value_each(labels), *part))
            of_leaf[frozenset(mine)] = len(parts) - 1
        nodes: dict[int, int] = {}
        empty: set[int] = set()
        for j, leaves in enumerate(per):
            if leaves is None:
                continue
            present = frozenset(i for i, v in enumerate(leaves) if v is not None)
            owner = of_leaf.get(present)
            if not present:
                empty.add(j)
            elif owner is None:
                return None  # (a node over other leaves than one part's)
            else:
                nodes[j] = owner
        return _Plan(parts, owners, nodes, frozenset(empty))


def _one_value_each(labels: Stages) -> Stages:
    """A part's labels with each key's values (one per leaf of the part, all equal: the part is
    the leaves of one set of labels) as that one value, which a mask gives every leaf of the
    packed tree it steps: the part's tree has the other parts' leaves as ``None`` leaves, so a
    tuple of the part's leaves' values would not match its leaves (a stateless ``masked``
    inner, which reads them per leaf, raised)."""
    out = []
    for key, values in labels:
        if isinstance(values, tuple) and values and all(v == values[0] for v in values):
            values = values[0]
        out.append((key, values))
    return tuple(out)


def _whole_buffers(
    layout: Layout, params: Packed, leaves: list[Tensor], mine: list[int]
) -> tuple[list[int], Layout] | None:
    """The buffers holding the leaves ``mine`` and the layout of the tree with ``None`` at the
    other leaves over them, when those buffers hold no other leaf; else ``None``."""
    taken = set(mine)
    held: list[int] = []
    for i in mine:
        slot = layout.slots[i]
        if slot is None:
            return None
        if slot[0] not in held:
            held.append(slot[0])
    for b in held:
        if not set(layout.members(b)) <= taken:
            return None
    stand_ins = [
        torch.empty(x.shape, dtype=x.dtype, device="meta") if i in taken else None
        for i, x in enumerate(leaves)
    ]
    sub = pack(params.structure.rebuild(stand_ins)).layout
    assert sub is not None
    # each of its buffers is the tree's buffer of its first leaf (checked whole below)
    order = [layout.slots[sub.members(b)[0]][0] for b in range(len(sub.sizes))]  # type: ignore[index]
    if (
        sorted(order) != sorted(held)
        or sub.sizes != tuple(layout.sizes[b] for b in order)
        or any(
            sub.slots[i] != (order.index(layout.slots[i][0]), layout.slots[i][1])  # type: ignore[index]
            for i in mine
        )
    ):
        return None  # (grouped otherwise by pack: not this route)
    return order, sub
