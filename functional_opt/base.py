"""Base types: :class:`GradientTransformation`, :class:`EmptyState`, ``chain`` and friends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from functional_opt import _kernels, _lists, tree
from functional_opt.packed import Packed
from functional_opt.tree import PyTree

__all__ = [
    "DONATE",
    "EmptyState",
    "GradientTransformation",
    "InitFn",
    "Params",
    "Schedule",
    "UpdateFn",
    "Updates",
    "apply_updates",
    "chain",
    "donating",
    "donating_updates",
    "identity",
    "named_chain",
    "safe_increment",
    "state_donation",
    "stateless",
    "without_donation",
    "zero_count",
]

Params = PyTree
Updates = PyTree
OptState = Any
Schedule = Callable[[Tensor], Tensor]
"""A schedule maps an integer step-count tensor to a 0-d value tensor."""

COUNT_DTYPE = torch.int32


class InitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer piece: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra) -> (updates, new_state)``."""

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def zero_count() -> Tensor:
    """A fresh step counter: a 0-d int32 tensor holding 0."""
    return torch.zeros((), dtype=COUNT_DTYPE)


def safe_increment(count: Tensor) -> Tensor:
    """``count + 1``, saturating at the dtype's maximum instead of wrapping."""
    top = torch.iinfo(count.dtype).max
    return torch.where(count < top, count + 1, count)


DONATE = "donate"
"""The keyword of donation mode. ``tx.update(updates, state, params, donate=True)`` promises
that the caller never uses ``state`` or ``updates`` again, so transforms may write the new state
into the state's buffers and the new updates into the incoming updates' buffers (as JAX's
``donate_argnums``); ``donate="state"`` promises it for ``state`` only. Results are identical
either way."""

STATE_ONLY = "state"


def _flag(extra: dict[str, Any]) -> bool | str:
    flag = extra.get(DONATE, False)
    if not (isinstance(flag, bool) or flag == STATE_ONLY):
        raise TypeError(f"{DONATE}= must be a Python bool or {STATE_ONLY!r}, got {flag!r}")
    return flag  # type: ignore[no-any-return]


def donating(extra: dict[str, Any]) -> bool:
    """Whether an update's extra arguments donate the state (``donate=True`` or ``"state"``)."""
    return bool(_flag(extra))


def donating_updates(extra: dict[str, Any]) -> bool:
    """Whether an update's extra arguments also donate the incoming updates (``donate=True``)."""
    return _flag(extra) is True


