"""The fast path of :class:`DreamerV3Optimizer`: flat buffers for gradients and moments, and
compiled kernels.

A DreamerV3 step is elementwise work over ``g, p, nu, mu`` plus the per-tensor norms of ``g``
and ``p`` that adaptive clipping needs. For each (device, dtype) bucket of a param group this
path keeps the gradients and both moments in contiguous flat buffers (each ``.grad`` and each
state entry is a view into them, as DDP's ``gradient_as_bucket_view`` does for gradients). The
params themselves stay where the user put them: their storage, offset and strides never change.

The buffers are laid out in *runs* of tensors of equal size, so a run of ``rows`` tensors of
``size`` elements is a 2-D view ``[rows, size]`` of each buffer. A param is updated on one of
four routes:

* **Direct** (at least :data:`DIRECT` elements, contiguous, at the start of its storage, sharing
  memory with no other param of the group): its norms (BLAS dot products for float32/64, a
  compiled cascade sum for 16-bit params), its clip factor, then one call of the compiled
  kernel on a ``[1, n]`` view of the param's own storage and its rows of the gradient and
  moment buffers. Large float32/64 params are taken one at a time, so that the kernel finds
  ``g`` and ``p`` still in cache from the norms.
* **Staged** (smaller params in runs of at least :data:`MERGE` elements, and params the direct
  route cannot take): a piece of a run (about :data:`PIECE` elements) is copied into a scratch
  buffer (one ``torch.cat``), its norms are taken there, one kernel call updates its moments'
  rows and writes the params' updates over their copies, and one pass adds the updates into
  the params' own storages while the piece is still in cache (torch's fused SGD kernel with
  ``lr = -1``: the same bits as the copy back of ``p + u`` it replaces, in half its time over
  many small params; 16-bit, non-contiguous and other-device params get ``p + u`` copied
  back).
* **Merged** (runs of fewer than :data:`MERGE` elements in all): copied into the scratch
  buffer and back together, updated by one kernel call per run if the bucket has staged or
  direct params (so compiles kernels anyway), else by one eager pass with the clip factor
  spread per element (a small model's step compiles nothing).
* **Shared** (params whose memory overlaps another param of the group, e.g. weights tied by
  storage): every update is computed from the values before the step and added into the
  shared memory one param after the other, in the group's order, as the generic
  :class:`~functional_opt.adapters.TransformOptimizer` step adds them (tied weights stay tied).

The kernel reads ``g, p, nu, mu`` and writes ``nu, mu, p`` with the clip factors and step sizes
broadcast per row; gradients are never modified (the clip is applied inside the kernel, in the
moments' dtype: float32 for 16-bit params, as the generic path does). The math is that of
``functional_opt.dreamerv3`` (and torchrl's optimizer), checked against a float64 oracle and the
generic path in the tests. A gradient that is not already a view of the bucket (a fresh
``.grad`` after ``zero_grad(set_to_none=True)``) is copied in first and replaced by its view.
Params without a gradient are masked out per tensor (their state and value are untouched).

With ``own_param_storage=True`` (opt-in) the bucket instead moves the params into a flat buffer
of its own (``p.data`` becomes a view into it), so every run is updated in place with one
kernel call and nothing is copied; see :class:`~functional_opt.adapters.DreamerV3Optimizer` for
what that costs the user.

The path is used for plain dense tensors whose options are Python numbers, and for FSDP2/HSDP
``DTensor`` params over their local shards (every param's local squared norms are then summed
over the ranks in one ``all_reduce`` before the kernels run: :meth:`FlatBucket.squares`);
anything else (other ``DTensor`` placements, sparse gradients, tensor options, memory shared
across dtypes) goes through the generic :class:`~functional_opt.adapters.TransformOptimizer`
step. If ``torch.compile`` is unavailable or fails, the same kernels run eagerly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import _kernels, _lists
from functional_opt._kernels import apply_kernel, update_kernel, update_kernel_donated
from functional_opt.transforms.clipping import agc_factors_from_norms
from functional_opt.transforms.moments import moment_dtype

__all__ = ["FlatBucket", "eligible_options", "eligible_params"]


def _row_norms(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The L2 norm of each row of ``x`` in ``dtype`` (a cascade sum: more accurate than
    ``vector_norm``, and without a widened copy of 16-bit inputs)."""
    y = x.to(dtype)
    return torch.sqrt((y * y).sum(-1))


