"""Routing combinators: ``masked`` and ``partition``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functional_opt import tree
from functional_opt.base import (
    DONATE,
    STATE_ONLY,
    GradientTransformation,
    Params,
    Stages,
    Updates,
    accepting,
    check_extra,
    current_stage,
    declare_fusable,
    declare_leaf_labels,
    declare_leafwise,
    declare_member_labels,
    expect_state,
    extra_keywords,
    fusable,
    has_leaf_labels,
    leafwise_level,
)
from functional_opt.packed import Layout, Packed
from functional_opt.tree import PyTree

__all__ = ["MaskedState", "PartitionState", "masked", "partition"]


class MaskedState(NamedTuple):
    """State of the inner transform (``None`` where the mask is false)."""

    inner_state: Any


def _expand(labels: PyTree | Callable[[Params], PyTree], reference: PyTree, what: str) -> list[Any]:
    """Labels (or bools) for each flat leaf of ``reference``; ``labels`` may be a prefix tree.

    A packed ``reference`` is matched by its tree (a mask is written for the params' tree, not
    for the ``Packed`` node around it), and a callable gets that tree (for a packed tree held
    in buffers, its views of them); its answer may be a tree for either. A list or tuple
    matches a sequence of the same length of another list or tuple type (a list of flags for
    ``TransformOptimizer``'s params, which the transform sees as a tuple subclass), entry by
    entry."""
    if callable(labels):
        labels = labels(reference.tree if isinstance(reference, Packed) else reference)
    if isinstance(labels, Packed):
        labels = labels.tree
    if isinstance(reference, Packed):
        reference = reference.tree  # (a Packed flattens to its tree: the same leaves, in order)
    labels = _as_sequence_of(labels, reference)
    try:
        full = optree.tree_broadcast_prefix(
            labels, reference, none_is_leaf=True, namespace=tree.NAMESPACE
        )
    except ValueError as err:
        path = _prefix_difference(labels, reference)
        where = tree.first_difference(labels, reference) if path is None else tree.path_str(path)
        raise ValueError(
            f"{what} does not match the structure of the params (first difference at {where})"
        ) from err
    return tree.leaves(full)


def _as_sequence_of(labels: Any, reference: Any) -> Any:
    """``labels`` rebuilt as ``reference``'s sequence type when both are lists or tuples of one
    length but of different types (named tuples, whose fields matter, excepted)."""
    if (
        isinstance(labels, (list, tuple))
        and isinstance(reference, (list, tuple))
        and type(labels) is not type(reference)
        and len(labels) == len(reference)
        and not hasattr(labels, "_fields")
        and not hasattr(reference, "_fields")
    ):
        return list(labels) if isinstance(reference, list) else type(reference)(labels)
    return labels


def _prefix_difference(
    prefix: PyTree, full: PyTree, path: tuple[Any, ...] = ()
) -> tuple[Any, ...] | None:
    """Path of the first node of ``prefix`` that does not match ``full`` (a leaf of ``prefix``
    matches any subtree), or ``None`` when ``prefix`` is a prefix of ``full``."""
    kw: dict[str, Any] = {"none_is_leaf": True, "namespace": tree.NAMESPACE}
    if optree.tree_is_leaf(prefix, **kw):
        return None
    if optree.tree_is_leaf(full, **kw) or type(prefix) is not type(full):
        return path
    a = optree.tree_flatten_one_level(prefix, **kw)
    b = optree.tree_flatten_one_level(full, **kw)
    ea, eb = list(a.entries), list(b.entries)
    for x, y in zip(ea, eb, strict=False):
        if x != y:
            return (*path, min(x, y, key=repr))
    if len(ea) != len(eb):
        return (*path, (ea if len(ea) > len(eb) else eb)[min(len(ea), len(eb))])
    for entry, ca, cb in zip(ea, a.children, b.children, strict=True):
        found = _prefix_difference(ca, cb, (*path, entry))
        if found is not None:
            return found
    return None


def _select(values: list[Any], keep: list[bool]) -> list[Any]:
    return [v if k else None for v, k in zip(values, keep, strict=True)]


def _holds_tensors(state: Any) -> bool:
    return any(isinstance(x, Tensor) for x in tree.leaves(state))


def _stateless(inner: GradientTransformation) -> bool:
    """Whether ``inner`` keeps no tensors in its state (its state for one param has none)."""
    try:
        return not _holds_tensors(inner.init([torch.zeros(1)]))
    except Exception:  # an inner that cannot take a plain list: not known to be stateless
        return False


def _planned(layout: Layout, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """``make()``, cached on ``layout`` by ``key``; while compiling, made afresh (a graph that
    read the cache would be guarded on it, and traced again once the plan was cached)."""
    if torch.compiler.is_compiling():
        return make()
    plan = layout._plans.get(key)
    if plan is None:
        plan = layout._plans[key] = make()
    return plan


def _sub_layout(layout: Layout, keep: list[bool]) -> Layout:
    """``layout`` with the leaves not kept made ``None`` leaves (gaps of the same buffers): the
    layout of the masked tree."""

    def make() -> Layout:
        shapes = tuple(s if k else None for s, k in zip(layout.shapes, keep, strict=True))
        slots = tuple(s if k else None for s, k in zip(layout.slots, keep, strict=True))
        return Layout(layout.structure.with_shapes(shapes), slots, layout.sizes).prepare()

    return _planned(layout, ("masked", tuple(keep)), make)  # type: ignore[no-any-return]


def _kept_ranges(layout: Layout, keep: list[bool]) -> list[list[tuple[int, int]]]:
    """Per buffer of ``layout``, the element ranges of its kept leaves, adjacent kept leaves
    merged across the alignment gaps between them."""

    def make() -> list[list[tuple[int, int]]]:
        ranges = []
        for b in range(len(layout.sizes)):
            mine: list[tuple[int, int]] = []
            merging = False
            for i in layout.members(b):
                start = layout.slots[i][1]  # type: ignore[index]
                end = start + layout.shapes[i].numel()  # type: ignore[union-attr]
                if keep[i] and merging:
                    mine[-1] = (mine[-1][0], end)
                elif keep[i]:
                    mine.append((start, end))
                merging = keep[i]
            ranges.append(mine)
        return ranges

    return _planned(layout, ("kept ranges", tuple(keep)), make)  # type: ignore[no-any-return]


def _merged(old: Packed, new: Packed, ranges: list[list[tuple[int, int]]]) -> Packed:
    """``new`` on ``ranges`` (the masked leaves, where its values mean something) and ``old``
    elsewhere, per buffer. Compiled: one ``torch.where`` on element indices (one vectorized
    pass, fused with the ops that made ``new``; a ``torch.cat`` of the slices compiled to a
    scalar loop, 8x slower on W1). Eager: one ``torch.cat`` of the slices (a copy, where the
    indices would be a buffer of their own)."""
    out = []
    compiling = torch.compiler.is_compiling()
    for before, after, kept in zip(old.buffers or (), new.buffers or (), ranges, strict=True):
        n = before.shape[-1]
        if not kept:
            out.append(before)
        elif kept == [(0, n)]:
            out.append(after)
        elif not compiling:
            pieces, end = [], 0
            for start, stop in kept:
                pieces += [before[end:start], after[start:stop]]
                end = stop
            out.append(torch.cat([*pieces, before[end:]]))
        else:
            index = torch.arange(n, device=before.device)
            inside = (index >= kept[0][0]) & (index < kept[0][1])
            for start, stop in kept[1:]:
                inside = inside | ((index >= start) & (index < stop))
            out.append(torch.where(inside, after, before))
    return Packed(old.layout, buffers=out)  # type: ignore[arg-type]


def masked(
    inner: GradientTransformation, mask: PyTree | Callable[[Params], PyTree]
) -> GradientTransformation:
    """Applies ``inner`` only to leaves where ``mask`` is true; other updates pass unchanged.

    ``mask`` is a tree of Python bools with the params' structure (or a prefix of it), or a
    function of the params returning one. Extra keywords go to ``inner`` (an unknown one is a
    ``TypeError``: see :func:`functional_opt.base.check_extra`).
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"masked: inner must be a GradientTransformation, got {type(inner).__name__}"
        )
    return _masked(inner, mask, extra_keywords(inner), "masked")


