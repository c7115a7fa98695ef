"""Routing combinators: ``masked`` and ``partition``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import optree

from functional_opt import tree
from functional_opt.base import GradientTransformation, Params, Updates
from functional_opt.tree import PyTree

__all__ = ["MaskedState", "PartitionState", "masked", "partition"]


class MaskedState(NamedTuple):
    """State of the inner transform (``None`` where the mask is false)."""

    inner_state: Any


def _expand(labels: PyTree | Callable[[Params], PyTree], reference: PyTree, what: str) -> list[Any]:
    """Labels (or bools) for each flat leaf of ``reference``; ``labels`` may be a prefix tree."""
    if callable(labels):
        labels = labels(reference)
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


def masked(
    inner: GradientTransformation, mask: PyTree | Callable[[Params], PyTree]
) -> GradientTransformation:
    """Applies ``inner`` only to leaves where ``mask`` is true; other updates pass unchanged.

    ``mask`` is a tree of Python bools with the params' structure (or a prefix of it), or a
    function of the params returning one.
    """

    def bools(reference: PyTree) -> list[bool]:
        flags = _expand(mask, reference, "mask")
        for f in flags:
            if not isinstance(f, bool):
                raise ValueError(f"mask leaves must be Python bools, got {f!r}")
        return flags

    def init_fn(params: Params) -> MaskedState:
        values, spec = tree.flatten(params)
        return MaskedState(inner.init(tree.unflatten(spec, _select(values, bools(params)))))

    def update_fn(
        updates: Updates, state: MaskedState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MaskedState]:
        u, spec = tree.flatten(updates)
        keep = bools(params if params is not None else updates)
        inner_params = None
        if params is not None:
            p = tree.Leaves(u, spec, updates).flat(params, "params")
            inner_params = tree.unflatten(spec, _select(p, keep))
        new_u, inner_state = inner.update(
            tree.unflatten(spec, _select(u, keep)), state.inner_state, inner_params, **extra
        )
        new_flat = tree.Leaves(u, spec, updates).flat(new_u, "inner updates")
        out = [n if k else old for n, old, k in zip(new_flat, u, keep, strict=True)]
        return tree.unflatten(spec, out), MaskedState(inner_state)

    return GradientTransformation(init_fn, update_fn)


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

    def labels_of(reference: PyTree) -> list[Any]:
        labels = _expand(param_labels, reference, "param_labels")
        missing = {lab for lab in labels if lab is not None and lab not in transforms}
        if missing:
            raise ValueError(
                f"param_labels uses labels {sorted(map(repr, missing))} that have no transform "
                f"(transforms: {sorted(map(repr, transforms))})"
            )
        return labels

    def masks(reference: PyTree) -> dict[Hashable, GradientTransformation]:
        labels = labels_of(reference)
        _, spec = tree.flatten(reference)
        return {
            label: masked(tx, tree.unflatten(spec, [lab == label for lab in labels]))
            for label, tx in transforms.items()
        }

    def init_fn(params: Params) -> PartitionState:
        return PartitionState({label: t.init(params) for label, t in masks(params).items()})

    def update_fn(
        updates: Updates, state: PartitionState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, PartitionState]:
        new_states = {}
        for label, t in masks(params if params is not None else updates).items():
            updates, new_states[label] = t.update(
                updates, state.inner_states[label], params, **extra
            )
        return updates, PartitionState(new_states)

    return GradientTransformation(init_fn, update_fn)