def _math_scalars(values: Sequence[float], device: torch.device) -> list[Tensor]:
    """The kernels' scalar arguments ``inv_bc2, beta1, beta2, eps`` (see :func:`_apply`), in
    float64. For params on the CPU, one vector of the four (:func:`_unpacked` takes them apart
    inside the kernel: the same 0-d values, the same arithmetic): dynamo traces a 0-d float64
    CPU tensor argument as a symbolic float (its ``item()``) that the compile cannot keep, and
    then traces and compiles the kernel a second time (1-2 s of a first step). Elsewhere, four
    0-d CPU tensors (the device's kernels take those as scalars)."""
    if device.type == "cpu":
        return [torch.tensor(list(values), dtype=torch.float64)]
    return [torch.tensor(x, dtype=torch.float64) for x in values]


def _unpacked(scalars: Sequence[Tensor]) -> list[Tensor]:
    """:func:`_math_scalars`' tensors as four 0-d ones."""
    if len(scalars) == 1:
        return list(scalars[0].unbind())
    return list(scalars)


def _apply(
    g: Tensor,
    p: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    *scalars: Tensor,
) -> None:
    """:func:`functional_opt._kernels.apply_kernel` with the gradient taken in the moments'
    dtype, so that the clipped gradient of a 16-bit param is never rounded back to 16 bits
    (compiled, the widening is fused into the kernel: no copy); ``scalars``: ``inv_bc2, beta1,
    beta2, eps`` as :func:`_math_scalars` gives them."""
    inv_bc2, beta1, beta2, eps = _unpacked(scalars)
    apply_kernel(g.to(nu.dtype), p, nu, mu, factor, step_size, inv_bc2, beta1, beta2, eps)


def _delta(
    g: Tensor,
    p: Tensor,
    nu: Tensor,
    mu: Tensor,
    factor: Tensor,
    step_size: Tensor,
    *scalars: Tensor,
) -> None:
    """:func:`_apply` (the same arguments) with the update ``u = step_size mu'`` written into
    ``p`` (a staged copy of the params, read before for their norms) instead of ``p + u``: the
    params then get ``u`` added in their own storage (:func:`functional_opt._lists.add_into`).
    ``p + u`` rounds as in :func:`_apply`, so the values are the same; only for params in the
    moments' dtype."""
    math = _unpacked(scalars)
    p.copy_(update_kernel_donated(g.to(nu.dtype), nu, mu, factor, step_size, *math))


def _factor_from_squares(g_square: Tensor, p_square: Tensor, agc: Tensor, pmin: Tensor) -> Tensor:
    """The clip factor of one tensor (``[1, 1]``) from ``||g||^2`` and ``||p||^2`` (0-d)."""
    return agc_factors_from_norms(g_square.sqrt(), p_square.sqrt(), agc, pmin).view(1, 1)


MERGE = 1 << 16
"""Runs with fewer elements than this (all their tensors together) share one eager pass."""

DIRECT = 1 << 15
"""Contiguous params with at least this many elements, at the start of their storage, are
updated in their own storage, one kernel call each (below it, copying a param into a staged run
and back measured cheaper than the calls of its own: norms, clip factor, kernel)."""

INTERLEAVE = 1 << 17
"""Direct float32/64 params with at least this many elements take their norms right before
their kernel call (below it, the compiled call of the clip factor costs more than finding ``g``
and ``p`` in cache saves)."""

PIECE = 1 << 18
"""Staged runs are updated in pieces of about this many elements (copied in, updated and
copied back while in cache)."""

PAD = 32
"""Elements left unused at the start of each flat buffer (see :class:`FlatBucket`)."""

DOT_ROWS = 1 << 14
DOT_MAX_COUNT = 256
"""Norms of runs of at most ``DOT_MAX_COUNT`` float32/64 tensors of at least ``DOT_ROWS``
elements are BLAS dot products, one per tensor."""


def eligible_params(params: Sequence[Tensor]) -> bool:
    """Whether the flat path can hold these params: plain dense floating tensors."""
    return all(
        type(p) in (Tensor, torch.nn.Parameter)
        and p.layout == torch.strided
        and p.is_floating_point()
        for p in params
    )


def eligible_options(options: dict[str, Any]) -> bool:
    """Whether a group's options are Python numbers (tensor options take the generic path)."""
    return all(
        isinstance(options[k], (int, float)) and not isinstance(options[k], bool)
        for k in ("lr", "agc", "parameter_norm_min", "beta1", "beta2", "eps", "warmup_steps")
    )


_GRAD = operator.attrgetter("grad")


def _eligible_grad(g: Tensor, view: Tensor) -> bool:
    return (
        type(g) is Tensor
        and g.layout == torch.strided
        and g.shape == view.shape
        and g.device == view.device
    )


def _local(x: Tensor) -> Tensor:
    """A ``DTensor``'s local shard (the shard itself, not a copy), or ``x``."""
    local: Tensor = getattr(x, "_local_tensor", x)
    return local


class Run(NamedTuple):
    """``rows`` tensors of ``size`` elements each, starting at tensor ``first`` and element
    ``offset`` of the bucket."""

    first: int
    rows: int
    size: int
    offset: int