def _masked(
    inner: GradientTransformation,
    mask: PyTree | Callable[[Params], PyTree],
    accepted: frozenset[str] | None,
    where: str,
    key: int | None = None,
) -> GradientTransformation:
    """:func:`masked`, with the keywords ``inner`` accepts already known; ``key``: the key of
    its labels (by default the mask's identity)."""

    # The label of a leaf the engine steps alone (see declare_leaf_labels): its flag, under
    # this key (the mask's own identity: the same for every instance made with it, as
    # inject_hyperparams makes one per step; two masks that are one object give one answer)
    if key is None:
        key = id(mask)

    def bools(reference: PyTree) -> list[bool]:
        flag = current_stage(key)
        if flag is not None:  # given by the engine (its flags read off the whole tree):
            seen = reference.tree if isinstance(reference, Packed) else reference
            n = len(tree.flatten(seen)[0])
            if isinstance(flag, bool):  # one leaf stepped alone
                return [flag] * n
            if isinstance(flag, tuple) and len(flag) == n:  # the leaves of a part, in order
                return list(flag)
            raise ValueError(f"mask: {n} leaves were given the flags {flag!r}")
        flags = _expand(mask, reference, "mask")
        for f in flags:
            if not isinstance(f, bool):
                raise ValueError(f"mask leaves must be Python bools, got {f!r}")
        return flags

    def init_fn(params: Params) -> MaskedState:
        values, spec = tree.flatten(params)
        return MaskedState(inner.init(tree.unflatten(spec, _select(values, bools(params)))))

    def on_buffers(
        updates: Packed, state: MaskedState, params: Params | None, extra: dict[str, Any]
    ) -> tuple[Updates, MaskedState] | None:
        """The packed route: ``inner`` over the updates' buffers with the leaves not masked as
        gaps (so its reductions leave them out), then the masked leaves' new values and the
        other leaves' old ones; ``None`` where it does not apply (a stateful or unfusable
        inner, params not packed with the updates' layout, a new dtype)."""
        layout = updates.layout
        assert layout is not None
        if _holds_tensors(state.inner_state):
            return None
        keep = bools(params if params is not None else updates)
        if not any(keep):  # a stateless inner on no leaf: nothing to compute
            return updates, state
        if params is not None and not (
            tree._is_buffered(params) and tree._same_layout(params.layout, layout)  # type: ignore[union-attr]
        ):
            return None
        sub = _sub_layout(layout, keep)
        mine = dict(extra)
        if extra.get(DONATE) is True and not all(keep):
            mine[DONATE] = STATE_ONLY  # the other leaves' updates are read after it
        new, inner_state = inner.update(
            Packed(sub, buffers=updates.buffers),  # type: ignore[arg-type]
            state.inner_state,
            None if params is None else Packed(sub, buffers=params.buffers),  # type: ignore[union-attr]
            **mine,
        )
        if not (
            tree._is_buffered(new)
            and tree._same_layout(new.layout, sub)
            and all(
                a.dtype == b.dtype for a, b in zip(new.buffers, updates.buffers or (), strict=True)
            )
        ):
            return None
        return _merged(updates, new, _kept_ranges(layout, keep)), MaskedState(inner_state)

    def update_fn(
        updates: Updates, state: MaskedState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MaskedState]:
        check_extra(extra, where, accepted)
        expect_state(state, MaskedState, where)
        if not stateless():
            flag = shared_flag()
            if flag is True:  # a part of the tree masked throughout: the inner over it as is
                new_u, inner_state = inner.update(updates, state.inner_state, params, **extra)
                return new_u, MaskedState(inner_state)
            if flag is False:  # a part left out throughout: its state is another part's
                return updates, state
        if tree._is_buffered(updates) and fast():
            done = on_buffers(updates, state, params, extra)
            if done is not None:
                return done
        u, spec = tree.flatten(updates)
        keep = bools(params if params is not None else updates)
        inner_params = None
        if params is not None:
            where_u = tree.Leaves(u, spec, updates)
            p = where_u.flat(params, "params")
            where_u.take(params, "params")  # shapes of every present leaf, masked or not
            inner_params = tree.unflatten(spec, _select(p, keep))
        new_u, inner_state = inner.update(
            tree.unflatten(spec, _select(u, keep)), state.inner_state, inner_params, **extra
        )
        new_flat = tree.Leaves(u, spec, updates).flat(new_u, "inner updates")
        out = [n if k else old for n, old, k in zip(new_flat, u, keep, strict=True)]
        return tree.unflatten(spec, out), MaskedState(inner_state)

    known: dict[str, bool] = {}

    def remembered(name: str, find: Callable[[], bool]) -> bool:
        """``find()``, kept in ``known`` once found; while compiling, found afresh (a graph
        that filled the memo would be guarded on it, and traced again on its next call)."""
        value = known.get(name)
        if value is None:
            value = find()
            if not torch.compiler.is_compiling():
                known[name] = value
        return value

    def stateless() -> bool:
        """Whether ``inner`` keeps no tensors (``add_decayed_weights``, ``scale``, clipping),
        once known."""
        return remembered("stateless", lambda: _stateless(inner))

    def shared_flag() -> bool | None:
        """The flag the engine gave every leaf it steps now, when they share one: a leaf
        stepped alone, or a part of the tree whose leaves all have one flag (under
        :func:`functional_opt.base.pinned`); else ``None``."""
        flag = current_stage(key)
        if isinstance(flag, bool):
            return flag
        if isinstance(flag, tuple) and flag and all(f is flag[0] for f in flag):
            return flag[0] if isinstance(flag[0], bool) else None
        return None

    def fast() -> bool:
        """Whether the update is fusable: a fusable inner that keeps no tensors (then the
        masked leaves are picked out of the buffers), or a stateful one on a part of the tree
        that the engine steps with one flag for all its leaves (a stateful inner keeps its
        state over the masked leaves only: ``TransformOptimizer`` steps each label's params as
        a part of their own, see ``functional_opt.adapters.label_parts``)."""
        return remembered("fusable", lambda: fusable(inner)) and (
            stateless() or shared_flag() is not None
        )

    def labelling() -> bool:
        """Whether the leaves' flags can be given to the engine as labels: an inner that treats
        every leaf on its own without reductions and has no labels of its own."""
        return remembered(
            "labelling",
            lambda: fusable(inner) and leafwise_level(inner) == 2 and not has_leaf_labels(inner),
        )

    def labelled() -> bool:
        """Whether a leaf may be stepped alone given its flag: a labelling inner (above) that
        keeps no tensors (every param's state then has one structure, masked or not), or a
        stateful one on a part stepped with one flag for all its leaves."""
        return labelling() and fast()

    def labels(params: Params) -> list[Stages] | None:
        if not labelling():
            return None
        return [((key, flag),) for flag in bools(params)]

    declare_fusable(update_fn, fast)
    declare_leafwise(update_fn, lambda: 2 if labelled() else 0)
    declare_leaf_labels(update_fn, labels)
    return GradientTransformation(init_fn, accepting(update_fn, accepted))


