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
  step: memory of one more copy of the staged params and gradients. Beside large leaves, a
  transform whose one-leaf step treats each element on its own
  (:func:`functional_opt.leaf_step.treats_elements_alone`) steps each run of the staging
  buffers (a ``[count, size]`` matrix of a large leaf's signature) with the large leaves'
  compiled step instead (:meth:`PlainTreeStep._run_staged_rows`): one graph in all.

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
from torch.utils._python_dispatch import TorchDispatchMode

from functional_opt import _kernels, _lists, tree
from functional_opt.base import (
    DONATE,
    GradientTransformation,
    OptState,
    Stages,
    has_leaf_labels,
    leaf_labels,
    leafwise_level,
    part_labels,
    pinned,
    stages,
    zero_updates,
)
from functional_opt.base import staged as staged_as
from functional_opt.leaf_step import (
    GIVEN,
    gradient_reductions,
    gradient_reductions_pass,
    labelled_call,
    large_parts,
    leaf_partials,
    leaf_step,
    ratio_argument,
    treats_elements_alone,
)
from functional_opt.packed import Gather, Layout, Packed, pack

__all__ = ["LEAF_MIN", "TREE_MIN", "PlainTreeStep"]

LEAF_MIN = 1 << 15
"""Leaves of at least this many elements are stepped one at a time (direct); the smaller ones
are staged (a compiled call's dispatch, 10-40 us, costs more than copying a small leaf)."""


TREE_MIN = 1 << 16
"""``dreamerv3()``'s eager update takes the engine over plain trees of at least this many
elements in all; smaller ones run its chain op by op (a first call that compiles would cost
more than the steps it saves)."""


class _Staging:
    """Packed buffers for the staged leaves of one layout: the gradients' (copied in every step,
    then overwritten with the update), the params' (copied in every step, only for a transform
    that reads them), and per per-parameter state entry the buffers the returned state's leaves
    are views of."""

    def __init__(self, key: tuple[Any, ...], grads: Packed) -> None:
        self.key = key
        assert grads.layout is not None and grads.buffers is not None
        self.layout: Layout = grads.layout.prepare()
        self.grads = list(grads.buffers)
        self.grad_views = cast(list[Tensor], self.layout.views(self.grads))
        self.grad_plan = Gather(self.layout, self.grads)
        self.params: list[Tensor] | None = None
        self.param_plan: Gather | None = None
        self.values: list[Tensor] | None = None
        self.value_plan: Gather | None = None
        """Buffers of the params' values for the step through the large leaves' step
        (:meth:`PlainTreeStep._run_staged_rows`) of a transform that does not read them, and
        what copies the params into them."""
        self.probed = False
        self.states: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        """By position among the per-parameter state entries: (buffers, leaf views)."""

    def state(
        self, j: int, leaves: list[Tensor], into_held: bool = False
    ) -> tuple[list[Tensor], bool]:
        """The buffers of state entry ``j`` holding ``leaves`` (the staged leaves' values), and
        whether ``leaves`` already were their views (else they are copied into new buffers, or
        with ``into_held`` into the buffers already held, when no state the caller keeps holds
        their views)."""
        held = self.states.get(j)
        if held is not None and len(leaves) == len(held[1]):
            if all(map(operator.is_, leaves, held[1])):
                return held[0], True
            if into_held and all(
                a.shape == b.shape and a.dtype == b.dtype
                for a, b in zip(leaves, held[1], strict=True)
            ):
                torch._foreach_copy_(held[1], leaves)
                return held[0], False
        buffers = self.layout.gather(self.layout.structure.rebuild(leaves), "state")
        self.states[j] = buffers, cast(list[Tensor], self.layout.views(buffers))
        return buffers, False

    def read_params(self) -> None:
        """Keep a buffer of the params' values (for a transform that reads them)."""
        self.params = [torch.empty_like(b) for b in self.grads]
        self.param_plan = Gather(self.layout, self.params)


_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _Facts:
    """The params of a step: the tensors and their addresses (to know them again), shapes,
    dtypes and devices, which are stepped directly (``large``) and which staged."""

    def __init__(self, ps: list[Tensor], leafwise: bool) -> None:
        self.params = ps
        self.pointers = list(map(Tensor.data_ptr, ps))
        self.shapes = list(map(Tensor.size, ps))
        self.dtypes = list(map(_DTYPE, ps))
        self.devices = list(map(_DEVICE, ps))
        self.large = (
            [i for i, s in enumerate(self.shapes) if s.numel() >= LEAF_MIN] if leafwise else []
        )
        taken = set(self.large)
        self.staged = [i for i in range(len(ps)) if i not in taken]
        self.key = (
            tuple((self.shapes[i], self.dtypes[i], self.devices[i]) for i in self.staged),
            tuple(self.staged),
        )
        self.kernels: dict[Any, Any] = {}
        """The compiled kernels kept for these params (see ``Kernel.kept_call``)."""
        self.probes: dict[Any, tuple[int, tuple[str, ...]]] = {}
        """What each totals pass computes over the large leaves (by kernel code, stages)."""
        self.fused_add = _lists.fused_add_ok([ps[i] for i in self.staged])
        """Whether the staged params may take :func:`functional_opt._lists.add_into`'s fused
        route (where they are contiguous; the staging buffers' views it adds are, and of the
        params' dtypes)."""
        self.storages = _storages(ps)
        self.numel = sum(s.numel() for s in self.shapes)
        self.signature = (tuple(self.shapes), tuple(self.dtypes), tuple(self.devices))
        """What a probe of the update's dtypes depends on (:meth:`PlainTreeStep._same_dtypes`:
        params of the same signature need no new probe)."""
        self.labels: tuple[Any, list[Stages] | None] | None = None
        """The tree structure the leaves' labels were read for, and the labels
        (:meth:`PlainTreeStep._labels`)."""


class PlainTreeStep:
    """``fused_step``'s step over plain trees for a fusable ``tx`` (see the module):
    ``step(params, grads, state)`` steps the params in place and returns the new state, or
    ``None`` where it does not apply (then the caller runs ``tx.update`` and ``apply_updates``).
    ``runner`` is the engine's compiled step of ``tx`` (:class:`functional_opt.engine.Runner`)."""

    def __init__(
        self,
        tx: GradientTransformation,
        runner: Any,
        updates_only: bool = False,
        min_numel: int = 0,
    ) -> None:
        self.tx = tx
        self.runner = runner
        self.updates_only = updates_only
        """Whether this step only runs :meth:`update` (the params are only read: they may
        share memory, as the rows of one buffer do)."""
        self.min_numel = min_numel
        """Trees of fewer elements in all are not taken (compiling would cost more than it
        saves)."""
        level = leafwise_level(tx)
        self.leafwise = level > 0
        """Whether large leaves are stepped one at a time (see the module)."""
        self.reduces = level == 1
        """Whether they need the totals of the update's reductions over all leaves first."""
        self.kernels: dict[Any, _kernels.Kernel | None] = {}
        """By the state's outline: its compiled step of one leaf (``None``: a state it cannot
        rebuild)."""
        self.staging: _Staging | None = None
        self.known: _Facts | None = None
        """The params last found steppable."""
        self.update_dtypes: dict[Any, bool] = {}
        """Whether the update gives each leaf its gradient's dtype, by state outline and the
        params' signature (:meth:`_same_dtypes`)."""
        self.seen: dict[int, tuple[Any, list[Any]]] = {}
        """The state's per-parameter subtrees found last step, by id: (node, leaves)."""
        self.elementwise: dict[Any, bool] = {}
        """Whether the large leaves' step treats each element on its own, by state outline,
        totals, stages and mode (see :meth:`_run_staged_rows`)."""

    def __call__(
        self, params: Any, grads: Any, state: OptState, *, into_held: bool = False
    ) -> OptState | None:
        """``into_held``: the caller keeps no state this step returned (it copies the returned
        state where it wants it), so the staged leaves' state is copied into the buffers already
        held instead of new ones."""
        leaves = self._leaves(params, grads)
        if leaves is None:
            return None
        ps, gs, spec, facts = leaves
        return self._run(params, ps, gs, spec, facts, state, into_held)

    def _leaves(
        self, params: Any, grads: Any
    ) -> tuple[list[Tensor], list[Tensor], Any, _Facts] | None:
        """The params' and gradients' leaves, their structure and what is known of the params;
        ``None`` where the step does not apply (see :meth:`_facts`)."""
        if not _kernels.compiles_here() or isinstance(params, Packed) or isinstance(grads, Packed):
            return None
        ps, spec = optree.tree_flatten(params, none_is_leaf=True, namespace=tree.NAMESPACE)
        gs, grad_spec = optree.tree_flatten(grads, none_is_leaf=True, namespace=tree.NAMESPACE)
        if not ps or grad_spec != spec:
            return None
        facts = self._facts(ps, gs)
        return None if facts is None else (ps, gs, spec, facts)

    def update(
        self, grads: Any, state: OptState, params: Any, donate: bool | str = True
    ) -> tuple[Any, OptState] | None:
        """``tx.update(grads, state, params, donate=donate)`` over plain trees: the same steps
        as a call, with the update itself written into the gradients instead of added into the
        params, which are only read. Gradients not donated (``donate`` not ``True``) are only
        read, and each update is a fresh tensor (so is that of a large 16-bit leaf); a state
        not donated (``donate=False``) is copied first, one multi-tensor copy, and the copy
        stepped.
        Returns ``(updates, new_state)``, or ``None`` where it does not apply (as for a call,
        and also: no params given, gradients that share memory with each other or with a
        param, an update whose leaves are not of their gradients' dtypes)."""
        leaves = None if params is None else self._leaves(params, grads)
        if leaves is None:
            return None
        ps, gs, spec, facts = leaves
        if facts.numel < self.min_numel:
            return None
        # each gradient is written once, with its own leaf's update: no two may share memory,
        # nor one with a param (which the same pass reads)
        if donate is True:
            storages = _storages(gs)
            if not storages.isdisjoint(facts.storages) or not (
                len(storages) == _nonempty(gs) or not _lists.overlapping(gs)
            ):
                return None
        elif donate is False:
            held, state_spec = optree.tree_flatten(
                state, none_is_leaf=True, namespace=tree.NAMESPACE
            )
            if not all(x is None or isinstance(x, Tensor) for x in held):
                return None
            copied = iter(_copies([x for x in held if x is not None]))
            state = optree.tree_unflatten(
                state_spec, [None if x is None else next(copied) for x in held]
            )
        # Each update goes into its gradient when donated, except a large 16-bit one: written
        # over the gradient it is computed from, in the same pass, it measured 2.5x slower than
        # into a fresh tensor (inductor's masked half-width stores under AVX-512). Gradients
        # not donated: fresh tensors.
        large = set(facts.large)
        dests = [
            g
            if donate is True and (g.element_size() >= 4 or i not in large)
            else torch.empty_like(g, memory_format=torch.contiguous_format)
            for i, g in enumerate(gs)
        ]
        new_state = self._run(params, ps, gs, spec, facts, state, False, (grads, state, dests))
        if new_state is None:
            return None
        if all(map(operator.is_, dests, gs)):
            return grads, new_state
        return optree.tree_unflatten(spec, dests), new_state

    def _same_dtypes(
        self, facts: _Facts, outline: Any, grads: Any, state: OptState, params: Any
    ) -> bool:
        """Whether ``tx.update(grads, state, params)`` gives every leaf its gradient's dtype:
        found once per state ``outline`` and params' shapes, dtypes and devices, on ``meta``
        copies, or where it cannot run there (an ``.item()``) on the tensors themselves, purely
        (``False`` if it cannot run at all: its own update then raises the error)."""
        key = (outline, facts.signature)
        known = self.update_dtypes.get(key)
        if known is None:

            def meta(x: Any) -> Any:
                return torch.empty_like(x, device="meta") if isinstance(x, Tensor) else x

            def same(args: tuple[Any, ...]) -> bool:
                with _Probe():  # type: ignore[no-untyped-call]  # (the engine's routes step aside: compiles_here() is False)
                    out, _ = self.tx.update(*args)
                leaves = optree.tree_leaves(out, none_is_leaf=True, namespace=tree.NAMESPACE)
                return list(map(_DTYPE, leaves)) == facts.dtypes

            try:
                known = same(tuple(_on(meta, x) for x in (grads, state, params)))
            except Exception:  # (an update that cannot run on meta)
                try:
                    known = same((grads, state, params))
                except Exception:
                    known = False
            self.update_dtypes[key] = known
        return known

    def _run(
        self,
        params: Any,
        ps: list[Tensor],
        gs: list[Tensor],
        spec: Any,
        facts: _Facts,
        state: OptState,
        into_held: bool,
        update_of: tuple[Any, OptState, list[Tensor]] | None = None,
    ) -> OptState | None:
        """The step (``update_of``: the gradients and state of :meth:`update`, and the tensor
        each leaf's update is written into instead, its gradient or a fresh one)."""
        split = _per_param(state, spec, params, facts.shapes, self.seen)
        if split is None:
            return None
        outer, outer_spec, kinds, per, self.seen = split
        dests = None if update_of is None else update_of[2]
        if update_of is not None and not self._same_dtypes(
            facts, outer_spec, update_of[0], update_of[1], params
        ):
            return None
        large, staged = facts.large, facts.staged
        across = self.reduces and bool(large)  # (all staged: one update of the whole tree)
        # the stages the transform declares for this step (read before anything is written):
        # the large leaves' kernels are compiled and run per stage
        found = stages(self.tx, state) if large else ()
        if large and self._kernel(outer_spec, kinds, 0, found) is None:
            return None  # (a state it cannot rebuild)
        labels = self._labels(params, spec, facts) if large else None
        if large and labels is None and has_leaf_labels(self.tx):
            return None  # (labels it cannot give for this tree: the transform's own update)
        # the staged leaves' labels, pinned while their update runs over them alone
        part = () if labels is None else part_labels(labels, staged)
        # everything that can refuse comes before anything is written
        prepared = self._prepare(gs, spec, facts, per, into_held) if staged else None
        loaded = self._load(prepared, ps, gs, facts, outer, outer_spec, kinds) if prepared else None
        given = [x for x, k in zip(outer, kinds, strict=True) if k in GIVEN]
        totals: list[Tensor] | None = None
        if across:
            with staged_as(found):
                totals = self._totals(
                    ps, gs, per, given, large, outer_spec, kinds, loaded, found, labels, part
                )
        new_outer = list(outer)
        outs: list[Tensor] = []
        if large:
            outs = [torch.empty_like(x) for x in given]
            ones: dict[tuple[torch.dtype, torch.device], Tensor] = {}
            kept, count = self.known_kernels(), len(totals or ())

            def step_for(into: str | None) -> Any:
                def kernel_for(stages_: Stages) -> _kernels.Kernel:
                    out = self._kernel(outer_spec, kinds, count, stages_, into)
                    assert out is not None
                    return out

                return kernel_for

            with staged_as(found):
                for i in large:  # first: the staged step below may write the counters in place
                    state_i = [leaves[i] for leaves in per]
                    one = ones.get((ps[i].dtype, ps[i].device))
                    if one is None:
                        one = ones[ps[i].dtype, ps[i].device] = ratio_argument(1.0, ps[i])
                    into, third = None, one
                    if dests is not None:  # (the update into the gradient, or a fresh tensor)
                        into, third = ("grad", one) if dests[i] is gs[i] else ("out", dests[i])
                    args = (gs[i], ps[i], third, *state_i, *given, *outs, *(totals or ()))
                    label = () if labels is None else labels[i]  # (a mask's flag)
                    labelled_call(step_for(into), kept, (i, (count, into)), found, label, args)
            news = iter(outs)
            new_outer = [next(news) if k in GIVEN else x for x, k in zip(outer, kinds, strict=True)]
        if prepared is not None and loaded is not None:
            staged_dests = None if dests is None else [dests[i] for i in staged]
            by_rows = None
            if large and labels is None:
                with staged_as(found):
                    by_rows = self._run_staged_rows(
                        prepared,
                        ps,
                        facts,
                        outer_spec,
                        kinds,
                        given,
                        outs,
                        totals,
                        found,
                        staged_dests,
                    )
            if by_rows is not None:
                staged_outer = by_rows
            else:
                with pinned(part):
                    staged_outer = self._run_staged(
                        prepared, loaded, ps, facts, outer_spec, kinds, totals, staged_dests
                    )
            positions = iter(range(len(per)))
            for n, (x, k) in enumerate(zip(staged_outer, kinds, strict=True)):
                if k == "param":  # the staged leaves' entries: views of the state's buffers
                    j = next(positions)
                    new_outer[n] = self._merged(outer[n], per[j], x, staged, spec, ps)
                elif not large:
                    new_outer[n] = x
        return optree.tree_unflatten(outer_spec, new_outer)

    def _totals(
        self,
        ps: list[Tensor],
        gs: list[Tensor],
        per: list[list[Any]],
        given: list[Tensor],
        large: list[int],
        outer_spec: Any,
        kinds: list[str],
        loaded: tuple[Packed, Any, Packed] | None,
        found: Stages,
        labels: list[Stages] | None = None,
        part: Stages = (),
    ) -> list[Tensor]:
        """The totals over the whole tree of the update's reductions (a transform leafwise
        given them): pass ``k`` sums the parts' partial values of reduction ``k`` with the
        totals before it given (one compiled call per large leaf, or one multi-tensor op for
        reductions of their gradients; one compiled pass over the staged buffers; a pass reads
        only what that reduction needs). Writes nothing."""
        totals: list[Tensor] = []

        # over the large leaves, ``totals`` given
        def large_pass() -> tuple[list[Any], int, tuple[str, ...]]:
            kernel = self._partials_kernel(outer_spec, kinds, len(totals), found)
            assert kernel is not None  # (the state rebuilds: checked before)
            kept, code = self.known_kernels(), -1 - len(totals)

            def args(i: int) -> tuple[Tensor, ...]:
                return (gs[i], ps[i], *[leaves[i] for leaves in per], *given, *totals)

            def label(i: int) -> Stages:
                return () if labels is None else labels[i]

            def probe() -> tuple[int, tuple[str, ...]]:
                outline = optree.tree_unflatten(outer_spec, kinds)
                with staged_as(found + label(large[0])):
                    return gradient_reductions(self.tx, outline, kinds, len(totals), args(large[0]))

            def pass_for(stages_: Stages) -> _kernels.Kernel:
                out = (
                    kernel
                    if stages_ is found
                    else self._partials_kernel(outer_spec, kinds, len(totals), stages_)
                )
                assert out is not None
                return out

            return large_parts(
                self.known_probes(),
                (code, found),
                probe,
                [gs[i] for i in large],
                lambda: [
                    labelled_call(pass_for, kept, (i, code), found, label(i), args(i))
                    for i in large
                ],
            )

        def staged_part(taken: tuple[str, ...]) -> tuple[Tensor, ...]:
            # where the large leaves took the pass's exact partials as reductions of the
            # gradients (``taken``: their kinds), the same multi-tensor ops over the staged leaves'
            # gradients: no graph of the staged buffers' partials to compile (2 s of a first
            # step)
            if taken and labels is None:
                staged = [gs[i] for i in range(len(gs)) if i not in large_set]
                rows = gradient_reductions_pass(staged, len(taken), taken)
                if rows is not None:
                    return tuple(_lists.summed(list(c)) for c in zip(*rows, strict=True))
            assert loaded is not None
            grads, sub, params = loaded
            with pinned(part):
                return self.runner.partials(grads, sub, params, {}, totals)  # type: ignore[no-any-return]

        large_set = set(large)
        while True:
            parts, exact, taken = large_pass()
            if loaded is not None:
                parts.append(staged_part(taken))
            if not _lists.next_total(totals, parts, exact):
                return totals

    def _labels(self, params: Any, spec: Any, facts: _Facts) -> list[Stages] | None:
        """Each leaf's labels (:func:`functional_opt.base.leaf_labels`: a mask's flag), read off
        the tree once for the known params and this structure; ``None`` for a transform that
        has none, or none it can give for this tree."""
        if not has_leaf_labels(self.tx):
            return None
        if facts.labels is None or facts.labels[0] != spec:
            try:
                found = leaf_labels(self.tx, params)
            except ValueError:
                found = None
            facts.labels = (spec, found)
        return facts.labels[1]

    def known_kernels(self) -> dict[Any, Any]:
        """The compiled kernels kept for the known params: by (leaf, kernel code, stages)."""
        assert self.known is not None
        return self.known.kernels

    def known_probes(self) -> dict[Any, tuple[int, tuple[str, ...]]]:
        """What each totals pass computes over the known params' large leaves (see
        :func:`functional_opt.leaf_step.large_parts`)."""
        assert self.known is not None
        return self.known.probes

    def _facts(self, ps: list[Any], gs: list[Any]) -> _Facts | None:
        """What the step needs to know of the params (made once for the same tensors at the
        same addresses), or ``None`` where the leaves cannot be stepped here: leaves that are
        not plain floating-point tensors, params that share a storage, a gradient not of its
        param's shape, dtype and device, anything autograd would record."""
        facts = self.known
        if not (
            facts is not None
            and len(facts.params) == len(ps)
            and all(map(operator.is_, ps, facts.params))
            and list(map(Tensor.data_ptr, ps)) == facts.pointers
        ):
            if not set(map(type, ps)) <= _lists._PLAIN:
                return None
            if not all(p.is_floating_point() and p.layout == torch.strided for p in ps):
                return None
            if (
                not self.updates_only
                and len(_storages(ps)) != _nonempty(ps)
                and _lists.overlapping(ps)
            ):
                return None  # (params written twice: tied by memory; a packed tree's leaves,
                # views of one buffer that do not overlap, are stepped each in its own place)
            facts = self.known = _Facts(ps, self.leafwise)
        if not set(map(type, gs)) <= _lists._PLAIN:
            return None
        if list(map(Tensor.size, gs)) != facts.shapes:
            return None
        if list(map(_DTYPE, gs)) != facts.dtypes or list(map(_DEVICE, gs)) != facts.devices:
            return None
        if torch.is_grad_enabled() and (
            any(map(_REQUIRES_GRAD, ps)) or any(map(_REQUIRES_GRAD, gs))
        ):
            return None
        if not all(gs[i].is_contiguous() for i in facts.large):
            return None  # (a large leaf's gradient is read in place)
        return facts

    def _kernel(
        self,
        outer_spec: Any,
        kinds: list[str],
        totals: int,
        found: Stages,
        into: str | None = None,
    ) -> _kernels.Kernel | None:
        """The compiled step of one large leaf for this state's outline, taking ``totals``
        reductions' totals, in the transform's stages ``found`` (``None``: a state it cannot
        rebuild); ``into``: writing the update instead (:meth:`update`: ``"grad"``, ``"out"``)."""
        outline = optree.tree_unflatten(outer_spec, kinds)
        spec = optree.tree_structure(outline, namespace=tree.NAMESPACE)
        key = spec, tuple(kinds), totals, found, into
        if key not in self.kernels:
            apply = not zero_updates(self.tx, found)
            fn = leaf_step(self.tx, outline, kinds, totals, apply, into=into)
            self.kernels[key] = None if fn is None else _kernels.Kernel(fn)
        return self.kernels[key]

    def _partials_kernel(
        self, outer_spec: Any, kinds: list[str], known: int, found: Stages
    ) -> _kernels.Kernel | None:
        """The compiled pass of one large leaf giving its partials with ``known`` totals given
        (:func:`functional_opt.leaf_step.leaf_partials`), in the stages ``found``."""
        outline = optree.tree_unflatten(outer_spec, kinds)
        spec = optree.tree_structure(outline, namespace=tree.NAMESPACE)
        key = spec, tuple(kinds), -1 - known, found
        if key not in self.kernels:
            fn = leaf_partials(self.tx, outline, kinds, known)
            self.kernels[key] = None if fn is None else _kernels.Kernel(fn)
        return self.kernels[key]

    def _prepare(
        self, gs: list[Tensor], spec: Any, facts: _Facts, per: list[list[Any]], into_held: bool
    ) -> tuple[_Staging, list[tuple[list[Tensor], bool]]] | None:
        """The staging buffers for the staged leaves (made for a new layout), and each
        per-parameter state entry's buffers (moved into buffers where they are not views of
        them already)."""
        staged = facts.staged
        everything = len(staged) == len(gs)
        key = (spec if everything else None, facts.key)
        staging = self.staging
        if staging is None or staging.key != key:
            # everything: the user's structure, which a transform may read (a mask); else the
            # staged leaves as a list (a leafwise transform reads no structure)
            g_tree = tree.unflatten(spec, gs) if everything else [gs[i] for i in staged]
            staging = self.staging = _Staging(key, pack(g_tree))
        try:
            states = [
                staging.state(j, [leaves[i] for i in staged], into_held)
                for j, leaves in enumerate(per)
            ]
        except ValueError:  # state leaves of several dtypes where one buffer holds them
            return None
        return staging, states

    def _load(
        self,
        prepared: tuple[_Staging, list[tuple[list[Tensor], bool]]],
        ps: list[Tensor],
        gs: list[Tensor],
        facts: _Facts,
        outer: list[Any],
        outer_spec: Any,
        kinds: list[str],
    ) -> tuple[Packed, Any, Packed]:
        """The staged leaves' gradients (and params, for a transform that reads them) copied
        into the staging buffers: ``(grads, state, params)`` as the engine takes them, the
        state's per-parameter entries as packed trees of its buffers."""
        staging, states = prepared
        layout = staging.layout
        staged = facts.staged
        staging.grad_plan(gs if len(staged) == len(gs) else [gs[i] for i in staged])
        buffers = iter(states)
        sub = optree.tree_unflatten(
            outer_spec,
            [
                Packed(layout, buffers=next(buffers)[0]) if k == "param" else x
                for x, k in zip(outer, kinds, strict=True)
            ],
        )
        grads = Packed(layout, buffers=staging.grads)
        if not staging.probed:
            staging.probed = True
            try:  # (pure: the state is not written)
                self.tx.update(grads, sub, None)
            except (ValueError, TypeError):
                staging.read_params()
        staged_ps = ps if len(staged) == len(ps) else [ps[i] for i in staged]
        if staging.params is not None:
            assert staging.param_plan is not None
            staging.param_plan(staged_ps)
            return grads, sub, Packed(layout, buffers=staging.params)
        # a loose tree: copied into a buffer only if the transform reads it after all
        return grads, sub, Packed(layout.structure, tree=layout.structure.rebuild(staged_ps))

    def _run_staged(
        self,
        prepared: tuple[_Staging, list[tuple[list[Tensor], bool]]],
        loaded: tuple[Packed, Any, Packed],
        ps: list[Tensor],
        facts: _Facts,
        outer_spec: Any,
        kinds: list[str],
        totals: list[Tensor] | None,
        into: list[Tensor] | None = None,
    ) -> list[Any]:
        """The engine's step over the staged leaves (their reductions' totals given, where the
        large leaves are stepped apart); the updates added into the params, or copied into
        ``into`` (the staged leaves' gradients, for :meth:`PlainTreeStep.update`). Returns the
        new state's entries (per-parameter ones as the state buffers' views)."""
        staging, states = prepared
        layout = staging.layout
        staged = facts.staged
        staged_ps = ps if len(staged) == len(ps) else [ps[i] for i in staged]
        grads, sub, given = loaded
        # (read before the step, which may write the counters in place)
        zero = zero_updates(self.tx, stages(self.tx, sub))
        updates, new_sub = self.runner(grads, sub, given, {DONATE: True}, totals=totals)
        # (checked each step: an in-place transpose keeps a param's address)
        fused = facts.fused_add and all(map(Tensor.is_contiguous, staged_ps))
        if isinstance(updates, Packed) and updates.buffers is not None:
            if all(map(operator.is_, updates.buffers, staging.grads)):
                views = staging.grad_views
            else:
                assert updates.layout is not None
                views = cast(list[Tensor], updates.layout.views(list(updates.buffers)))
                fused = fused and all(
                    u.dtype == b.dtype for u, b in zip(updates.buffers, staging.grads, strict=True)
                )
        else:
            views, fused = (
                tree.leaves(updates.tree if isinstance(updates, Packed) else updates),
                False,
            )
        if into is not None:
            torch._foreach_copy_(into, views)  # type: ignore[misc]
        elif not zero:  # (negative zeros leave every param as it is, bit for bit)
            _lists.add_into(staged_ps, views, fused=fused)
        new_entries = outer_spec.flatten_up_to(new_sub)
        positions = iter(range(len(states)))
        for n, k in enumerate(kinds):
            if k != "param":
                continue
            j = next(positions)
            held, state_views = staging.states[j]
            new = new_entries[n]
            got = new.buffers if isinstance(new, Packed) else None
            if got is not None and tree._same_layout(new.layout, layout):
                for b, x in zip(held, got, strict=True):
                    if x is not b:
                        b.copy_(x)
            else:  # (a transform that returned its state entry another way)
                values = new.tree if isinstance(new, Packed) else new
                torch._foreach_copy_(state_views, tree.leaves(values))
            new_entries[n] = state_views
        return cast(list[Any], new_entries)

    def _run_staged_rows(
        self,
        prepared: tuple[_Staging, list[tuple[list[Tensor], bool]]],
        ps: list[Tensor],
        facts: _Facts,
        outer_spec: Any,
        kinds: list[str],
        given: list[Tensor],
        outs: list[Tensor],
        totals: list[Tensor] | None,
        found: Stages,
        into: list[Tensor] | None,
    ) -> list[Any] | None:
        """The staged leaves through the large leaves' compiled step (under the caller's
        stages ``found``), where it serves them: a transform whose one-leaf step treats each
        element on its own (:func:`functional_opt.leaf_step.treats_elements_alone`), and runs
        of the staging buffers that are matrices of a large leaf's kind (:meth:`_rows_fit`).
        Each run ``[count, size]`` is then stepped as one leaf of that shape: one graph for the
        whole step, not a second one for the staged leaves. The params' values are copied into
        a staging buffer (where the step reads them or writes ``p + u`` there), then copied
        back; for :meth:`update` the step writes ``u`` into the staged gradients, copied into
        ``into``. Returns the new state's entries as :meth:`_run_staged` does (the others
        unchanged: the large leaves' steps give them), or ``None`` (nothing written) where it
        does not serve them."""
        staging, states = prepared
        layout = staging.layout
        mode = None if into is None else "grad"
        count = len(totals or ())
        kernel = self._kernel(outer_spec, kinds, count, found, mode)
        if kernel is None or not self._rows_fit(staging, facts):
            return None
        key = (outer_spec, tuple(kinds), count, found, mode)
        elementwise = self.elementwise.get(key)
        if elementwise is None:
            elementwise = self.elementwise[key] = all(
                treats_elements_alone(
                    kernel.fn, self._stand_in(staging, states, b, given, outs, totals)
                )
                for b in range(len(staging.grads))
            )
        if not elementwise:
            return None
        staged = facts.staged
        staged_ps = ps if len(staged) == len(ps) else [ps[i] for i in staged]
        apply = into is None and not zero_updates(self.tx, found)
        if staging.params is not None:  # (read by the transform: copied in by _load)
            values = staging.params
        else:
            if staging.values is None:
                staging.values = [torch.empty_like(b) for b in staging.grads]
                staging.value_plan = Gather(layout, staging.values)
            assert staging.value_plan is not None
            values = staging.values
            if apply:
                staging.value_plan(staged_ps)
        ones: dict[torch.dtype, Tensor] = {}
        kept = self.known_kernels()
        for b in range(len(staging.grads)):
            state_buffers = [buffers[b] for buffers, _ in states]
            for start, rows, size in layout.runs(b):
                end = start + rows * size
                p = values[b][start:end].view(rows, size)
                one = ones.get(p.dtype)
                if one is None:
                    one = ones[p.dtype] = ratio_argument(1.0, p)
                args = (
                    staging.grads[b][start:end].view(rows, size),
                    p,
                    one,
                    *[x[start:end].view(rows, size) for x in state_buffers],
                    *given,
                    *outs,
                    *(totals or ()),
                )
                kernel.kept_call(kept, ("rows", b, start, count, mode, found), args)
        if into is not None:
            torch._foreach_copy_(into, staging.grad_views)
        elif apply:
            torch._foreach_copy_(staged_ps, cast(list[Tensor], layout.views(values)))
        new_entries: list[Any] = []
        positions = iter(range(len(states)))
        for k in kinds:
            new_entries.append(staging.states[next(positions)][1] if k == "param" else None)
        return new_entries

    def _stand_in(
        self,
        staging: _Staging,
        states: list[tuple[list[Tensor], bool]],
        b: int,
        given: list[Tensor],
        outs: list[Tensor],
        totals: list[Tensor] | None,
    ) -> Any:
        """``args(n)``: the large leaves' step's arguments for a stand-in leaf of ``n``
        elements of buffer ``b``'s dtypes (fresh tensors; see :meth:`_run_staged_rows`)."""
        device = staging.grads[b].device
        dtype = staging.grads[b].dtype
        state_dtypes = [buffers[b].dtype for buffers, _ in states]

        def args(n: int) -> tuple[Any, ...]:
            def leaf(dtype: torch.dtype, value: float) -> Tensor:
                return torch.full((n,), value, dtype=dtype, device=device)

            p = leaf(dtype, 0.5)
            return (
                leaf(dtype, 0.25),
                p,
                ratio_argument(1.0, p),
                *[leaf(d, 0.0) for d in state_dtypes],
                *[x.clone() for x in given],
                *[torch.empty_like(x) for x in outs],
                *[t.clone() for t in totals or ()],
            )

        return args

    def _rows_fit(self, staging: _Staging, facts: _Facts) -> bool:
        """Whether the large leaves' compiled step serves the staging buffers' runs as
        matrices: each run of at least two rows and columns, in a buffer of the dtype and
        device of a large leaf that is a matrix of at least two rows and columns (the sizes a
        graph with dynamic sizes is specialized on)."""
        matrices = {
            (facts.dtypes[i], facts.devices[i])
            for i in facts.large
            if len(facts.shapes[i]) == 2 and min(facts.shapes[i]) >= 2
        }
        layout = staging.layout
        return all(
            (g.dtype, g.device) in matrices
            and all(rows >= 2 and size >= 2 for _, rows, size in layout.runs(b))
            for b, g in enumerate(staging.grads)
        )

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


class _Probe(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A mode that only runs each op: within it no route of the engine compiles anything."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _storages(xs: list[Tensor]) -> set[int]:
    """The storages of the tensors of ``xs`` that have elements (empty ones share none)."""
    return {x.untyped_storage().data_ptr() for x in xs if x.numel()}


def _nonempty(xs: list[Tensor]) -> int:
    return sum(1 for x in xs if x.numel())


def _copies(xs: list[Tensor]) -> list[Tensor]:
    """Fresh copies of ``xs`` (one multi-tensor copy)."""
    out = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    if out:
        torch._foreach_copy_(out, xs)  # type: ignore[misc]
    return out


def _on(fn: Any, x: Any) -> Any:
    return optree.tree_map(fn, x, none_is_leaf=True, namespace=tree.NAMESPACE)


def _shaped(leaves: list[Any], shapes: list[torch.Size]) -> bool:
    """Whether ``leaves`` are tensors of the ``shapes`` (one C-level pass: ``Tensor.size`` of
    anything else raises)."""
    try:
        return list(map(Tensor.size, leaves)) == shapes
    except TypeError:
        return False


def _per_param(
    state: OptState,
    spec: Any,
    params: Any,
    shapes: list[torch.Size],
    seen: dict[int, tuple[Any, list[Any]]],
) -> tuple[list[Any], Any, list[str], list[list[Any]], dict[int, tuple[Any, list[Any]]]] | None:
    """``state`` split into its per-parameter subtrees (each of the params' structure, leaves of
    their shapes) and its other leaves: ``(entries, structure, kinds, per, found)`` with kinds
    ``"param"``, ``"none"`` or ``"group"`` (a tensor not per parameter: a counter), ``per`` the
    leaves of each per-parameter subtree, and ``found`` those subtrees by id (``seen`` on the
    next call: a subtree found then, with the same leaves, needs no look at their shapes).
    ``None`` where another leaf is not a tensor."""
    found: dict[int, tuple[Any, list[Any]]] = {}
    root = type(params)
    single = len(shapes) == 1

    def per_param(node: Any) -> bool:
        if isinstance(node, Tensor):
            if not single:
                return False
        elif type(node) is not root:  # (cheap: most nodes are not of the params' container)
            return False
        leaves, node_spec = optree.tree_flatten(node, none_is_leaf=True, namespace=tree.NAMESPACE)
        if node_spec != spec:
            return False
        known = seen.get(id(node))
        if not (
            known is not None and known[0] is node and all(map(operator.is_, leaves, known[1]))
        ) and not _shaped(leaves, shapes):
            return False
        found[id(node)] = node, leaves
        return True

    outer, outer_spec = optree.tree_flatten(
        state, is_leaf=per_param, none_is_leaf=True, namespace=tree.NAMESPACE
    )
    kinds = ["param" if id(x) in found else ("none" if x is None else "group") for x in outer]
    if any(k == "group" and not isinstance(x, Tensor) for x, k in zip(outer, kinds, strict=True)):
        return None
    per = [found[id(x)][1] for x, k in zip(outer, kinds, strict=True) if k == "param"]
    return outer, outer_spec, kinds, per, found
