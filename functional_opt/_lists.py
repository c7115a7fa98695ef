"""Elementwise math over lists of tensors: one multi-tensor kernel per op, or one op per leaf.

The fast path calls ``torch._foreach_*`` (which groups tensors by device and dtype internally)
on lists of plain tensors or of ``DTensor``s (whose ``_foreach_*`` ops run shard-wise, as
``torch.optim`` uses them under FSDP2). Other lists (tensors wrapped by ``torch.func.vmap``/
``grad``, other tensor subclasses, plain tensors mixed with ``DTensor``s) go through the plain
per-tensor path, which computes the same formula op by op. Functions return new tensors and never
write into their arguments, except ``moment``/``decay_add`` with ``donate=True`` (donation mode:
the caller gave up the old state), which write into the state buffers they are given.

Reductions of a ``DTensor`` (``norms``, ``global_norm``, ``all_finite``) return **full values**:
plain tensors, equal on every rank, of the whole logical tensor (not the local shard), combined
with one collective per device mesh; they mix with sharded tensors as 0-d scalars. Within
:func:`sharded_reductions` the same reductions take plain tensors that are *local shards* and
sum their partial values over the ranks (what ``TransformOptimizer``'s engine runs under FSDP2).

Ops with a scalar (``mul``, ``add_scalar``, ``div_scalar``) keep each tensor's dtype even for 0-d
tensors, which type promotion would otherwise widen to a 0-d tensor scalar's dtype.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

Scalar = float | Tensor
"""A hyperparameter: a Python number or a 0-d tensor (an injected hyperparameter)."""

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


_PLAIN = frozenset((Tensor, torch.nn.Parameter))


def dtensor_type() -> type[Tensor] | None:
    """The ``DTensor`` class if ``torch.distributed.tensor`` is loaded, else ``None`` (then no
    ``DTensor`` can exist; checking costs no import). Read as an attribute of its parent package
    (set when the submodule loads): dynamo traces that as a constant, where a lookup in
    ``sys.modules`` cost it 0.1 s per call while tracing a chain."""
    module: Any = getattr(torch.distributed, "tensor", None)
    return None if module is None else module.DTensor  # type: ignore[no-any-return]


def distinct(xs: Sequence[Tensor]) -> bool:
    """True when no tensor is in ``xs`` twice (by identity). Under ``torch.compile`` the set of
    the tensors themselves: dynamo makes every ``id()`` it traces a guard on that object, so a
    step given fresh gradients each call would compile again every call (a tensor hashes by
    identity, and dynamo compares its graph's inputs, already guarded against aliasing)."""
    if torch.compiler.is_compiling():
        return len(set(xs)) == len(xs)
    return len({id(x) for x in xs}) == len(xs)


def use_foreach(xs: Sequence[Tensor], *scalars: Any) -> bool:
    """True when ``torch._foreach_*`` can run on ``xs`` (with the tensor ``scalars``, if any):
    all plain tensors (no functorch wrapping) or all ``DTensor``s. A scalar batched by
    ``torch.func.vmap`` (e.g. a swept learning rate) sends ``xs`` down the per-tensor path."""
    if torch.compiler.is_compiling():
        # Dynamo traces ``_foreach_*`` ops under ``grad`` but not under ``vmap`` (no batching
        # rules), and can ask a tensor only whether vmap batched it (a check made once, while
        # tracing).
        batched = torch._C._functorch.is_batchedtensor
        return not any(isinstance(x, Tensor) and batched(x) for x in (*xs, *scalars))
    # Only inside a functorch transform can a tensor be wrapped by a live level (a wrapper that
    # escaped its transform acts as a plain tensor), so outside one there is nothing to check.
    transformed = torch._C._functorch.peek_interpreter_stack() is not None
    if transformed and any(isinstance(s, Tensor) and _is_wrapped(s) for s in scalars):
        return False
    types = set(map(type, xs))  # C-level loops: lists of thousands of leaves are common
    if types <= _PLAIN and not (transformed and any(map(_is_wrapped, xs))):
        return True
    dtensor = dtensor_type()
    return dtensor is not None and types == {dtensor}


def tracked(*lists: Sequence[Tensor]) -> bool:
    """Whether any tensor of ``lists`` requires grad (autograd records ops on it in grad
    mode)."""
    return any(any(column(xs, "requires_grad")) for xs in lists)


def overlapping(params: Sequence[Tensor]) -> list[list[int]]:
    """Groups of indices of params whose memory may overlap (weights tied by storage, views of
    one another), each with at least two members. Conservative: each param counts as the whole
    address range from its first to its last element, and params chained by overlaps form one
    group."""
    spans = []
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        size = p.element_size()
        start = p.untyped_storage().data_ptr() + int(p.storage_offset()) * size
        last = sum((n - 1) * s for n, s in zip(p.shape, p.stride(), strict=True))
        spans.append((start, start + (last + 1) * size, i))
    spans.sort()
    out: list[list[int]] = []
    cluster: list[int] = []
    end = -1
    for start, stop, i in spans:
        if start >= end:
            if len(cluster) > 1:
                out.append(sorted(cluster))
            cluster, end = [], stop
        cluster.append(i)
        end = max(end, stop)
    if len(cluster) > 1:
        out.append(sorted(cluster))
    return out


def column(xs: Sequence[Any], attr: str) -> list[Any]:
    """``[getattr(x, attr) for x in xs]``: a C-level loop in eager mode (trees of thousands of
    leaves are common), a plain one under ``torch.compile`` (which cannot trace
    ``operator.attrgetter``)."""
    if torch.compiler.is_compiling():
        return [getattr(x, attr) for x in xs]
    return list(map(operator.attrgetter(attr), xs))


def full_values(xs: Sequence[Tensor]) -> list[Tensor]:
    """``xs`` with each ``DTensor`` (e.g. a norm, partial over shards) replaced by its full value:
    a plain tensor, the same on every rank. The ``DTensor`` entries of one device mesh,
    placements, dtype and shape are stacked and resolved with one collective; plain tensors are
    returned as they are."""
    dtensor = dtensor_type()
    out = list(xs)
    if dtensor is None:
        return out
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, x in enumerate(xs):
        if isinstance(x, dtensor):
            key = (x.device_mesh, x.placements, x.dtype, x.shape)  # type: ignore[attr-defined]
            groups.setdefault(key, []).append(i)
    for index in groups.values():
        full = torch.stack([xs[i] for i in index]).full_tensor()  # type: ignore[attr-defined]
        for i, value in zip(index, full.unbind(), strict=True):
            out[i] = value
    return out


def once(s: Any, like: Sequence[Tensor] = ()) -> Any:
    """``s`` unchanged, except that under ``torch.compile`` a 0-d tensor (or each one of a list)
    is made a buffer computed once per call.

    Inductor otherwise inlines scalar math into every elementwise loop that uses it: a bias
    correction's ``1 - b**t`` became one ``pow`` per 16 elements, which made the compiled
    DreamerV3 update 2.7x slower on 16M elements. A reduction is always computed into a buffer of
    its own, so ``max(s, s)`` (exactly ``s``) is.

    ``like``: the tensors the op combines ``s`` with. Where they all have one float32 or
    float64 dtype, a floating ``s`` of another is converted to it first, once: the conversion
    the op makes of a 0-d operand anyway (a 0-d tensor takes the dtype of the tensors it meets),
    which inductor would otherwise make in every vector iteration (the same bits either way)."""
    if not torch.compiler.is_compiling():
        return s
    if isinstance(s, (list, tuple)):
        return [once(x, like) for x in s]
    if isinstance(s, Tensor) and s.dim() == 0:
        dtype = _common_wide(like)
        if dtype is not None and s.dtype != dtype and s.is_floating_point():
            s = s.to(dtype)
        return _computed_once(s)
    return s


def _common_wide(xs: Sequence[Tensor]) -> torch.dtype | None:
    """The dtype of ``xs`` when they all have one, float32 or float64 (and are not 0-d)."""
    if not xs:
        return None
    dtype = xs[0].dtype
    if dtype not in (torch.float32, torch.float64):
        return None
    if all(x.dtype == dtype and x.dim() > 0 for x in xs):
        return dtype
    return None


def once_per_leaf(factors: Tensor) -> Tensor:
    """:func:`once` for a vector of per-leaf values (a clip factor per leaf), which every loop
    over a run of leaves would otherwise recompute from its math."""
    return _computed_once(factors) if torch.compiler.is_compiling() else factors


def _computed_once(x: Tensor) -> Tensor:
    # exactly x. A 0-d value: a reduction over its broadcast (no buffer but the result's; one
    # to a scalar output stays a reduction). A vector: over a stack, which is a buffer of its
    # own (a reduction this small to a vector is unrolled into its consumers' loops).
    if x.dim() == 0:
        return x.expand(2).amax(0)
    return torch.stack([x, x]).amax(0)


def _scalars(s: Scalar | Sequence[Scalar], n: int) -> list[Scalar]:
    if isinstance(s, (list, tuple)):
        return list(s)
    return [s] * n  # type: ignore[list-item]


def mul(xs: Sequence[Tensor], s: Scalar | Sequence[Scalar]) -> list[Tensor]:
    """``x * s`` for each ``x`` (in ``x``'s dtype); ``s`` is one scalar or one per tensor."""
    if not xs:
        return []
    s = once(s, xs)
    if use_foreach(xs, s):
        if isinstance(s, (list, tuple)) and s and isinstance(s[0], Tensor):
            return like(torch._foreach_mul(list(xs), list(s)), xs)
        return like(torch._foreach_mul(list(xs), s), xs)  # type: ignore[arg-type]
    return like([x * c for x, c in zip(xs, _scalars(s, len(xs)), strict=True)], xs)


def div(xs: Sequence[Tensor], ys: Sequence[Tensor]) -> list[Tensor]:
    """``x / y`` elementwise."""
    if not xs:
        return []
    if use_foreach(xs) and use_foreach(ys):
        return list(torch._foreach_div(list(xs), list(ys)))
    return [x / y for x, y in zip(xs, ys, strict=True)]


def add(xs: Sequence[Tensor], ys: Sequence[Tensor], alpha: Scalar = 1.0) -> list[Tensor]:
    """``x + alpha * y`` elementwise."""
    if not xs:
        return []
    if isinstance(alpha, Tensor):
        ys = mul(ys, alpha)
        alpha = 1.0
    if use_foreach(xs, alpha) and use_foreach(ys):
        return list(torch._foreach_add(list(xs), list(ys), alpha=alpha))
    return [x + alpha * y if alpha != 1.0 else x + y for x, y in zip(xs, ys, strict=True)]


def add_into(targets: Sequence[Tensor], updates: Sequence[Tensor], fused: bool = False) -> None:
    """``t <- t + u`` for each pair, in place, as one multi-tensor op. With ``fused`` (the
    caller knows every pair to be contiguous tensors of one float32 or float64 dtype on one CPU
    or CUDA device) torch's fused SGD with ``lr = -1`` (``t - (-1) u``, the same bits as
    ``t + u``): one pass in C++ over the list, about twice as fast as ``torch._foreach_add_``
    over thousands of small tensors, where the per-tensor dispatch dominates. (It reads its
    tensors as flat memory: it must not get one that is not contiguous. While ``torch.compile``
    traces, where that kernel has no fake implementation, the multi-tensor add runs.)"""
    if not targets:
        return
    if fused and not torch.compiler.is_compiling():
        torch._fused_sgd_(
            list(targets),
            list(updates),
            [],
            weight_decay=0.0,
            momentum=0.0,
            lr=-1.0,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=False,
        )
    else:
        torch._foreach_add_(list(targets), list(updates))


def fused_add_ok(xs: Sequence[Tensor]) -> bool:
    """Whether :func:`add_into` may take its ``fused`` route for targets ``xs`` (and updates
    like them): contiguous plain tensors of one float32 or float64 dtype on one CPU or CUDA
    device."""
    if not xs:
        return False
    dtype, device = xs[0].dtype, xs[0].device
    return (
        dtype in (torch.float32, torch.float64)
        and device.type in ("cpu", "cuda")
        and all(
            type(x) in _PLAIN and x.dtype == dtype and x.device == device and x.is_contiguous()
            for x in xs
        )
    )


def sub(xs: Sequence[Tensor], ys: Sequence[Tensor]) -> list[Tensor]:
    """``x - y`` elementwise."""
    if not xs:
        return []
    if use_foreach(xs) and use_foreach(ys):
        return list(torch._foreach_sub(list(xs), list(ys)))
    return [x - y for x, y in zip(xs, ys, strict=True)]


def add_scalar(xs: Sequence[Tensor], s: Scalar) -> list[Tensor]:
    """``x + s`` (in ``x``'s dtype)."""
    if not xs:
        return []
    s = once(s, xs)
    # Compiled, ``_foreach_add`` of a tensor scalar is lowered through ``s.item()`` (a host sync
    # that splits the graph's kernel in two); ``x + s`` per tensor fuses like any other op.
    if use_foreach(xs, s) and not (isinstance(s, Tensor) and torch.compiler.is_compiling()):
        return like(torch._foreach_add(list(xs), s), xs)
    return like([x + s for x in xs], xs)


def sqrt(xs: Sequence[Tensor]) -> list[Tensor]:
    """Elementwise square root."""
    if not xs:
        return []
    if use_foreach(xs):
        return list(torch._foreach_sqrt(list(xs)))
    return [torch.sqrt(x) for x in xs]


def square(xs: Sequence[Tensor]) -> list[Tensor]:
    """``x * x``; for a complex ``x`` its squared modulus ``|x|^2 = Re(conj(x) x)`` (in ``x``'s
    complex dtype, imaginary part exactly 0), as optax squares complex updates."""
    if not xs:
        return []
    if not _COMPLEX.isdisjoint(column(xs, "dtype")):
        return [_abs_sq(x) if x.is_complex() else x * x for x in xs]
    if use_foreach(xs):
        return list(torch._foreach_mul(list(xs), list(xs)))
    return [x * x for x in xs]


def _abs_sq(x: Tensor) -> Tensor:
    # The real part of the product: its imaginary part can be a rounding residual, not 0.
    return (x.conj() * x).real.to(x.dtype)


_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))


