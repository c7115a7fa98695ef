"""Hypothesis strategies and float64 helpers shared by the property and invariant tests.

Trees are nested dicts and lists of tensors with mixed shapes (0-d included, rank <= 4 so that
``adaptive_grad_clip``'s unit-wise norms apply). A *structure* is such a tree with :class:`Leaf`
shape markers in place of tensors; :func:`realize` fills it with random values from a seeded
``torch.Generator`` so every example is reproducible from what hypothesis drew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch
from hypothesis import strategies as st

SHAPES: list[tuple[int, ...]] = [
    (),
    (1,),
    (3,),
    (1, 4),
    (2, 3),
    (3, 1),
    (2, 2, 3),
    (2, 1, 2, 2),
]


@dataclass(frozen=True)
class Leaf:
    """Placeholder for a tensor of ``shape`` in a structure (an optree leaf)."""

    shape: tuple[int, ...]


def structures(max_leaves: int = 6) -> st.SearchStrategy[dict[str, Any]]:
    """Nested dicts/lists of :class:`Leaf` under a top-level dict with keys ``p0``, ``p1``..."""
    leaf = st.sampled_from(SHAPES).map(Leaf)
    node = st.recursive(
        leaf,
        lambda children: (
            st.lists(children, min_size=1, max_size=3)
            | st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3)
        ),
        max_leaves=max_leaves,
    )
    return st.lists(node, min_size=1, max_size=3).map(
        lambda nodes: {f"p{i}": n for i, n in enumerate(nodes)}
    )


def tmap(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` with ``None`` as a leaf."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=True)


def tleaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=True)


def from_list(values: list[Any], like: Any) -> Any:
    """The tree with ``like``'s structure and ``values`` as its leaves."""
    return optree.tree_structure(like, none_is_leaf=True).unflatten(values)


def realize(
    structure: Any,
    gen: torch.Generator,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Any:
    """Random normal tensors (times ``scale``) in the shapes of ``structure``."""
    return tmap(lambda s: torch.randn(s.shape, generator=gen, dtype=dtype) * scale, structure)


@dataclass
class Problem:
    """Params and a sequence of gradients, all float64 with the same structure."""

    structure: Any
    params: Any
    grads: list[Any]
    seed: int


@st.composite
def problems(
    draw: st.DrawFn, min_steps: int = 10, max_steps: int = 12, max_leaves: int = 6
) -> Problem:
    """A random structure, params and ``min_steps..max_steps`` gradient trees, with magnitudes
    spread over several decades so clipping sometimes triggers and sometimes does not."""
    structure = draw(structures(max_leaves))
    seed = draw(st.integers(0, 2**32 - 1))
    steps = draw(st.integers(min_steps, max_steps))
    gen = torch.Generator().manual_seed(seed)
    pscale = 10.0 ** draw(st.floats(-2, 1))
    params = realize(structure, gen, pscale)
    grads = []
    for _ in range(steps):
        gscale = 10.0 ** draw(st.floats(-3, 2))
        grads.append(realize(structure, gen, gscale))
    return Problem(structure, params, grads, seed)


def decays(low: float = 0.0, high: float = 0.999) -> st.SearchStrategy[float]:
    """Decay rates in ``[low, high]`` (inside the valid ``[0, 1)``)."""
    return st.floats(low, high)


def masks_for(structure: Any) -> st.SearchStrategy[Any]:
    """A tree of Python bools with the structure's shape."""
    n = len(tleaves(structure))
    spec = optree.tree_structure(structure, none_is_leaf=True)
    return st.lists(st.booleans(), min_size=n, max_size=n).map(lambda bs: spec.unflatten(bs))
