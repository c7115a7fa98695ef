"""The engine's step of one leaf: a leafwise transform's update of a single param, compiled once
for every size, that reads its gradient in place and writes its state and the param in their
own storage.

A transform that treats every leaf on its own (:func:`functional_opt.base.leafwise`) gives each
leaf of a tree the update it would give that leaf alone. So a tree of separate tensors (the
params of a ``torch.nn.Module``, a plain tree of the pure API) can be stepped leaf by leaf:
:func:`leaf_step` makes the function ``step(g, p, ratio, *state, *given, *outs)`` that
runs the transform on the one-leaf tree ``[g]``, and :class:`functional_opt._kernels.Kernel`
compiles it with dynamic sizes: one graph per rank and dtype, called without dynamo's per-call
work after the first call. Nothing is copied into or out of a buffer: the step moves what
torch's fused Adam moves, plus one call's dispatch (about 10-30 us) per leaf.

Users: ``TransformOptimizer``'s engine for its large params
(``functional_opt.adapters.packed_group``) and :func:`functional_opt.fused_step` on plain
trees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import optree
from torch import Tensor

from functional_opt import tree
from functional_opt.base import DONATE, STATE_ONLY, GradientTransformation

__all__ = ["GIVEN", "Rebuild", "leaf_step"]

GIVEN = ("group", "hyper")
"""The kinds of state leaves that are not per parameter: each step gets them, and every call
writes their same new values (see :func:`leaf_step`)."""


def leaf_step(
    tx: GradientTransformation, outline: Any, kinds: list[str]
) -> Callable[..., None] | None:
    """The step of one param alone, to compile: ``step(g, p, ratio, *state, *given, *outs)``
    runs ``tx.update`` on the one-param tree ``[g]`` with the state rebuilt from the param's own
    per-parameter entries ``state`` and the other state leaves ``given``, writes the new
    per-parameter entries into ``state``, ``p + ratio u`` into ``p`` (in ``p``'s dtype) and the
    new values of ``given`` into ``outs``. Only the state is donated (the gradient is the
    caller's); ``given`` is copied first, so every call reads the same values.

    ``outline`` is the state's structure with each per-parameter subtree and each other leaf
    replaced by its kind (``kinds``, in ``optree``'s order: ``"param"``, ``"group"``,
    ``"hyper"`` or ``"none"``). ``None`` when the state holds a node :class:`Rebuild` cannot
    rebuild."""
    n_param = kinds.count("param")
    n_given = sum(k in GIVEN for k in kinds)
    template = optree.tree_map(
        lambda k: [0] if k == "param" else (None if k == "none" else 0),
        outline,
        namespace=tree.NAMESPACE,
    )
    try:
        shape = Rebuild(template)
    except TypeError:
        return None

    def step(g: Tensor, p: Tensor, ratio: Tensor, *args: Tensor) -> None:
        state_in = iter(args[:n_param])
        given = iter([x.clone() for x in args[n_param : n_param + n_given]])
        outs = iter(args[n_param + n_given :])
        leaves = [
            next(state_in) if k == "param" else (None if k == "none" else next(given))
            for k in kinds
        ]
        state = shape.build(iter(leaves))
        updates, new = tx.update([g], state, [p], **{DONATE: STATE_ONLY})
        u = tree.leaves(updates)[0]
        p.copy_((p + ratio * u).to(p.dtype))
        state_in = iter(args[:n_param])
        new_leaves: list[Any] = []
        shape.leaves(new, new_leaves)
        for k, value in zip(kinds, new_leaves, strict=True):
            if k == "param":
                old = next(state_in)
                if value is not old:
                    old.copy_(value)
            elif k != "none":
                next(outs).copy_(value)

    return step


class Rebuild:
    """A state tree's structure, to rebuild the tree from its leaves and to list the leaves of a
    tree of that structure in plain Python, in ``optree``'s order (inside a traced function:
    dynamo cannot rebuild a tree from a structure made outside it, nor flatten a dict through
    ``optree``). Takes the containers states are made of (tuples, named tuples, lists, dicts;
    ``None`` and ints are leaves); another node raises ``TypeError``."""

    def __init__(self, node: Any) -> None:
        self.kind = "leaf"
        self.type: Any = None
        self.keys: list[Any] = []  # a dict's keys, in the order its leaves come
        self.order: list[Any] = []  # a dict's keys, in its own order
        self.children: list[Rebuild] = []
        if node is None or isinstance(node, int):
            return
        children, _, entries = optree.tree_flatten_one_level(
            node, none_is_leaf=True, namespace=tree.NAMESPACE
        )[:3]
        self.children = [Rebuild(c) for c in children]
        self.type = type(node)
        if self.type is dict:
            self.kind, self.keys, self.order = "dict", list(entries), list(node)
        elif self.type in (tuple, list):
            self.kind = "sequence"
        elif issubclass(self.type, tuple) and hasattr(self.type, "_fields"):
            self.kind = "namedtuple"
        else:
            raise TypeError(f"the state holds a {self.type.__name__}")

    def build(self, leaves: Iterator[Any]) -> Any:
        """The tree of this structure with ``leaves``' next values for leaves."""
        if self.kind == "leaf":
            return next(leaves)
        values = [c.build(leaves) for c in self.children]
        if self.kind == "dict":
            by_key = dict(zip(self.keys, values, strict=True))
            return {k: by_key[k] for k in self.order}
        if self.kind == "namedtuple":
            return self.type(*values)
        return self.type(values)

    def leaves(self, node: Any, out: list[Any]) -> None:
        """Append the leaves of ``node`` (a tree of this structure) to ``out``."""
        if self.kind == "leaf":
            out.append(node)
            return
        items = [node[k] for k in self.keys] if self.kind == "dict" else list(node)
        for c, item in zip(self.children, items, strict=True):
            c.leaves(item, out)