def copy(xs: Sequence[Tensor]) -> list[Tensor]:
    """A fresh copy of each tensor, bit for bit (for an update that would otherwise be a state
    buffer itself: callers may edit returned updates in place)."""
    if not xs:
        return []
    if not torch.compiler.is_compiling() and use_foreach(xs):
        return list(torch._foreach_mul(list(xs), 1.0))  # one multi-tensor kernel; x * 1 == x
    return [x.clone() for x in xs]


def unshared(out: Sequence[Tensor], state: Sequence[Tensor]) -> list[Tensor]:
    """``out`` with a fresh copy in place of each entry that is the matching ``state`` tensor
    itself: returned updates never share memory with the returned state."""
    if len(out) != len(state):
        raise ValueError(f"unshared: {len(out)} updates for {len(state)} state tensors")
    if not any(map(operator.is_, out, state)):  # a C-level loop
        return list(out)
    same = [i for i, (x, y) in enumerate(zip(out, state, strict=True)) if x is y]
    result = list(out)
    for i, c in zip(same, copy([out[i] for i in same]), strict=True):
        result[i] = c
    return result


def clamp(xs: Sequence[Tensor], lo: Scalar, hi: Scalar) -> list[Tensor]:
    """Clip each element into ``[lo, hi]``."""
    if not xs:
        return []
    if use_foreach(xs) and not isinstance(lo, Tensor) and not isinstance(hi, Tensor):
        return list(torch._foreach_clamp_max(torch._foreach_clamp_min(list(xs), lo), hi))
    return [torch.clamp(x, min=lo, max=hi) for x in xs]  # type: ignore[arg-type]


