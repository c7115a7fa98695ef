""":func:`functional_opt.fused_step` over plain trees: the large leaves of a leafwise transform
stepped one at a time in their own storage, the other leaves *staged* through packed buffers.

A plain tree (a list or dict of separate tensors, as ``torch.func`` code holds its params) has
one tensor per leaf, so a compiled graph over it would have one input per leaf (minutes to
compile for thousands of leaves) and the eager update runs a handful of ops per leaf. Here:

* **direct** (a transform that treats every leaf on its own, :func:`functional_opt.base.leafwise`,
  and leaves of at least :data:`LEAF_MIN` elements): one compiled call of the transform's update
  of that one leaf (:mod:`functional_opt.leaf_step`), reading the gradient in place and writing
  the state and ``p + u`` in their own storage;
* **staged** (the other leaves; every leaf of a fusable transform that is not leafwise, such as
  ``chain(clip_by_global_norm(...), adamw(...))``): the gradients and params are copied into
  packed buffers (:mod:`functional_opt.packed`) kept for that layout, the engine's compiled step
  (:class:`functional_opt.engine.Runner`) runs over them, and the params are copied back, one
  ``torch._foreach_copy_`` each way. The staged leaves' per-parameter state is moved into packed
  buffers of its own on the first step, and the returned state holds views of them: the next
  step that gets those same views back runs on the buffers without copying them (a state
  built elsewhere is copied in again). The staging buffers of the last layout are kept by the
  step: memory of one more copy of the staged params and gradients.

:class:`PlainTreeStep` returns ``None`` where neither applies and the caller runs the
transform's own update: trees that are not plain or do not match, leaves that are not
floating-point tensors of one storage each, gradients that are not of their param's shape, dtype
and device, state it cannot split into per-parameter subtrees, and wherever the engine does not
compile (:func:`functional_opt._kernels.compiles_here`).
"""

from __future__ import annotations

import operator
from typing import Any, cast

import optree
import torch
from torch import Tensor

from functional_opt import _kernels, _lists, tree
from functional_opt.base import DONATE, GradientTransformation, OptState, leafwise
from functional_opt.leaf_step import GIVEN, leaf_step
from functional_opt.packed import Layout, Packed, pack

__all__ = ["LEAF_MIN", "PlainTreeStep"]

LEAF_MIN = 1 << 15
"""Leaves of at least this many elements are stepped one at a time (direct); the smaller ones
are staged (a compiled call's dispatch, 10-40 us, costs more than copying a small leaf)."""


class _Staging:
    """Packed buffers for the staged leaves of one layout: the gradients' and the params' (copied
    in and out every step), and per per-parameter state entry the buffers the returned state's
    leaves are views of."""

    def __init__(self, key: tuple[Any, ...], params: Packed, grads: Packed) -> None:
        self.key = key
        assert params.layout is not None and params.buffers is not None
        assert grads.buffers is not None
        self.layout: Layout = params.layout
        self.params = list(params.buffers)
        self.grads = list(grads.buffers)
        self.param_views = cast(list[Tensor], self.layout.views(self.params))
        self.grad_views = cast(list[Tensor], self.layout.views(self.grads))
        self.states: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        """By position among the per-parameter state entries: (buffers, leaf views)."""

    def state(self, j: int, leaves: list[Tensor]) -> tuple[list[Tensor], bool]:
        """The buffers of state entry ``j`` holding ``leaves`` (the staged leaves' values), and
        whether ``leaves`` already were their views (else they are copied into new buffers)."""
        held = self.states.get(j)
        if (
            held is not None
            and len(leaves) == len(held[1])
            and all(map(operator.is_, leaves, held[1]))
        ):
            return held[0], True
        buffers = self.layout.gather(self.layout.structure.rebuild(leaves), "state")
        self.states[j] = buffers, cast(list[Tensor], self.layout.views(buffers))
        return buffers, False


