"""Test tooling for transforms: contract checks, a reference comparison, the rounding rule and
hypothesis strategies.

* :func:`check_transform` runs every contract check on any
  :class:`~functional_opt.GradientTransformation` (purity, ``None`` gradients, dtype policy,
  donation, checkpoints, mismatched trees, ``vmap``, ``torch.compile``); each ``check_*`` is
  also callable alone and fails with an ``AssertionError`` naming the check and the leaf.
* :func:`assert_matches_reference` compares a transform with a float64 formula.
* :func:`assert_bitwise`, :func:`assert_close_rounding`, :class:`MagnitudeRun`: the rounding
  rule the comparisons follow (:mod:`functional_opt.testing.tolerance`).
* :mod:`functional_opt.testing.strategies` (needs ``hypothesis``: ``pip install
  'functional-opt[testing]'``): pytrees of tensors and gradient streams with NaN/Inf faults.
  Its names are also importable from here (loaded on first use).

Import it as ``functional_opt.testing``; ``import functional_opt`` does not load it.
"""

from __future__ import annotations

import importlib
from typing import Any

from functional_opt.testing.checks import (
    CHECKS,
    DEFAULT_ELEMENTWISE_OPS,
    check_checkpoint_round_trip,
    check_compile,
    check_donation,
    check_dtype_policy,
    check_mismatched_trees_error,
    check_none_gradients_keep_state,
    check_purity,
    check_transform,
    check_vmap,
    default_ops,
)
from functional_opt.testing.reference import assert_matches_reference
from functional_opt.testing.streams import Fault, gradient_stream, random_like
from functional_opt.testing.tolerance import (
    MagnitudeRun,
    Ops,
    abs_run,
    assert_bitwise,
    assert_close_rounding,
    eps,
    rounding_bound,
)

_STRATEGIES = frozenset(
    {
        "Leaf",
        "Problem",
        "decays",
        "faults",
        "gradient_streams",
        "masks_for",
        "problems",
        "pytrees",
        "shapes",
        "structures",
    }
)

__all__ = [
    "CHECKS",
    "DEFAULT_ELEMENTWISE_OPS",
    "Fault",
    "Leaf",
    "MagnitudeRun",
    "Ops",
    "Problem",
    "abs_run",
    "assert_bitwise",
    "assert_close_rounding",
    "assert_matches_reference",
    "check_checkpoint_round_trip",
    "check_compile",
    "check_donation",
    "check_dtype_policy",
    "check_mismatched_trees_error",
    "check_none_gradients_keep_state",
    "check_purity",
    "check_transform",
    "check_vmap",
    "decays",
    "default_ops",
    "eps",
    "faults",
    "gradient_stream",
    "gradient_streams",
    "masks_for",
    "problems",
    "pytrees",
    "random_like",
    "rounding_bound",
    "shapes",
    "structures",
]


def __getattr__(name: str) -> Any:
    """The strategies' names, imported on first use (they need hypothesis)."""
    if name in _STRATEGIES:
        return getattr(importlib.import_module("functional_opt.testing.strategies"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