class PartitionState(NamedTuple):
    """One masked inner state per label."""

    inner_states: dict[Hashable, MaskedState]


def partition(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: PyTree | Callable[[Params], PyTree],
) -> GradientTransformation:
    """Applies ``transforms[label]`` to the leaves labelled ``label`` by ``param_labels``."""
    if not transforms:
        raise ValueError("partition needs at least one transform")
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"partition: transforms[{label!r}] is a {type(t).__name__}, not a "
                "GradientTransformation"
            )
    accepts = {label: extra_keywords(t) for label, t in transforms.items()}
    accepted: frozenset[str] | None = None
    if all(a is not None for a in accepts.values()):
        accepted = frozenset().union(*accepts.values())  # type: ignore[arg-type]

    def labels_of(reference: PyTree) -> list[Any]:
        labels = _expand(param_labels, reference, "param_labels")
        missing = {lab for lab in labels if lab is not None and lab not in transforms}
        if missing:
            raise ValueError(
                f"param_labels uses labels {sorted(map(repr, missing))} that have no transform "
                f"(transforms: {sorted(map(repr, transforms))})"
            )
        return labels

    def label_mask(label: Hashable) -> Callable[[PyTree], PyTree]:
        def mask(reference: PyTree) -> PyTree:
            _, spec = tree.flatten(reference)
            return tree.unflatten(spec, [lab == label for lab in labels_of(reference)])

        return mask

    # one masked transform per label, made once: its mask (a function of the params) is the
    # same object every step, so the engine can give each leaf's flags as labels (see masked)
    # (keyed by the labels' identity and the label: the same for every instance made with
    # them, as inject_hyperparams makes one per step)
    members = {
        label: _masked(
            tx,
            label_mask(label),
            accepts[label],
            f"partition[{label!r}]",
            hash((id(param_labels), "partition", label)),
        )
        for label, tx in transforms.items()
    }

    def init_fn(params: Params) -> PartitionState:
        return PartitionState({label: m.init(params) for label, m in members.items()})

    def update_fn(
        updates: Updates, state: PartitionState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, PartitionState]:
        check_extra(extra, "partition", accepted)
        expect_state(state, PartitionState, "partition")
        if not isinstance(state.inner_states, dict) or state.inner_states.keys() != accepts.keys():
            got = (
                sorted(map(repr, state.inner_states))
                if isinstance(state.inner_states, dict)
                else type(state.inner_states).__name__
            )
            raise ValueError(
                f"partition: state.inner_states must have the labels "
                f"{sorted(map(repr, transforms))}, got {got}"
            )
        new_states = {}
        for label, m in members.items():
            a = accepts[label]
            mine = extra if a is None else {k: v for k, v in extra.items() if k in a}
            updates, new_states[label] = m.update(
                updates, state.inner_states[label], params, **mine
            )
        return updates, PartitionState(new_states)

    parts = list(members.values())
    declare_fusable(update_fn, lambda: all(map(fusable, parts)))
    declare_leafwise(update_fn, lambda: min(map(leafwise_level, parts)))
    declare_member_labels(update_fn, lambda: parts)
    return GradientTransformation(init_fn, accepting(update_fn, accepted))
