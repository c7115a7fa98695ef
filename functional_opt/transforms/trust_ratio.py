"""Layer-wise trust ratio: ``scale_by_trust_ratio`` (LARS, LAMB: You et al. 2017, 2019)."""

from __future__ import annotations

import torch
from torch import Tensor

from functional_opt import _lists, _validate, tree
from functional_opt.base import GradientTransformation, Params, Updates, stateless

__all__ = ["scale_by_trust_ratio", "trust_ratios"]


def trust_ratios(
    g: list[Tensor],
    p: list[Tensor],
    min_norm: float | Tensor,
    trust_coefficient: float | Tensor,
    eps: float | Tensor,
) -> list[Tensor]:
    """Per tensor, ``trust_coefficient * max(||p||, min_norm) / (max(||u||, min_norm) + eps)``,
    or 1 where either clipped norm is 0 (0-d tensors, in at least float32)."""
    u_norm = torch.clamp(_lists.stack(_lists.norms(g)), min=min_norm)
    p_norm = torch.clamp(_lists.stack(_lists.norms(p)), min=min_norm)
    ratio = trust_coefficient * p_norm / (u_norm + eps)
    ratio = torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)
    return list(ratio.unbind())


def scale_by_trust_ratio(
    min_norm: float | Tensor = 0.0,
    trust_coefficient: float | Tensor = 1.0,
    eps: float | Tensor = 0.0,
) -> GradientTransformation:
    """``u -> u * trust_coefficient * ||p|| / (||u|| + eps)`` per tensor (each leaf's own L2
    norms), both norms first raised to ``min_norm``; a tensor whose (raised) param or update
    norm is 0 is left unchanged (ratio 1). Needs params.

    ``min_norm``, ``trust_coefficient`` and ``eps`` are finite and ``>= 0``. Norms are computed
    in at least float32; the updates keep their dtype."""
    _validate.non_negative("min_norm", min_norm)
    _validate.non_negative("trust_coefficient", trust_coefficient)
    _validate.non_negative("eps", eps)

    def apply(updates: Updates, params: Params | None) -> Updates:
        if params is None:
            raise ValueError(
                "scale_by_trust_ratio needs params: call update(updates, state, params)"
            )
        g, at = tree.split(updates)
        if not g:
            return updates
        p = at.take(params, "params")
        return at.updates(_lists.mul(g, trust_ratios(g, p, min_norm, trust_coefficient, eps)))

    return stateless(apply)
