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

A step that treats each element on its own (no per-leaf norm, no number of the leaf's size:
:func:`treats_elements_alone`) also steps a ``[rows, size]`` matrix of many small params' rows
as one param, with the same graph: the engines then compile one graph for the large params and
the small ones alike.

Users: ``TransformOptimizer``'s engine for its large params
(``functional_opt.adapters.packed_group``) and :func:`functional_opt.fused_step` on plain
trees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from functional_opt import _lists, tree
from functional_opt.base import (
    DONATE,
    STATE_ONLY,
    GradientTransformation,
    Stages,
    leafwise,
    staged,
)

__all__ = [
    "GIVEN",
    "LOW_PRECISION",
    "GivenPack",
    "Rebuild",
    "gradient_reductions",
    "gradient_reductions_pass",
    "large_parts",
    "leaf_partials",
    "leaf_step",
    "labelled_call",
    "ratio_argument",
    "needs_other_ranks",
    "reduction_sources",
    "rows_step",
    "treats_elements_alone",
]

GIVEN = ("group", "hyper")
"""The kinds of state leaves that are not per parameter: each step gets them, and every call
writes their same new values (see :func:`leaf_step`)."""

LOW_PRECISION = (torch.float16, torch.bfloat16)
"""The gradient dtypes that ``upcast`` turns into float32 (see :func:`leaf_step`)."""


def _fed_update(
    tx: GradientTransformation, g: Tensor, state: Any, p: Tensor, upcast: bool, **extra: Any
) -> tuple[Any, Any]:
    """``tx.update([g], state, [p])``, with a 16-bit ``g`` fed in float32 if ``upcast`` (its
    norms taken from ``g`` itself: :func:`functional_opt._lists.widened`)."""
    if not (upcast and g.dtype in LOW_PRECISION):
        return tx.update([g], state, [p], **extra)
    wide = g.float()
    old = _lists.widened(((wide, g),))
    try:
        return tx.update([wide], state, [p], **extra)
    finally:
        _lists.widened(old)


def ratio_argument(ratio: float | Tensor, param: Tensor) -> Tensor:
    """``ratio`` as :func:`leaf_step`'s ``ratio`` argument for ``param``: a tensor on its device
    in the dtype the step multiplies the update by it in (float32, or float64 for a float64
    param: :func:`functional_opt._lists.once` converts it to the update's dtype anyway).

    Not a 0-d float64 tensor: dynamo traces one of those as a symbolic float (its ``item()``),
    which the compile cannot keep, and then traces and compiles the whole step a second time
    (1.3-2 s of a first step). A float64 param's ratio is a one-element vector instead, which
    multiplies as the 0-d tensor does (the update is float64 too)."""
    shape: tuple[int, ...]
    if param.dtype == torch.float64:
        dtype, shape = torch.float64, (1,)
    else:
        dtype, shape = torch.float32, ()
    if isinstance(ratio, Tensor):
        return ratio.detach().to(device=param.device, dtype=dtype).reshape(shape)
    return torch.full(shape, ratio, dtype=dtype, device=param.device)