class PlainTreeStep:
    """``fused_step``'s step over plain trees for a fusable ``tx`` (see the module):
    ``step(params, grads, state)`` steps the params in place and returns the new state, or
    ``None`` where it does not apply (then the caller runs ``tx.update`` and ``apply_updates``).
    ``runner`` is the engine's compiled step of ``tx`` (:class:`functional_opt.engine.Runner`)."""

    def __init__(self, tx: GradientTransformation, runner: Any) -> None:
        self.tx = tx
        self.runner = runner
        self.leafwise = leafwise(tx)
        self.kernels: dict[Any, _kernels.Kernel | None] = {}
        """By the state's outline: its compiled step of one leaf (``None``: a state it cannot
        rebuild)."""
        self.staging: _Staging | None = None
        self.known: tuple[list[Tensor], list[int]] | None = None
        """The params last found steppable, and their data pointers."""

    def __call__(self, params: Any, grads: Any, state: OptState) -> OptState | None:
        if not _kernels.compiles_here() or isinstance(params, Packed) or isinstance(grads, Packed):
            return None
        ps, spec = optree.tree_flatten(params, none_is_leaf=True, namespace=tree.NAMESPACE)
        gs, grad_spec = optree.tree_flatten(grads, none_is_leaf=True, namespace=tree.NAMESPACE)
        if not ps or grad_spec != spec or not self._steppable(ps, gs):
            return None
        shapes = [p.shape for p in ps]
        split = _per_param(state, spec, params, shapes)
        if split is None:
            return None
        outer, outer_spec, kinds = split
        per = [
            optree.tree_leaves(x, none_is_leaf=True, namespace=tree.NAMESPACE)
            for x, k in zip(outer, kinds, strict=True)
            if k == "param"
        ]
        large = [i for i, s in enumerate(shapes) if s.numel() >= LEAF_MIN] if self.leafwise else []
        kernel = self._kernel(outer_spec, kinds) if large else None
        if large and kernel is None:
            return None
        if large and not all(gs[i].is_contiguous() for i in large):
            return None
        taken = set(large)
        staged = [i for i in range(len(ps)) if i not in taken]
        # everything that can refuse comes before anything is written
        prepared = self._prepare(ps, gs, spec, staged, per) if staged else None
        new_outer = list(outer)
        if large:
            assert kernel is not None
            given = [x for x, k in zip(outer, kinds, strict=True) if k in GIVEN]
            outs = [torch.empty_like(x) for x in given]
            one = torch.ones((), dtype=torch.float64, device=ps[large[0]].device)
            for i in large:  # first: the staged step below may write the counters in place
                kernel(gs[i], ps[i], one, *[leaves[i] for leaves in per], *given, *outs)
            news = iter(outs)
            new_outer = [next(news) if k in GIVEN else x for x, k in zip(outer, kinds, strict=True)]
        if prepared is not None:
            staged_outer = self._run_staged(prepared, ps, gs, staged, outer, outer_spec, kinds)
            positions = iter(range(len(per)))
            for n, (x, k) in enumerate(zip(staged_outer, kinds, strict=True)):
                if k == "param":  # the staged leaves' entries: views of the state's buffers
                    j = next(positions)
                    new_outer[n] = self._merged(outer[n], per[j], x, staged, spec, ps)
                elif not large:
                    new_outer[n] = x
        return optree.tree_unflatten(outer_spec, new_outer)

    def _steppable(self, ps: list[Any], gs: list[Any]) -> bool:
        """Whether the leaves can be stepped here: plain floating-point tensors, each param with
        a storage of its own, each gradient of its param's shape, dtype and device, nothing that
        autograd would record. The params' own checks are skipped when they are the tensors
        last found steppable, at the same addresses."""
        known = self.known
        if not (
            known is not None
            and len(known[0]) == len(ps)
            and all(map(operator.is_, ps, known[0]))
            and list(map(Tensor.data_ptr, ps)) == known[1]
        ):
            if not set(map(type, ps)) <= _lists._PLAIN:
                return False
            if not all(p.is_floating_point() and p.layout == torch.strided for p in ps):
                return False
            if len({p.untyped_storage().data_ptr() for p in ps}) != len(ps):
                return False
            self.known = ps, list(map(Tensor.data_ptr, ps))
        if not set(map(type, gs)) <= _lists._PLAIN:
            return False
        if list(map(Tensor.size, gs)) != list(map(Tensor.size, ps)):
            return False
        if [g.dtype for g in gs] != [p.dtype for p in ps]:
            return False
        if [g.device for g in gs] != [p.device for p in ps]:
            return False
        return not (torch.is_grad_enabled() and any(x.requires_grad for x in (*ps, *gs)))

    def _kernel(self, outer_spec: Any, kinds: list[str]) -> _kernels.Kernel | None:
        outline = optree.tree_unflatten(outer_spec, kinds)
        key = optree.tree_structure(outline, namespace=tree.NAMESPACE), tuple(kinds)
        if key not in self.kernels:
            fn = leaf_step(self.tx, outline, kinds)
            self.kernels[key] = None if fn is None else _kernels.Kernel(fn)
        return self.kernels[key]

    def _prepare(
        self, ps: list[Tensor], gs: list[Tensor], spec: Any, staged: list[int], per: list[list[Any]]
    ) -> tuple[_Staging, list[tuple[list[Tensor], bool]]] | None:
        """The staging buffers for ``staged`` (made for a new layout), and each per-parameter
        state entry's buffers (moved into buffers where they are not views of them already)."""
        everything = len(staged) == len(ps)
        key = (
            spec if everything else tuple(staged),
            tuple(ps[i].shape for i in staged),
            tuple(ps[i].dtype for i in staged),
            tuple(ps[i].device for i in staged),
        )
        staging = self.staging
        if staging is None or staging.key != key:
            if everything:  # the user's structure: a transform that reads it sees it
                p_tree, g_tree = tree.unflatten(spec, ps), tree.unflatten(spec, gs)
            else:  # a leafwise transform reads no structure
                p_tree, g_tree = [ps[i] for i in staged], [gs[i] for i in staged]
            staging = self.staging = _Staging(key, pack(p_tree), pack(g_tree))
        try:
            states = [staging.state(j, [leaves[i] for i in staged]) for j, leaves in enumerate(per)]
        except ValueError:  # state leaves of several dtypes where one buffer holds them
            return None
        return staging, states

    def _run_staged(
        self,
        prepared: tuple[_Staging, list[tuple[list[Tensor], bool]]],
        ps: list[Tensor],
        gs: list[Tensor],
        staged: list[int],
        outer: list[Any],
        outer_spec: Any,
        kinds: list[str],
    ) -> list[Any]:
        """The engine's step over the staged leaves; the params copied back. Returns the new
        state's entries (per-parameter ones as packed trees)."""
        staging, states = prepared
        layout = staging.layout
        torch._foreach_copy_(staging.grad_views, [gs[i] for i in staged])
        torch._foreach_copy_(staging.param_views, [ps[i] for i in staged])
        buffers = iter(states)
        sub = [
            Packed(layout, buffers=next(buffers)[0]) if k == "param" else x
            for x, k in zip(outer, kinds, strict=True)
        ]
        _, new_sub = self.runner(
            Packed(layout, buffers=staging.grads),
            optree.tree_unflatten(outer_spec, sub),
            Packed(layout, buffers=staging.params),
            {DONATE: True},
            list(staging.params),
            True,
        )
        torch._foreach_copy_([ps[i] for i in staged], staging.param_views)
        new_entries = outer_spec.flatten_up_to(new_sub)
        positions = iter(range(len(states)))
        for n, k in enumerate(kinds):
            if k != "param":
                continue
            j = next(positions)
            held, views = staging.states[j]
            new = new_entries[n]
            got = new.buffers if isinstance(new, Packed) else None
            if got is not None and tree._same_layout(new.layout, layout):
                for b, x in zip(held, got, strict=True):
                    if x is not b:
                        b.copy_(x)
            else:  # (a transform that returned its state entry another way)
                values = new.tree if isinstance(new, Packed) else new
                torch._foreach_copy_(views, tree.leaves(values))
            new_entries[n] = views
        return cast(list[Any], new_entries)

    def _merged(
        self,
        old: Any,
        old_leaves: list[Any],
        views: list[Tensor],
        staged: list[int],
        spec: Any,
        ps: list[Tensor],
    ) -> Any:
        """A per-parameter state entry after the step: the large leaves' tensors (written in
        place) and the staged leaves' views. ``old`` itself where it already holds those views."""
        if len(staged) == len(ps) and all(map(operator.is_, old_leaves, views)):
            return old
        leaves = list(old_leaves)
        for i, v in zip(staged, views, strict=True):
            leaves[i] = v
        if all(map(operator.is_, leaves, old_leaves)):
            return old
        return optree.tree_unflatten(spec, leaves)


