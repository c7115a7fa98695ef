"""The suite's hypothesis strategies are :mod:`functional_opt.testing.strategies` (public, for
users too); this module re-exports them for the test modules that import ``strategies``."""

from __future__ import annotations

from functional_opt.testing.strategies import (
    SHAPES,
    Leaf,
    Problem,
    decays,
    from_list,
    masks_for,
    problems,
    realize,
    structures,
    tleaves,
    tmap,
)

__all__ = [
    "SHAPES",
    "Leaf",
    "Problem",
    "decays",
    "from_list",
    "masks_for",
    "problems",
    "realize",
    "structures",
    "tleaves",
    "tmap",
]
