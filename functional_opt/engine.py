"""The engine: any transform written with the library's tree helpers, compiled over packed buffers.

A transform whose math goes through ``tree.split(updates, elementwise=True)`` and
:mod:`functional_opt._lists` (every transform of the library except the per-leaf ones, and any
a user writes the same way) runs over a packed tree (:mod:`functional_opt.packed`) as a handful
of ops per buffer, whatever the number of leaves. :func:`fused` compiles that handful with
``torch.compile`` into single-pass kernels: a whole ``chain(clip_by_global_norm, adamw)`` update
is a norm and one elementwise kernel per buffer, with the moments updated in their own buffers
(donated state) and the update written into the gradients' buffers (donated updates).

The graph is traced once per layout of the packed trees and set of keywords; hyperparameters
injected as tensors (``inject_hyperparams``) and the step counters are inputs of the graph, so
changing them never recompiles. (:func:`fused_step` also steps plain trees: their large leaves
one at a time, for a transform that treats every leaf on its own, and the others staged through
packed buffers; see :mod:`functional_opt.plain_trees`.) Trees that are not packed, packed trees
with batch dimensions, complex buffers, buffers autograd records, calls made while already
compiling, inside a ``torch.func`` transform, and under a ``TorchDispatchMode`` of the user's
(where ``torch.compile`` runs no compiled code) run the transform's own update unchanged.
Within :func:`functional_opt._lists.sharded_reductions` (``TransformOptimizer``'s engine on
FSDP2 shards) the graphs are compiled apart, their reductions summed over the group's ranks.
If compiling fails (before any of the compiled code ran) the update runs eagerly, with a
warning, and that signature is not compiled again.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import Tensor

from functional_opt import _kernels, _lists, tree
from functional_opt.base import (
    DONATE,
    STATE_ONLY,
    GradientTransformation,
    OptState,
    Params,
    Updates,
    accepting,
    apply_updates,
    declare_step_size,
    donate_mode,
    extra_keywords,
    fusable,
    has_leaf_labels,
    inner_step_size,
    staged,
    stages,
)
from functional_opt.compiled_step import Opaque
from functional_opt.packed import Packed
from functional_opt.packed_label_parts import PackedLabelParts
from functional_opt.plain_label_parts import PlainLabelParts
from functional_opt.plain_trees import PlainTreeStep

__all__ = ["Runner", "fused", "fused_step"]


def _buffered(x: Any) -> bool:
    return isinstance(x, Packed) and x.buffers is not None and not x.structure.batch


def _packed_pair(params: Any, grads: Any) -> TypeGuard[Packed]:
    """Whether ``params`` and ``grads`` are packed trees (held in buffers or loose) of one
    structure that no autograd records."""
    return (
        isinstance(params, Packed)
        and isinstance(grads, Packed)
        and params.structure == grads.structure
        and not torch.compiler.is_compiling()
        and not (
            torch.is_grad_enabled()
            and any(b.requires_grad for x in (params, grads) for b in (x.buffers or ()))
        )
    )


def _buffers(tree: Any) -> list[Any]:
    return list(tree.buffers) if _buffered(tree) else []


def _donated_step(
    tx: GradientTransformation, extra: dict[str, Any]
) -> Callable[..., tuple[Updates, OptState]]:
    """The step that is compiled: ``tx.update``, and with donated updates the result written
    into the updates' own buffers (where dtypes agree), so no buffer is allocated per step.

    Given ``targets`` (tensors in the updates' leaf order, or the params' buffers when
    ``whole``), the step also adds the updates into them in the same graph, ``t <- t + u`` in
    ``t``'s dtype, so the update is added where it is computed (one pass), and returns
    ``None`` for the updates; with ``copy`` it writes the updates into them (``t <- u``, a
    persistent buffer instead of a fresh one).

    Given ``totals`` (a part of a tree, for a transform leafwise given its reductions) the
    update runs within :func:`functional_opt._lists.across_parts`, its reductions over all
    leaves given."""
    into_updates = extra.get(DONATE) is True

    def step(
        updates: Updates,
        state: OptState,
        params: Params | None,
        targets: list[Any] | None = None,
        whole: bool = False,
        copy: bool = False,
        totals: list[Tensor] | None = None,
    ) -> tuple[Updates, OptState]:
        old = None if totals is None else _lists.across_parts(_lists.Across(totals))
        try:
            new, new_state = tx.update(updates, state, params, **extra)
        finally:
            if totals is not None:
                _lists.across_parts(old)
        if isinstance(new, Packed) and new.buffers is None:
            new = new.repack()  # a leaf-by-leaf transform's result: loose leaves
        if targets is not None:
            if whole and not tree._same_layout(new.layout, updates.layout):
                targets, whole = updates.layout.views(targets), False  # leaf by leaf
            us = list(new.buffers) if whole else new.layout.views(new.buffers)
            for t, u in zip(targets, us, strict=True):
                t.copy_(u if copy else (t + u).to(t.dtype))
            return None, new_state
        if (
            into_updates
            and isinstance(new, Packed)
            and new.buffers is not None
            and tree._same_layout(new.layout, updates.layout)
            and all(n.dtype == g.dtype for n, g in zip(new.buffers, updates.buffers, strict=True))
        ):
            for g, n in zip(updates.buffers, new.buffers, strict=True):
                if n is not g:
                    g.copy_(n)
            new = Packed(updates.layout, buffers=list(updates.buffers))
        return new, new_state

    return step


def _partials_step(
    tx: GradientTransformation, extra: dict[str, Any]
) -> Callable[..., tuple[Tensor, ...]]:
    """The pass that is compiled for a part of a tree (a transform leafwise given its
    reductions): the partial values of the reductions of ``tx.update`` over the part, the first
    ``len(totals)`` given their totals (see :class:`functional_opt._lists.Across`). Pure: the
    update's results are dropped, so the compiled pass computes only what the partials need."""
    pure = {k: v for k, v in extra.items() if k != DONATE}

    def step(
        updates: Updates,
        state: OptState,
        params: Params | None,
        targets: list[Any] | None = None,
        whole: bool = False,
        copy: bool = False,
        totals: list[Tensor] | None = None,
    ) -> tuple[Tensor, ...]:
        del targets, whole, copy
        across = _lists.Across(totals or [])
        old = _lists.across_parts(across)
        try:
            tx.update(updates, state, params, **pure)
        finally:
            _lists.across_parts(old)
        return tuple(across.partials)

    return step


