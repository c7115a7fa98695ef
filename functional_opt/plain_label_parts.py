""":func:`functional_opt.fused_step` over plain trees of ``partition`` (or ``masked`` around a
stateful transform): one :class:`~functional_opt.plain_trees.PlainTreeStep` per set of labels.

Such a transform keeps each label's state over that label's leaves only (``None`` at the
others), and picks its leaves out of the tree: over the whole tree it is not fusable. But it
gives each leaf's flags as labels (:func:`functional_opt.base.leaf_labels`), and over a part of
the tree whose leaves share their flags, under :func:`functional_opt.base.pinned`, each mask
runs its inner over the whole part (flag true) or passes it through untouched (false): an
ordinary fusable, leafwise update. :class:`PlainLabelParts` steps the tree as such parts, each
as a list of its leaves with the state's per-parameter subtrees cut down to them, and puts the
parts' new state back together. The state that is not per parameter (counters) is given to every
part as it was; each takes from the parts the value the part that changed it returned (a
counter outside the masks, which every part advances, the same way: the transform is leafwise),
and the counters of masks no leaf is in advance by an update of no leaf under their flags
alone, as the whole tree's update advances them. A part that the plain-tree step refuses (after
another was stepped) runs its update eagerly under its flags and adds it into its params.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import optree
import torch
from torch import Tensor

from functional_opt import _kernels, tree
from functional_opt.base import (
    DONATE,
    STATE_ONLY,
    GradientTransformation,
    OptState,
    Stages,
    apply_updates,
    extra_keywords,
    fusable,
    has_leaf_labels,
    leaf_labels,
    leafwise,
    part_labels,
    pinned,
)
from functional_opt.packed import Packed
from functional_opt.plain_trees import PlainTreeStep

__all__ = ["PlainLabelParts"]


class PlainLabelParts:
    """``fused_step``'s step over plain trees for a transform with leaf labels that is not
    fusable over a whole tree (see the module): ``step(params, grads, state)`` steps the params
    in place and returns the new state, or ``None`` where it does not apply (nothing written:
    the caller runs the transform's own update)."""

    def __init__(
        self, tx: GradientTransformation, make_runner: Any, updates_only: bool = False
    ) -> None:
        self.tx = tx
        self.make_runner = make_runner
        self.updates_only = updates_only
        """Whether this only runs :meth:`update` (each part's step then is one that only reads
        its params: see :class:`~functional_opt.plain_trees.PlainTreeStep`)."""
        self.plans: dict[Any, tuple[list[tuple[list[int], Stages]], dict[int, int]] | None] = {}
        """By the structure of the params and the state and the leaves' labels: what
        :meth:`_plan` found."""
        self.labelled: tuple[list[Tensor], Any, list[Stages] | None] | None = None
        """The params last labelled, their structure and their labels (read again for other
        params: a mask may read their shapes)."""
        self.steps: dict[Stages, PlainTreeStep] = {}
        """Each part's plain-tree step (its compiled kernels and staging buffers), by labels."""

    def __call__(
        self, params: Any, grads: Any, state: OptState, *, into_held: bool = False
    ) -> OptState | None:
        """``into_held``: as :class:`PlainTreeStep`'s, for each part's step."""
        done = self._parts(params, grads, state, None, into_held)
        return None if done is None else done[1]

    def update(
        self, grads: Any, state: OptState, params: Any, donate: bool | str = True
    ) -> tuple[Any, OptState] | None:
        """``tx.update(grads, state, params, donate=donate)`` over plain trees (``fused(tx)``'s
        update): each part's :meth:`PlainTreeStep.update`, which writes the part's update into
        its gradients (donated) or fresh tensors and only reads the params. Returns
        ``(updates, new_state)``, or ``None`` where it does not apply (nothing written: the
        caller runs the transform's own update)."""
        if params is None:
            return None
        return self._parts(params, grads, state, donate, False)

    def packed(
        self, params: Packed, grads: Packed, state: OptState, donate: bool | str | None
    ) -> tuple[Any, OptState] | None:
        """The step (``donate is None``) or the update (see :meth:`update`) over packed trees
        of one structure: their leaves (views of the buffers, which the step writes through)
        stepped as a plain tree, the state's packed per-parameter subtrees (a label's state,
        ``None`` at the other labels' leaves) as plain trees too, and the results packed
        again (loose, except updates written into the gradients: ``grads`` itself). ``None``
        where it does not apply (batch dimensions, a ``Packed`` without a tree, a state whose
        packed nodes are not of the params' structure); nothing is written then."""
        if (
            params.structure.batch
            or grads.structure.batch
            or params.structure.spec != grads.structure.spec
        ):
            return None
        flat, flat_spec = optree.tree_flatten(
            state, is_leaf=_is_packed, none_is_leaf=True, namespace=tree.NAMESPACE
        )
        nodes = [x if isinstance(x, Packed) else None for x in flat]
        try:
            params_tree, grads_tree = params.tree, grads.tree
            loose = [x.tree if isinstance(x, Packed) else x for x in flat]
        except TypeError:  # (a Packed holding other values than tensors)
            return None
        n = len(optree.tree_leaves(params_tree, none_is_leaf=True, namespace=tree.NAMESPACE))
        spec = optree.tree_structure(params_tree, none_is_leaf=True, namespace=tree.NAMESPACE)
        # every packed node of the state must be a per-parameter subtree, and nothing else
        _, _, per = _split(loose, spec, type(params_tree), n)
        if [p is not None for p in per] != [x is not None for x in nodes]:
            return None
        done = self._parts(
            params_tree, grads_tree, optree.tree_unflatten(flat_spec, loose), donate, False
        )
        if done is None:
            return None
        updates, new_state = done
        outer, _, new_per = _split(new_state, spec, type(params_tree), n)
        if len(outer) != len(nodes) or [p is not None for p in new_per] != [
            x is not None for x in nodes
        ]:
            raise RuntimeError("fused_step: the update changed the state's structure")
        repacked = optree.tree_unflatten(
            flat_spec,
            [
                x if node is None else Packed(node.structure, tree=x)
                for x, node in zip(outer, nodes, strict=True)
            ],
        )
        if donate is None or updates is grads_tree:
            return (grads if donate is not None else None), repacked
        return Packed(grads.structure, tree=updates), repacked

    def _parts(
        self,
        params: Any,
        grads: Any,
        state: OptState,
        donate: bool | str | None,
        into_held: bool,
    ) -> tuple[Any, OptState] | None:
        """The step (``donate is None``: params stepped in place, no updates returned) or the
        update with that donation, part by part; ``(updates or None, new state)``. ``None``
        where compiled code cannot run (inside ``torch.compile``'s tracing: the transform's own
        update is traced instead)."""
        if not _kernels.compiles_here():
            return None
        ps, spec = optree.tree_flatten(params, none_is_leaf=True, namespace=tree.NAMESPACE)
        gs, grad_spec = optree.tree_flatten(grads, none_is_leaf=True, namespace=tree.NAMESPACE)
        if (
            not ps
            or grad_spec != spec
            or isinstance(params, Tensor)
            or not all(isinstance(x, Tensor) for x in ps + gs)
        ):
            return None
        outer, outer_spec, per = _split(state, spec, type(params), len(ps))
        plan = self._plan(params, spec, outer, outer_spec, per)
        if plan is None:
            return None
        runs, owners = plan
        new_outer: list[Any] = [None if leaves is None else list(leaves) for leaves in per]
        out_updates: list[Any] = list(gs)
        for k, (mine, labels) in enumerate(runs):
            sub_state = _cut(outer, outer_spec, per, mine)
            sub_params, sub_grads = [ps[i] for i in mine], [gs[i] for i in mine]
            with pinned(labels):
                new_sub = None
                sub_updates: list[Any] | None = None
                if mine:
                    step = self.steps.get(labels)
                    if step is None:
                        step = self.steps[labels] = PlainTreeStep(
                            self.tx, self.make_runner(), updates_only=self.updates_only
                        )
                    if donate is None:
                        new_sub = step(sub_params, sub_grads, sub_state, into_held=into_held)
                    else:
                        done = step.update(sub_grads, sub_state, sub_params, donate)
                        if done is not None:
                            sub_updates, new_sub = list(done[0]), done[1]
                if new_sub is None:
                    if k == 0 and mine:
                        return None  # (nothing written yet: the transform's own update)
                    accepted = extra_keywords(self.tx)
                    ok = accepted is None or DONATE in accepted
                    kw: dict[str, bool | str]
                    if donate is None:
                        # (the state only: a plain-tree step reads the gradients, never
                        # writes them)
                        kw = {DONATE: STATE_ONLY} if ok else {}
                        updates, new_sub = self.tx.update(sub_grads, sub_state, sub_params, **kw)
                        apply_updates(sub_params, updates, donate=True)
                    else:
                        kw = {DONATE: donate} if ok and donate is not False else {}
                        updates, new_sub = self.tx.update(sub_grads, sub_state, sub_params, **kw)
                        sub_updates = list(updates)
                if sub_updates is not None:
                    for i, u in zip(mine, sub_updates, strict=True):
                        out_updates[i] = u
            sub_outer, sub_spec, sub_per = _split(new_sub, _list_spec(len(mine)), list, len(mine))
            if sub_spec != outer_spec:
                raise RuntimeError("fused_step: a part's update changed the state's structure")
            for j, new in enumerate(sub_outer):
                leaves = new_outer[j]
                if per[j] is not None:
                    values = sub_per[j]
                    if values is None:
                        raise RuntimeError(
                            "fused_step: a part's update changed the state's structure"
                        )
                    for i, value in zip(mine, values, strict=True):
                        leaves[i] = value
                elif owners.get(j) == k:
                    new_outer[j] = new
        out = [
            (x if owners.get(j) is None else new_outer[j])
            if per[j] is None
            else optree.tree_unflatten(spec, new_outer[j])
            for j, x in enumerate(outer)
        ]
        new_state = optree.tree_unflatten(outer_spec, out)
        if donate is None:
            return None, new_state
        if all(map(operator.is_, out_updates, gs)):
            return grads, new_state
        return optree.tree_unflatten(spec, out_updates), new_state

    def _plan(
        self, params: Any, spec: Any, outer: list[Any], outer_spec: Any, per: list[Any]
    ) -> tuple[list[tuple[list[int], Stages]], dict[int, int]] | None:
        """The runs (each part's leaves and labels, after the update of no leaf where one is
        needed) and, per state leaf that is not per parameter and that the update changes, the
        run whose value it takes; ``None``: not split (see the module). Found once per
        structure of the params and the state."""
        labels = self._labels(params, spec)
        if not labels:
            return None
        key = (spec, outer_spec, tuple(labels))
        if key in self.plans:
            return self.plans[key]
        self.plans[key] = None
        by_labels: dict[Stages, list[int]] = {}
        for i, leaf_stages in enumerate(labels):
            by_labels.setdefault(leaf_stages, []).append(i)
        runs = [(m, part_labels(labels, m)) for m in by_labels.values()]
        keys = [key for key, _ in labels[0]]
        unused = {key for key in keys if not any(dict(m)[key] is True for m in labels)}
        orphans: Stages = tuple((key, key in unused) for key in keys)
        try:
            whole = _changes(self.tx, params, outer, outer_spec, per, None)
            found = []
            for mine, stages in [*runs, ([], orphans)]:
                with pinned(stages):
                    if mine and not (fusable(self.tx) and leafwise(self.tx)):
                        return None
                    found.append(_changes(self.tx, params, outer, outer_spec, per, mine))
        except Exception:  # (an update that cannot run on stand-ins: not split)
            return None
        nothing = found.pop()
        shared = frozenset.intersection(*found, nothing)
        if nothing - shared:
            runs.insert(0, ([], orphans))
            found.insert(0, nothing)
        owners: dict[int, int] = {j: 0 for j in shared}
        for k, changed in enumerate(found):
            for j in changed - shared:
                if j in owners:  # (changed by two runs, not by all)
                    return None
                owners[j] = k
        if set(owners) != whole:
            return None
        self.plans[key] = (runs, owners)
        return self.plans[key]

    def _labels(self, params: Any, spec: Any) -> list[Stages] | None:
        """Each leaf's labels, read once for the same params (the same tensors)."""
        ps = optree.tree_leaves(params, none_is_leaf=True, namespace=tree.NAMESPACE)
        known = self.labelled
        if (
            known is None
            or known[1] != spec
            or len(known[0]) != len(ps)
            or not all(map(operator.is_, known[0], ps))
        ):
            try:
                labels = leaf_labels(self.tx, params) if has_leaf_labels(self.tx) else None
            except ValueError:
                labels = None
            known = self.labelled = (ps, spec, labels)
        return known[2]


def _is_packed(x: Any) -> bool:
    return isinstance(x, Packed)


def _meta(x: Any) -> Any:
    return torch.empty_like(x, device="meta") if isinstance(x, Tensor) else x


def _list_spec(n: int) -> Any:
    zeros: Any = [0] * n
    return optree.tree_structure(zeros, none_is_leaf=True, namespace=tree.NAMESPACE)


def _cut(outer: list[Any], outer_spec: Any, per: list[Any], mine: list[int]) -> Any:
    """The state of the leaves ``mine``: each per-parameter subtree a list of their entries."""
    return optree.tree_unflatten(
        outer_spec,
        [
            x if leaves is None else [leaves[i] for i in mine]
            for x, leaves in zip(outer, per, strict=True)
        ],
    )


def _changes(
    tx: GradientTransformation,
    params: Any,
    outer: list[Any],
    outer_spec: Any,
    per: list[Any],
    mine: list[int] | None,
) -> frozenset[int]:
    """The positions of the state leaves that are not per parameter which the eager update of
    the leaves ``mine`` (all, in the params' structure, for ``None``), on meta stand-ins,
    returns anew."""
    metas = [
        _meta(x) if leaves is None else [_meta(v) for v in leaves]
        for x, leaves in zip(outer, per, strict=True)
    ]
    ps = optree.tree_leaves(params, none_is_leaf=True, namespace=tree.NAMESPACE)
    spec = optree.tree_structure(params, none_is_leaf=True, namespace=tree.NAMESPACE)
    if mine is None:
        sub_params: Any = optree.tree_map(_meta, params, namespace=tree.NAMESPACE)
        entries = [
            x if leaves is None else optree.tree_unflatten(spec, x)
            for x, leaves in zip(metas, per, strict=True)
        ]
        n_spec, root, n = spec, type(params), len(ps)
    else:
        sub_params = [_meta(ps[i]) for i in mine]
        entries = [
            x if leaves is None else [x[i] for i in mine]
            for x, leaves in zip(metas, per, strict=True)
        ]
        n_spec, root, n = _list_spec(len(mine)), list, len(mine)
    state = optree.tree_unflatten(outer_spec, entries)
    _, new_state = tx.update(sub_params, state, sub_params)
    new, new_spec, _ = _split(new_state, n_spec, root, n)
    if new_spec != outer_spec:
        raise ValueError("the update changed the state's structure")
    return frozenset(
        j
        for j, (old, value, leaves) in enumerate(zip(entries, new, per, strict=True))
        if leaves is None and isinstance(old, Tensor) and value is not old
    )


def _split(
    state: Any, spec: Any, root: type, n: int
) -> tuple[list[Any], Any, list[list[Any] | None]]:
    """``state`` flattened down to its per-parameter subtrees (of the params' structure ``spec``,
    container type ``root`` and ``n`` leaves, each a tensor or ``None``: a label's state over
    its own leaves) and its other leaves; with, for each, the subtree's leaves (``None`` for
    the others). Each node is flattened once."""
    found: dict[int, list[Any]] = {}

    def per_param(node: Any) -> bool:
        if type(node) is not root or (isinstance(node, (list, tuple)) and len(node) != n):
            return False
        leaves: list[Any]
        leaves, node_spec = optree.tree_flatten(
            cast(Any, node), none_is_leaf=True, namespace=tree.NAMESPACE
        )
        if node_spec != spec or not all(
            t is type(None) or issubclass(t, Tensor) for t in set(map(type, leaves))
        ):
            return False
        found[id(node)] = leaves
        return True

    outer, outer_spec = optree.tree_flatten(
        state, is_leaf=per_param, none_is_leaf=True, namespace=tree.NAMESPACE
    )
    return outer, outer_spec, [found.get(id(x)) for x in outer]