def leaf_step(
    tx: GradientTransformation,
    outline: Any,
    kinds: list[str],
    totals: int = 0,
    apply: bool = True,
    pack: GivenPack | None = None,
    upcast: bool = False,
    into: str | None = None,
    squares: bool = False,
) -> Callable[..., Tensor | None] | None:
    """The step of one param alone, to compile: ``step(g, p, ratio, *state, *given, *outs,
    *totals)`` runs ``tx.update`` on the one-param tree ``[g]`` with the state rebuilt from the
    param's own per-parameter entries ``state`` and the other state leaves ``given``, writes the
    new per-parameter entries into ``state``, ``p + ratio u`` into ``p`` (in ``p``'s dtype) and
    the new values of ``given`` into ``outs``. Only the state is donated (the gradient is the
    caller's); ``given`` is copied first, so every call reads the same values.

    ``totals`` (for a transform leafwise given its reductions,
    :func:`functional_opt.base.leafwise` with ``reductions=True``): how many totals of its
    reductions over all leaves the step takes, in order (:func:`leaf_partials` makes them); the
    update then runs within :func:`functional_opt._lists.across_parts`.

    ``apply=False``: the param is not written (for a stage whose update is negative zeros
    throughout, :func:`functional_opt.base.zero_updates`: ``p + u`` would be ``p``). A
    transform that declares stages (:func:`functional_opt.base.declare_stages`) is traced
    under the caller's :func:`functional_opt.base.staged`, one compiled step per stage.

    ``pack``: ``given`` and ``outs`` come as ``pack``'s buffers (:meth:`GivenPack.pack`), a
    few inputs instead of one per leaf (each input of a compiled graph is checked on every
    call).

    ``upcast``: a 16-bit gradient is fed to the transform in float32 (``TransformOptimizer``'s
    ``upcast_16bit_grads``); inside the compiled step that is a conversion in the pass that
    reads it, not a copy.

    ``into``: the update ``u`` itself is written, for the pure API's ``update``
    (:meth:`functional_opt.plain_trees.PlainTreeStep.update`), into ``g`` (``"grad"``: donated
    updates) or into the third argument, a tensor of ``g``'s shape and dtype, in place of
    ``ratio`` (``"out"``); ``p`` is only read. ``u`` must have ``g``'s dtype (the caller
    checks).

    ``squares`` (with ``apply``): the step returns the sum of squares of the param's new
    value (in at least float32), taken in the pass that writes it: the partial value of the
    param's squared norm that the next step's reductions need (see
    :func:`gradient_reductions_pass`), without reading the param again.

    ``outline`` is the state's structure with each per-parameter subtree and each other leaf
    replaced by its kind (``kinds``, in ``optree``'s order: ``"param"``, ``"group"``,
    ``"hyper"`` or ``"none"``). ``None`` when the state holds a node :class:`Rebuild` cannot
    rebuild."""
    shape = _rebuild(outline)
    if shape is None:
        return None
    n_param = kinds.count("param")
    n_given = sum(k in GIVEN for k in kinds) if pack is None else len(pack.keys)
    across = totals > 0 or not leafwise(tx)

    def step(g: Tensor, p: Tensor, ratio: Tensor, *args: Tensor) -> Tensor | None:
        state_in = iter(args[:n_param])
        given_in = [x.clone() for x in args[n_param : n_param + n_given]]
        outs_in = list(args[n_param + n_given : n_param + 2 * n_given])
        given = iter(given_in if pack is None else pack.unpack(given_in))
        outs = iter(outs_in if pack is None else pack.unpack(outs_in))
        leaves = [
            next(state_in) if k == "param" else (None if k == "none" else next(given))
            for k in kinds
        ]
        state = shape.build(iter(leaves))
        old = _lists.across_parts(_lists.Across(args[n_param + 2 * n_given :])) if across else None
        try:
            updates, new = _fed_update(tx, g, state, p, upcast, **{DONATE: STATE_ONLY})
        finally:
            if across:
                _lists.across_parts(old)
        total: Tensor | None = None
        if into == "grad":
            g.copy_(tree.leaves(updates)[0])
        elif into == "out":
            ratio.copy_(tree.leaves(updates)[0])
        elif apply:
            u = tree.leaves(updates)[0]
            new_p = (p + _lists.once(ratio, [u]) * u).to(p.dtype)
            p.copy_(new_p)
            if squares:
                wide = new_p.to(torch.promote_types(p.dtype, torch.float32))
                total = (wide * wide).sum()
        state_in = iter(args[:n_param])
        new_leaves: list[Any] = []
        shape.leaves(new, new_leaves)
        for k, value in zip(kinds, new_leaves, strict=True):
            if k == "param":
                old_value = next(state_in)
                if value is not old_value:
                    old_value.copy_(value)
            elif k != "none":
                next(outs).copy_(value)
        return total

    return step


