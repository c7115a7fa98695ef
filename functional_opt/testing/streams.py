"""Deterministic test data: random trees shaped like params, and gradient streams with faults.

Nothing here needs hypothesis: the checks of :mod:`functional_opt.testing.checks` call these
with a seed, and the strategies of :mod:`functional_opt.testing.strategies` draw the seeds,
scales and fault positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import tree
from functional_opt.packed import Packed, pack
from functional_opt.tree import PyTree

__all__ = ["Fault", "gradient_stream", "random_like", "rebuild", "tensor_leaves"]


class Fault(NamedTuple):
    """A non-finite value put into a gradient stream: at ``step``, in the ``leaf``-th tensor
    leaf (flattening order, ``None`` leaves not counted), at flat element ``position`` (modulo
    the leaf's size; an empty leaf takes none)."""

    step: int
    leaf: int
    value: float = float("nan")
    position: int = 0


def tensor_leaves(value: PyTree) -> list[int]:
    """Flat positions (``None`` leaves counted) of the tensor leaves of ``value``."""
    return [i for i, x in enumerate(tree.leaves(value)) if isinstance(x, Tensor)]


def rebuild(like: PyTree, leaves: Sequence[Any]) -> PyTree:
    """A tree with ``like``'s structure and ``leaves``; a packed ``like`` gives a tree packed
    anew (with its batch dimensions), so its leaves may differ in shape, dtype or be ``None``."""
    if isinstance(like, Packed):
        inner = tree.flatten(like.tree)[1]
        return pack(tree.unflatten(inner, leaves), batch_dims=len(like.structure.batch))
    return tree.unflatten(tree.flatten(like)[1], leaves)


def random_like(params: PyTree, gen: torch.Generator, scale: float = 1.0) -> PyTree:
    """Standard normal values times ``scale`` in the shapes, dtypes and devices of the tensor
    leaves of ``params`` (drawn in float64 and rounded once); ``None`` leaves stay ``None``."""

    def one(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        if not (x.dtype.is_floating_point or x.dtype.is_complex):
            return x.clone()
        values = torch.randn(x.shape, generator=gen, dtype=torch.float64) * scale
        return values.to(device=x.device, dtype=x.dtype)

    return rebuild(params, [one(x) for x in tree.leaves(params)])


def gradient_stream(
    params: PyTree,
    steps: int = 3,
    *,
    seed: int = 0,
    scales: Sequence[float] | float = 1.0,
    faults: Sequence[Fault] = (),
    none: Sequence[tuple[int, int]] = (),
) -> list[PyTree]:
    """``steps`` gradient trees shaped like ``params`` (packed if it is), reproducible from
    ``seed``: standard normal values times ``scales`` (one number, or one per step), with each
    :class:`Fault` written in and the tensor leaf ``leaf`` of step ``step`` set to ``None`` for
    each ``(step, leaf)`` in ``none``."""
    if steps < 0:
        raise ValueError(f"gradient_stream: steps must be >= 0, got {steps}")
    per_step = [float(scales)] * steps if isinstance(scales, (int, float)) else list(scales)
    if len(per_step) != steps:
        raise ValueError(f"gradient_stream: {len(per_step)} scales for {steps} steps")
    gen = torch.Generator().manual_seed(seed)
    positions = tensor_leaves(params)
    out = []
    for step, scale in enumerate(per_step):
        g = random_like(params, gen, scale)
        leaves = list(tree.leaves(g))
        for fault in faults:
            if fault.step == step and positions:
                x = leaves[positions[fault.leaf % len(positions)]]
                if isinstance(x, Tensor) and x.numel():
                    flat = x.clone().reshape(-1)
                    flat[fault.position % x.numel()] = fault.value
                    leaves[positions[fault.leaf % len(positions)]] = flat.reshape(x.shape)
        for at, leaf in none:
            if at == step and positions:
                leaves[positions[leaf % len(positions)]] = None
        out.append(rebuild(params, leaves) if faults or none else g)
    return out
