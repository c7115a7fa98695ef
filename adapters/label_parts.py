"""A group whose params keep different state, stepped on the engine one part per label.

``partition`` (and ``masked`` around a transform that keeps state) keeps each label's state over
that label's params only: the params of a group do not all have the same state entries, so one
set of packed buffers cannot hold them, and the update picks its leaves out of the tree, which
the engine cannot compile over buffers. :func:`label_parts` splits such a group by the leaves'
labels (:func:`functional_opt.base.leaf_labels`: each mask's flag, read off the whole group
once) into *parts* whose params share their labels, hence their state entries. Each part is a
:class:`~functional_opt.adapters.packed_group.PackedGroup` of its own, built and stepped under
:func:`functional_opt.base.pinned` with the part's labels: there every mask has one flag for
all the leaves it sees, and a masked transform runs its inner over the whole part (flag true)
or passes the part's updates through and leaves its state alone (false). Each label's state,
its counters included, is then written by its own part only, and the transform of a part is an
ordinary fusable one: its update compiles over the part's buffers, its large params take the
direct route, and so on.

The split is taken only where it gives the whole group's update, which is checked once, on
stand-ins (meta tensors): the transform treats every leaf on its own (no reduction over the
leaves, such as a global norm, which a part would take over its own leaves only); within a
part every param keeps the same state entries; and the state leaves that are not per parameter
(counters) that the parts change are, together, those the whole group's update changes, each
changed by one part only (a label's) or by every part the same way (a counter outside the
masks, such as ``inject_hyperparams``' step count: each part then takes it as it was before
the step, see :attr:`LabelParts.shared`). The counters of masks no param is in advance by an
update of no param under their flags alone (:attr:`LabelParts.orphans`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functional_opt import tree
from functional_opt.base import (
    GradientTransformation,
    Stages,
    has_leaf_labels,
    leaf_labels,
    leafwise,
    part_labels,
    pinned,
)

from .packed_group import PackedGroup, packable, templates_by_name

Slots = list[tuple[str, str]]
"""Each leaf of the state tree's kind and name (see ``PackedGroup.slots``)."""


class Part(NamedTuple):
    """One part of a group: params that share their labels."""

    members: list[int]
    """The params' positions in the group."""
    stages: Stages
    """Their labels (:func:`functional_opt.base.part_labels`), pinned while the part steps."""
    slots: Slots
    """The group's state slots, the per-parameter entries that no member keeps made ``"none"``
    (the state tree then holds ``None`` there: another part's state)."""
    group: PackedGroup


class LabelParts:
    """A group stepped as :class:`Part`\\ s (see the module docstring)."""

    sharded = False  # (a group of DTensors is not split)

    def __init__(self, parts: list[Part], orphans: Stages | None, shared: list[int]) -> None:
        self.parts = parts
        self.orphans = orphans
        """The labels under which the update of no param at all advances the counters of the
        masks that no param of the group is in (the whole group's update advances them too),
        or ``None`` when there are none to advance."""
        self.shared = shared
        """The positions of the state leaves that are not per parameter and that every part
        (and the update of no param) changes, the same way: a counter outside the masks
        (``inject_hyperparams``' step count). Each part must take them as they were before the
        step (the first part's new values are every part's)."""

    @property
    def steps(self) -> int:
        """Steps the group took here (what tests read to know the engine ran)."""
        return min(part.group.steps for part in self.parts)

    def packable(
        self,
        tx: GradientTransformation,
        params: Sequence[Tensor],
        grads: Sequence[Tensor | None],
        shapes: Sequence[torch.Size | bool],
    ) -> bool:
        """Whether every part can step on its buffers this step (see
        :func:`~functional_opt.adapters.packed_group.packable`)."""
        for part in self.parts:
            with pinned(part.stages):
                if not packable(
                    tx,
                    [params[i] for i in part.members],
                    [grads[i] for i in part.members],
                    [shapes[i] for i in part.members],
                ):
                    return False
        return True


MakeGroup = Callable[[list[Tensor], dict[str, list[Tensor]], Slots, list[Stages]], PackedGroup]
"""Builds a part's :class:`PackedGroup` from its params, its state templates by name, its slots
and its params' labels (what ``TransformOptimizer`` gives, with its options)."""