def rows_step(
    tx: GradientTransformation,
    outline: Any,
    kinds: list[str],
    reads_params: bool,
    pack: GivenPack,
) -> Callable[..., None] | None:
    """The step of a run of params of one size, to compile: ``step(g, *p, u, *state, *given,
    *outs)`` where ``g``, ``p`` (only if ``reads_params``), the update ``u`` and each
    per-parameter state entry are ``[rows, size]`` matrices, one param per row (a stretch of
    the engine's packed buffers). Each row gets ``tx.update`` of the one-param tree ``[g_row]``
    (``torch.vmap`` over the rows of the update of one param, as :func:`leaf_step` runs it, so
    a per-leaf norm is a per-row one); the new per-parameter entries are written into
    ``state``, the update into ``u``, and the new values of the state that is not per
    parameter (the same for every row) into ``outs``; ``given`` and ``outs`` come as ``pack``'s
    buffers. Nothing else is written. For a transform that treats every leaf on its own
    without reductions (:func:`functional_opt.base.leafwise`); compiled with dynamic sizes,
    one graph serves every piece. ``None`` when the state holds a node :class:`Rebuild`
    cannot rebuild."""
    shape = _rebuild(outline)
    if shape is None:
        return None
    n_param = kinds.count("param")
    n_given = len(pack.keys)
    present = [k for k in kinds if k != "none"]
    in_dims = (0, 0 if reads_params else None, *[0 if k == "param" else None for k in present])
    out_dims: Any = (0, *[0] * n_param, *[None] * sum(k in GIVEN for k in kinds))

    def one(g: Tensor, p: Tensor | None, *leaves: Tensor) -> tuple[Tensor, ...]:
        given = iter(leaves)
        state = shape.build(iter([next(given) if k != "none" else None for k in kinds]))
        updates, new = tx.update([g], state, None if p is None else [p])
        new_leaves: list[Any] = []
        shape.leaves(new, new_leaves)
        per = [v for v, k in zip(new_leaves, kinds, strict=True) if k == "param"]
        rest = [v for v, k in zip(new_leaves, kinds, strict=True) if k in GIVEN]
        return (tree.leaves(updates)[0], *per, *rest)

    def step(g: Tensor, *args: Tensor) -> None:
        p = args[0] if reads_params else None
        args = args[1:] if reads_params else args
        u_out = args[0]
        state_in = list(args[1 : 1 + n_param])
        given_in = [x.clone() for x in args[1 + n_param : 1 + n_param + n_given]]
        outs = pack.unpack(list(args[1 + n_param + n_given :]))
        given = iter(pack.unpack(given_in))
        per = iter(state_in)
        leaves = [next(per) if k == "param" else next(given) for k in present]
        results = torch.vmap(one, in_dims=in_dims, out_dims=out_dims)(g, p, *leaves)
        u_out.copy_(results[0])
        for old, value in zip(state_in, results[1 : 1 + n_param], strict=True):
            old.copy_(value)
        for out, value in zip(outs, results[1 + n_param :], strict=True):
            out.copy_(value)

    return step


class GivenPack:
    """The state leaves that are not per parameter (:data:`GIVEN`), packed for
    :func:`leaf_step`: one flat buffer per dtype and device, each leaf a view of its buffer in
    the step's graph."""

    def __init__(self, given: Sequence[Tensor]) -> None:
        where: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, x in enumerate(given):
            where.setdefault((x.dtype, x.device), []).append(i)
        self.keys = list(where)
        self.members = list(where.values())
        """Per buffer, which leaves it holds, in order."""
        self.slots: list[tuple[int, int, int, torch.Size]] = [(0, 0, 0, torch.Size())] * len(given)
        """Per leaf: its buffer, offset, number of elements and shape."""
        for b, members in enumerate(self.members):
            offset = 0
            for i in members:
                n = given[i].numel()
                self.slots[i] = (b, offset, n, given[i].shape)
                offset += n
        self.sizes = [sum(given[i].numel() for i in m) for m in self.members]

    def fits(self, given: Sequence[Tensor]) -> bool:
        """Whether ``given`` has the leaves this pack was made for (dtypes, devices, shapes)."""
        return len(given) == len(self.slots) and all(
            (x.dtype, x.device) == self.keys[b] and x.shape == shape
            for x, (b, _, _, shape) in zip(given, self.slots, strict=True)
        )

    def pack(self, given: Sequence[Tensor]) -> list[Tensor]:
        """``given`` copied into fresh buffers."""
        return [torch.cat([given[i].reshape(-1) for i in m]) for m in self.members]

    def empty(self) -> list[Tensor]:
        """Buffers to write into."""
        return [
            torch.empty(n, dtype=dtype, device=device)
            for n, (dtype, device) in zip(self.sizes, self.keys, strict=True)
        ]

    def unpack(self, buffers: Sequence[Tensor]) -> list[Tensor]:
        """Each leaf's view of ``buffers``."""
        return [buffers[b][o : o + n].view(shape) for b, o, n, shape in self.slots]


