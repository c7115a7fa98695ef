"""A param group's step on the engine: packed gradient and state buffers, one compiled update.

``TransformOptimizer`` steps a group here when its transform is fusable
(:func:`functional_opt.base.fusable`) and the group is plain: dense tensors on one device, every
gradient present with its param's dtype, per-parameter state shaped like the params. Then

* the per-parameter state lives in one flat buffer per (state entry, dtype), laid out as
  ``functional_opt.pack`` lays out the params, and ``optimizer.state[p][name]`` is a view of it
  (what ``state_dict()`` saves is unchanged; a state loaded or replaced by hand is copied back
  into the buffers on the next step);
* the gradients are copied into a flat buffer of the same layout, which then takes the update.
  Gradients that persist between steps (the same tensors as on the last step:
  ``zero_grad(set_to_none=False)``) are rebound to their views of that buffer once copied
  (bucket views, as DDP's ``gradient_as_bucket_view``), so backward accumulates into it and
  later steps read them in place; the update then gets a buffer of its own (the optimizer never
  writes the gradients). A step whose gradients are those views, whose params' memory did not
  move and whose state dicts are the last step's is a *usual* one: it skips the per-param checks
  (:meth:`PackedGroup.usual_grads`);
* the transform's update runs on these packed trees through :func:`functional_opt.engine.fused`
  (compiled into single-pass kernels; the moments updated in their buffers, the update written
  into the gradient buffer); the params come in as a loose packed tree, copied into a buffer
  only if the transform reads them;
* ``p += u`` is one multi-tensor add into the params' own storage, which the optimizer never
  replaces (their storage identity, ties and aliases stay as they are).

With a transform that treats every leaf on its own (:func:`functional_opt.base.leafwise`), the
group's large params (``direct_min``: ``TransformOptimizer.direct_min_numel``) that are
contiguous and share no memory take the *direct* route instead: each is stepped alone by one
call of :func:`leaf_step`, the transform's update of that one param compiled once for every size
(:class:`functional_opt._kernels.Kernel`, called straight after the first call). It reads the
gradient where it is, keeps the param's state in tensors of its own and writes ``p + ratio u``
into the param's storage in the pass that computes ``u``: nothing is copied, so the step moves
what torch's fused Adam moves, plus one call's dispatch (about 10-30 us) per param. The other
params take the packed route above, and with such a transform that takes no reductions over
all leaves, more than :data:`APPLY_INSIDE_MAX` of them and no leaf labels, no shared memory or
shards, they take it *piece by piece* (:attr:`PackedGroup.pieces`): rows of the buffers of
about :data:`PIECE` elements, each piece's gradients (and the params' values, where the
transform reads them) copied in, one call of :func:`functional_opt.leaf_step.rows_step` (the
one-param update vmapped over the piece's rows, one graph for every piece) and its update
added into its params while the piece is in cache.

Beside direct params, the pieces take the direct params' own compiled step where it serves
them (:meth:`PackedGroup._step_leaf_pieces`): the transform's one-param step treats each
element on its own (:func:`functional_opt.leaf_step.treats_elements_alone`) and each piece's
``[rows, size]`` matrices have a direct matrix's signature. Each piece is then stepped as one
param of that shape (its params' values copied into a buffer, ``p + ratio u`` written there and
copied back), so the group compiles one graph, not two. That route also takes a transform with
reductions over all params (a leading clip, a finite check: their totals come first, the
pieces' part from their gradients) and a group of few packed params; where it cannot (a
reduction of something other than the gradients, a step with per-leaf norms), the group keeps
the routes above.

A group of ``DTensor`` params (FSDP2: ``Shard(0)``; HSDP: ``(Replicate(), Shard(0))``; see
:func:`functional_opt._lists.local_shards`) with ``DTensor`` gradients of the same placements
steps the same way over the params' *local shards*: the buffers hold this rank's elements, the
update is added into each ``DTensor``'s local tensor (FSDP2's own storage, never moved), and
``optimizer.state[p][name]`` is a ``DTensor`` of the param's placements wrapping the buffer's
view (what ``torch.distributed.checkpoint`` saves and reshards). The compiled update runs within
:func:`functional_opt._lists.sharded_reductions`, so its reductions (a global norm, per-leaf
norms, a finite check) are of the whole tensors: local partial sums added up over the shard
dimension's process group by one all-reduce per reduction, inside the graph.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import optree
import torch
from torch import Tensor

from functional_opt import _kernels, _lists, tree
from functional_opt.base import (
    DONATE,
    STATE_ONLY,
    GradientTransformation,
    Stages,
    fusable,
    has_leaf_labels,
    leaf_labels,
    leafwise,
    leafwise_level,
    part_labels,
    pinned,
    staged,
    stages,
    zero_updates,
)
from functional_opt.engine import Runner
from functional_opt.leaf_step import (
    GIVEN,
    LOW_PRECISION,
    GivenPack,
    gradient_reductions,
    gradient_reductions_pass,
    labelled_call,
    large_parts,
    leaf_partials,
    leaf_step,
    needs_other_ranks,
    ratio_argument,
    reduction_sources,
    rows_step,
    treats_elements_alone,
)
from functional_opt.packed import Gather, Layout, Packed, pack

_GRAD = operator.attrgetter("grad")

APPLY_INSIDE_MAX = 4
"""At most this many packed params of a group (the direct ones aside) get the update added
inside the compiled graph."""

PIECE = 1 << 18
"""The packed params of a leafwise transform step in pieces of about this many elements (see
:class:`Piece`): a piece's gradients, params, state and update stay in cache from its copy in
to its add back."""

PIECES_MAX = 16
"""More pieces than this (many runs of small leaves of different sizes) take the piecewise
route only where they average at least a quarter of :data:`PIECE` elements (each is a call)."""


class Piece(NamedTuple):
    """Rows ``rows`` of a run of the packed buffers: params of ``size`` elements each, laid out
    from element ``start`` of buffer ``buffer``; ``members``: their positions among the packed
    params; ``shape``: their common shape (their gradients and values are then copied in with
    one ``torch.cat``), ``None`` if they have several."""

    buffer: int
    start: int
    rows: int
    size: int
    members: list[int]
    shape: torch.Size | None

    def of(self, buffer: Tensor) -> Tensor:
        """This piece of ``buffer`` (a buffer of the layout), as a ``[rows, size]`` matrix."""
        return buffer[self.start : self.start + self.rows * self.size].view(self.rows, self.size)

    def copy_in(self, matrix: Tensor, values: list[Tensor], views: list[Tensor]) -> None:
        """``values`` (the members') into ``matrix`` (:meth:`of`), whose members' views
        are ``views``."""
        if self.shape is not None:
            torch.cat(values, out=matrix.view(self.rows * self.shape[0], *self.shape[1:]))
        else:
            torch._foreach_copy_(views, values)


class PackedGroup:
    """The buffers of one param group (made on its first packed step, rebuilt when the group's
    params or transform change).

    ``params`` are plain tensors. For a group of ``DTensor`` params ``keys`` (see
    :func:`shards_of`) they are the params' local shards, and ``group`` is the process group
    over which the shards' partial sums add up (``None``: nothing sharded, local sums are
    whole); the state entries are then ``DTensor``s wrapping the buffers' views."""

    def __init__(
        self,
        params: Sequence[Tensor],
        templates: dict[str, list[Tensor]],
        tx: GradientTransformation,
        slots_type: Callable[[Sequence[Any]], Any],
        spec: optree.PyTreeSpec,
        slots: list[tuple[str, str]],
        keys: Sequence[Tensor] | None = None,
        group: Any = None,
        direct_min: int = 0,
        given: Sequence[Any] | None = None,
        direct_rest_max: int = 0,
        upcast: bool = False,
        labels: list[Stages] | None = None,
    ) -> None:
        self.slots_type = slots_type
        self.spec = spec
        """The structure of the group's state down to its per-parameter nodes."""
        self.slots = slots
        """Each of its leaves' kind (``"param"``, ``"group"``, ``"hyper"`` or ``"none"``) and
        state name."""
        self.sharded = keys is not None
        """Whether the group's params are ``DTensor``s stepped on their local shards."""
        self.keys: list[Tensor] = list(params if keys is None else keys)
        self.group = group
        self.steps = 0
        """Steps this group took here (what tests read to know the engine ran)."""
        self.direct: list[int] = []
        """The params stepped one at a time in their own storage (see :func:`direct_params`)."""
        self.tx = tx
        self.upcast = upcast and any(p.dtype in LOW_PRECISION for p in params)
        """Whether 16-bit gradients are fed to the transform in float32
        (``TransformOptimizer.upcast_16bit_grads``): the direct params' steps convert them as
        they read them, the packed ones' buffer is float32 (the gradients are copied into it,
        never its views)."""
        self.leaf_steps: dict[tuple[Any, ...], _kernels.Kernel] = {}
        """Their step, compiled (:func:`leaf_step`), by the number of reduction totals it takes
        and the transform's stages; with ``-1 - k`` the pass giving their partials with ``k``
        totals (:func:`leaf_partials`)."""
        self.reduces = leafwise_level(tx) == 1
        """Whether the direct params need the totals of the update's reductions over the whole
        group first (see :class:`functional_opt._lists.Across`)."""
        self.outline = optree.tree_unflatten(spec, [kind for kind, _ in slots])
        self.one_leaf: tuple[Tensor, ...] = ()
        """A sharded group's stand-in arguments of one param's step (one element each)."""
        self.rank_orders: dict[bool, tuple[Tensor, Tensor]] = {}
        """A sharded group's parts' params in the parts' order (the direct ones, then the packed
        ones, with or without them), and the inverse permutation: the group's order."""
        self.sharded_direct = False
        """Whether a sharded group steps its large local shards directly (a leafwise
        transform, params of one dtype). Then every rank, whatever its own shards' sizes, first
        takes the totals of the update's reductions: over all leaves (a global norm) and over
        the ranks (each leaf's norms, :attr:`rank_reductions`), each pass's summed over the
        ranks in one collective (:meth:`_totals`)."""
        self.rank_reductions = False
        """Whether one param's update on its local shard needs other ranks' values (its
        norms: :func:`needs_other_ranks`, the same on every rank)."""
        self.stand_in_totals: list[Tensor] = []
        """A sharded group's totals of one stand-in param (:attr:`one_leaf`), pass by pass."""
        self.stand_in_passes: dict[tuple[int, Stages], tuple[list[str], list[Tensor]]] = {}
        """Per totals pass (totals known, stages): what it computes, found on the stand-in
        (:func:`reduction_sources`; the kinds and the stand-in's partials, whose shapes are
        what a pass needs of them)."""
        self.labels: list[Stages] | None = None
        """Each param's labels (:func:`functional_opt.base.leaf_labels`: a mask's flag, read
        off the group's whole tree once), added to the stages its direct step is compiled and
        run under; ``None`` for a transform that has none."""
        if labels is not None:  # (read off the whole group: these params are a part of it)
            self.labels = labels
        elif direct_min > 0 and leafwise(tx, reductions=True) and has_leaf_labels(tx):
            try:
                self.labels = None if self.sharded else leaf_labels(tx, slots_type(params))
            except ValueError:
                self.labels = None
            if self.labels is None:  # (none for this tree, or sharded: every param packed)
                direct_min = 0
        if direct_min > 0 and leafwise(tx, reductions=True):
            if not self.sharded:
                self.direct = direct_params(tx, params, direct_min)
                if self.direct and self._leaf_kernel(0) is None:
                    self.direct = []  # (a state it cannot rebuild: every param is packed)
            elif self._leaf_kernel(0) is not None and self._stand_in(params, templates, given):
                self.sharded_direct = True
                self.direct = direct_params(tx, params, direct_min)
            if self.direct and len(params) - len(self.direct) <= direct_rest_max:
                # few small params beside the large ones: stepped directly too
                self.direct = direct_params(tx, params, 1)
        self.direct_kinds = [
            (params[i].dtype, params[i].device, params[i].shape) for i in self.direct
        ]
        """The direct params' dtypes, devices and shapes."""
        self.totals_first = (self.reduces or self.rank_reductions) and (
            bool(self.direct) or self.sharded_direct
        )
        """Whether each step first takes the totals of the update's reductions (:meth:`_totals`)
        and steps every part given them."""
        taken = set(self.direct)
        self.rest = [i for i in range(len(params)) if i not in taken]
        """The params stepped together over packed buffers."""
        self.rest_labels: Stages = (
            () if self.labels is None else part_labels(self.labels, self.rest)
        )
        """Their labels (:func:`functional_opt.base.part_labels`), pinned while their update
        runs (a mask evaluated on them alone would see another tree)."""
        # few packed params (large ones, by the size rule of the optimizer): the update is
        # added into them inside the compiled graph, in the pass that computes it (with many
        # leaves inductor's code for the slices was slower than one multi-tensor add after it)
        self.apply_inside = len(self.rest) <= APPLY_INSIDE_MAX
        rest = [params[i] for i in self.rest]
        self.fused_add = not self.sharded and _lists.fused_add_ok(rest)
        """Whether the packed params may take :func:`functional_opt._lists.add_into`'s fused
        route (where they are contiguous, checked each step)."""
        device = params[0].device
        self.layout: Layout | None = None
        self.grads: list[Tensor] = []
        self.param_dtypes: list[torch.dtype] = []
        """The dtype of the packed params in each buffer of the layout."""
        order: list[list[int]] = []
        if rest:
            stand_ins = slots_type([torch.empty_like(p, device="meta") for p in rest])
            layout: Layout = pack(stand_ins).layout  # type: ignore[assignment]
            self.layout = layout
            order = [[self.rest[j] for j in layout.members(b)] for b in range(len(layout.sizes))]
            self.param_dtypes = [params[members[0]].dtype for members in order]
            self.grads = [
                torch.zeros(n, dtype=self._grad_dtype(dtype), device=device)
                for n, dtype in zip(layout.sizes, self.param_dtypes, strict=True)
            ]
        self.grad_gather = Gather(self.layout, self.grads) if self.layout is not None else None
        """Copies the packed params' gradients into the buffer (one ``torch.cat`` per run of
        leaves of one shape)."""
        self.grad_views: list[Tensor | None] = self._views(self.grads, params)
        """Per param: its view of the gradient buffer (``None`` for a direct param, whose
        gradient is read where it is)."""
        self.state: dict[str, list[Tensor]] = {}
        self.state_views: dict[str, list[Tensor]] = {}
        for name, values in templates.items():
            dtypes = [{values[i].dtype for i in members} for members in order]
            if any(len(d) != 1 for d in dtypes):
                raise NotPackable(f"state {name} mixes dtypes within one buffer")
            buffers = [
                torch.zeros(n, dtype=d.pop(), device=device)
                for n, d in zip(self.layout.sizes if self.layout else (), dtypes, strict=True)
            ]
            self.state[name] = buffers
            views = self._views(buffers, params)
            for i in self.direct:  # a direct param's state: tensors of its own
                views[i] = torch.zeros(params[i].shape, dtype=values[i].dtype, device=device)
            self.state_views[name] = views  # type: ignore[assignment]
        self.state_entries = {
            name: self._entries(views) for name, views in self.state_views.items()
        }
        """What ``optimizer.state[p][name]`` holds: the views (``DTensor``s wrapping them for a
        sharded group)."""
        self.given_pack: GivenPack | None = None
        """How the direct params' steps take the state that is not per parameter: packed into
        a buffer per dtype (a few graph inputs, not one per leaf)."""
        self.leaf_outs: list[Tensor] = []
        """Where the direct params' steps write it (:attr:`given_pack`'s buffers)."""
        self.gradient_passes: dict[tuple[int, Stages], tuple[int, tuple[str, ...]]] = {}
        """Per partials pass (code, stages): what it computes (:func:`gradient_reductions`)."""
        self.param_squares: dict[int, tuple[Tensor, Tensor, int, int]] = {}
        """A sharded group's direct params' sums of squares of their local shards, taken by
        their last step's kernels as they wrote them (:meth:`_param_squares`): per direct
        param (its position in :attr:`direct`), ``(value, shard, shard version, DTensor
        version)``."""
        self.dtensor_versions: list[int] = []
        """The direct params' ``DTensor`` version counters at the start of this step."""
        self.reused_squares = 0
        """How many direct params' sums of squares the last step took from
        :attr:`param_squares` instead of reading the shard (a diagnostic)."""
        self.leaf_kernels: dict[tuple[int, int, Stages], Callable[..., Any]] = {}
        """Per direct param and kernel (the code of :meth:`_leaf_kernel`), the compiled kernel
        once it is called without dynamo."""
        # one runner for every kind of call (its compiled steps are keyed by the call's kind)
        self.runner = Runner(tx)
        self.scratch: list[Tensor] | None = None
        self.scratch_views: list[Tensor] = []
        self.params: list[Tensor] | None = None  # buffers of the params' values, if read
        self.param_views: list[Tensor] = []
        self.param_gather: Gather | None = None
        """Copies the packed params into :attr:`params` (a transform that reads them)."""
        self.probed = False
        self.contiguous: bool | None = None
        """Whether every param is contiguous, as :meth:`usual_grads` found it for the step
        it let through (``None``: not known; :meth:`_fused` reads the params)."""
        self.piece_args: dict[tuple[bool, bool], tuple[list[Tensor], list[tuple[Tensor, ...]]]] = {}
        """Per piecewise step reading the params or not, through the direct params' step or
        not (:meth:`_step_leaf_pieces`): the buffers it was made from, and
        per piece its views of them that the compiled step takes (see :meth:`_piece_args`)."""
        self.piece_params: tuple[list[Tensor], list[list[Tensor]]] = ([], [])
        """The packed params as the last piecewise step had them, and each piece's."""
        self.usual: tuple[list[int], list[dict[str, Tensor]]] | None = None
        """What the last step that ended well saw (the params' addresses, their state
        dicts), which the next step takes as its usual one (:meth:`usual_grads`); ``None``
        while a step runs, so a step that raised is followed by a fully checked one."""
        self.table: tuple[Mapping[Tensor, Any], list[Tensor], list[Any]] | None = None
        """The optimizer's state when the last step ended well: the mapping, its keys and its
        values in order (see :meth:`_same_table`)."""
        self.persisting: list[int] = []
        """The ids of the packed params' gradients of the last step (:meth:`_load`)."""
        self.rest_views: list[Tensor] = [self.grad_views[i] for i in self.rest]  # type: ignore[misc]
        """The packed params' views of the gradient buffer (never ``None``)."""
        self.rest_of = operator.itemgetter(*self.rest) if len(self.rest) > 1 else None
        self.pieces: list[Piece] = self._pieces(params)
        """The packed params in pieces (for a transform that treats every leaf on its own
        without reductions): each piece's gradients copied in, its update (one compiled call
        of :func:`functional_opt.leaf_step.rows_step`) and the update added into its params
        while the piece is in cache, instead of each of those passes over all the packed
        params in turn; empty where the group takes the whole-buffer route."""
        self.piece_steps: dict[tuple[Stages, bool], _kernels.Kernel] = {}
        self.elementwise: dict[Stages, bool] = {}
        """Per stages of the transform, whether its one-param step treats every element on its
        own (:func:`functional_opt.leaf_step.treats_elements_alone`, found on the first
        piecewise step in those stages): then, in a group with direct params, the pieces take
        the direct params' compiled step (:meth:`_step_pieces`), one graph less to compile."""
        self.piece_kernels: dict[Any, Callable[..., Any]] = {}
        self.reads_params: dict[Stages, bool] = {}
        """Per stages of the transform, whether its update reads the params (found on the
        first piecewise step in those stages: a mini-step of ``MultiSteps`` does not)."""
        self.piece_values: list[Tensor] = []
        self.piece_updates: list[Tensor] = []
        """Buffers of the layout for the pieces' params (if read) and updates."""
        self.piece_value_views: list[list[Tensor]] = []
        self.piece_update_views: list[list[Tensor]] = []
        """Per piece, its members' views of them."""

    def _grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the gradient buffer for params of ``dtype``."""
        return torch.float32 if self.upcast and dtype in LOW_PRECISION else dtype

    def _rest(self, values: list[Any]) -> list[Any]:
        """The packed params' entries of a per-param list."""
        if self.rest_of is None:
            return [values[i] for i in self.rest]
        return list(self.rest_of(values))

    def usual_grads(
        self, params: list[Tensor], states: Mapping[Tensor, dict[str, Tensor]]
    ) -> tuple[list[Tensor], list[dict[str, Tensor]]] | None:
        """The params' gradients and state dicts when this step is a *usual* one, which needs
        none of the per-param checks of the first step (their results cannot have changed): the
        packed
        params' gradients are this group's views of its gradient buffer (bucket views: see
        :meth:`_load`), every direct param has a dense gradient of its shape and dtype, no
        param's memory moved (``p.data`` re-pointed) and every state dict is the one the last
        step used. ``None`` otherwise (the step takes the checked path). Plain groups only."""
        self.contiguous = None
        usual = self.usual
        if usual is None or self.sharded:
            return None
        grads: list[Tensor] = list(map(_GRAD, params))
        if self.rest and not all(map(operator.is_, self._rest(grads), self.rest_views)):
            return None
        for i in self.direct:
            g, p = grads[i], params[i]
            if (
                g is None
                or type(g) not in _lists._PLAIN
                or g.layout != torch.strided
                or g.dtype != p.dtype
                or g.device != p.device
                or g.shape != p.shape
            ):
                return None
        if list(map(Tensor.data_ptr, params)) != usual[0]:
            return None
        if not self._same_table(states) and not all(
            map(operator.is_, map(states.__getitem__, params), usual[1])
        ):
            return None
        # read now, while the params' tensors are in cache from the addresses (about a
        # quarter of the cost of a pass of its own over 2000 params)
        self.contiguous = self.fused_add and all(map(Tensor.is_contiguous, params))
        return grads, usual[1]

    def _same_table(self, states: Mapping[Tensor, dict[str, Tensor]]) -> bool:
        """Whether ``states`` (the optimizer's state, all groups') holds the same keys and the
        same dicts, in the same order, as when the last step ended: then each param's state
        dict is the one that step used. Two passes of identity checks over the table instead
        of a lookup per param (a tensor's hash is a Python call: 0.5 ms over 2000 params)."""
        table = self.table
        if table is None or states is not table[0] or len(states) != len(table[1]):
            return False
        return all(map(operator.is_, states, table[1])) and all(
            map(operator.is_, states.values(), table[2])
        )

    def accept(
        self,
        params: list[Tensor],
        states: list[dict[str, Tensor]],
        addresses: list[int] | None = None,
        table: Mapping[Tensor, dict[str, Tensor]] | None = None,
    ) -> None:
        """Record a step that ended well (see :attr:`usual`); ``addresses``: the params'
        addresses, when known (a usual step checked them; the step moves no param);
        ``table``: the optimizer's state, whose keys and dicts the next step compares whole
        (:meth:`_same_table`)."""
        if addresses is None:
            addresses = list(map(Tensor.data_ptr, params))
        self.usual = (addresses, states)
        self.table = None if table is None else (table, list(table), list(table.values()))

    def _stand_in(
        self,
        params: Sequence[Tensor],
        templates: dict[str, list[Tensor]],
        given: Sequence[Any] | None,
    ) -> bool:
        """A sharded group's stand-in param (:attr:`one_leaf`: one element each of the
        gradient, the param and its state, ``given``: the state leaves that are not per
        parameter), on which every rank finds the same facts of the update whatever its own
        shards: whether it needs other ranks (:attr:`rank_reductions`), what each totals pass
        computes. Params of one dtype only (what the passes compute depends on it)."""
        if given is None or len({p.dtype for p in params}) != 1:
            return False
        names = [name for kind, name in self.slots if kind == "param"]
        device = params[0].device

        def one(dtype: torch.dtype) -> Tensor:
            return torch.zeros(1, dtype=dtype, device=device)

        dtype = params[0].dtype
        self.one_leaf = (one(dtype), one(dtype), *[one(templates[n][0].dtype) for n in names])
        kinds = [kind for kind, _ in self.slots]
        self.rank_reductions = needs_other_ranks(
            self.tx, self.outline, kinds, (*self.one_leaf, *given), self.upcast
        )
        return True

    def _views(self, buffers: list[Tensor], params: Sequence[Tensor]) -> list[Tensor | None]:
        """Per param (all of the group's): its view of ``buffers`` (laid out over the packed
        params); ``None`` for a direct param."""
        out: list[Tensor | None] = [None] * len(params)
        if self.layout is not None:
            rest = [params[i] for i in self.rest]
            views = self.layout.views(buffers)
            for i, v, p in zip(self.rest, views, rest, strict=True):
                out[i] = v if v is not None else p
        return out

    def _entries(self, views: list[Tensor]) -> list[Tensor]:
        return _lists.like_shards(views, self.keys) if self.sharded else views

    def adopt_state(self, entries: list[dict[str, Tensor]]) -> None:
        """Make each ``entries[j][name]`` a view of this group's buffers (a ``DTensor`` wrapping
        it for a sharded group), copying values that live elsewhere: fresh state, or state
        loaded from a checkpoint (redistributed to the param's placements where it has others).
        The entries' dicts keep their order."""
        for name, views in self.state_views.items():
            wanted = self.state_entries[name]
            if all(map(operator.is_, map(operator.itemgetter(name), entries), wanted)):
                continue
            current = [e[name] for e in entries]
            moved = [
                (v, _lists.local_like(c, k) if self.sharded else c)
                for v, c, w, k in zip(views, current, wanted, self.keys, strict=True)
                if c is not w
            ]
            moved = [(v, c) for v, c in moved if v is not c]
            if moved:
                torch._foreach_copy_([v for v, _ in moved], [c for _, c in moved])
            for e, w in zip(entries, wanted, strict=True):
                e[name] = w

    def packed_state(self, name: str) -> Packed | None:
        """The packed params' state entry ``name`` (``None`` when every param is direct)."""
        if self.layout is None:
            return None
        return Packed(self.layout, buffers=self.state[name])

    def step(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        outer: list[Any],
        ratio: float | Tensor,
    ) -> Any:
        """One update: the direct params one at a time (:meth:`_step_direct`), then the others'
        gradients into the buffer, the fused update, ``p += ratio * u`` (or those steps piece
        by piece, :meth:`_step_pieces`). ``outer`` holds the
        leaves of the state tree down to its per-parameter nodes (:attr:`spec`, :attr:`slots`),
        the per-parameter ones packed. Returns the new state tree (packed per-parameter
        subtrees). For a transform leafwise given its reductions, their totals over the group
        come first (:meth:`_totals`).
        For a sharded group ``params`` and ``grads`` are the ``DTensor``s, stepped on their
        local shards."""
        if self.sharded:
            self.dtensor_versions = [params[i]._version for i in self.direct]
            params = [p._local_tensor for p in params]  # type: ignore[attr-defined]
            grads = [g._local_tensor for g in grads]  # type: ignore[attr-defined]
        self.steps += 1
        # the stages the transform declares for this step (read before anything is written):
        # the direct params' kernels are compiled and run per stage
        spread = self.direct or self.totals_first or self.pieces
        found = stages(self.tx, optree.tree_unflatten(self.spec, outer)) if spread else ()
        if self.pieces:
            try:
                with staged(found):
                    return self._step_in_pieces(params, grads, outer, ratio, found)
            except _NoPieces:  # (raised before anything was written)
                self.pieces = []
        loaded = self._load(params, grads, outer) if self.layout is not None else None
        totals: list[list[Tensor]] = [[]] * (len(self.direct) + 1)
        if self.totals_first:
            with staged(found), _lists.sharded_reductions(self.group):
                totals = self._totals(params, grads, outer, loaded, found)
        if self.direct:
            # first: the packed update may write the group's counters in place
            with staged(found), _lists.sharded_reductions(self.group):
                news = self._step_direct(params, grads, outer, ratio, totals[:-1], found)
            if loaded is None:
                return optree.tree_unflatten(self.spec, news)
        assert loaded is not None
        return self._step_packed([params[i] for i in self.rest], loaded, ratio, totals[-1])

    def _step_in_pieces(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        outer: list[Any],
        ratio: float | Tensor,
        found: Stages,
    ) -> Any:
        """The piecewise step (under the caller's stages ``found``): the totals of the update's
        reductions if it takes any, the direct params, then the pieces (:meth:`_step_pieces`).
        Raises :class:`_NoPieces` before writing anything where the pieces cannot take this
        step: a transform with reductions or few packed params whose one-param step does not
        treat each element alone (only the direct params' step takes totals, and pieces
        without it are for many packed params), or a totals pass that is not a reduction of the
        gradients (:meth:`_pieces_parts`)."""
        totals: list[list[Tensor]] = [[]] * (len(self.direct) + 1)
        if self.totals_first:
            totals = self._totals(params, grads, outer, None, found)
        given, pack = self._given(outer)
        leaf = self._leaf_pieces(found, pack, given, totals[-1])
        if not leaf and (self.reduces or len(self.rest) <= APPLY_INSIDE_MAX):
            raise _NoPieces
        if self.direct:
            self._step_direct(params, grads, outer, ratio, totals[:-1], found)
        return self._step_pieces(params, grads, outer, ratio, found, leaf, totals[-1])

    def _pieces(self, params: Sequence[Tensor]) -> list[Piece]:
        """The pieces of the packed params (see :attr:`pieces`): each run of the layout in
        pieces of about :data:`PIECE` elements; none where the route does not apply (a sharded
        group, leaf labels, params sharing memory; without direct params: reductions or few
        packed params) or would make many small calls. (With direct params, a transform with
        reductions or few packed params keeps them only if its one-param step treats each
        element alone, found on the first step: :meth:`_step_in_pieces`.)"""
        layout = self.layout
        if (
            layout is None
            or self.sharded
            or self.labels is not None
            or not leafwise(self.tx, reductions=bool(self.direct))
            or (len(self.rest) <= APPLY_INSIDE_MAX and not self.direct)
            or any(len(c) > 1 for c in _lists.overlapping([params[i] for i in self.rest]))
            or rows_step(self.tx, self.outline, [k for k, _ in self.slots], False, GivenPack([]))
            is None  # (a state it cannot rebuild)
        ):
            return []
        present = layout.present()
        position = {leaf: j for j, leaf in enumerate(present)}
        shapes = layout.shapes
        pieces: list[Piece] = []
        for b in range(len(layout.sizes)):
            members = [position[i] for i in layout.members(b)]
            taken = 0
            for start, count, size in layout.runs(b):
                run, taken = members[taken : taken + count], taken + count
                if size == 0:
                    continue
                step = max(1, PIECE // size)
                for r in range(0, count, step):
                    mine = run[r : r + step]
                    kinds = {shapes[present[j]] for j in mine}
                    one = kinds.pop() if len(kinds) == 1 else None
                    common = one if one is not None and len(one) > 0 else None
                    pieces.append(Piece(b, start + r * size, len(mine), size, mine, common))
        total = sum(piece.rows * piece.size for piece in pieces)
        if not pieces or (len(pieces) > PIECES_MAX and total < len(pieces) * (PIECE // 4)):
            return []
        return pieces

    def _piece_views(self, buffers: list[Tensor]) -> list[list[Tensor]]:
        """Per piece, its members' views of ``buffers`` (buffers of the layout)."""
        layout = self.layout
        assert layout is not None
        views, present = layout.views(buffers), layout.present()
        return [[cast(Tensor, views[present[j]]) for j in piece.members] for piece in self.pieces]

    def _piece_step(self, found: Stages, reads: bool) -> _kernels.Kernel | None:
        """The pieces' compiled step (:func:`functional_opt.leaf_step.rows_step`) for the
        transform's stages ``found``, given the params if it ``reads`` them."""
        assert self.given_pack is not None
        key = (found, reads)
        if key not in self.piece_steps:
            kinds = [kind for kind, _ in self.slots]
            fn = rows_step(self.tx, self.outline, kinds, reads, self.given_pack)
            if fn is None:
                return None
            self.piece_steps[key] = _kernels.Kernel(fn)
        return self.piece_steps[key]

    def _given(self, outer: list[Any]) -> tuple[list[Any], GivenPack]:
        """The state leaves that are not per parameter, and :attr:`given_pack`, made for them."""
        kinds = [kind for kind, _ in self.slots]
        given = [x for x, k in zip(outer, kinds, strict=True) if k in GIVEN]
        if self.given_pack is None or not self.given_pack.fits(given):
            self.given_pack = GivenPack(given)
            self.leaf_outs = self.given_pack.empty()
            self.leaf_steps = {k: v for k, v in self.leaf_steps.items() if not k[2]}
            self.leaf_kernels.clear()
            self.piece_steps.clear()
            self.piece_kernels.clear()
        return given, self.given_pack

    def _step_pieces(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        outer: list[Any],
        ratio: float | Tensor,
        found: Stages,
        leaf: bool,
        totals: list[Tensor],
    ) -> Any:
        """The packed params piece by piece (:attr:`pieces`): through the direct params' step
        given ``totals`` if ``leaf`` (:meth:`_step_leaf_pieces`), else through the rows step.
        Returns the new state tree."""
        params = self._rest(params)
        grads = self._rest(grads)
        views = self.rest_views
        layout = self.layout
        assert layout is not None
        given, pack = self._given(outer)
        reads = self.reads_params.get(found)
        if reads is None:  # (under the stages found: the caller's staged)
            state = optree.tree_unflatten(self.spec, outer)
            updates = Packed(layout, buffers=self.grads)
            reads = self.reads_params[found] = _reads_params(self.tx, updates, state)
        apply = not zero_updates(self.tx, found)
        if leaf:
            return self._step_leaf_pieces(
                params, grads, outer, ratio, found, reads or apply, totals
            )
        step = self._piece_step(found, reads)
        assert step is not None
        if not self.piece_updates:
            self.piece_updates = [torch.empty_like(b) for b in self.grads]
            self.piece_update_views = self._piece_views(self.piece_updates)
        if reads:
            self._make_piece_values()
        # the gradients: read where they are (the buffer's views), or copied in piece by piece
        copy, persist = self._gradients_in(params, grads)
        names = [name for kind, name in self.slots if kind == "param"]
        packed = pack.pack(given)
        fused = self._fused(params)
        pieces_args = self._piece_args(reads, names)
        pieces_params = self._piece_params(params)
        for q, piece in enumerate(self.pieces):
            args = pieces_args[q]
            if copy:
                members = piece.members
                piece.copy_in(args[0], [grads[j] for j in members], [views[j] for j in members])
            if reads:
                piece.copy_in(args[1], pieces_params[q], self.piece_value_views[q])
            step.kept_call(self.piece_kernels, (q, found), (*args, *packed, *self.leaf_outs))
            if apply:
                _add(pieces_params[q], self.piece_update_views[q], ratio, fused)
        return self._after_pieces(params, outer, pack, persist)

    def _leaf_pieces(
        self, found: Stages, pack: GivenPack, given: list[Any], totals: list[Tensor]
    ) -> bool:
        """Whether the pieces take the direct params' compiled step (given ``totals``) in the
        transform's stages ``found`` (see :attr:`elementwise`): a group with direct params,
        whose transform's one-param step treats each element on its own for every buffer's
        dtypes (checked once per stages, on stand-in params of a few thousand elements), and
        whose pieces' matrices the direct params' compiled graph serves: a direct param is a
        matrix of their dtypes (its gradient too) and no piece has one row or one column (the
        sizes a graph with dynamic sizes is specialized on). Elsewhere a graph of their own
        would save nothing."""
        if not self.direct or not self._pieces_fit_direct_graph():
            return False
        known = self.elementwise.get(found)
        if known is None:
            step = self._leaf_kernel(len(totals), found, pack)
            assert step is not None
            names = [name for kind, name in self.slots if kind == "param"]
            device = self.grads[0].device

            def args_for(b: int) -> Callable[[int], tuple[Any, ...]]:
                def args(n: int) -> tuple[Any, ...]:
                    def leaf(dtype: torch.dtype, value: float) -> Tensor:
                        return torch.full((n,), value, dtype=dtype, device=device)

                    p = leaf(self.param_dtypes[b], 0.5)
                    state = [leaf(self.state[name][b].dtype, 0.0) for name in names]
                    given_ = [x.clone() for x in pack.pack(given)]
                    outs = [torch.empty_like(x) for x in self.leaf_outs]
                    scale = ratio_argument(1.0, p)
                    g = leaf(self.grads[b].dtype, 0.25)
                    return (g, p, scale, *state, *given_, *outs, *[t.clone() for t in totals])

                return args

            known = self.elementwise[found] = all(
                treats_elements_alone(step.fn, args_for(b)) for b in range(len(self.grads))
            )
        return known

    def _pieces_fit_direct_graph(self) -> bool:
        """Whether each piece's ``[rows, size]`` matrices have the signature of some direct
        param's step (:meth:`_leaf_pieces`)."""
        grad_dtypes = {(b.dtype, b.device) for b in self.grads}
        matrices = {
            (dtype, device)
            for dtype, device, shape in self.direct_kinds
            if len(shape) == 2 and min(shape) >= 2 and (dtype, device) in grad_dtypes
        }
        return all(
            piece.rows >= 2
            and piece.size >= 2
            and (self.param_dtypes[piece.buffer], self.grads[piece.buffer].device) in matrices
            for piece in self.pieces
        )

    def _step_leaf_pieces(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        outer: list[Any],
        ratio: float | Tensor,
        found: Stages,
        values: bool,
        totals: list[Tensor],
    ) -> Any:
        """The packed params piece by piece through the direct params' compiled step
        (:meth:`_leaf_pieces`): each piece's ``[rows, size]`` matrices stepped as one param of
        that shape (the graph the direct params' calls use, for matrices). The params' values
        are copied into a buffer of the layout (where the step reads or writes them:
        ``values``), the step writes ``p + ratio u`` there, and that is copied back into the
        params, so each packed param gets the bits a direct one would. ``params`` and
        ``grads``: the packed params'. Returns the new state tree."""
        views = self.rest_views
        given, pack = self._given(outer)
        step = self._leaf_kernel(len(totals), found, pack)
        assert step is not None
        self._make_piece_values()
        copy, persist = self._gradients_in(params, grads)
        names = [name for kind, name in self.slots if kind == "param"]
        packed = pack.pack(given)
        scales: dict[torch.dtype, Tensor] = {}
        pieces_params = self._piece_params(params)
        pieces_args = self._piece_args(True, names, leaf=True)
        for q, piece in enumerate(self.pieces):
            g, p, *state = pieces_args[q]
            if copy:
                members = piece.members
                piece.copy_in(g, [grads[j] for j in members], [views[j] for j in members])
            if values:
                piece.copy_in(p, pieces_params[q], self.piece_value_views[q])
            scale = scales.get(p.dtype)
            if scale is None:
                scale = scales[p.dtype] = ratio_argument(ratio, p)
            step.kept_call(
                self.piece_kernels,
                (q, found, "leaf"),
                (g, p, scale, *state, *packed, *self.leaf_outs, *totals),
            )
            if values:
                torch._foreach_copy_(pieces_params[q], self.piece_value_views[q])
        return self._after_pieces(params, outer, pack, persist)

    def _make_piece_values(self) -> None:
        """The buffers of the pieces' params' values (:attr:`piece_values`), made once."""
        if not self.piece_values:
            self.piece_values = [
                torch.empty_like(b, dtype=d)
                for b, d in zip(self.grads, self.param_dtypes, strict=True)
            ]
            self.piece_value_views = self._piece_views(self.piece_values)

    def _after_pieces(
        self, params: list[Tensor], outer: list[Any], pack: GivenPack, persist: bool
    ) -> Any:
        """The end of a piecewise step: the packed params' gradients rebound to their views
        where they persist (``params``: the packed ones), and the new state tree, the values
        that are not per parameter from the steps' outputs."""
        if persist:
            self._rebind(params)
        kinds = [kind for kind, _ in self.slots]
        news = iter(pack.unpack([x.clone() for x in self.leaf_outs]))
        return optree.tree_unflatten(
            self.spec, [next(news) if k in GIVEN else x for x, k in zip(outer, kinds, strict=True)]
        )

    def _piece_args(
        self, reads: bool, names: list[str], leaf: bool = False
    ) -> list[tuple[Tensor, ...]]:
        """Per piece, the ``[rows, size]`` matrices its compiled step takes: its rows of the
        gradient buffer, of the params' values (if the transform ``reads`` them), of the
        update buffer and of each per-parameter state buffer (``names``). Made once, then
        reused while those buffers are the same tensors (slicing them anew costs two tensor
        ops per matrix per piece, every step)."""
        values = self.piece_values if reads else []
        updates = [] if leaf else self.piece_updates
        buffers = [*self.grads, *values, *updates]
        for name in names:
            buffers += self.state[name]
        kept = self.piece_args.get((reads, leaf))
        if (
            kept is not None
            and len(kept[0]) == len(buffers)
            and all(map(operator.is_, kept[0], buffers))
        ):
            return kept[1]
        made = []
        for piece in self.pieces:
            b = piece.buffer
            args = [piece.of(self.grads[b])]
            if reads:
                args.append(piece.of(self.piece_values[b]))
            if not leaf:
                args.append(piece.of(self.piece_updates[b]))
            args += [piece.of(self.state[name][b]) for name in names]
            made.append(tuple(args))
        self.piece_args[reads, leaf] = (buffers, made)
        return made

    def _piece_params(self, params: list[Tensor]) -> list[list[Tensor]]:
        """Per piece, its params (of the packed ``params``): the lists the last piecewise
        step made when ``params`` are the same tensors (an identity check per param instead
        of a list per piece)."""
        kept, lists = self.piece_params
        if len(kept) == len(params) and all(map(operator.is_, kept, params)):
            return lists
        lists = [[params[j] for j in piece.members] for piece in self.pieces]
        self.piece_params = (list(params), lists)
        return lists

    def _gradients_in(self, params: list[Tensor], grads: list[Tensor]) -> tuple[bool, bool]:
        """Where this step reads the packed params' gradients (``params`` and ``grads``: the
        packed ones'): ``(copy, persist)``. ``copy``: they must be copied into the buffer (they
        are not its views). Where some are views already (a param that had no gradient got a
        fresh one) the others are copied into theirs here and rebound to them as the rest are,
        leaving nothing to copy (a copy of all would read the buffer it writes). ``persist``:
        they are the same tensors as on the last step, so they persist between steps
        (``zero_grad(set_to_none=False)``): once copied, the caller rebinds them to their
        views (:meth:`_rebind`)."""
        views = self.rest_views
        same = list(map(operator.is_, grads, views))
        if all(same):
            return False, False
        if any(same):
            fresh = [j for j, s in enumerate(same) if not s]
            torch._foreach_copy_([views[j] for j in fresh], [grads[j] for j in fresh])
            if not self.sharded:
                for j in fresh:
                    params[j].grad = views[j]
            return False, False
        ids = list(map(id, grads))
        persist = not self.sharded and not self.upcast and ids == self.persisting
        self.persisting = ids
        return True, persist

    def _rebind(self, params: list[Tensor]) -> None:
        """Make the packed params' gradients their views of the buffer, which hold their values
        now and which backward accumulates into from now on (as DDP's
        ``gradient_as_bucket_view``). A fresh tensor that happened to get a freed one's id is
        rebound too: its values are in the view all the same."""
        for p, view in zip(params, self.rest_views, strict=True):
            p.grad = view
        self.persisting = list(map(id, self.rest_views))

    def _load(
        self, params: list[Tensor], grads: list[Tensor], outer: list[Any]
    ) -> tuple[Packed, Any, Packed, dict[str, Any]]:
        """The packed params' gradients copied into the buffer (unless they are its views) and
        their values where the transform reads them: ``(updates, state, params, donate)`` as
        the runner takes them."""
        params = self._rest(params)
        grads = self._rest(grads)
        state = optree.tree_unflatten(self.spec, outer)
        # The gradient buffer is ours (a copy) unless the params' gradients are its views
        # (bucket views): then they are the user's, and the update may not be written over them
        # (the optimizer never writes the gradients).
        copy, persist = self._gradients_in(params, grads)
        if copy:
            assert self.grad_gather is not None
            self.grad_gather(grads)
            if persist:
                self._rebind(params)
        ours = copy and not persist
        donate: dict[str, Any] = {DONATE: True if ours else STATE_ONLY}
        layout = self.layout
        assert layout is not None
        updates = Packed(layout, buffers=self.grads)
        if not self.probed:
            self._probe(updates, state)
        if self.params is not None:
            assert self.param_gather is not None
            self.param_gather(params)  # (read by the transform)
            given = Packed(layout, buffers=self.params)
        else:  # a loose tree: copied into a buffer only if the transform reads it after all
            given = Packed(layout, tree=self.slots_type(params))
        return updates, state, given, donate

    def _step_packed(
        self,
        params: list[Tensor],
        loaded: tuple[Packed, Any, Packed, dict[str, Any]],
        ratio: float | Tensor,
        totals: list[Tensor],
    ) -> Any:
        """The packed params' update (:meth:`_load`), added into them; the new state tree."""
        updates, state, given, donate = loaded
        layout = self.layout
        assert layout is not None
        given_totals = totals or None
        # an update of negative zeros (a mini-step that only accumulates) leaves the params as
        # they are, bit for bit: not added (read before the step writes the counters)
        zero = zero_updates(self.tx, stages(self.tx, state))
        if self.apply_inside and not zero and not isinstance(ratio, Tensor) and ratio == 1.0:
            _, new_state = self._run(
                updates, state, given, donate, list(params), totals=given_totals
            )
            return new_state
        if donate[DONATE] is not True:  # the update into a persistent buffer of ours
            if self.scratch is None:
                self.scratch = [torch.empty_like(b) for b in self.grads]
                self.scratch_views = layout.views(self.scratch)  # type: ignore[assignment]
            _, new_state = self._run(
                updates, state, given, donate, self.scratch, True, True, totals=given_totals
            )
            if not zero:
                _add(params, self.scratch_views, ratio, self._fused(params))
            return new_state
        new_updates, new_state = self._run(updates, state, given, donate, totals=given_totals)
        fused = False
        if isinstance(new_updates, Packed) and new_updates.buffers is not None:
            if all(map(operator.is_, new_updates.buffers, self.grads)):
                views, fused = [self.grad_views[i] for i in self.rest], self._fused(params)
            else:
                views = layout.views(list(new_updates.buffers))
        else:
            views = tree.leaves(
                new_updates.tree if isinstance(new_updates, Packed) else new_updates
            )
        if not zero:
            _add(params, views, ratio, fused)  # type: ignore[arg-type]
        return new_state

    def _fused(self, params: list[Tensor]) -> bool:
        """Whether ``p += u`` may take the fused multi-tensor route into the buffers' views
        (checked each step: an in-place transpose keeps a param's address). A usual step's
        params were checked with its gradients (:attr:`contiguous`); that answer serves once."""
        known, self.contiguous = self.contiguous, None
        if known is not None:
            return known
        return self.fused_add and all(map(Tensor.is_contiguous, params))

    def _run(
        self,
        updates: Packed,
        state: Any,
        given: Packed,
        donate: dict[str, Any],
        targets: list[Tensor] | None = None,
        whole: bool = False,
        copy: bool = False,
        totals: list[Tensor] | None = None,
    ) -> tuple[Any, Any]:
        """The runner's update, within the group's sharded reductions (a sharded group's: the
        runner compiles its graphs for that group)."""
        with _lists.sharded_reductions(self.group), pinned(self.rest_labels):
            return self.runner(updates, state, given, donate, targets, whole, copy, totals)

    def _probe(self, updates: Packed, state: Any) -> None:
        """Whether the transform needs the params (its pure update without them raises): then
        each step copies them into a buffer of the layout before the compiled update, instead
        of the graph gathering thousands of separate tensors (which compiles for minutes). A
        group of few params (:data:`APPLY_INSIDE_MAX`) is gathered inside the graph instead,
        where inductor reads the params in the pass that uses them (a copy first measured 1.4x
        the step of ``adamw`` on one 16.8M tensor)."""
        self.probed = True
        if self.apply_inside:
            return
        try:
            with pinned(self.rest_labels):
                self.tx.update(updates, state, None)
        except (ValueError, TypeError):
            self.params = [
                torch.empty_like(b, dtype=d)
                for b, d in zip(self.grads, self.param_dtypes, strict=True)
            ]
            self.param_views = updates.layout.views(self.params)  # type: ignore[union-attr,assignment]
            self.param_gather = Gather(updates.layout, self.params)  # type: ignore[arg-type]

    def write_back(self, name: str, new: Any) -> None:
        """Copy a new packed state subtree into the buffers (when the transform returned other
        buffers than it was given)."""
        if not isinstance(new, Packed) or new.buffers is None:
            values = tree.leaves(new.tree if isinstance(new, Packed) else new)
            views = self.state_views[name]
            torch._foreach_copy_([views[i] for i in self.rest], values)
            return
        for old, value in zip(self.state[name], new.buffers, strict=True):
            if value is not old:
                old.copy_(value)

    def _leaf_kernel(
        self, code: int, found: Stages = (), pack: GivenPack | None = None, squares: bool = False
    ) -> _kernels.Kernel | None:
        """The direct params' compiled step taking ``code`` totals (the state that is not per
        parameter as ``pack``'s buffers, if given; returning the new param's sum of squares
        with ``squares``), or (``code < 0``) their partials pass with ``-1 - code`` totals, for
        the transform's stages ``found``; ``None`` for a state it cannot rebuild."""
        key: tuple[Any, ...] = (code, found, pack is not None, *((True,) if squares else ()))
        if key not in self.leaf_steps:
            kinds = [kind for kind, _ in self.slots]
            fn: Callable[..., Any] | None
            if code >= 0:
                apply = not zero_updates(self.tx, found)
                fn = leaf_step(
                    self.tx, self.outline, kinds, code, apply, pack, self.upcast, squares=squares
                )
            else:
                fn = leaf_partials(self.tx, self.outline, kinds, -1 - code, self.upcast)
            if fn is None:
                return None
            self.leaf_steps[key] = _kernels.Kernel(fn)
        return self.leaf_steps[key]

    def _totals(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        outer: list[Any],
        loaded: tuple[Packed, Any, Packed, dict[str, Any]] | None,
        found: Stages,
    ) -> list[list[Tensor]]:
        """The totals of the update's reductions, for each part of the group: each direct
        param (in :attr:`direct`'s order), then the packed params. Pass ``k`` computes the
        partial values of reduction ``k`` (the totals before it given) of the direct params (a
        compiled call each, or one multi-tensor op for reductions of their gradients) and of
        the packed ones (one compiled pass), and sums them over the parts. A sharded group's
        are then summed over the ranks, one collective per pass (:meth:`_over_ranks`). Writes
        nothing."""
        kinds = [kind for kind, _ in self.slots]
        given = [x for x, k in zip(outer, kinds, strict=True) if k in GIVEN]
        if not self.sharded:
            totals: list[Tensor] = []
            while True:
                parts, exact, taken = self._direct_parts(
                    params, grads, given, [totals] * len(self.direct), found
                )
                if loaded is not None:
                    parts.append(self._packed_parts(loaded, totals, taken))
                elif self.pieces:
                    parts.append(self._pieces_parts(grads, taken))
                if not _lists.next_total(totals, parts, exact):
                    return [totals] * (len(self.direct) + 1)
        per_part: list[list[Tensor]] = [[] for _ in range(len(self.direct) + 1)]
        self.stand_in_totals = []
        while True:
            parts, exact, _ = self._direct_parts(params, grads, given, per_part[:-1], found)
            if loaded is not None:
                updates, state, given_params, _ = loaded
                parts.append(self.runner.partials(updates, state, given_params, {}, per_part[-1]))
            key = (len(self.stand_in_totals), found)
            if key not in self.stand_in_passes:
                self.stand_in_passes[key] = reduction_sources(
                    self.tx,
                    self.outline,
                    kinds,
                    len(self.stand_in_totals),
                    (*self.one_leaf, *given, *self.stand_in_totals),
                    self.upcast,
                )
            sources, partials = self.stand_in_passes[key]
            if not sources:
                return per_part
            self.stand_in_totals += partials[:exact]
            self._over_ranks(per_part, parts, sources[:exact], loaded is not None)
            if len(sources) <= exact:
                return per_part

    def _pieces_parts(self, grads: list[Tensor], taken: tuple[str, ...]) -> tuple[Tensor, ...]:
        """The packed params' partials of one totals pass of the piecewise step, summed from
        the multi-tensor ops the direct params' part took (``taken``: reductions of the
        gradients, see :meth:`_packed_parts`) over the packed params' gradients where they
        are. Raises :class:`_NoPieces` for a pass of something else (the pieces have no
        compiled pass for it)."""
        rows = None
        if taken:
            rows = gradient_reductions_pass(self._rest(grads), len(taken), taken, None, True)
        if rows is None:
            raise _NoPieces
        return tuple(_lists.summed(list(column)) for column in zip(*rows, strict=True))

    def _packed_parts(
        self,
        loaded: tuple[Packed, Any, Packed, dict[str, Any]],
        totals: list[Tensor],
        taken: tuple[str, ...],
    ) -> tuple[Tensor, ...]:
        """The packed params' partials of one totals pass (unsharded), ``totals`` given. Where
        the direct params' part of the pass took its exact partials as reductions of the
        gradients (``taken``, their kinds: a global norm's sum of squares, a finite check's
        count; see :func:`large_parts`), summed from the same multi-tensor ops over the packed
        params' gradient views (:func:`gradient_reductions_pass`); else the runner's compiled
        pass over the packed trees. The first takes no graph of its own to compile (2 s of a
        first step) and runs no slower (W1's 60 small vectors: one ``_foreach_norm``)."""
        if taken and not self.rest_labels:
            rows = gradient_reductions_pass(self.rest_views, len(taken), taken, None, True)
            if rows is not None:
                return tuple(_lists.summed(list(column)) for column in zip(*rows, strict=True))
        updates, state, given_params, _ = loaded
        with pinned(self.rest_labels):
            return self.runner.partials(updates, state, given_params, {}, totals)

    def _over_ranks(
        self,
        per_part: list[list[Tensor]],
        parts: list[Any],
        sources: list[str],
        packed: bool,
    ) -> None:
        """A sharded group's totals of one pass, appended to each part's (``per_part``), from
        the parts' partial values (``parts``: the direct params', then the packed params' if
        ``packed``) of reductions of the kinds ``sources``: a reduction over all leaves (a sum
        of squares, a count of non-finite tensors) summed over the parts and the ranks; one
        over the ranks (:func:`functional_opt._lists.sum_over_shards` of per-leaf values: ``m``
        blocks of one value per leaf, in leaf order) summed over the ranks leaf by leaf, in the
        group's param order (the ranks' parts hold different params). All in one
        ``all_reduce``."""
        counts = [1] * len(self.direct) + ([len(self.rest)] if packed else [])
        if packed not in self.rank_orders:
            # the parts' params, in the parts' order: where each of the group's params sits
            members = [*self.direct, *(self.rest if packed else [])]
            device = parts[0][0].device
            self.rank_orders[packed] = (
                torch.tensor(members, device=device),
                torch.tensor(sorted(range(len(members)), key=members.__getitem__), device=device),
            )
        order, inverse = self.rank_orders[packed]
        n = order.numel()
        dtype = torch.float32
        for part in parts:
            for x in part[: len(sources)]:
                dtype = torch.promote_types(dtype, x.dtype)
        pieces: list[Tensor] = []
        blocks: list[int] = []
        for j, kind in enumerate(sources):
            if kind != "ranks":
                pieces.append(_lists.summed([part[j] for part in parts]).to(dtype).reshape(1))
                blocks.append(0)
                continue
            m = parts[0][j].numel() // counts[0]
            nd = len(self.direct)
            singles = [part[j] for part in parts[:nd]]
            columns = []
            if singles and all(x.dtype == dtype for x in singles):
                columns.append(torch.stack(singles, dim=1))  # (one op for the direct params)
            else:
                columns += [x.to(dtype).reshape(m, 1) for x in singles]
            rest = zip(parts[nd:], counts[nd:], strict=True)
            columns += [part[j].to(dtype).reshape(m, c) for part, c in rest]
            by_param = torch.cat(columns, dim=1).index_select(1, inverse)
            pieces.append(by_param.reshape(-1))
            blocks.append(m)
        whole = _lists.sum_over_shards(torch.cat(pieces))
        # each total a tensor of its own (a view at an offset of ``whole`` would make the
        # compiled kernels taking it treat the offset as a symbol: called through dynamo)
        offset = 0
        for j, m in enumerate(blocks):
            if m == 0:
                total = whole[offset].clone()
                for q, totals in enumerate(per_part):
                    like = parts[q][j] if q < len(parts) else total
                    totals.append(total.to(like.dtype))
                offset += 1
                continue
            by_part = whole[offset : offset + m * n].view(m, n).index_select(1, order)
            mine = list(torch.split(by_part, counts, dim=1))
            nd = len(self.direct)
            dtypes = {parts[q][j].dtype for q in range(min(nd, len(parts)))}
            if nd and dtypes == {whole.dtype}:
                # the direct params' totals, each a tensor of its own, in one op (x * 1 is x)
                rows = by_part[:, :nd].t().contiguous().unbind()
                per_param = torch._foreach_mul(list(rows), 1.0)
                for q in range(nd):
                    per_part[q].append(per_param[q])
                mine[:nd] = []
                start = nd
            else:
                start = 0
            for q in range(start, len(per_part)):
                k = q - start
                if q < len(parts):
                    per_part[q].append(mine[k].reshape(-1).to(parts[q][j].dtype, copy=True))
                else:  # (no packed params: never read)
                    per_part[q].append(by_part.new_zeros(0))
            offset += m * n

    def _direct_parts(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        given: list[Any],
        totals: list[list[Tensor]],
        found: Stages,
    ) -> tuple[list[Any], int, tuple[str, ...]]:
        """One totals pass over the direct params, each given its ``totals`` (see
        :func:`functional_opt.leaf_step.large_parts`)."""
        kinds = [kind for kind, _ in self.slots]
        names = [name for kind, name in self.slots if kind == "param"]
        known = len(self.stand_in_totals) if self.sharded else len(totals[0]) if totals else 0
        code = -1 - known
        kernel = self._leaf_kernel(code, found)
        assert kernel is not None

        def args(q: int) -> tuple[Tensor, ...]:
            i = self.direct[q]
            state = [self.state_views[name][i] for name in names]
            return (grads[i], params[i], *state, *given, *totals[q])

        def probe() -> tuple[int, tuple[str, ...]]:
            # (a sharded group: on the stand-in, so that every rank finds the same)
            sample = (*self.one_leaf, *given, *self.stand_in_totals) if self.sharded else args(0)
            with staged(found + self._label(self.direct[0]) if self.direct else found):
                return gradient_reductions(self.tx, self.outline, kinds, known, sample, self.upcast)

        def kernel_for(stages_: Stages) -> _kernels.Kernel:
            out = kernel if stages_ is found else self._leaf_kernel(code, stages_)
            assert out is not None
            return out

        return large_parts(
            self.gradient_passes,
            (code, found),
            probe,
            [grads[i] for i in self.direct],
            lambda: [
                labelled_call(
                    kernel_for, self.leaf_kernels, (i, code), found, self._label(i), args(q)
                )
                for q, i in enumerate(self.direct)
            ],
            (lambda: self._param_squares(params)) if self.sharded else None,
            host_reads=True,
        )

    def _param_squares(self, params: list[Tensor]) -> list[Tensor]:
        """Each direct param's sum of squares of its local shard (``params``: the shards), for
        a sharded pass that takes the params' norms (:func:`gradient_reductions_pass`). Where
        the param's last step took it as it wrote the shard (:attr:`param_squares`) and
        neither the shard's nor the ``DTensor``'s version counter has moved since (nothing
        wrote the param in place: ``load_state_dict``, DCP, ``torch.no_grad()`` ops, FSDP2's
        own), that value, without reading the shard again; the others' from their local norms
        (BLAS dot products). A write that PyTorch does not version (through ``p.data``) is not
        seen: see ``docs/distributed.md``."""
        out: list[Tensor | None] = []
        missing: list[int] = []
        kept = self.param_squares
        for q, i in enumerate(self.direct):
            p = params[i]
            entry = kept.get(q)
            if (
                entry is not None
                and entry[1] is p
                and entry[2] == p._version
                and entry[3] == self.dtensor_versions[q]
            ):
                out.append(entry[0])
            else:
                out.append(None)
                missing.append(q)
        if missing:
            fresh = _lists.local_norms([params[self.direct[q]] for q in missing])
            for q, norm in zip(missing, fresh, strict=True):
                out[q] = norm.square()
        self.reused_squares = len(out) - len(missing)
        return cast(list[Tensor], out)

    def _emits_squares(self) -> bool:
        """Whether the direct params' steps return their new sums of squares: a sharded group
        whose partials passes take the params' norms (see :meth:`_param_squares`)."""
        return self.sharded and any(
            kind.startswith("norms:") and "p" in kind[len("norms:") :]
            for _, kinds in self.gradient_passes.values()
            for kind in kinds
        )

    def _label(self, i: int) -> Stages:
        """Param ``i``'s leaf labels (``()`` for a transform without)."""
        return () if self.labels is None else self.labels[i]

    def _step_direct(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        outer: list[Any],
        ratio: float | Tensor,
        totals: list[list[Tensor]],
        found: Stages,
    ) -> list[Any]:
        """The direct params, one compiled call each, each given its ``totals``
        (:func:`leaf_step`): the transform's
        update of that param alone, its state written in place and ``p + ratio u`` into its
        own storage (not where the stage's update is negative zeros); its gradient is read
        where it is and never written. Returns ``outer`` with the new values of the state that
        is not per parameter (every call computes the same ones)."""
        kinds = [kind for kind, _ in self.slots]
        known = len(totals[0])
        given, pack = self._given(outer)
        squares = self._emits_squares()
        step = self._leaf_kernel(known, found, pack, squares)
        assert step is not None

        def kernel_for(stages_: Stages) -> _kernels.Kernel:
            out = step if stages_ is found else self._leaf_kernel(known, stages_, pack, squares)
            assert out is not None
            return out

        names = [name for kind, name in self.slots if kind == "param"]
        packed = pack.pack(given)
        scales: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        kept = self.param_squares
        self.param_squares = {}  # (kept again below once written: a step that raises drops it)
        for q, (i, own) in enumerate(zip(self.direct, totals, strict=True)):
            p = params[i]
            scale = scales.get((p.dtype, p.device))
            if scale is None:
                scale = scales[p.dtype, p.device] = ratio_argument(ratio, p)
            args: tuple[Tensor, ...] = (grads[i], p, scale)
            args += (*[self.state_views[name][i] for name in names], *packed, *self.leaf_outs)
            new = labelled_call(
                kernel_for, self.leaf_kernels, (i, known), found, self._label(i), (*args, *own)
            )
            if isinstance(new, Tensor):
                kept[q] = (new, p, p._version, self.dtensor_versions[q])
        if squares:
            self.param_squares = kept
        news = iter(pack.unpack([x.clone() for x in self.leaf_outs]))
        return [next(news) if k in GIVEN else x for x, k in zip(outer, kinds, strict=True)]


def _reads_params(tx: GradientTransformation, updates: Packed, state: Any) -> bool:
    """Whether ``tx``'s update reads the params: its pure update without them raises."""
    try:
        tx.update(updates, state, None)
    except (ValueError, TypeError):
        return True
    return False


def direct_params(tx: GradientTransformation, params: Sequence[Tensor], least: int) -> list[int]:
    """The params of a group that step one at a time in their own storage: for a transform
    that treats every leaf on its own (:func:`functional_opt.base.leafwise`), the contiguous
    params of at least ``least`` elements that share memory with no other param of the group.
    Each costs one call of a compiled kernel (about 10-30 us of dispatch), and saves copying
    its gradient into a buffer and its update out of one (two passes over its memory)."""
    if not leafwise(tx, reductions=True):
        return []
    shared = {i for cluster in _lists.overlapping(params) for i in cluster}
    return [
        i
        for i, p in enumerate(params)
        if p.numel() >= least and p.is_contiguous() and i not in shared
    ]


def _add(
    params: list[Tensor], updates: list[Tensor], ratio: float | Tensor, fused: bool = False
) -> None:
    """``p += ratio * u`` for each pair, one multi-tensor add (``fused``: see
    :func:`functional_opt._lists.add_into`)."""
    if isinstance(ratio, Tensor):
        torch._foreach_add_(params, [u * ratio.to(u.device) for u in updates])
    elif ratio == 1.0:
        _lists.add_into(params, updates, fused=fused)
    else:
        torch._foreach_add_(params, updates, alpha=ratio)


class _NoPieces(Exception):
    """The pieces cannot take this step (:meth:`PackedGroup._step_in_pieces`): the group takes
    the whole-buffer route from now on."""


class NotPackable(Exception):
    """The group cannot step on packed buffers (it steps through the generic path)."""


def packable(
    tx: GradientTransformation,
    params: list[Tensor],
    grads: list[Tensor | None],
    shapes: Sequence[torch.Size | bool],
) -> bool:
    """Whether a group can step on packed buffers (see the module docstring). ``shapes``: per
    param, what :func:`template_shapes` found in its state templates. Each check reads one
    attribute of every tensor (``_lists.column``): over 2000 params a Python loop of these
    checks cost as much as the step's kernels."""
    if torch.compiler.is_compiling() or not params or not fusable(tx):
        return False
    if any(g is None for g in grads):
        return False
    tensors = cast(list[Tensor], grads)
    if not _lists._PLAIN.issuperset(map(type, params)):
        return False
    if not _lists._PLAIN.issuperset(map(type, tensors)):
        return False
    device = params[0].device
    if any(d != device for d in _lists.column(params, "device")):
        return False
    if any(d != device for d in _lists.column(tensors, "device")):
        return False
    if _lists.column(tensors, "dtype") != _lists.column(params, "dtype"):
        return False
    if any(_lists.column(tensors, "is_sparse")):
        return False
    if any(x != torch.strided for x in _lists.column(params, "layout")):
        return False
    if len({id(p) for p in params}) != len(params):
        return False
    now = _lists.column(params, "shape")
    return now == shapes or all(
        s is True or (s is not False and s == n) for s, n in zip(shapes, now, strict=True)
    )


def template_shapes(templates: list[dict[str, Tensor]]) -> list[torch.Size | bool]:
    """Per param, the one shape of its per-parameter state (templates of state name -> tensor),
    which is then the shape the param must have to step on packed buffers; ``True`` for a param
    with no such state (any shape), ``False`` where its states' shapes differ (never)."""
    out: list[torch.Size | bool] = []
    for entry in templates:
        found = {t.shape for t in entry.values()}
        out.append(True if not found else found.pop() if len(found) == 1 else False)
    return out


def shards_of(
    tx: GradientTransformation,
    params: list[Tensor],
    grads: list[Tensor | None],
    templates: list[dict[str, Tensor]],
) -> _lists.Shards | None:
    """For a group of ``DTensor`` params that can step on packed buffers over their local
    shards (see the module docstring): the shards and their process group; else ``None``.
    Every gradient must be a ``DTensor`` of its param's mesh and placements whose local tensor
    is plain, dense, of the local shard's shape, dtype and device. What is checked is the same
    on every rank (types, placements, whole shapes), so all ranks take the same path."""
    if torch.compiler.is_compiling() or not params or not fusable(tx):
        return None
    shards = _lists.local_shards(params)
    if shards is None:
        return None
    device = shards.locals[0].device
    dtensor = _lists.dtensor_type()
    for p, g, local in zip(params, grads, shards.locals, strict=True):
        if g is None or type(g) is not dtensor or local.device != device:
            return None
        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        if g.device_mesh is not mesh and g.device_mesh != mesh:  # type: ignore[attr-defined]
            return None
        if g.placements != placements:  # type: ignore[attr-defined]
            return None
        lg = g._local_tensor  # type: ignore[attr-defined]
        if type(lg) is not Tensor or lg.layout != torch.strided or lg.device != device:
            return None
        if lg.dtype != local.dtype or lg.shape != local.shape:
            return None
    if len({id(p) for p in params}) != len(params):
        return None
    ok = all(
        t.shape == p.shape
        for p, entry in zip(params, templates, strict=True)
        for t in entry.values()
    )
    return shards if ok else None


def templates_by_name(templates: list[dict[str, Tensor]]) -> dict[str, list[Tensor]]:
    """Per state name, each param's template (meta tensors of the state's dtype)."""
    names = sorted({n for t in templates for n in t})
    out: dict[str, list[Tensor]] = {}
    for name in names:
        if not all(name in t for t in templates):
            raise NotPackable(f"state {name} is not kept for every parameter")
        out[name] = [t[name] for t in templates]
    return out


def flatten_to_packed(state: Any, slots_type: type) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``state`` down to its packed subtrees, param slots and group-level leaves."""
    return optree.tree_flatten(
        state,
        is_leaf=lambda x: isinstance(x, (Packed, slots_type)),
        none_is_leaf=True,
        namespace=tree.NAMESPACE,
    )