def _runs(sizes: Sequence[int], first: int, offset: int) -> list[Run]:
    """Runs of consecutive equal ``sizes`` (tensor ``first`` at element ``offset``)."""
    out: list[Run] = []
    for n in sizes:
        if out and out[-1].size == n:
            out[-1] = out[-1]._replace(rows=out[-1].rows + 1)
        else:
            out.append(Run(first, 1, n, offset))
        first += 1
        offset += n
    return out


class FlatBucket:
    """The params of one (device, dtype) bucket of a group, with their gradients and moments in
    flat buffers.

    Layout of the buffers: the *merged* region (the runs small enough to share one eager pass),
    the *staged* runs, the *shared* params (in the group's order), then the *direct* params;
    merged and staged runs are sorted by size, and every run is a 2-D view ``[rows, size]``. The
    scratch buffer ``p`` covers the merged and staged regions (with ``own_param_storage``: every
    param, all of them merged or staged, and it *is* the params' storage).
    """

    def __init__(
        self,
        params: list[Tensor],
        shared: Collection[int] = (),
        own_param_storage: bool = False,
        keys: Sequence[Tensor] | None = None,
        group: Any = None,
        positions: Sequence[int] | None = None,
    ) -> None:
        """``params`` are plain tensors. For a sharded group they are the local shards of the
        ``DTensor`` params ``keys`` (whose ``.grad`` and optimizer-state entries the bucket then
        serves, as ``DTensor``s of the params' placements wrapping its views), and ``group`` is
        the process group over which the shards' partial sums add up (``None``: no sum across
        ranks, every param replicated). ``positions``: each param's index in its param group
        (default: its index in ``params``)."""
        self.own = own_param_storage
        self.sharded = keys is not None
        self.group = group
        self.kernels: dict[Callable[..., Any], _kernels._Compiled] = {}
        """Compiled kernels of the per-param calls (see :meth:`_call`)."""
        shared = set() if own_param_storage else set(shared)
        by_size: dict[int, list[int]] = {}
        direct: list[int] = []
        shared_order = [i for i in range(len(params)) if i in shared]
        for i, p in enumerate(params):
            if i in shared:
                continue
            if (
                not own_param_storage
                and p.numel() >= DIRECT
                and p.is_contiguous()
                and p.storage_offset() == 0
            ):
                direct.append(i)
            else:
                by_size.setdefault(p.numel(), []).append(i)
        merged = sorted(n for n, idx in by_size.items() if n * len(idx) < MERGE)
        staged = sorted(n for n, idx in by_size.items() if n * len(idx) >= MERGE)
        direct.sort(key=lambda i: params[i].numel())
        order = [i for n in merged + staged for i in by_size[n]] + shared_order + direct
        self.params = [params[i] for i in order]
        self.keys: list[Tensor] = self.params if keys is None else [keys[i] for i in order]
        self.positions = torch.tensor(
            [order[k] if positions is None else positions[order[k]] for k in range(len(order))]
        )
        """Each param's index in its param group, in bucket order: the bucket orders params by
        their (local) sizes, which may differ between ranks; the group's order does not."""
        self.group_order = self.positions.tolist()
        """What holds each param's ``.grad`` and state: the param, or its ``DTensor``."""
        self.sizes = [p.numel() for p in self.params]
        n_merged = sum(len(by_size[n]) for n in merged)
        n_staged = n_merged + sum(len(by_size[n]) for n in staged)
        n_shared = n_staged + len(shared_order)
        self.merged_tensors = n_merged
        self.merged_numel = sum(self.sizes[:n_merged])
        self.staged_numel = sum(self.sizes[:n_staged])
        self.shared_slice = slice(n_staged, n_shared)
        self.shared_offset = self.staged_numel
        self.shared_numel = sum(self.sizes[self.shared_slice])
        first = params[0]
        mdtype = moment_dtype(first, "float32_for_16bit")
        device = first.device
        total = sum(self.sizes)
        scratch = total if own_param_storage else self.staged_numel
        # Each buffer starts PAD elements into its storage, so that no view of it passed to a
        # compiled kernel is at offset 0 or 1 (values that dynamo specializes on: the first
        # call of a signature at offset 0 would make the next one, at another offset, compile
        # a second graph, and all later calls go through dynamo).
        self.p = torch.empty(PAD + scratch, dtype=first.dtype, device=device)[PAD:]
        self.g = torch.zeros(PAD + total, dtype=first.dtype, device=device)[PAD:]
        self.nu = torch.zeros(PAD + total, dtype=mdtype, device=device)[PAD:]
        self.mu = torch.zeros(PAD + total, dtype=mdtype, device=device)[PAD:]
        self.g_views = self._views(self.g)
        self.nu_views = self._views(self.nu)
        self.mu_views = self._views(self.mu)
        self.p_views = self._views(self.p, len(self.params) if own_param_storage else n_staged)
        """Views of the scratch buffer shaped like the params it covers."""
        self.grad_entries = self._entries(self.g_views)
        self.nu_entries = self._entries(self.nu_views)
        self.mu_entries = self._entries(self.mu_views)
        """What ``.grad`` and the state entries are set to: the views (``DTensor``s wrapping
        them for a sharded bucket)."""
        self.merged_runs = _runs(self.sizes[:n_merged], 0, 0)
        self.staged_runs = _runs(self.sizes[n_merged:n_staged], n_merged, self.merged_numel)
        self.direct = list(range(n_shared, len(self.params)))
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.piece_numel = 0 if own_param_storage else PIECE
        self.pieces = self._pieces()
        self.merged_sizes = torch.tensor(self.sizes[:n_merged], device=device)
        """The sizes that spread the merged tensors' clip factors per element."""
        self.merged_compiled = bool(self.pieces or self.direct)
        """Whether the merged runs are updated by the compiled kernel, one call per run (when
        the bucket compiles kernels anyway: measured 0.5 ms a step faster than the eager pass
        over DreamerV3's 60 bias vectors), rather than by one eager pass."""
        self.step_rows = torch.empty((len(self.params), 1), dtype=mdtype, device=device)
        """The row buffer that carries each tensor's step size into the kernel."""
        with torch.no_grad():
            if own_param_storage:
                torch._foreach_copy_(self.p_views, [p.detach() for p in self.params])
                for p, view in zip(self.params, self.p_views, strict=True):
                    p.data = view
            self.targets = [p.detach() for p in self.params]
            """The params (detached aliases), written by the scatter and the direct kernel."""
            self.flat_targets = [t.view(-1) if t.is_contiguous() else t for t in self.targets]
            self.gather_by_cat = all(t.is_contiguous() for t in self.targets[:n_staged])
        self.add_back = (
            not own_param_storage
            and self.gather_by_cat
            and first.dtype == mdtype
            and device.type in ("cpu", "cuda")
        )
        """Whether the merged and staged params get their update added in their own storage
        (:func:`_delta`, then :func:`functional_opt._lists.add_into`) instead of their new
        values copied back; not while ``torch.compile`` traces the step (the fused SGD kernel
        has no fake implementation)."""
        self.direct_args = {
            i: (
                self.g_views[i].view(1, -1),
                self.targets[i].view(1, -1),
                self.nu_views[i].view(1, -1),
                self.mu_views[i].view(1, -1),
                self.g_views[i].view(-1),
                self.flat_targets[i],
                self.step_rows[i : i + 1],
            )
            for i in self.direct
        }
        """Per direct param: its ``[1, n]`` rows of the gradient, the param, both moments, its flat
        gradient and param, and its step-size slot."""
        self.data_ptrs = self._data_ptrs()
        self.param_squares: dict[int, tuple[Tensor, int, int]] = {}
        """A sharded bucket's float32/64 direct params' sums of squares of their local shards,
        taken by their last step's kernels as they wrote them: per direct param, ``(value,
        shard version, DTensor version)`` (see :meth:`squares`)."""
        self.reused_squares = 0
        """How many of them the last :meth:`squares` took from there instead of reading the
        shard (a diagnostic)."""
        self.everyone = list(range(len(self.params)))
        self.unbound = set(self.everyone)
        """Params whose optimizer-state entries are not yet the bucket's views."""

    def _pieces(self) -> list[Run]:
        """The staged runs, long ones cut into pieces of about :data:`PIECE` elements (with
        ``own_param_storage`` nothing is copied: whole runs)."""
        if not self.piece_numel:
            return list(self.staged_runs)
        out = []
        for run in self.staged_runs:
            step = max(1, self.piece_numel // run.size)
            for k in range(0, run.rows, step):
                rows = min(step, run.rows - k)
                out.append(Run(run.first + k, rows, run.size, run.offset + k * run.size))
        return out

    def _views(self, flat: Tensor, count: int | None = None) -> list[Tensor]:
        params = self.params[:count]
        sizes = self.sizes[: len(params)]
        head = flat[: sum(sizes)]
        return [v.view_as(p) for v, p in zip(torch.split(head, sizes), params, strict=True)]

    def _entries(self, views: list[Tensor]) -> list[Tensor]:
        return _lists.like_shards(views, self.keys) if self.sharded else views

    def _data_ptrs(self) -> list[int]:
        if self.sharded:
            return [_local(k).data_ptr() for k in self.keys]
        return list(map(Tensor.data_ptr, self.params))

    def intact(self) -> bool:
        """Whether every param still has the memory it had when the bucket was built (nobody
        re-pointed ``p.data``, or a ``DTensor``'s local shard)."""
        return self._data_ptrs() == self.data_ptrs

    def adopt_state(self, states: dict[Tensor, dict[str, Any]], names: tuple[str, str]) -> None:
        """Make ``states[p][names]`` the bucket's views, copying values that live elsewhere
        (after ``load_state_dict``, or state made by the generic path)."""
        rms, momentum = names
        for i, key in enumerate(self.keys):
            entry = states.get(key)
            if not entry:
                continue
            for name, views, entries in (
                (rms, self.nu_views, self.nu_entries),
                (momentum, self.mu_views, self.mu_entries),
            ):
                current = entry.get(name)
                if current is None or current is entries[i]:
                    continue
                if self.sharded:
                    current = _lists.local_like(current, key)
                if current.data_ptr() != views[i].data_ptr():
                    views[i].copy_(current)
                entry[name] = entries[i]
            self.unbound.discard(i)

    def bind_state(
        self, states: dict[Tensor, dict[str, Any]], names: tuple[str, str], present: list[int]
    ) -> None:
        """Give the params at ``present`` that have no state entry yet the bucket's views (in
        the group's order: ``state_dict`` keeps the insertion order, and gathering a sharded
        state issues one collective per entry in that order, which must agree across ranks)."""
        if not self.unbound:
            return
        for i in sorted(present, key=self.group_order.__getitem__):
            if i in self.unbound:
                entry = states[self.keys[i]]
                entry[names[0]] = self.nu_entries[i]
                entry[names[1]] = self.mu_entries[i]
                self.unbound.discard(i)

    @staticmethod
    def _rows(flat: Tensor, run: Run) -> Tensor:
        return flat[run.offset : run.offset + run.rows * run.size].view(run.rows, run.size)

    def _run_norms(self, rows: Tensor, squared: bool = False) -> Tensor:
        """The L2 norm of each row of ``rows`` (in the moment dtype; its square with
        ``squared``).

        Long float32/float64 rows use BLAS dot products (one stream at full read bandwidth);
        other float32/64 runs and small runs one eager ``vector_norm``; long 16-bit runs a
        compiled cascade sum (no widened copy; like the dot products, more accurate than
        ``vector_norm``)."""
        mdtype = self.nu.dtype
        count, size = rows.shape
        if rows.dtype == mdtype and size >= DOT_ROWS and count <= DOT_MAX_COUNT:
            dots = torch.stack([torch.dot(r, r) for r in rows])
            return dots if squared else dots.sqrt_()
        out: Tensor
        if rows.dtype == mdtype or count * size < MERGE:
            out = torch.linalg.vector_norm(rows, dim=1, dtype=mdtype)
        else:
            out = _kernels.call(_row_norms, rows, mdtype)
        return out.square() if squared else out

    @staticmethod
    def _factors(g_norms: Tensor, p_norms: Tensor, agc: float, pmin: float) -> Tensor:
        """Each tensor's clip factor ``1 / max(1, ||g|| / (agc max(pmin, ||p||)))``."""
        return agc_factors_from_norms(g_norms, p_norms, agc, pmin)

    def _run_factors(
        self, run: Run, agc: float, pmin: float, factors: Tensor | None = None
    ) -> Tensor:
        if factors is not None:
            return factors[run.first : run.first + run.rows]
        if agc <= 0:
            return torch.ones(run.rows, dtype=self.nu.dtype, device=self.g.device)
        p_norms = self._run_norms(self._rows(self.p, run))
        return self._factors(self._run_norms(self._rows(self.g, run)), p_norms, agc, pmin)

    def _step_direct(
        self,
        indices: list[int],
        agc: float,
        pmin: float,
        scalars: list[Tensor],
        factors: Tensor | None = None,
    ) -> None:
        """The direct params: norms, clip factors, then one kernel call per param on its own
        storage. Float32/64 params of at least :data:`INTERLEAVE` elements are taken one at a
        time (norms by BLAS dot products, the clip factor by a compiled call, then the kernel,
        which finds ``g`` and ``p`` still in cache from the norms); the others have their norms
        taken first and their clip factors computed together (16-bit: a compiled cascade sum
        per param, without widened copies). (Folded into the kernel, the clip factor's scalar
        math would run once per vector of elements: measured up to 40% slower.)"""
        mdtype = self.nu.dtype
        device = self.g.device
        if factors is not None:  # given (a sharded step's, from all-reduced norms)
            rows = factors.view(-1, 1)
            wide = self.g.dtype == mdtype
            kept, self.param_squares = self.param_squares, {}  # (a step that raises drops it)
            for i in indices:
                g, p, nu, mu, _, flat_p, step_size = self.direct_args[i]
                self._call(_apply, g, p, nu, mu, rows[i : i + 1], step_size, *scalars)
                if wide:  # the new param's sum of squares, for the next step's norms
                    value = torch.dot(flat_p, flat_p)  # (while the param is in cache)
                    kept[i] = (value, self.params[i]._version, self.keys[i]._version)
            self.param_squares = kept
            return
        if agc <= 0:
            one = torch.ones((1, 1), dtype=mdtype, device=device)
            for i in indices:
                g, p, nu, mu, _, _, step_size = self.direct_args[i]
                self._call(_apply, g, p, nu, mu, one, step_size, *scalars)
            return
        wide = self.g.dtype == mdtype
        one_by_one = [i for i in indices if wide and self.sizes[i] >= INTERLEAVE]
        together = [i for i in indices if not wide or self.sizes[i] < INTERLEAVE]
        if together:
            args = [self.direct_args[i] for i in together]
            if wide:  # float32/64: BLAS dot products
                squares = [torch.dot(a[4], a[4]) for a in args]
                squares += [torch.dot(a[5], a[5]) for a in args]
                norms = torch.stack(squares).sqrt_().view(2, -1)
                factors = self._factors(norms[0], norms[1], agc, pmin).view(-1, 1)
            else:  # 16-bit: a compiled cascade sum, without widened copies
                pairs = [self._call(_kernels.norm_pair, a[4], a[5], mdtype) for a in args]
                norms = torch.stack(pairs)
                factors = self._factors(norms[:, 0], norms[:, 1], agc, pmin).view(-1, 1)
            for k, (g, p, nu, mu, _, _, step_size) in enumerate(args):
                self._call(_apply, g, p, nu, mu, factors[k : k + 1], step_size, *scalars)
        if one_by_one:
            clip = torch.tensor(agc, dtype=mdtype, device=device)
            floor = torch.tensor(pmin, dtype=mdtype, device=device)
            for i in one_by_one:
                g, p, nu, mu, flat_g, flat_p, step_size = self.direct_args[i]
                g_square, p_square = torch.dot(flat_g, flat_g), torch.dot(flat_p, flat_p)
                factor = self._call(_factor_from_squares, g_square, p_square, clip, floor)
                self._call(_apply, g, p, nu, mu, factor, step_size, *scalars)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``_kernels.call(fn, *args)`` for the per-param calls of direct params. Once ``fn``
        runs without dynamo, later calls go to its compiled kernel straight (every direct param
        of a bucket has the same signature), skipping the work of finding the kernel for the
        arguments: a step makes one such call per param, each with caches cold from the
        previous param's update."""
        kernel = self.kernels.get(fn)
        if kernel is not None and kernel.direct is not None:
            return kernel(*args)
        out = _kernels.call(fn, *args)
        if not torch.compiler.is_compiling():
            self.kernels[fn] = _kernels.compiled(fn, *args)
        return out

    def plan_grads(self) -> tuple[list[int], list[int]] | None:
        """The bucket indices of the params with a gradient, and of those whose gradient is
        not a view of the bucket (to copy in: :meth:`take_grads`); ``None`` if a gradient is
        one the flat path cannot take (sparse, a tensor subclass, another shape). Changes
        nothing."""
        entries = self.grad_entries
        if all(map(operator.is_, map(_GRAD, self.keys), entries)):  # the usual step
            return self.everyone, []
        present = []
        copy = []
        for i, (key, entry) in enumerate(zip(self.keys, entries, strict=True)):
            g = key.grad
            if g is None:
                continue
            present.append(i)
            if g is not entry:
                if self._grad_source(i, g) is None:
                    return None
                copy.append(i)
        return present, copy

    def _grad_source(self, i: int, g: Tensor) -> Tensor | None:
        """The plain tensor to copy param ``i``'s gradient ``g`` from (its local shard for a
        sharded bucket), or ``None`` if the flat path cannot take it."""
        view = self.g_views[i]
        if self.sharded:
            key = self.keys[i]
            if (
                type(g) is not type(key)
                or g.device_mesh != key.device_mesh  # type: ignore[attr-defined]
                or g.placements != key.placements  # type: ignore[attr-defined]
            ):
                return None
            g = _local(g)
        return g if _eligible_grad(g, view) else None

    def take_grads(self, plan: tuple[list[int], list[int]]) -> list[int]:
        """Copy the gradients of ``plan`` (from :meth:`plan_grads`) that are not views of the
        bucket in (their ``.grad`` becomes the view); returns the params with a gradient."""
        present, copy = plan
        if copy:
            views = self.g_views
            grads = [self._grad_source(i, self.keys[i].grad) for i in copy]  # type: ignore[arg-type]
            torch._foreach_copy_([views[i] for i in copy], grads)  # type: ignore[arg-type]
            for i in copy:
                self.keys[i].grad = self.grad_entries[i]
        return present

    def squares(self) -> Tensor:
        """``[2, n]``: each param's local ``||g||^2`` and ``||p||^2`` (bucket order, moment
        dtype), what a sharded step sums over the ranks (one collective for all of them) before
        :meth:`step` takes them as ``squares``. Copies the merged and staged params into the
        scratch buffer, where their runs' norms are taken and where that step finds them."""
        mdtype = self.nu.dtype
        self._gather(0, self.shared_slice.start)
        g_sq: list[Tensor] = []
        p_sq: list[Tensor] = []
        for run in (*self.merged_runs, *self.staged_runs):
            g_sq.append(self._run_norms(self._rows(self.g, run), squared=True))
            p_sq.append(self._run_norms(self._rows(self.p, run), squared=True))
        singles: list[Tensor] = []
        for i in range(self.shared_slice.start, self.shared_slice.stop):
            singles.append(torch.linalg.vector_norm(self.g_views[i], dtype=mdtype).square())
            singles.append(torch.linalg.vector_norm(self.targets[i], dtype=mdtype).square())
        wide = self.g.dtype == mdtype
        self.reused_squares = 0
        for i in self.direct:
            flat_g, flat_p = self.direct_args[i][4:6]
            if wide:  # BLAS dot products (the param's, unless its last step took it)
                known = self._param_square(i)
                self.reused_squares += known is not None
                p_square = torch.dot(flat_p, flat_p) if known is None else known
                singles += [torch.dot(flat_g, flat_g), p_square]
            else:  # 16-bit: a compiled cascade sum, without widened copies
                singles += list(self._call(_kernels.norm_pair, flat_g, flat_p, mdtype).square())
        if singles:
            pairs = torch.stack(singles).view(-1, 2)
            g_sq.append(pairs[:, 0])
            p_sq.append(pairs[:, 1])
        return torch.stack([torch.cat(g_sq), torch.cat(p_sq)])

    def _param_square(self, i: int) -> Tensor | None:
        """Direct param ``i``'s sum of squares as its last sharded step took it, right after
        its kernel wrote it (the dot product :meth:`squares` would take), where neither its
        shard's nor its ``DTensor``'s version counter has moved since (nothing wrote the param
        in place: ``load_state_dict``, DCP, ``torch.no_grad()`` ops); else ``None``. A write
        PyTorch does not version (through ``p.data``) is not seen: see
        ``docs/distributed.md``."""
        entry = self.param_squares.get(i)
        if entry is None:
            return None
        value, version, outer = entry
        if self.params[i]._version != version or self.keys[i]._version != outer:
            return None
        return value

    def step(
        self,
        present: list[int],
        *,
        lr: float,
        bc1: float,
        bc2: float,
        agc: float,
        pmin: float,
        beta1: float,
        beta2: float,
        eps: float,
        squares: Tensor | None = None,
    ) -> None:
        """One update of the params at ``present`` (from :meth:`take_grads`).

        ``squares`` (a sharded step's): the whole tensors' ``||g||^2`` and ``||p||^2`` of every
        param (:meth:`squares`, summed over the ranks); the clip factors then come from them,
        and the merged and staged params are already in the scratch buffer. Without it each
        route takes its norms itself, interleaved with its kernel calls."""
        factors = None
        if squares is not None and agc > 0:
            factors = self._factors(squares[0].sqrt(), squares[1].sqrt(), agc, pmin)
        gathered = squares is not None
        n_params = len(self.params)
        everyone = len(present) == n_params
        absent = [] if everyone else sorted(set(range(n_params)) - set(present))
        has = None if everyone else set(present)
        for i in absent:
            self.g_views[i].zero_()
        # Params without a gradient keep value and state: the kernels of merged, staged and
        # shared params run over whole runs (their gradient is zero), then what they changed of
        # theirs is put back; the new values of their params are never written back.
        saved = [
            (i, self.nu_views[i].clone(), self.mu_views[i].clone())
            for i in absent
            if i < self.shared_slice.stop or self.own
        ]
        saved_p = [(i, self.p_views[i].clone()) for i in absent] if self.own else []
        self.step_rows.fill_(-lr / bc1)
        add = self.add_back and not torch.compiler.is_compiling()
        kernel = _delta if add else _apply
        values = (1 / bc2, beta1, beta2, eps)
        scalars = _math_scalars(values, self.g.device)
        if self.merged_numel:
            n = self.merged_numel
            if not gathered:
                self._gather(0, self.merged_tensors)
            if factors is not None:
                factor = factors[: self.merged_tensors]
            else:
                parts = [self._run_factors(run, agc, pmin) for run in self.merged_runs]
                factor = parts[0] if len(parts) == 1 else torch.cat(parts)
            if self.merged_compiled:
                for run in self.merged_runs:
                    _kernels.call(
                        kernel,
                        *(self._rows(t, run) for t in (self.g, self.p, self.nu, self.mu)),
                        factor[run.first : run.first + run.rows].view(-1, 1),
                        self.step_rows[run.first : run.first + run.rows],
                        *scalars,
                    )
            else:  # no kernel of its own: eager ops cost less than compiling one
                spread = torch.repeat_interleave(factor, self.merged_sizes, output_size=n)
                g, p, nu, mu = (t[:n].view(1, n) for t in (self.g, self.p, self.nu, self.mu))
                kernel(g, p, nu, mu, spread.view(1, n), self.step_rows[:1], *scalars)
            self._scatter(0, self.merged_tensors, has, add)
        # Piece by piece (a piece is a run, or part of a long run): its params copied into the
        # scratch buffer, their norms, one kernel call, the new values copied back while the
        # piece is still in cache.
        for run in self.pieces:
            if not gathered:
                self._gather(run.first, run.first + run.rows)
            _kernels.call(
                kernel,
                *(self._rows(t, run) for t in (self.g, self.p, self.nu, self.mu)),
                self._run_factors(run, agc, pmin, factors).view(-1, 1),
                self.step_rows[run.first : run.first + run.rows],
                *scalars,
            )
            self._scatter(run.first, run.first + run.rows, has, add)
        if self.shared_numel:
            self._step_shared(has, agc, pmin, scalars, factors)
        direct = self.direct if has is None else [i for i in self.direct if i in has]
        if direct:
            self._step_direct(direct, agc, pmin, scalars, factors)
        for i, nu, mu in saved:
            self.nu_views[i].copy_(nu)
            self.mu_views[i].copy_(mu)
        for i, p in saved_p:
            self.p_views[i].copy_(p)

    def _gather(self, start: int, stop: int) -> None:
        """Copy the params ``start:stop`` (staged) into the scratch buffer."""
        if self.own:
            return
        if self.gather_by_cat:
            lo = self.offsets[start]
            torch.cat(self.flat_targets[start:stop], out=self.p[lo : self.offsets[stop]])
        else:
            torch._foreach_copy_(self.p_views[start:stop], self.targets[start:stop])

    def _scatter(self, start: int, stop: int, has: set[int] | None, add: bool) -> None:
        """Write the params ``start:stop`` (staged) with a gradient back into their own
        storages: their updates added (``add``, what :func:`_delta` left in the scratch
        buffer), or their new values copied (what :func:`_apply` left there)."""
        if self.own:
            return
        if has is None:
            targets, values = self.targets[start:stop], self.p_views[start:stop]
        else:
            back = [i for i in range(start, stop) if i in has]
            targets, values = [self.targets[i] for i in back], [self.p_views[i] for i in back]
        if add:  # (contiguous tensors of one float32/64 dtype: see :attr:`add_back`)
            _lists.add_into(targets, values, fused=True)
        else:
            torch._foreach_copy_(targets, values)

    def _step_shared(
        self,
        has: set[int] | None,
        agc: float,
        pmin: float,
        scalars: list[Tensor],
        factors: Tensor | None = None,
    ) -> None:
        """The params that share memory: every update from the values before the step, then
        added in the group's order (eager: tied weights are rare, not worth a compiled form)."""
        part = self.shared_slice
        members = range(part.start, part.stop)
        lo, hi = self.shared_offset, self.shared_offset + self.shared_numel
        mdtype = self.nu.dtype
        if agc > 0:
            if factors is not None:
                factor = factors[part]
            else:
                g_norms = torch.stack(
                    [torch.linalg.vector_norm(self.g_views[i], dtype=mdtype) for i in members]
                )
                p_norms = torch.stack(
                    [torch.linalg.vector_norm(self.targets[i], dtype=mdtype) for i in members]
                )
                factor = self._factors(g_norms, p_norms, agc, pmin)
            sizes = torch.tensor(self.sizes[part], device=factor.device)
            spread = torch.repeat_interleave(factor, sizes, output_size=hi - lo).view(1, -1)
        else:
            spread = torch.ones((1, 1), dtype=mdtype, device=self.g.device)
        nu, mu = self.nu[lo:hi].view(1, -1), self.mu[lo:hi].view(1, -1)
        nu_new, mu_new, u = update_kernel(
            self.g[lo:hi].view(1, -1).to(mdtype),
            nu,
            mu,
            spread,
            self.step_rows[:1],
            *_unpacked(scalars),
        )
        nu.copy_(nu_new)
        mu.copy_(mu_new)
        updates = torch.split(u.view(-1), self.sizes[part])
        for i, update in zip(members, updates, strict=True):
            if has is None or i in has:
                self.targets[i].add_(update.view_as(self.targets[i]))
