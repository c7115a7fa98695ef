"""Guards: ``zero_nans``, ``set_to_zero``, ``freeze``, and the skip tests of ``MultiSteps``
(``skip_not_finite``, ``skip_large_updates``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import (
    EXTRA_KEYWORDS,
    GradientTransformation,
    Params,
    Updates,
    accepting,
    check_extra,
    expect_state,
    stateless,
)
from functional_opt.transforms.combinators import masked
from functional_opt.transforms.finite import negative_zeros_like
from functional_opt.tree import PyTree

__all__ = [
    "ZeroNansState",
    "freeze",
    "set_to_zero",
    "skip_large_updates",
    "skip_not_finite",
    "zero_nans",
]


class ZeroNansState(NamedTuple):
    """``found_nan``: a tree of the params' structure whose leaves are 0-d bool tensors, true
    where the last update of that leaf had a NaN."""

    found_nan: PyTree


def zero_nans() -> GradientTransformation:
    """Replaces every NaN of the updates by 0: ``u -> where(isnan(u), 0, u)`` (optax's
    ``zero_nans``); infinities pass unchanged.

    The state records, per leaf, whether its last update had a NaN (``found_nan``, a 0-d bool
    tensor per leaf, all false after ``init``): nothing reads it, it is there to be logged. A
    ``None`` update keeps its leaf's flag. A complex element is NaN when either part is."""

    def init_fn(params: Params) -> ZeroNansState:
        return ZeroNansState(
            tree.map_params(lambda p: torch.zeros((), dtype=torch.bool, device=p.device), params)
        )

    def update_fn(
        updates: Updates, state: ZeroNansState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ZeroNansState]:
        check_extra(extra, "zero_nans")
        expect_state(state, ZeroNansState, "zero_nans")
        g, at = tree.split(updates)
        if params is not None:  # updates of another shape are refused, never passed on
            at.take(params, "params")
        at.flat(state.found_nan, "state.found_nan")  # its structure is the updates'
        nan = [torch.isnan(x) for x in g]
        found = [m.any() for m in nan]
        out = [torch.where(m, torch.zeros_like(x), x) for m, x in zip(nan, g, strict=True)]
        return at.updates(out), ZeroNansState(at.carry(state.found_nan, found, "state.found_nan"))

    return GradientTransformation(init_fn, accepting(update_fn, EXTRA_KEYWORDS))


def set_to_zero() -> GradientTransformation:
    """Maps every update to zero (optax's ``set_to_zero``), stateless; ``None`` updates stay
    ``None``. Used with :func:`~functional_opt.masked` or :func:`~functional_opt.partition`
    to hold parameters fixed, or through :func:`freeze`.

    The zeros are negative zeros (``-0.0``, equal to ``0.0``): ``p + (-0.0)`` is ``p`` bit for
    bit for every ``p``, where ``-0.0 + 0.0`` would give ``+0.0``, so ``apply_updates`` leaves
    every param exactly as it was. NaN and infinite updates give zero too."""

    def apply(updates: Updates, params: Params | None) -> Updates:
        del params
        g, at = tree.split(updates, elementwise=True)
        return at.updates(negative_zeros_like(g))

    return stateless(apply, "set_to_zero", elementwise=True, leafwise=True)


def _check_mask(mask: Any) -> None:
    """A Python bool, or a tree whose leaves are Python bools (a prefix of the params'
    structure); a function of the params is checked when it is called."""
    if callable(mask) and not isinstance(mask, Tensor):
        return
    if isinstance(mask, bool):
        return
    paths, leaves, _ = optree.tree_flatten_with_path(
        mask, none_is_leaf=True, namespace=tree.NAMESPACE
    )
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, bool):
            what = f"a {type(leaf).__name__}" if leaf is not None else "None"
            hint = (
                " (a tensor would be read on the host: pass bool(...))"
                if isinstance(leaf, Tensor)
                else ""
            )
            raise _validate.HyperparameterTypeError(
                f"freeze: mask must be a bool or a tree of bools, got {what} at "
                f"{tree.path_str(path)}{hint}"
            )


def freeze(mask: bool | PyTree | Callable[[Params], PyTree]) -> GradientTransformation:
    """Zero updates (``-0.0``, see :func:`set_to_zero`) where ``mask`` is true, updates passed
    unchanged elsewhere: ``masked(set_to_zero(), mask)``, as ``optax.transforms.freeze``.

    ``mask`` is static: a Python bool (everything frozen, or nothing), a tree of Python bools
    with the params' structure or a prefix of it, or a function of the params returning one.
    Frozen leaves keep no state (the state is ``MaskedState(EmptyState())``). To train the other
    leaves with an optimizer whose state skips the frozen ones, use
    ``partition({"train": opt, "freeze": set_to_zero()}, labels)``."""
    _check_mask(mask)
    return masked(set_to_zero(), mask)


def _floats(updates: Updates) -> list[Tensor]:
    """The present floating-point and complex tensors of ``updates`` (``None`` leaves left
    out)."""
    return tree.split(updates)[0]


def skip_not_finite(
    updates: Updates, gradient_step: Tensor, params: Params | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """A ``should_skip_update_fn`` for :class:`~functional_opt.MultiSteps` (optax's
    ``skip_not_finite``): skip a mini-step whose updates have a NaN or an infinity.

    Returns ``(should_skip, {"should_skip": should_skip, "num_not_finite": n})``, with ``n``
    the number of non-finite elements (an int64 0-d tensor), counted on the device: nothing is
    read on the host."""
    del gradient_step, params
    g = _floats(updates)
    counts = [torch.isfinite(x).logical_not().sum() for x in g]
    total = (
        torch.stack(_lists.full_values(counts)).sum()
        if counts
        else torch.zeros((), dtype=torch.int64)
    )
    should_skip = total > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": total}


def _squared_norm(x: Tensor) -> Tensor:
    """``sum |x|^2`` in at least float32 (a sum of squares, as optax: not a rounded norm
    squared)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return (x.conj() * x).real.sum() if x.is_complex() else (x * x).sum()


def skip_large_updates(
    updates: Updates,
    gradient_step: Tensor,
    params: Params | None,
    max_squared_norm: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A ``should_skip_update_fn`` for :class:`~functional_opt.MultiSteps` (optax's
    ``skip_large_updates``): skip a mini-step unless ``||u||^2 < max_squared_norm``, with
    ``||u||^2 = sum_i sum |u_i|^2`` the sum of the squares of every element of the updates (a
    NaN sum is skipped too). Bind the
    bound with ``functools.partial(skip_large_updates, max_squared_norm=...)``.

    Returns ``(should_skip, {"should_skip": should_skip, "norm_squared": ||u||^2})``; the norm
    is computed in at least float32 (complex elements count ``|u|^2``), on the device."""
    del gradient_step, params
    _validate.non_negative("max_squared_norm", max_squared_norm)
    g = _floats(updates)
    norm_sq = (
        _lists.stack(_lists.full_values([_squared_norm(x) for x in g])).sum()
        if g
        else torch.zeros(())
    )
    should_skip = torch.logical_not(norm_sq < max_squared_norm)
    return should_skip, {"should_skip": should_skip, "norm_squared": norm_sq}