def cast(xs: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> list[Tensor]:
    """Each ``x`` in the matching dtype (no copy when it already has it)."""
    return [x if x.dtype == d else x.to(d) for x, d in zip(xs, dtypes, strict=True)]


def like(xs: Sequence[Tensor], refs: Sequence[Tensor]) -> list[Tensor]:
    """Each ``x`` cast to the dtype of the matching ``ref``."""
    return cast(xs, [r.dtype for r in refs])


def promoted(xs: Sequence[Tensor], ys: Sequence[Tensor]) -> list[torch.dtype]:
    """The promoted dtype of each pair."""
    return [torch.promote_types(x.dtype, y.dtype) for x, y in zip(xs, ys, strict=True)]


_HALF = (torch.float16, torch.bfloat16)


def _scaled(m: list[Tensor], s: Scalar, in_place: bool) -> list[Tensor]:
    """``m * s`` with ``torch._foreach_mul_``: into ``m`` itself (``in_place``) or into a copy.
    Both use the in-place kernel, whose 16-bit rounding differs from the out-of-place one's, so
    donated and pure updates agree bit for bit."""
    if in_place:
        out = list(m)
    elif any(x.dtype in _HALF for x in m):
        out = [x.clone() for x in m]
    else:
        return list(torch._foreach_mul(m, s))  # type: ignore[arg-type]
    torch._foreach_mul_(out, s)  # type: ignore[arg-type]
    return out


def moment(
    m: Sequence[Tensor], g: Sequence[Tensor], decay: Scalar, order: int, *, donate: bool = False
) -> list[Tensor]:
    """Exponential moving average ``decay * m + (1 - decay) * g**order`` in the promoted dtype
    of ``m`` and ``g`` (callers cast the stored state back).

    With ``donate`` (the caller never reads ``m`` again) the result is written into ``m``'s
    buffers when their dtype is already the promoted one; the arithmetic, and so the result, is
    the same either way.
    """
    if not m:
        return []
    dtypes = promoted(m, g)
    complex_square = order == 2 and not _COMPLEX.isdisjoint(dtypes)  # |g|^2, not g * g
    if use_foreach(m, decay) and use_foreach(g) and not complex_square:
        in_place = donate and all(x.dtype == d for x, d in zip(m, dtypes, strict=True))
        gw = cast(g, dtypes)
        if isinstance(decay, Tensor):
            # (1 - decay in decay's dtype, then converted: as the op would convert it)
            rest = once(1 - decay, gw)
            decay = once(decay, gw)
            out = _scaled(cast(m, dtypes), decay, in_place)
            gp = list(gw) if order == 1 else list(torch._foreach_mul(gw, gw))
            torch._foreach_add_(out, list(torch._foreach_mul(gp, rest)))
            return out
        out = _scaled(cast(m, dtypes), decay, in_place)
        if order == 1:
            torch._foreach_add_(out, gw, alpha=1.0 - decay)
        else:
            torch._foreach_addcmul_(out, gw, gw, value=1.0 - decay)
        return out
    decay = once(decay)
    m, g = cast(m, dtypes), cast(g, dtypes)
    gp = list(g) if order == 1 else square(g)
    return add(mul(m, decay), gp, alpha=1.0 - decay)


def decay_add(
    m: Sequence[Tensor], g: Sequence[Tensor], decay: Scalar, *, donate: bool = False
) -> list[Tensor]:
    """``decay * m + g`` (a momentum trace) in the promoted dtype; with ``donate``, written into
    ``m``'s buffers when they already have that dtype (same arithmetic either way)."""
    if not m:
        return []
    dtypes = promoted(m, g)
    gw = cast(g, dtypes)
    decay = once(decay, gw)
    if use_foreach(m, decay) and use_foreach(g):
        in_place = donate and all(x.dtype == d for x, d in zip(m, dtypes, strict=True))
        out = _scaled(cast(m, dtypes), decay, in_place)
        torch._foreach_add_(out, gw)
        return out
    return add(mul(cast(m, dtypes), decay), gw)


def div_scalar(xs: Sequence[Tensor], s: Scalar) -> list[Tensor]:
    """``x / s`` for one scalar ``s`` (in ``x``'s dtype)."""
    if not xs:
        return []
    s = once(s, xs)
    if use_foreach(xs, s):
        return like(torch._foreach_div(list(xs), s), xs)
    return like([x / s for x in xs], xs)


def norms(xs: Sequence[Tensor]) -> list[Tensor]:
    """The L2 norm of each tensor (0-d tensors), computed in at least float32; for a ``DTensor``
    the norm of the whole tensor, as a plain tensor (see :func:`full_values`), and within
    :func:`sharded_reductions` that of the whole tensor each local shard is part of."""
    if not xs:
        return []
    if _SHARDED is not None:
        return _summed_norms(local_norms(xs), xs)
    return full_values(local_norms(xs))


def local_norms(xs: Sequence[Tensor]) -> list[Tensor]:
    """:func:`norms` of the tensors as they are on this rank: a ``DTensor``'s is partial (see
    :func:`full_values`), a local shard's that of the shard; no collective."""
    if not xs:
        return []
    if _WIDENED:
        xs = [_narrow(x) for x in xs]
    half = any(x.dtype in _HALF for x in xs)
    if use_foreach(xs):
        if half and all(type(x) in _PLAIN and x.dtype in (*_HALF, torch.float32) for x in xs):
            if torch.compiler.is_compiling():
                # inductor lowers each norm to one pass reading the 16-bit values; it runs
                # the foreach form as torch's kernel, which first copies them to float32
                # (measured: half of a compiled chain(clip_by_global_norm, adamw) step)
                return [torch.linalg.vector_norm(x, dtype=torch.float32) for x in xs]
            # accumulated and returned in float32 (torch's CPU kernel makes a float32 copy of
            # one tensor at a time)
            return list(torch._foreach_norm(list(xs), 2, dtype=torch.float32))
        xs = [x.float() if x.dtype in _HALF else x for x in xs] if half else xs
        return _full_precision_norms(xs)
    xs = [x.float() if x.dtype in _HALF else x for x in xs]
    return [torch.linalg.vector_norm(x) for x in xs]


DOT_MIN = 1 << 14
"""Contiguous float32/float64 tensors of at least this many elements have their norm taken as
``sqrt(dot(x, x))`` (a BLAS dot product: one stream at full read bandwidth), the others by
``torch._foreach_norm``."""

_DOT_DTYPES = (torch.float32, torch.float64)


def _full_precision_norms(xs: Sequence[Tensor]) -> list[Tensor]:
    """The norms of plain or ``DTensor`` float32/float64 tensors (local ones for a ``DTensor``,
    by ``_foreach_norm``): the long contiguous plain ones by BLAS dot products (measured 1.7x
    as fast as ``_foreach_norm`` on 16.8M float32 elements, one thread; inside a compiled
    graph through the opaque op :func:`_dot_norms`, which inductor would otherwise lower to a
    slower reduction loop of its own), when autograd records nothing (the op has no
    derivative)."""
    recording = torch.is_grad_enabled()
    long = [
        i
        for i, x in enumerate(xs)
        if type(x) in _PLAIN
        and x.numel() >= DOT_MIN
        and x.dtype in _DOT_DTYPES
        and not (recording and x.requires_grad)
        and x.is_contiguous()
    ]
    if not long:
        return list(torch._foreach_norm(list(xs)))
    big = [xs[i] for i in long]
    dots = torch.ops.functional_opt.dot_norms(big) if torch.compiler.is_compiling() else None
    out: list[Tensor | None] = [None] * len(xs)
    for i, n in zip(long, dots if dots is not None else _dot_norms_of(big), strict=True):
        out[i] = n
    taken = set(long)
    rest = [i for i in range(len(xs)) if i not in taken]
    if rest:
        for i, n in zip(rest, torch._foreach_norm([xs[i] for i in rest]), strict=True):
            out[i] = n
    return out  # type: ignore[return-value]


def _dot_norms_of(xs: list[Tensor]) -> list[Tensor]:
    flat = [x.view(-1) for x in xs]
    return [torch.dot(v, v).sqrt_() for v in flat]


# ``functional_opt::dot_norms(xs)``: ``[sqrt(dot(x, x)) for x in xs]`` of contiguous
# float32/float64 tensors (0-d, in each one's dtype). Defined on the dispatcher directly (a
# ``torch.library.custom_op`` adds some tens of microseconds of Python per call).
_LIBRARY = torch.library.Library("functional_opt", "DEF")  # type: ignore[no-untyped-call]
_LIBRARY.define("dot_norms(Tensor[] xs) -> Tensor[]")  # type: ignore[no-untyped-call]
_LIBRARY.impl(  # type: ignore[no-untyped-call]
    "dot_norms", _dot_norms_of, "CompositeExplicitAutograd"
)


def _dot_norms_fake(xs: list[Tensor]) -> list[Tensor]:
    return [x.new_empty(()) for x in xs]


torch.library.register_fake("functional_opt::dot_norms", _dot_norms_fake, lib=_LIBRARY)


def _summed_norms(local: list[Tensor], xs: Sequence[Tensor]) -> list[Tensor]:
    """Whole norms from local shards' norms (``local``, of the shards ``xs``): their squares
    summed over the ranks (one collective), the square roots in each norm's dtype."""
    whole = sum_over_shards(stack(local).square(), of=xs).sqrt()
    return [v.to(n.dtype) for v, n in zip(whole.unbind(), local, strict=True)]


def stack(xs: Sequence[Tensor]) -> Tensor:
    """Stack 0-d tensors into a vector in their promoted dtype (at least float32)."""
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return torch.stack([x.to(dtype) for x in xs])


def global_norm(xs: Sequence[Tensor]) -> Tensor:
    """``sqrt(sum_i ||x_i||^2)`` over all tensors (0 for an empty list); within
    :func:`sharded_reductions` over the whole tensors (one collective); within
    :func:`across_parts` over the whole tree (see :class:`Across`)."""
    if _ACROSS is not None:
        given = given_total(_squares_dtype(xs))
        if given is not None:  # (the part's own sum of squares is not computed)
            return given.sqrt()
        return across_total(squares_sum(xs), ("squares", list(xs))).sqrt()
    if not xs:
        return torch.zeros(())
    if _SHARDED is not None:
        return sum_over_shards(stack(local_norms(xs)).square().sum()).sqrt()
    out: Tensor = torch.linalg.vector_norm(stack(norms(xs)))
    return out


def _real(x: Tensor) -> Tensor:
    """``x``, with a complex tensor as its real view (real and imaginary parts)."""
    return torch.view_as_real(x) if x.is_complex() else x


def _finite_flags(xs: Sequence[Tensor]) -> Tensor:
    """A 1-d bool tensor: for each non-empty tensor, whether all its elements are finite, exactly
    when its smallest and largest are (``torch.aminmax`` propagates NaN): one vectorized pass per
    tensor, eager or compiled (an infinity norm, ``torch._foreach_norm(xs, inf)``, measured
    12-25x slower on a CPU thread), then one check of all the ends together (a check per tensor
    cost 0.5 ms more for W1's 60 large gradients)."""
    pairs = [torch.aminmax(_real(x)) for x in xs if x.numel()]
    if not pairs:
        return torch.ones(0, dtype=torch.bool)
    if len({x.device for x in xs}) > 1:
        return torch.stack([torch.isfinite(torch.stack(pair)).all() for pair in pairs])
    ends = torch.stack([end for pair in pairs for end in pair])  # (dtypes promoted: exact)
    return torch.isfinite(ends).view(-1, 2).all(dim=1)


def all_finite(xs: Sequence[Tensor]) -> Tensor:
    """A 0-d bool tensor: every element of every tensor is finite. For ``DTensor``s (and local
    shards within :func:`sharded_reductions`), of every shard on every rank (the non-finite
    elements are counted and the counts summed across ranks with one collective per device
    mesh), so all ranks get the same flag."""
    if _ACROSS is not None:
        given = given_total(torch.float32)
        if given is not None:  # (the part's own count is not computed)
            return given == 0
        count = _finite_flags(xs).logical_not().sum(dtype=torch.float32)
        return across_total(count, ("non-finite", list(xs))) == 0
    if _SHARDED is not None:  # (a collective even where this rank holds no element)
        return non_finite_count(_finite_flags(xs)) == 0
    if not xs:
        return torch.ones((), dtype=torch.bool)
    dtensor = dtensor_type()
    if dtensor is None or not any(isinstance(x, dtensor) for x in xs):
        if use_foreach(xs):
            return _finite_flags(xs).all()  # (all of none: True, an empty tensor is finite)
        flags = [torch.isfinite(x).all() for x in xs if x.numel()]  # (wrapped by torch.func)
        if not flags:  # an empty tensor is finite
            return torch.ones((), dtype=torch.bool)
        return flags[0] if len(flags) == 1 else torch.stack(flags).all()
    flags = [torch.isfinite(x).all() for x in xs if not isinstance(x, dtensor)]
    counts = [torch.isfinite(x).logical_not().sum() for x in xs if isinstance(x, dtensor)]
    flags.append(torch.stack(full_values(counts)).sum() == 0)
    return torch.stack(flags).all()


def local_like(value: Tensor, like: Tensor) -> Tensor:
    """``value`` as this rank's local tensor of it placed as the ``DTensor`` ``like`` (a
    ``DTensor`` of other placements, e.g. optimizer state loaded from a checkpoint of another
    layout, is redistributed first); a plain tensor as it is."""
    if not hasattr(value, "device_mesh"):
        return value
    mesh, placements = like.device_mesh, like.placements  # type: ignore[attr-defined]
    if value.device_mesh != mesh or value.placements != placements:  # type: ignore[attr-defined]
        value = value.redistribute(mesh, placements)  # type: ignore[attr-defined]
    local: Tensor = value._local_tensor  # type: ignore[attr-defined]
    return local


def where(cond: Tensor, xs: Sequence[Tensor], ys: Sequence[Tensor]) -> list[Tensor]:
    """``x`` where the 0-d bool ``cond`` holds, else ``y`` (NaN-safe select)."""
    return [torch.where(cond, x, y) for x, y in zip(xs, ys, strict=True)]


def where_like(cond: Tensor, xs: Sequence[Tensor], ys: Sequence[Tensor]) -> list[Tensor]:
    """``x`` where the 0-d bool ``cond`` holds, else ``y``, in ``y``'s dtype."""
    return [torch.where(cond, x, y).to(y.dtype) for x, y in zip(xs, ys, strict=True)]


def zeros_like(xs: Sequence[Tensor]) -> list[Tensor]:
    """Fresh zeros shaped like each tensor."""
    return [torch.zeros_like(x) for x in xs]


class Shards(NamedTuple):
    """``DTensor``s as local shards: see :func:`local_shards`."""

    locals: list[Tensor]
    """Each ``DTensor``'s local tensor (the shard itself: writing it writes the ``DTensor``)."""
    group: Any
    """The process group over whose ranks the shards' partial sums add up to the whole
    tensors' sums; ``None`` when nothing is sharded (local sums are whole)."""


def like_shards(locals_: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
    """Each local tensor as a ``DTensor`` placed as its ``like`` (a ``DTensor`` of which it is
    this rank's shard): no copy, no collective (the inverse of :func:`local_shards`)."""
    from torch.distributed.tensor import DTensor

    out: list[Tensor] = []
    for local, key in zip(locals_, like, strict=True):
        mesh, placements = key.device_mesh, key.placements  # type: ignore[attr-defined]
        out.append(
            DTensor.from_local(
                local, mesh, placements, shape=key.shape, stride=key.stride(), run_check=False
            )
        )
    return out


def local_shards(xs: Sequence[Tensor]) -> Shards | None:
    """``xs`` as their local shards, when that is all the math on them needs: every one a
    ``DTensor`` on one device mesh, placed by ``Shard``/``Replicate`` only (no ``Partial``: the
    local values are the tensors' own), sharded over the same one mesh dimension or none (FSDP2:
    ``(Shard(0),)``; HSDP: ``(Replicate(), Shard(0))``), with plain dense local tensors. Then
    elementwise math runs on the shards as on plain tensors, and a sum over a whole tensor (of
    squares, of counts) is the sum over ``group`` of its shards' sums (one collective for any
    number of them). ``None`` for anything else (no ``DTensor``, mixed meshes, several sharded
    mesh dimensions, ...)."""
    dtensor = dtensor_type()
    if dtensor is None or not xs or not all(isinstance(x, dtensor) for x in xs):
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh = xs[0].device_mesh  # type: ignore[attr-defined]
    dims: set[int] | None = None
    out = []
    for x in xs:
        placements = x.placements  # type: ignore[attr-defined]
        if x.device_mesh != mesh or not all(  # type: ignore[attr-defined]
            type(pl) in (Shard, Replicate) for pl in placements
        ):
            return None
        sharded = {i for i, pl in enumerate(placements) if type(pl) is Shard}
        if dims is None:
            dims = sharded
        if sharded != dims or len(sharded) > 1:
            return None
        local = x._local_tensor  # type: ignore[attr-defined]
        if type(local) is not Tensor or local.layout != torch.strided:
            return None
        out.append(local)
    group = None if not dims else mesh.get_group(next(iter(dims)))
    return Shards(out, group)


# --------------------------------------------------------------------------------------------
# Reductions over local shards (``TransformOptimizer``'s engine under FSDP2).

_SHARDED: Any = None
"""The process group of the active :func:`sharded_reductions`, else ``None``."""


@contextlib.contextmanager
def sharded_reductions(group: Any) -> Iterator[None]:
    """Within the block the tensors that the library's reductions get are *local shards* of
    tensors sharded over the ranks of the process group ``group`` (see :func:`local_shards`):
    :func:`norms`, :func:`global_norm`, :func:`all_finite` and the reductions of the trees'
    records (:class:`functional_opt.tree.Leaves`, :class:`functional_opt.tree.BufferLeaves`)
    compute local partial values (squares of norms, counts of non-finite elements), sum them
    over ``group`` with one collective per call (a functional ``all_reduce``, which
    ``torch.compile`` traces into its graph) and return the whole tensors' values, the same on
    every rank. Elementwise math is unchanged.

    Every call issues its collective whatever its inputs (a rank whose shard is empty
    included), so every rank must make the same calls: the same trees (leaves, dtypes) on
    every rank, which the shards of one group of ``DTensor``s are. ``group=None`` changes
    nothing. Code compiled inside the block depends on it: compile it under the same ``group``
    (:class:`functional_opt.engine.Runner` keys its graphs by it)."""
    global _SHARDED
    old = _SHARDED
    _SHARDED = group
    try:
        yield
    finally:
        _SHARDED = old


def sharded_group() -> Any:
    """The process group of the active :func:`sharded_reductions`, or ``None``."""
    return _SHARDED


def sum_over_shards(t: Tensor, of: Sequence[Tensor] | None = None) -> Tensor:
    """``t`` summed over the ranks of the active :func:`sharded_reductions` group (one
    ``all_reduce``; a plain tensor, also in eager mode). Within :func:`across_parts` (the
    engine's update of a part of a sharded group) the sum is a reduction of the kind
    ``"ranks"`` of the active :class:`Across`: its total given, or ``t`` recorded as its
    partial (the engine sums every part's over the ranks in one collective). ``of``: the
    tensors whose squared local norms ``t`` stacks (:func:`norms` of local shards), recorded
    with the partial (see :attr:`Across.norms_of`)."""
    if isinstance(_SHARDED, CollectiveCount):  # (counted, not issued: see below)
        _SHARDED.calls += 1
        return t
    if _ACROSS is not None:  # a part of a sharded group: summed over the ranks by the engine
        return across_total(t, ("ranks", [t]), of)
    if (
        type(t) is Tensor
        and not t.requires_grad
        and not torch.compiler.is_compiling()
        and torch._C._functorch.peek_interpreter_stack() is None
    ):
        # eager, outside autograd and torch.func: c10d's own in-place all_reduce on a copy
        # (the functional collective's wrapping measured about 0.08 ms more CPU per call)
        summed = t.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(summed, group=_SHARDED)
        return summed
    from torch.distributed import _functional_collectives as fc

    out: Tensor = fc.all_reduce(t, "sum", _SHARDED)
    if not torch.compiler.is_compiling() and isinstance(out, fc.AsyncCollectiveTensor):
        out = out.wait()
    return out


def sum_totals_over_shards(totals: Sequence[Tensor], group: Any) -> list[Tensor]:
    """Each of ``totals`` (0-d tensors: this rank's totals of some reductions, see
    :class:`Across`) summed over the ranks of ``group``, all in one ``all_reduce`` (in their
    widest dtype; each returned in its own)."""
    if not totals:
        return []
    with sharded_reductions(group):
        whole = sum_over_shards(stack(list(totals)))
    return [v.to(t.dtype) for v, t in zip(whole.unbind(), totals, strict=True)]


class CollectiveCount:
    """What :func:`counted_collectives` saw: ``calls``, the collectives the library's reductions
    would have issued."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0


@contextlib.contextmanager
def counted_collectives() -> Iterator[CollectiveCount]:
    """Within the block the library's reductions behave as within :func:`sharded_reductions`
    but issue nothing: each collective they would issue is counted (its local value stands in
    for the sum), so code can be run once to find whether it needs other ranks at all (the
    engine's check that a leaf's update on a local shard needs no other rank's values, its
    reductions over all leaves aside)."""
    global _SHARDED
    old = _SHARDED
    count = CollectiveCount()
    _SHARDED = count
    try:
        yield count
    finally:
        _SHARDED = old


def non_finite_count(flags: Tensor) -> Tensor:
    """How many of the local bool ``flags`` (one per tensor or region: all elements finite) are
    false on all ranks of the active :func:`sharded_reductions` group (one collective, also for
    no flags)."""
    return sum_over_shards(flags.logical_not().sum(dtype=torch.float32).reshape(1))[0]


_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def _squares_dtype(xs: Sequence[Tensor]) -> torch.dtype:
    """The dtype of :func:`squares_sum` of ``xs``: float32, or float64 where one of them is
    (or is complex128), as their norms' promotion gives it."""
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, _REAL.get(x.dtype, x.dtype))
    return dtype


def squares_sum(xs: Sequence[Tensor]) -> Tensor:
    """``sum_i ||x_i||^2`` over the tensors as they are here (at least float32; 0 for none)."""
    local = [n.square() for n in local_norms(xs)]
    return stack(local).sum() if local else torch.zeros(())


class Across:
    """The library's reductions over a whole tree, where the tree is updated in parts (a leaf,
    or some leaves, at a time: the engine's direct and staged routes). Each reduction over a
    part (:func:`global_norm`, :func:`all_finite`, and the tree records' ``global_norm`` /
    ``all_finite``) has a *partial* value that the parts' values sum to: a sum of squares, a
    count of non-finite tensors. The first ``len(given)`` reductions of an update return the
    whole tree's totals from ``given`` (what their partials summed to); each later one records
    its partial in ``partials`` and goes on with it as a stand-in (its results are not used).

    So for a transform whose only dependence across leaves is these reductions
    (:func:`functional_opt.base.leafwise` with ``reductions=True``), an update of a part with
    all its reductions' totals given is that part of the whole tree's update; the totals come
    from passes over the parts, the ``k``-th with the first ``k - 1`` totals given. Made and
    made active inside the code the engine compiles (:func:`across_parts`), so the totals are
    inputs of the graph and the partials its outputs."""

    __slots__ = ("count", "given", "norms_of", "partials", "sources")

    def __init__(self, given: Sequence[Tensor]) -> None:
        self.given = list(given)
        self.partials: list[Tensor] = []
        self.sources: list[tuple[str, list[Tensor]]] = []
        """For each partial: what it is of, ``("squares", xs)`` (:func:`global_norm`'s sum of
        squares of the tensors ``xs``) or ``("non-finite", xs)`` (:func:`all_finite`'s count),
        for the engine to recognize a pass it can run as one multi-tensor op."""
        self.norms_of: list[list[Tensor] | None] = []
        """For each partial of the kind ``"ranks"`` that is the stacked squared local norms of
        some tensors (:func:`norms` of local shards), those tensors; else ``None``."""
        self.count = 0


_ACROSS: Across | None = None
"""The active :class:`Across`, else ``None``."""

_WIDENED: tuple[tuple[Tensor, Tensor], ...] = ()
"""Pairs ``(wide, narrow)``: ``wide`` is ``narrow`` (a 16-bit tensor) converted to float32
(see :func:`widened`)."""


def widened(pairs: tuple[tuple[Tensor, Tensor], ...]) -> tuple[tuple[Tensor, Tensor], ...]:
    """Declare each ``(wide, narrow)`` of ``pairs`` a float32 conversion of the 16-bit
    ``narrow`` (``()``: none); returns the pairs it replaces, to restore after (a plain
    function: compiled code calls it). :func:`local_norms` then takes the norm of ``wide``
    from ``narrow``: the same values, in one pass over the 16-bit memory (a compiled graph
    would otherwise write the float32 copy out for the norm). The engine declares the
    gradients it converts for ``TransformOptimizer.upcast_16bit_grads``."""
    global _WIDENED
    old = _WIDENED
    _WIDENED = pairs
    return old


def _narrow(x: Tensor) -> Tensor:
    for wide, narrow in _WIDENED:
        if x is wide:
            return narrow
    return x


def across_parts(value: Across | None) -> Across | None:
    """Make ``value`` the active :class:`Across` (``None``: none); returns the one it replaces,
    to restore after (a plain function rather than a context manager: compiled code calls it)."""
    global _ACROSS
    old = _ACROSS
    _ACROSS = value
    return old


def given_total(dtype: torch.dtype) -> Tensor | None:
    """Within :func:`across_parts`: the next reduction's total in ``dtype`` where it is given
    (the reduction is then counted, and its part's partial need not be computed: an update
    given all its totals reads each leaf with elementwise ops only), else ``None`` (the caller
    goes on to :func:`across_total` with its partial)."""
    active = _ACROSS
    assert active is not None
    k = active.count
    if k >= len(active.given):
        return None
    active.count = k + 1
    return active.given[k].to(dtype)


def across_total(
    partial: Tensor, source: tuple[str, list[Tensor]], of: Sequence[Tensor] | None = None
) -> Tensor:
    """Within :func:`across_parts`: the next reduction's total (given), else ``partial``, which
    is recorded with its ``source`` and ``of`` (see :class:`Across`)."""
    active = _ACROSS
    assert active is not None
    k = active.count
    active.count = k + 1
    if k < len(active.given):
        return active.given[k].to(partial.dtype)
    active.partials.append(partial)
    active.sources.append(source)
    active.norms_of.append(None if of is None else list(of))
    return partial


def summed(partials: Sequence[Tensor]) -> Tensor:
    """The total of the parts' partial values of one reduction (in their widest dtype)."""
    return stack(list(partials)).sum()


def next_total(totals: list[Tensor], parts: Sequence[Sequence[Tensor]], exact: int = 1) -> bool:
    """One pass of the totals: ``parts`` holds each part's partial values from a pass with
    ``totals`` given (the first ``exact`` of them exact: the first always, later ones where
    they depend on no total still to come); appends their totals and returns whether another
    pass is needed (see :class:`Across`)."""
    if not parts or not parts[0]:
        return False
    for j in range(exact):
        totals.append(summed([p[j] for p in parts]))
    return len(parts[0]) > exact