class Runner:
    """Compiled steps of one transform, by keyword signature (what :func:`fused` and
    :func:`fused_step` call; ``TransformOptimizer``'s engine calls it with the params to add
    the updates into). ``runner(updates, state, params, extra, targets=None, whole=False)``;
    with ``totals`` the update of a part of a tree given its reductions' totals, and
    :meth:`partials` the pass that gives a part's partial values of them (see
    :class:`functional_opt._lists.Across`)."""

    def __init__(self, tx: GradientTransformation) -> None:
        self.tx = tx
        # only transforms that declare their math elementwise are compiled: a leaf-by-leaf one
        # over thousands of views would compile for minutes and run no faster
        self.compilable = fusable(tx)
        self.steps: dict[tuple[Any, ...], Any] = {}
        self.failed: set[tuple[Any, ...]] = set()

    def __call__(
        self,
        updates: Updates,
        state: OptState,
        params: Params | None,
        extra: dict[str, Any],
        targets: list[Any] | None = None,
        whole: bool = False,
        copy: bool = False,
        totals: list[Tensor] | None = None,
    ) -> tuple[Updates, OptState]:
        out = self._run(False, updates, state, params, extra, targets, whole, copy, totals)
        return out  # type: ignore[no-any-return]

    def partials(
        self,
        updates: Updates,
        state: OptState,
        params: Params | None,
        extra: dict[str, Any],
        totals: list[Tensor],
    ) -> tuple[Tensor, ...]:
        """The partial values of ``tx.update``'s reductions over this part (``updates``) of a
        tree, the first ``len(totals)`` given their totals; writes nothing."""
        out = self._run(True, updates, state, params, extra, None, False, False, totals)
        return out  # type: ignore[no-any-return]

    def _run(
        self,
        partials: bool,
        updates: Updates,
        state: OptState,
        params: Params | None,
        extra: dict[str, Any],
        targets: list[Any] | None,
        whole: bool,
        copy: bool,
        totals: list[Tensor] | None,
    ) -> Any:
        args = (updates, state, params, targets, whole, copy, totals)
        flag = extra.get(DONATE, False)
        if (
            not _kernels.compiles_here()
            or not self.compilable
            or not _buffered(updates)
            # (inductor has no code generation for complex numbers: it would run them eagerly)
            or any(b.is_complex() for b in updates.buffers)
            or not (flag is True or flag is False or flag == STATE_ONLY)
            # an update autograd records: the transform's own ops, which it can differentiate
            or (torch.is_grad_enabled() and _lists.tracked(updates.buffers, _buffers(params)))
        ):
            return self._eager(partials, extra, *args)
        updates.layout.prepare()  # (plans made inside a graph would make it recompile)
        # values of the state read for free (a CPU counter): one graph per stage, traced and
        # run under it (MultiSteps: a mini-step that emits nothing compiles its accumulation)
        found = stages(self.tx, state)
        key: tuple[Any, ...] = (
            *sorted(extra.items()),
            ("apply", targets is None, whole, copy),
            ("stages", found),
            ("across", partials, None if totals is None else len(totals)),
            # (a call without params, such as a probe of whether the transform reads them,
            # must not reach a graph traced with them: its guard would trace again, uncaught)
            ("params", params is None),
        )
        group = _lists.sharded_group()
        if group is not None:  # the reductions sum over its ranks (_lists.sharded_reductions)
            key = (*key, ("sharded", id(group)))
        if key in self.failed:
            return self._eager(partials, extra, *args)
        step = self.steps.get(key)
        first = step is None
        if step is None:
            fn = (_partials_step if partials else _donated_step)(self.tx, extra)
            # A code object of its own: dynamo caches compiled graphs per code object, and the
            # steps of all transforms would otherwise share one cache (and its size limit).
            own = types.FunctionType(
                fn.__code__.replace(), fn.__globals__, fn.__name__, None, fn.__closure__
            )
            step = torch.compile(own, fullgraph=True, dynamic=False)
            self.steps[key] = step
        if not first:
            with staged(found):
                return step(*args)
        try:
            with staged(found):
                return step(*args)
        except torch._dynamo.exc.TorchDynamoException as err:
            # (raised while tracing or compiling, before the compiled code ran)
            del self.steps[key]  # (first: after a user error the next call compiles afresh)
            out = self._eager(partials, extra, *args)  # a user error surfaces here
            self.failed.add(key)
            warnings.warn(
                f"fused: torch.compile failed ({type(err).__name__}: {str(err)[:300]}); this "
                "transform's update runs eagerly",
                RuntimeWarning,
                stacklevel=4,
            )
            return out

    def _eager(
        self,
        partials: bool,
        extra: dict[str, Any],
        updates: Updates,
        state: OptState,
        params: Params | None,
        targets: list[Any] | None,
        whole: bool,
        copy: bool,
        totals: list[Tensor] | None,
    ) -> Any:
        if partials:
            return _partials_step(self.tx, extra)(updates, state, params, totals=totals)
        if targets is None and totals is None:
            return self.tx.update(updates, state, params, **extra)
        return _donated_step(self.tx, extra)(updates, state, params, targets, whole, copy, totals)