def without_donation(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` minus the donation flag: for a wrapper that may still need the old state."""
    return {k: v for k, v in extra.items() if k != DONATE}


def state_donation(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with at most the state donated: for passing updates the caller did not donate
    (made by another transform, which may still own them) to an inner transform."""
    return {**extra, DONATE: STATE_ONLY} if _flag(extra) else extra


def stateless(fn: Callable[[Updates, Params | None], Updates]) -> GradientTransformation:
    """A transform without state: ``update`` returns ``fn(updates, params)`` and the
    ``EmptyState`` it was given."""

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        del extra
        return fn(updates, params), state

    return GradientTransformation(init_fn, update_fn)


def identity() -> GradientTransformation:
    """Leaves updates unchanged: ``u -> u``."""
    return stateless(lambda updates, params: updates)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies transforms in order, ``u -> t_n(... t_1(u))``; the state is a tuple of theirs."""
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is a {type(t).__name__}, not a GradientTransformation"
            )

    def init_fn(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state that is not a tuple of "
                f"{len(transforms)} states"
            )
        new_states = []
        # Only the first transform gets the caller's updates; the others get updates made by
        # the transform before them, which may be that transform's state, so they may not
        # write into them.
        later = state_donation(extra)
        for i, (t, s) in enumerate(zip(transforms, state, strict=True)):
            updates, s = t.update(updates, s, params, **(extra if i == 0 else later))
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init_fn, update_fn)


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict keyed by the given names."""
    names = [name for name, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    inner = chain(*(t for _, t in transforms))

    def init_fn(params: Params) -> dict[str, OptState]:
        return dict(zip(names, inner.init(params), strict=True))

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        if not isinstance(state, dict) or list(state) != names:
            raise ValueError(f"named_chain expects a state dict with keys {names}")
        updates, states = inner.update(updates, tuple(state[n] for n in names), params, **extra)
        return updates, dict(zip(names, states, strict=True))

    return GradientTransformation(init_fn, update_fn)


def apply_updates(params: Params, updates: Updates, *, donate: bool = False) -> Params:
    """``p + u`` leaf by leaf, cast back to each param's dtype; a ``None`` update keeps ``p``.

    ``donate=True`` promises that the caller never uses ``params`` again: the sums are then
    written into the params' buffers (same arithmetic, same result) where that is safe (plain
    tensors that autograd does not track).
    """
    if not isinstance(donate, bool):
        raise TypeError(f"donate= must be a Python bool, got {donate!r}")
    if isinstance(params, Packed) and isinstance(updates, Packed):
        packed = _apply_packed(params, updates, donate)
        if packed is not None:
            return packed
    pvals, spec = tree.flatten(params)
    where = tree.Leaves(pvals, spec, params, "params")
    uvals = where.flat(updates, "updates")
    idx = [
        i
        for i, (p, u) in enumerate(zip(pvals, uvals, strict=True))
        if p is not None and u is not None
    ]
    xs = [pvals[i] for i in idx]
    us = [uvals[i] for i in idx]
    if donate and _in_place_ok(xs, us):
        _add_in_place(xs, us)
        return params
    new = _lists.like(_lists.add(xs, us), xs)
    out = list(pvals)
    for i, v in zip(idx, new, strict=True):
        out[i] = v
    return tree.unflatten(spec, out)


def _apply_packed(params: Packed, updates: Packed, donate: bool) -> Packed | None:
    """``apply_updates`` over the buffers of two packed trees of one layout (one add per
    buffer instead of one per leaf), or ``None`` when one of them is loose or the layouts
    differ (e.g. bfloat16 and float32 params in two buffers, their float32 updates in one).
    Elementwise the same adds as leaf by leaf."""
    p, u, layout = params.buffers, updates.buffers, params.layout
    if p is None or u is None or layout is None or layout != updates.layout:
        return None
    if torch.compiler.is_compiling():
        return None
    ps, us = list(p), list(u)
    if donate and _in_place_ok(ps, us):
        _add_in_place(ps, us)
        return params
    return Packed(layout, buffers=_lists.like(_lists.add(ps, us), ps))


_NARROW = frozenset((torch.bfloat16, torch.float16))


def _add_in_place(xs: list[Tensor], us: list[Tensor]) -> None:
    """``x += u`` for each pair: large 16-bit pairs of one dtype through a compiled kernel
    (eager 16-bit adds measured twice as slow; the sums are the same, rounded once from
    float32), the rest with one multi-tensor add."""
    rest: list[int] | range = range(len(xs))
    if not torch.compiler.is_compiling() and not _NARROW.isdisjoint(_lists.column(xs, "dtype")):
        narrow = [
            i
            for i, (x, u) in enumerate(zip(xs, us, strict=True))
            if x.dtype in _NARROW
            and u.dtype == x.dtype
            and x.numel() >= _kernels.ADD_MIN
            and x.is_contiguous()
            and u.is_contiguous()
        ]
        for i in narrow:
            _kernels.call(_kernels.add_in_place, xs[i].view(-1), us[i].view(-1))
        if narrow:
            taken = set(narrow)
            rest = [i for i in rest if i not in taken]
    if rest:
        torch._foreach_add_([xs[i] for i in rest], [us[i] for i in rest])


def _in_place_ok(xs: list[Tensor], us: list[Tensor]) -> bool:
    if not (_lists.use_foreach(xs) and _lists.use_foreach(us)):
        return False
    if len({id(x) for x in xs}) != len(xs):
        return False  # a param twice in the tree: each sum must see the old value
    if torch.is_grad_enabled() and _lists.tracked(xs, us):
        return False  # autograd may need the old values, and leaves refuse in-place ops
    if _lists.column(xs, "shape") != _lists.column(us, "shape"):
        return False
    pdtypes, udtypes = _lists.column(xs, "dtype"), _lists.column(us, "dtype")
    return pdtypes == udtypes or all(
        p == torch.promote_types(p, u) for p, u in zip(pdtypes, udtypes, strict=True)
    )