def leaf_partials(
    tx: GradientTransformation, outline: Any, kinds: list[str], known: int, upcast: bool = False
) -> Callable[..., tuple[Tensor, ...]] | None:
    """For a transform leafwise given its reductions: ``partials(g, p, *state, *given,
    *totals)``, one param's partial values of the reductions of ``tx.update`` on the one-param
    tree ``[g]``, the first ``known`` of them given their totals over all leaves (``totals``);
    it returns the partials of the others (the first is exact; the later ones stand on it, see
    :class:`functional_opt._lists.Across`). Writes nothing. The arguments are
    :func:`leaf_step`'s (without ``ratio`` and ``outs``); compiled, what the returned partials
    do not need is left out (for ``clip_by_global_norm`` first in a chain: a pass over ``g``).
    ``upcast``: as for :func:`leaf_step`."""
    run = _partials_run(tx, outline, kinds, known, upcast)
    if run is None:
        return None

    def partials(g: Tensor, p: Tensor, *args: Tensor) -> tuple[Tensor, ...]:
        return tuple(run(g, p, args).partials)

    return partials


def gradient_reductions(
    tx: GradientTransformation,
    outline: Any,
    kinds: list[str],
    known: int,
    args: tuple[Any, ...],
    upcast: bool = False,
) -> tuple[int, tuple[str, ...]]:
    """What a pass of :func:`leaf_partials` computes, found by running the update once,
    eagerly, on the pass's arguments ``args`` of one param (writing nothing): how many partials
    it returns, and the kinds of its leading partials that are reductions of the param's
    gradient as given (a float32 or float64 one): ``"squares"`` (a global norm's sum of
    squares) or ``"non-finite"`` (a finite check's count). Those depend on no total still to
    come, so they are exact, and a pass over many params computes them with
    :func:`gradient_reductions_pass`, multi-tensor ops with the compiled pass's results,
    without a compiled call per param. A sharded pass's per-leaf norms of the gradient and
    the param as given (float32 or float64 ones; :func:`functional_opt._lists.norms` of local
    shards) are recognized too: ``"norms:gp"`` (the letters say which tensors' squared local
    norms the partial stacks, in order). ``()`` where the first partial is of something else
    (or of a gradient that ``upcast`` converts first)."""
    run = _partials_run(tx, outline, kinds, known, upcast)
    g = args[0]
    if run is None:
        return 0, ()
    p = args[1]
    across = run(g, p, args[2:])
    leading: list[str] = []
    exact = (torch.float32, torch.float64)
    if g.dtype in exact:
        for (kind, xs), of in zip(across.sources, across.norms_of, strict=True):
            if of is not None and of and p.dtype in exact:
                names = ["g" if x is g else "p" if x is p else "" for x in of]
                if "" in names:
                    break
                leading.append("norms:" + "".join(names))
                continue
            if len(xs) != 1 or xs[0] is not g:
                break
            leading.append(kind)
    return len(across.partials), tuple(leading)


def needs_other_ranks(
    tx: GradientTransformation,
    outline: Any,
    kinds: list[str],
    args: tuple[Any, ...],
    upcast: bool = False,
) -> bool:
    """Whether one param's update, run on a *local shard* (FSDP2, HSDP), needs values of the
    other ranks beyond the totals of its reductions over all leaves (see
    :class:`functional_opt._lists.Across`): a per-leaf norm, as adaptive clipping takes, is of
    the whole tensor, so it would. Found by running the update once, eagerly, on the arguments
    ``args`` of :func:`leaf_partials` (``g, p, *state, *given``; writing nothing) with the
    library's collectives counted instead of issued
    (:func:`functional_opt._lists.counted_collectives`). What it finds depends on the
    transform's code, not on the values, so every rank finds the same."""
    run = _partials_run(tx, outline, kinds, 0, upcast)
    if run is None:
        return True
    with _lists.counted_collectives() as count:
        run(args[0], args[1], args[2:])
    return count.calls > 0