def _packed_parts(
    tx: GradientTransformation, plain: PlainTreeStep | PlainLabelParts | None
) -> PackedLabelParts | None:
    """Beside a transform's plain parts, the route for its packed trees held in buffers whose
    labels fill whole buffers (:mod:`functional_opt.packed_label_parts`)."""
    if not isinstance(plain, PlainLabelParts):
        return None
    return PackedLabelParts(tx, plain, lambda: Runner(tx))


def fused_step(
    tx: GradientTransformation,
) -> Callable[[Packed, Packed, OptState], tuple[Packed, OptState]]:
    """The whole donated step of ``tx`` over packed trees, compiled as one graph:
    ``step(params, grads, state) -> (params, state)`` computes ``tx.update(grads, state,
    params, donate=True)`` and adds the updates into the params' buffers in the same pass
    (``apply_updates(..., donate=True)``'s sums), so the update is never written out.

    ``params`` and ``grads`` are packed trees of one layout held in buffers; the params, the
    gradients and the state are donated (written in place). Over plain trees of a fusable
    transform (:mod:`functional_opt.plain_trees`) the params are stepped in place too: a
    transform that treats every leaf on its own (:func:`functional_opt.base.leafwise`) steps
    each leaf of at least :data:`functional_opt.plain_trees.LEAF_MIN` elements alone, in its
    own storage, with one compiled call of its update of that leaf
    (:mod:`functional_opt.leaf_step`), and the other leaves are staged: copied into packed
    buffers, stepped by the compiled graph, and the params copied back; the returned state
    holds the staged leaves' entries as views of buffers the next step reuses. A ``partition``
    (or ``masked`` of a stateful transform), not fusable over a whole tree, is stepped over a
    plain or packed tree as one such step per set of labels
    (:mod:`functional_opt.plain_label_parts`; a packed tree's leaves are views of its buffers,
    written through), or, over packed trees whose buffers each hold leaves of one set of
    labels, as one compiled step per set of labels over its buffers
    (:mod:`functional_opt.packed_label_parts`). Other trees run ``tx.update`` and
    ``apply_updates`` as they are.

    Called inside a function that ``torch.compile`` traces, the step over a plain tree (a
    ``list``, ``tuple`` or ``dict`` of tensors) is one op of the graph, which runs this same
    step when the compiled code runs (:mod:`functional_opt.compiled_step`): compiling a
    training step costs seconds instead of minutes, and its results are those of the step
    called outside ``torch.compile``, bit for bit."""
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"fused_step: tx must be a GradientTransformation, got {type(tx).__name__}")
    runner = Runner(tx)

    def plain_step() -> PlainTreeStep | PlainLabelParts | None:
        if fusable(tx):
            return PlainTreeStep(tx, runner)
        if has_leaf_labels(tx):  # (partition: a plain-tree step per label)
            return PlainLabelParts(tx, lambda: Runner(tx))
        return None

    plain = plain_step()
    by_buffers = _packed_parts(tx, plain)
    # Inside a user's torch.compile: the step over a plain tree as one op of the graph, with a
    # plain-tree step of its own (its staging buffers are reused every step, which would write
    # into the state an eager call of this step returned).
    mine = plain_step()
    opaque = None if mine is None else Opaque(tx, mine)

    def step(params: Packed, grads: Packed, state: OptState) -> tuple[Packed, OptState]:
        if opaque is not None and torch.compiler.is_compiling() and not _buffered(params):
            routed = opaque.call(params, grads, state)
            if routed is not None:
                return routed
        buffers = params.buffers if _buffered(params) else None
        if buffers is None and plain is not None:
            new_state = plain(params, grads, state)
            if new_state is not None:
                return params, new_state
        if isinstance(plain, PlainLabelParts) and _packed_pair(params, grads):
            done = None if by_buffers is None else by_buffers(params, grads, state, None)
            if done is None:
                done = plain.packed(params, grads, state, None)  # (its leaves, a plain tree)
            if done is not None:
                return params, done[1]
        if (
            buffers is None
            or not _buffered(grads)
            or not tree._same_layout(params.layout, grads.layout)
            or (torch.is_grad_enabled() and any(b.requires_grad for b in buffers))
        ):
            updates, state = tx.update(grads, state, params, donate=True)
            return apply_updates(params, updates, donate=True), state
        _, state = runner(grads, state, params, {DONATE: True}, list(buffers), True)
        return params, state

    return step