def label_parts(
    tx: GradientTransformation,
    params: list[Tensor],
    templates: list[dict[str, Tensor]],
    spec: optree.PyTreeSpec,
    slots: Slots,
    given: list[Any],
    slots_type: type,
    make: MakeGroup,
) -> LabelParts | None:
    """The group split into parts by its leaves' labels, or ``None`` where the split would not
    give the whole group's update (see the module docstring). ``templates``: each param's
    state entries (meta tensors); ``spec``/``slots``: the state tree down to its per-parameter
    nodes; ``given``: its leaves that are not per parameter (``None`` at the others)."""
    if not has_leaf_labels(tx):
        return None
    try:
        labels = leaf_labels(tx, slots_type(params))
    except ValueError:
        return None
    assert labels is not None
    by_labels: dict[Stages, list[int]] = {}
    for i, mine in enumerate(labels):
        by_labels.setdefault(mine, []).append(i)
    stand_ins = [torch.empty_like(p, device="meta") for p in params]
    try:
        whole = _changed(tx, spec, slots, given, stand_ins, templates, slots_type)
    except Exception:  # (an update that cannot run on stand-ins: not split)
        return None
    parts: list[Part] = []
    runs: list[frozenset[int]] = []  # what each part changes (then the update of no param)
    for members in by_labels.values():
        entries = [templates[i] for i in members]
        names = set(entries[0])
        if any(set(t) != names for t in entries):
            return None
        part_slots = [
            (kind, name) if kind != "param" or name in names else ("none", "")
            for kind, name in slots
        ]
        stages = part_labels(labels, members)
        with pinned(stages):
            if not leafwise(tx):
                return None
            try:
                runs.append(
                    _changed(
                        tx,
                        spec,
                        part_slots,
                        given,
                        [stand_ins[i] for i in members],
                        entries,
                        slots_type,
                    )
                )
            except Exception:
                return None
            group = make(
                [params[i] for i in members],
                templates_by_name(entries),
                part_slots,
                [labels[i] for i in members],
            )
        parts.append(Part(members, stages, part_slots, group))
    # the masks no param is in: their inner's update of no leaf, under those masks' flags only
    keys = [key for key, _ in labels[0]]
    unused = {key for key in keys if not any(dict(mine)[key] is True for mine in labels)}
    orphans: Stages = tuple((key, key in unused) for key in keys)
    with pinned(orphans):
        try:
            nothing = _changed(tx, spec, slots, given, [], [], slots_type)
        except Exception:
            return None
    shared = frozenset.intersection(*runs, nothing)
    if nothing - shared:
        runs.append(nothing)
    alone = [run - shared for run in runs]
    # each leaf changed by every run (the same way: the transform is leafwise) or by one
    if sum(map(len, alone)) != len(frozenset().union(*alone)):
        return None
    if shared.union(*alone) != whole:
        return None
    return LabelParts(parts, orphans if nothing - shared else None, sorted(shared))


def _changed(
    tx: GradientTransformation,
    spec: optree.PyTreeSpec,
    slots: Slots,
    given: list[Any],
    stand_ins: list[Tensor],
    templates: list[dict[str, Tensor]],
    slots_type: type,
) -> frozenset[int]:
    """The positions of the state leaves that are not per parameter which ``tx``'s update of
    the params ``stand_ins`` (meta tensors, their state ``templates``) returns anew."""
    outer: list[Any] = []
    for (kind, name), value in zip(slots, given, strict=True):
        if kind == "param":
            outer.append(slots_type([t.get(name) for t in templates]))
        elif isinstance(value, Tensor):  # (a group-level leaf, or a hyperparameter)
            outer.append(torch.empty_like(value, device="meta"))
        else:
            outer.append(value)
    state = optree.tree_unflatten(spec, outer)
    grads = slots_type(stand_ins)
    _, new_state = tx.update(grads, state, slots_type(stand_ins))
    new = optree.tree_flatten(
        new_state,
        is_leaf=lambda x: isinstance(x, slots_type),
        none_is_leaf=True,
        namespace=tree.NAMESPACE,
    )[0]
    return frozenset(
        j
        for j, ((kind, _), old, value) in enumerate(zip(slots, outer, new, strict=True))
        if kind == "group" and value is not old
    )