def reduction_sources(
    tx: GradientTransformation,
    outline: Any,
    kinds: list[str],
    known: int,
    args: tuple[Any, ...],
    upcast: bool = False,
) -> tuple[list[str], list[Tensor]]:
    """What a pass of :func:`leaf_partials` on the arguments ``args`` of one param computes,
    found by running the update once, eagerly (writing nothing): the kind of each partial
    (``"squares"``, ``"non-finite"``, or ``"ranks"``: a sum over the ranks of per-leaf values,
    see :func:`functional_opt._lists.sum_over_shards`) and the partials themselves."""
    run = _partials_run(tx, outline, kinds, known, upcast)
    if run is None:
        return [], []
    across = run(args[0], args[1], args[2:])
    return [kind for kind, _ in across.sources], list(across.partials)


def gradient_reductions_pass(
    grads: list[Tensor],
    count: int,
    leading: tuple[str, ...],
    param_squares: Callable[[], list[Tensor]] | None = None,
    host_reads: bool = False,
) -> list[tuple[Tensor, ...]] | None:
    """The partials of a pass that :func:`gradient_reductions` recognized (``count`` per param,
    the ``leading`` ones reductions of the gradients), for the params with gradients
    ``grads``: the sums of squares from torch's multi-tensor norm (the compiled pass takes the
    same norm, the same bits), the non-finite counts from each gradient's smallest and largest
    elements; the partials after them, stand-ins (see :class:`functional_opt._lists.Across`),
    repeat the first. ``"norms:..."`` partials (of a sharded pass) stack each param's squared
    local norms of its gradient (``g``) and its param (``p``: from ``param_squares()``, each
    param's sum of squares, in at least float32). ``None`` unless every gradient is float32 or
    float64 (the compiled pass takes a 16-bit one's norm another way), or where a partial needs
    the params and ``param_squares`` is not given. ``host_reads`` (``TransformOptimizer``'s
    step, not the pure API's, which never reads a tensor's value on the host): a finite check
    beside a clip's sum of squares may read their total (see :func:`_non_finite_counts`)."""
    if not all(g.dtype in (torch.float32, torch.float64) for g in grads):
        return None
    if param_squares is None and any(kind.startswith("norms:") for kind in leading):
        return None
    found: dict[str, list[Tensor]] = {}

    def squares_of(name: str) -> list[Tensor]:
        if name not in found:
            if name == "g":
                # last to first: the first params' gradients are then the ones still in cache
                # when their updates start (the direct steps run in the params' order; measured
                # on a sharded DreamerV3 step, 1.27-1.29x -> 1.24-1.25x)
                found[name] = [n.square() for n in _lists.local_norms(grads[::-1])][::-1]
            else:
                assert param_squares is not None
                found[name] = param_squares()
        return found[name]

    shortcut = host_reads and "squares" in leading and "non-finite" in leading
    if shortcut:
        squares_of("g")  # (first: the finite check may take its counts from them)
    columns: list[list[Tensor]] = []
    for kind in leading:
        if kind == "squares":
            columns.append(squares_of("g"))
        elif kind.startswith("norms:"):
            per_name = [squares_of(name) for name in kind[len("norms:") :]]
            flat = [x for row in zip(*per_name, strict=True) for x in row]
            if len({x.dtype for x in flat}) == 1:
                # one stack for all params (what _lists.stack gives each: the same dtype)
                matrix = torch.stack(flat).view(len(grads), len(per_name))
                columns.append(list(matrix.unbind()))
            else:
                columns.append([_lists.stack(list(row)) for row in zip(*per_name, strict=True)])
        else:
            columns.append(_non_finite_counts(grads, found.get("g") if shortcut else None))
    rows = [list(values) for values in zip(*columns, strict=True)]
    return [tuple(row + [row[0]] * (count - len(row))) for row in rows]


def _non_finite_counts(grads: list[Tensor], squares: list[Tensor] | None) -> list[Tensor]:
    """Each gradient's count of non-finite tensors (``1.0`` or ``0.0``, float32), as a finite
    check takes it. With the gradients' sums of squares ``squares`` already taken (a clip's,
    in the same pass) on the CPU, where reading one value costs no device sync: when their
    total is finite, no element of any gradient is NaN or infinite (a NaN or an infinity makes
    its square and every sum with it non-finite), so every count is zero without another read
    of the gradients; otherwise (a non-finite element, or finite ones whose squares overflow)
    the counts come from each gradient's smallest and largest elements."""
    if (
        squares
        and all(g.device.type == "cpu" for g in grads)
        and bool(torch.isfinite(_lists.stack(squares).sum()))
    ):
        return list(torch.zeros(len(grads), dtype=torch.float32).unbind())
    counts = _lists._finite_flags(grads).logical_not().to(torch.float32)
    return list(counts.unbind())