def _per_param(
    state: OptState, spec: Any, params: Any, shapes: list[torch.Size]
) -> tuple[list[Any], Any, list[str]] | None:
    """``state`` split into its per-parameter subtrees (each of the params' structure, leaves of
    their shapes) and its other leaves: ``(entries, structure, kinds)`` with kinds ``"param"``,
    ``"none"`` or ``"group"`` (a tensor not per parameter: a counter). ``None`` where another
    leaf is not a tensor."""
    found: set[int] = set()
    root = type(params)
    single = len(shapes) == 1

    def per_param(node: Any) -> bool:
        if isinstance(node, Tensor):
            if not single:
                return False
        elif type(node) is not root:  # (cheap: most nodes are not of the params' container)
            return False
        leaves, node_spec = optree.tree_flatten(node, none_is_leaf=True, namespace=tree.NAMESPACE)
        if node_spec == spec and all(
            isinstance(x, Tensor) and x.shape == s for x, s in zip(leaves, shapes, strict=True)
        ):
            found.add(id(node))
            return True
        return False

    outer, outer_spec = optree.tree_flatten(
        state, is_leaf=per_param, none_is_leaf=True, namespace=tree.NAMESPACE
    )
    kinds = ["param" if id(x) in found else ("none" if x is None else "group") for x in outer]
    if any(k == "group" and not isinstance(x, Tensor) for x, k in zip(outer, kinds, strict=True)):
        return None
    return outer, outer_spec, kinds