def fused(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` with its update over packed trees compiled into single-pass kernels.

    ``init`` is ``tx``'s. ``update(updates, state, params, **extra)`` equals ``tx.update`` on the
    same arguments (bit for bit where inductor's kernels round as the eager ops do, and within
    float rounding otherwise: compiled code may fuse ``a * b + c``). With ``donate=True`` the
    result is written into the updates' buffers (and the moments into the state's), so a
    training loop of ``fused(tx).update(g, s, p, donate=True)`` and
    ``apply_updates(p, u, donate=True)`` allocates nothing per step.

    Only a fusable ``tx`` (:func:`functional_opt.base.fusable`) takes the compiled path: over
    packed trees held in buffers (:func:`functional_opt.pack`) without batch dimensions, and,
    eagerly with params given, over plain trees (a ``list``, ``dict`` or other tree of separate
    tensors), which it steps as :func:`fused_step` does (large leaves of a leafwise ``tx`` one
    compiled call each, the others staged through packed buffers) with the update written into
    the gradients: donated, or copies of them (and of the state, without donation). A
    ``partition`` (or ``masked`` of a stateful transform), not fusable over a whole tree, takes
    it too, eagerly with params given, over plain and packed trees: one such update per set of
    labels (:mod:`functional_opt.plain_label_parts`; a packed tree's leaves are views of its
    buffers, or, where its buffers each hold leaves of one set of labels, the buffers
    themselves: :mod:`functional_opt.packed_label_parts`). Anything else runs ``tx.update`` as
    it is. The first call compiles (seconds), and later calls with the same layout and keywords
    reuse it."""
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"fused: tx must be a GradientTransformation, got {type(tx).__name__}")
    runner = Runner(tx)
    plain: PlainTreeStep | PlainLabelParts | None = None
    if fusable(tx):
        plain = PlainTreeStep(tx, runner, updates_only=True)
    elif has_leaf_labels(tx):  # (partition: an update per set of labels)
        plain = PlainLabelParts(tx, lambda: Runner(tx), updates_only=True)
    by_buffers = _packed_parts(tx, plain)

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        if plain is not None and not _buffered(updates) and set(extra) <= {DONATE}:
            done = plain.update(updates, state, params, donate_mode(extra))
            if done is not None:
                return done
        if (
            isinstance(plain, PlainLabelParts)
            and set(extra) <= {DONATE}
            and _packed_pair(params, updates)
        ):
            mode = donate_mode(extra)
            done = None if by_buffers is None else by_buffers(params, updates, state, mode)
            if done is None:
                done = plain.packed(params, updates, state, mode)
            if done is not None:
                return done
        return runner(updates, state, params, extra)

    declare_step_size(update_fn, inner_step_size(tx))
    return GradientTransformation(tx.init, accepting(update_fn, extra_keywords(tx)))