def labelled_call(
    kernel_for: Callable[[Stages], Any],
    kept: dict[Any, Callable[..., Any]],
    key: tuple[Any, ...],
    found: Stages,
    label: Stages,
    args: tuple[Any, ...],
) -> Any:
    """One param's compiled call, as both engines make it (``Kernel.kept_call`` under ``kept``,
    keyed by ``key`` and the stages): ``kernel_for(found)``'s, or for a param with leaf labels
    (:func:`functional_opt.base.leaf_labels`) the kernel for ``found + label``, called under
    those stages (the transform reads its label while traced)."""
    if not label:
        return kernel_for(found).kept_call(kept, (*key, found), args)
    mine = found + label
    with staged(mine):
        return kernel_for(mine).kept_call(kept, (*key, mine), args)


def large_parts(
    probes: dict[Any, tuple[int, tuple[str, ...]]],
    key: Any,
    probe: Callable[[], tuple[int, tuple[str, ...]]],
    grads: list[Tensor],
    compiled: Callable[[], list[Any]],
    param_squares: Callable[[], list[Tensor]] | None = None,
    host_reads: bool = False,
) -> tuple[list[Any], int, tuple[str, ...]]:
    """One totals pass over the large params (both engines'): their partials, how many of
    each param's leading partials are exact, and the kinds of those where they are reductions
    of the gradients taken by :func:`gradient_reductions_pass` (``()`` otherwise: the small
    params' part of such a pass can take the same ops). What the pass computes is found once
    (``probe()``, :func:`gradient_reductions`) and kept in ``probes`` under ``key``;
    reductions of the gradients run as :func:`gradient_reductions_pass`, anything else as
    ``compiled()`` (a compiled call per param, its first partial exact)."""
    if key not in probes:
        probes[key] = probe()
    count, leading = probes[key]
    parts = (
        gradient_reductions_pass(grads, count, leading, param_squares, host_reads)
        if leading
        else None
    )
    if parts is None:
        return compiled(), 1, ()
    return parts, len(leading), leading


def _partials_run(
    tx: GradientTransformation, outline: Any, kinds: list[str], known: int, upcast: bool = False
) -> Callable[[Tensor, Tensor, tuple[Tensor, ...]], _lists.Across] | None:
    """``run(g, p, args)``: ``tx.update`` of the one-param tree ``[g]`` (state from ``args``, as
    :func:`leaf_partials` takes them) within an :class:`functional_opt._lists.Across` with the
    first ``known`` totals given; returns it, holding the partials of the others."""
    shape = _rebuild(outline)
    if shape is None:
        return None
    n_param = kinds.count("param")
    n_given = sum(k in GIVEN for k in kinds)

    def run(g: Tensor, p: Tensor, args: tuple[Tensor, ...]) -> _lists.Across:
        state_in = iter(args[:n_param])
        given = iter(args[n_param : n_param + n_given])
        leaves = [
            next(state_in) if k == "param" else (None if k == "none" else next(given))
            for k in kinds
        ]
        across = _lists.Across(args[n_param + n_given : n_param + n_given + known])
        old = _lists.across_parts(across)
        try:
            _fed_update(tx, g, shape.build(iter(leaves)), p, upcast)
        finally:
            _lists.across_parts(old)
        return across

    return run


_ATEN = torch.ops.aten
_ELEMENTWISE_AS_WELL = {
    _ATEN.copy_.default,
    _ATEN._to_copy.default,
    _ATEN.detach.default,
    _ATEN.alias.default,
    _ATEN.view.default,
    _ATEN._unsafe_view.default,
    _ATEN.reshape.default,
    _ATEN.expand.default,
    _ATEN.empty_like.default,
    _ATEN.zeros_like.default,
    _ATEN.ones_like.default,
    _ATEN.full_like.default,
    _ATEN.fill_.Scalar,
    _ATEN.fill_.Tensor,
    _ATEN.zero_.default,
    _ATEN.lift_fresh.default,
    _ATEN.empty.memory_format,
    _ATEN.zeros.default,
    _ATEN.ones.default,
    _ATEN.full.default,
}
"""Ops without torch's ``pointwise`` tag that treat every element on its own all the same
(copies, conversions, views of the same elements, fills)."""

