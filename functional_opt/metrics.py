"""The optimizer metrics DreamerV3 logs, as a pure function of tensors (no host syncs).

``grad_norm = sqrt(sum_i ||g_i||^2)``; ``grad_rms = sqrt(sum_i ||g_i||^2 / sum_i n_i)`` (the root
mean square over every element of every gradient, before clipping); likewise ``update_rms`` over
the applied updates and ``param_rms`` over the params after the update; ``grad_scale`` and
``grad_overflow`` (1.0 when the step overflowed) under float16 loss scaling; ``updates``, the
number of optimizer updates so far. ``None`` leaves are ignored; every value is a 0-d float32
tensor (reductions run in at least float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from functional_opt import _lists, tree
from functional_opt.tree import PyTree

__all__ = ["dreamerv3_metrics", "tree_rms"]


def _present(values: PyTree) -> list[Tensor]:
    return [x for x in tree.leaves(values) if x is not None]


def tree_rms(values: PyTree) -> Tensor:
    """``sqrt(sum_i ||x_i||^2 / sum_i numel(x_i))`` over the tensor leaves (0 if there are none)."""
    xs = _present(values)
    count = sum(x.numel() for x in xs)
    if count == 0:
        return torch.zeros(())
    rms: Tensor = (_lists.global_norm(xs) / count**0.5).float()
    return rms


def dreamerv3_metrics(
    grads: PyTree,
    *,
    updates: PyTree | None = None,
    params: PyTree | None = None,
    grad_scale: Tensor | None = None,
    grads_finite: Tensor | None = None,
    count: Tensor | int | None = None,
) -> dict[str, Tensor]:
    """DreamerV3's optimizer metrics: ``grad_norm`` and ``grad_rms`` of ``grads`` (pass them
    unscaled and before clipping), ``update_rms`` of ``updates``, ``param_rms`` of ``params``
    (after the update), ``grad_scale``, ``grad_overflow = 1 - grads_finite`` and ``updates =
    count``; entries whose inputs are not given are left out."""
    gs = _present(grads)
    norm = _lists.global_norm(gs).float() if gs else torch.zeros(())
    n = sum(g.numel() for g in gs)
    out = {"grad_norm": norm, "grad_rms": norm / max(n, 1) ** 0.5}
    if updates is not None:
        out["update_rms"] = tree_rms(updates)
    if params is not None:
        out["param_rms"] = tree_rms(params)
    if grad_scale is not None:
        out["grad_scale"] = torch.as_tensor(grad_scale).detach().float()
    if grads_finite is not None:
        out["grad_overflow"] = (~torch.as_tensor(grads_finite, dtype=torch.bool)).float()
    if count is not None:
        out["updates"] = torch.as_tensor(count).detach().float()
    return out
