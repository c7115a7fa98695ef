"""Hypothesis strategies for pytrees of tensors and gradient streams (requires hypothesis).

A *structure* is a tree of :class:`Leaf` shape markers (``None`` for a parameter without a
value); :func:`realize` fills it with random values from a seeded ``torch.Generator``, so every
example is reproducible from what hypothesis drew. :func:`pytrees` draws realized trees (dtypes,
``None`` leaves, dicts, lists, tuples and namedtuples, optionally packed with
:func:`functional_opt.pack`); :func:`gradient_streams` draws gradient sequences for given
params, with NaN/Inf faults and ``None`` leaves; :func:`problems` draws both at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover (hypothesis is a dependency of the extra)
    raise ImportError(
        "functional_opt.testing.strategies needs hypothesis: pip install "
        "'functional-opt[testing]' (or hypothesis>=6.100)"
    ) from e

from functional_opt.packed import pack
from functional_opt.testing.streams import Fault, gradient_stream, tensor_leaves
from functional_opt.tree import PyTree

__all__ = [
    "CONTAINERS",
    "EMPTY_SHAPES",
    "SHAPES",
    "Leaf",
    "Pair",
    "Problem",
    "decays",
    "faults",
    "from_list",
    "gradient_streams",
    "masks_for",
    "problems",
    "pytrees",
    "realize",
    "shapes",
    "structures",
    "tleaves",
    "tmap",
]

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
"""Leaf shapes of rank 0 to 4 (rank <= 4 so that unit-wise norms apply), none empty."""

EMPTY_SHAPES: list[tuple[int, ...]] = [(0,), (2, 0), (0, 3)]
"""Shapes with no elements (add them to ``shapes=`` to test empty leaves)."""

CONTAINERS = ("list", "dict")
"""The default container kinds of :func:`structures`; ``"tuple"`` and ``"namedtuple"`` (a
:class:`Pair`) may be added."""


class Pair(NamedTuple):
    """A namedtuple node for generated trees."""

    first: Any
    second: Any


@dataclass(frozen=True)
class Leaf:
    """Placeholder for a tensor of ``shape`` in a structure (an optree leaf)."""

    shape: tuple[int, ...]


def shapes(
    max_dims: int = 4, max_side: int = 3, *, allow_empty: bool = True
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes of rank ``0..max_dims`` with sides ``0..max_side`` (``1..`` without
    ``allow_empty``)."""
    side = st.integers(0 if allow_empty else 1, max_side)
    return st.lists(side, min_size=0, max_size=max_dims).map(tuple)


def structures(
    max_leaves: int = 6,
    *,
    shapes: Sequence[tuple[int, ...]] | st.SearchStrategy[tuple[int, ...]] = SHAPES,
    containers: Sequence[str] = CONTAINERS,
    none_leaves: bool = False,
) -> st.SearchStrategy[dict[str, Any]]:
    """Nested containers of :class:`Leaf` under a top-level dict with keys ``p0``, ``p1``...

    ``shapes``: the leaf shapes (a list to sample from, or a strategy such as :func:`shapes`);
    ``containers``: which of ``"list"``, ``"dict"``, ``"tuple"``, ``"namedtuple"`` nest;
    ``none_leaves``: some leaves may be ``None`` (a parameter without a value)."""
    unknown = set(containers) - {"list", "dict", "tuple", "namedtuple"}
    if unknown or not containers:
        raise ValueError(f"structures: unknown or no containers {sorted(unknown)}")
    shape = shapes if isinstance(shapes, st.SearchStrategy) else st.sampled_from(list(shapes))
    leaf: st.SearchStrategy[Any] = shape.map(Leaf)
    if none_leaves:
        leaf = leaf | st.none()

    def nest(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        kinds: list[st.SearchStrategy[Any]] = []
        if "list" in containers:
            kinds.append(st.lists(children, min_size=1, max_size=3))
        if "dict" in containers:
            kinds.append(st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3))
        if "tuple" in containers:
            kinds.append(st.lists(children, min_size=1, max_size=3).map(tuple))
        if "namedtuple" in containers:
            kinds.append(st.tuples(children, children).map(lambda t: Pair(*t)))
        return st.one_of(*kinds)

    node = st.recursive(leaf, nest, max_leaves=max_leaves)
    return st.lists(node, min_size=1, max_size=3).map(
        lambda nodes: {f"p{i}": n for i, n in enumerate(nodes)}
    )