_FOREACH_OVERLOADS = {"List": "Tensor", "ScalarList": "Scalar", "Tensor": "Tensor"}


def _elementwise_op(func: Any) -> bool:
    """Whether aten op ``func`` computes each element of its outputs from the same element of
    its inputs (and 0-d or one-element operands) alone: torch's ``pointwise`` tag, the ops of
    :data:`_ELEMENTWISE_AS_WELL`, and a multi-tensor ``_foreach_<op>`` whose ``<op>`` is one."""
    if func in _ELEMENTWISE_AS_WELL or torch.Tag.pointwise in getattr(func, "tags", ()):
        return True
    name = getattr(func, "__name__", "")
    packet_name, _, overload = name.partition(".")
    if getattr(func, "namespace", None) != "aten" or not packet_name.startswith("_foreach_"):
        return False
    packet = getattr(_ATEN, packet_name[len("_foreach_") :], None)
    if packet is None:
        return False
    for candidate in (_FOREACH_OVERLOADS.get(overload, overload), overload, "default"):
        if candidate in packet.overloads():
            base = getattr(packet, candidate)
            return base in _ELEMENTWISE_AS_WELL or torch.Tag.pointwise in base.tags
    return False


class _ElementOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the ops of a call on tensors of ``n`` elements (a leaf's, of sizes no other
    tensor of the call has): whether every op that reads or writes one is elementwise
    (:func:`_elementwise_op`), and each op with its arguments that are not such tensors (a
    number computed from the leaf's size shows there)."""

    def __init__(self, n: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.n = n
        self.elementwise = True
        self.ops: list[tuple[Any, ...]] = []

    def _mark(self, x: Any) -> Any:
        if isinstance(x, Tensor):
            return ("leaf" if x.numel() == self.n else tuple(x.shape), x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(map(self._mark, x))
        return "n" if isinstance(x, int) and x == self.n else x

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        everything: list[Any] = optree.tree_leaves((args, kwargs, out))  # type: ignore[arg-type]
        tensors = [x for x in everything if isinstance(x, Tensor)]
        if any(x.numel() == self.n for x in tensors) and not _elementwise_op(func):
            self.elementwise = False
        self.ops.append((func, self._mark(args), self._mark(sorted(kwargs.items()))))
        return out


_STAND_IN_SIZES = (1009, 2003)
"""The sizes of :func:`treats_elements_alone`'s stand-in params: primes, which no other tensor of
a step (counters, packed hyperparameters) has."""


def treats_elements_alone(
    step: Callable[..., Any], args_for: Callable[[int], tuple[Any, ...]]
) -> bool:
    """Whether ``step`` (a :func:`leaf_step` function) computes each element of the param, its
    update and its state from the same element of its gradient, param and state alone (and the
    values that are not per parameter): then a stretch of many params' rows stepped as one
    leaf gives each param the update it would get alone (``TransformOptimizer``'s pieces take
    the direct params' compiled step).

    Found by running it: ``args_for(n)`` gives ``step``'s arguments for a stand-in param of
    ``n`` elements (fresh tensors, which it may write), and ``step`` runs eagerly for two
    sizes, each op recorded (:class:`_ElementOps`). It must read and write the param's tensors
    with elementwise ops only (no reduction of a leaf, such as its norm: the update would see a
    piece of rows as one leaf) and make the same ops with the same numbers for both sizes (no
    number computed from a leaf's size). A step that raises does not qualify."""
    runs = []
    for n in _STAND_IN_SIZES:
        record = _ElementOps(n)
        try:
            with record:
                step(*args_for(n))
        except Exception:  # (whatever it was: not shown elementwise)
            return False
        if not record.elementwise:
            return False
        runs.append(record.ops)
    return runs[0] == runs[1]


def _rebuild(outline: Any) -> Rebuild | None:
    template = optree.tree_map(
        lambda k: [0] if k == "param" else (None if k == "none" else 0),
        outline,
        namespace=tree.NAMESPACE,
    )
    try:
        return Rebuild(template)
    except TypeError:
        return None


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
