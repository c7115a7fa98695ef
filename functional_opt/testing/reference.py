"""Compare a transform with a float64 reference formula."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_opt import tree
from functional_opt.base import GradientTransformation, apply_updates
from functional_opt.checkpoint import state_paths
from functional_opt.testing.streams import gradient_stream, rebuild
from functional_opt.testing.tolerance import MagnitudeRun, Ops, assert_close_rounding
from functional_opt.tree import PyTree

__all__ = ["Reference", "assert_matches_reference"]

Reference = Callable[[Tensor, Tensor, dict[str, Any]], Tensor]
"""A per-leaf reference: ``(grad, param, memory) -> update`` in float64, where ``memory`` is a
dict the function keeps its state in (empty on the first step, one per leaf)."""


def _to(value: PyTree, dtype: torch.dtype | None) -> PyTree:
    leaves = [
        x.detach().to(dtype)
        if dtype is not None and isinstance(x, Tensor) and x.is_floating_point()
        else x
        for x in tree.leaves(value)
    ]
    return rebuild(value, leaves)


def assert_matches_reference(
    tx: GradientTransformation,
    reference: Reference | Callable[[PyTree, PyTree, dict[str, Any]], PyTree],
    params: PyTree,
    grads: Sequence[PyTree] | None = None,
    *,
    ops: Ops | Callable[[Tensor], Ops],
    steps: int = 5,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    per_leaf: bool = True,
    magnitudes: bool = True,
    apply: bool = True,
) -> None:
    """Runs ``tx`` and a float64 ``reference`` over a gradient stream and checks, after every
    update, that the transform's updates are within the rounding bound of the reference's.

    * ``reference``: with ``per_leaf=True`` (default) a function ``(g, p, memory) -> u`` of one
      leaf's gradient and param (float64 tensors) returning its update, keeping its state in
      ``memory`` (a dict per leaf, empty on the first step); with ``per_leaf=False`` the same
      over whole trees (``None`` leaves included, one ``memory``). A ``None`` gradient leaf is
      not passed to a per-leaf reference and its update must be ``None``.
    * ``grads``: the gradient trees; default :func:`~functional_opt.testing.gradient_stream`
      of ``steps`` steps from ``seed``. ``dtype`` casts params and gradients first (the
      reference then reads the same rounded values in float64).
    * ``ops``: roundings of one update in each leaf's dtype (counted from the transform's
      formula: each product, sum, quotient, root and cast), or a function of the expected
      leaf returning it; the bound after ``t`` updates is ``t * ops`` (the transform's state
      carries its errors, the reference's carries none), relative to the magnitudes of a
      :class:`~functional_opt.testing.MagnitudeRun` (``magnitudes=False``: each tensor's
      largest reference value).
    * ``apply``: the params move by the transform's updates (``apply_updates``) after each
      step; both sides read the same params.

    Raises ``AssertionError`` naming the step and the leaf."""
    p = _to(params, dtype)
    stream = [
        _to(g, dtype)
        for g in (grads if grads is not None else gradient_stream(p, steps, seed=seed))
    ]
    state = tx.init(p)
    run = MagnitudeRun(tx, p) if magnitudes else None
    memory: dict[str, Any] = {}
    memories: dict[int, dict[str, Any]] = {}
    for t, g in enumerate(stream):
        g64, p64 = _to(g, torch.float64), _to(p, torch.float64)
        if per_leaf:
            leaves: list[Any] = []
            for i, (gl, pl) in enumerate(zip(tree.leaves(g64), tree.leaves(p64), strict=True)):
                if gl is None:
                    leaves.append(None)
                    continue
                leaves.append(reference(gl, pl, memories.setdefault(i, {})))
            want = rebuild(g64, leaves)
        else:
            want = reference(g64, p64, memory)
        u, state = tx.update(g, state, p)
        scale = run.update(g, p)[0] if run is not None else None
        count = (
            (lambda leaf, f=ops, n=t + 1: _times(f(leaf), n))
            if callable(ops)
            else _times(ops, t + 1)
        )
        for name, a, e in zip(state_paths(u), tree.leaves(u), tree.leaves(want), strict=True):
            if (a is None) != (e is None):
                raise AssertionError(
                    f"assert_matches_reference: step {t}, leaf {name}: {a!r} vs reference {e!r}"
                )
        dtypes = {x.dtype for x in tree.leaves(u) if isinstance(x, Tensor)}
        for leaf_dtype in sorted(dtypes, key=str):
            pick = [isinstance(x, Tensor) and x.dtype == leaf_dtype for x in tree.leaves(u)]
            assert_close_rounding(
                _only(u, pick),
                _only(want, pick),
                dtype=leaf_dtype,
                ops=count,
                scale=None if scale is None else _only(scale, pick),
                check_dtype=False,
                msg=f"assert_matches_reference: step {t}",
            )
        if apply:
            p = apply_updates(p, u)


def _only(value: PyTree, pick: list[bool]) -> PyTree:
    """``value`` with the leaves not picked set to ``None`` (compared as ``None``)."""
    return rebuild(
        value, [x if keep else None for x, keep in zip(tree.leaves(value), pick, strict=True)]
    )


def _times(ops: Ops, n: int) -> Ops:
    if isinstance(ops, dict):
        return {k: v * n for k, v in ops.items()}
    if not isinstance(ops, (int, float)):
        return {k: v * n for k, v in ops.items()}
    return ops * n