def tmap(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` with ``None`` as a leaf."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=True)


def tleaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, ``None`` included."""
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
    """Random normal tensors (times ``scale``) in the shapes of ``structure`` (``None``
    stays ``None``)."""
    return tmap(
        lambda s: None if s is None else torch.randn(s.shape, generator=gen, dtype=dtype) * scale,
        structure,
    )


def pytrees(
    max_leaves: int = 6,
    *,
    shapes: Sequence[tuple[int, ...]] | st.SearchStrategy[tuple[int, ...]] = SHAPES,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    containers: Sequence[str] = CONTAINERS,
    none_leaves: bool = False,
    packed: bool | None = False,
    scale: tuple[float, float] = (-2.0, 1.0),
) -> st.SearchStrategy[PyTree]:
    """Trees of random tensors: a :func:`structures` draw realized with one dtype drawn from
    ``dtypes`` per leaf, values standard normal times ``10**x`` for ``x`` drawn from
    ``scale``. ``packed=True`` packs every tree with :func:`functional_opt.pack`, ``None``
    packs some."""

    @st.composite
    def draw_tree(draw: st.DrawFn) -> PyTree:
        structure = draw(
            structures(max_leaves, shapes=shapes, containers=containers, none_leaves=none_leaves)
        )
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        magnitude = 10.0 ** draw(st.floats(*scale))
        n = len(tleaves(structure))
        kinds = draw(st.lists(st.sampled_from(list(dtypes)), min_size=n, max_size=n))
        leaves = [
            None
            if s is None
            else (torch.randn(s.shape, generator=gen, dtype=torch.float64) * magnitude).to(d)
            for s, d in zip(tleaves(structure), kinds, strict=True)
        ]
        value = from_list(leaves, structure)
        do_pack = draw(st.booleans()) if packed is None else packed
        return pack(value) if do_pack else value

    return draw_tree()


def faults(
    steps: int,
    leaves: int,
    *,
    values: Sequence[float] = (float("nan"), float("inf"), -float("inf")),
) -> st.SearchStrategy[list[Fault]]:
    """Lists of up to three :class:`~functional_opt.testing.streams.Fault`\\ s at steps
    ``< steps`` and tensor leaves ``< leaves``, with values drawn from ``values``."""
    if steps < 1 or leaves < 1:
        return st.just([])
    fault = st.builds(
        Fault,
        st.integers(0, steps - 1),
        st.integers(0, leaves - 1),
        st.sampled_from(list(values)),
        st.integers(0, 2**16),
    )
    return st.lists(fault, max_size=3)


def gradient_streams(
    params: PyTree,
    *,
    min_steps: int = 3,
    max_steps: int = 6,
    with_faults: bool = False,
    none_leaves: bool = False,
    scale: tuple[float, float] = (-3.0, 2.0),
) -> st.SearchStrategy[list[PyTree]]:
    """Gradient streams for ``params`` (see :func:`~functional_opt.testing.gradient_stream`):
    ``min_steps..max_steps`` trees, each step's magnitude ``10**x`` for ``x`` drawn from
    ``scale``; ``with_faults`` adds NaN/Inf values (:func:`faults`), ``none_leaves`` sets some
    leaves of some steps to ``None`` (not for packed params)."""

    @st.composite
    def draw_stream(draw: st.DrawFn) -> list[PyTree]:
        steps = draw(st.integers(min_steps, max_steps))
        n = len(tensor_leaves(params))
        scales = [10.0 ** draw(st.floats(*scale)) for _ in range(steps)]
        bad = draw(faults(steps, n)) if with_faults else []
        none: list[tuple[int, int]] = []
        if none_leaves and n:
            cells = st.tuples(st.integers(0, steps - 1), st.integers(0, n - 1))
            none = draw(st.lists(cells, max_size=3))
        seed = draw(st.integers(0, 2**32 - 1))
        return gradient_stream(params, steps, seed=seed, scales=scales, faults=bad, none=none)

    return draw_stream()


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
    """A random structure, float64 params and ``min_steps..max_steps`` gradient trees, with
    magnitudes spread over several decades (so clipping sometimes triggers and sometimes does
    not)."""
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
