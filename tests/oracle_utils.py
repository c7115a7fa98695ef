"""Shared helpers for the optax oracle tests (``tests/test_oracle_*.py``).

Random pytrees of float64 tensors, torch <-> JAX conversion, and a step-by-step comparison of a
functional_opt transform with its optax namesake. JAX runs on the CPU with 64-bit floats enabled
(set here, at import, before any array is made). Importing this module skips the importing test
module when JAX or optax is not installed (they are the optional ``oracle`` extra).

Tolerances follow ``tests/conftest.py``'s rule: ours and optax compute the same math in float64
with other kernels, so their results agree to ``ops * eps(float64) * magnitude``, where ``ops``
counts the roundings of one step (:data:`ELEMENTWISE_OPS` plus the norms' sums) times the steps
run so far (errors carried in state add up). With 16-bit params optax runs on their exact
float64 values, as the float64 oracle of our 16-bit computation; the caller counts its
roundings per dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree
import pytest
import torch
from conftest import ELEMENTWISE_OPS, Ops, assert_close_rounding

import functional_opt as fo

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = pytest.importorskip("jax.numpy")
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_platforms", "cpu")

STEPS = 12


def step_ops(params: Any) -> int:
    """Roundings of one update of a transform on ``params``: :data:`ELEMENTWISE_OPS` plus a norm
    over at most every element of the tree (a sum of ``n`` squares: ``n + 1`` roundings, which
    the square root halves, and the quotient that makes a clip factor; counted as ``n + 2``)."""
    n = sum(int(x.numel()) for x in optree.tree_leaves(params))
    return ELEMENTWISE_OPS + n + 2


# A small fixed pool of shapes: JAX caches its eager kernels per shape, so reusing the same few
# shapes across tests keeps the oracle tests fast. Ranks 0-4, with size-1 axes for the
# squeeze rule of optax's unit-wise norm.
SHAPES: tuple[tuple[int, ...], ...] = ((), (3,), (2, 3), (1, 4), (3, 1, 2), (2, 2, 1, 3))


def randn(rng: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A float64 tensor of standard normal samples (0-d for ``shape=()``)."""
    return torch.from_numpy(np.asarray(rng.standard_normal(shape), dtype=np.float64))


def random_params(seed: int, shapes: Sequence[tuple[int, ...]] = SHAPES) -> Any:
    """A random nested dict/list pytree of float64 tensors (always a 0-d and a 1-d leaf)."""
    rng = np.random.default_rng(seed)
    n_extra = int(rng.integers(1, 4))
    chosen = [(), (3,), *(shapes[int(i)] for i in rng.integers(len(shapes), size=n_extra))]
    rng.shuffle(chosen)
    tensors = [randn(rng, s) for s in chosen]
    return _nest(rng, tensors, top=True)


def _nest(rng: np.random.Generator, items: list[torch.Tensor], top: bool = False) -> Any:
    if len(items) == 1 and not top and rng.random() < 0.75:
        return items[0]
    k = min(len(items), int(rng.integers(1, 4)))
    cuts = sorted(rng.choice(np.arange(1, len(items)), size=k - 1, replace=False).tolist())
    groups = [items[a:b] for a, b in zip([0, *cuts], [*cuts, len(items)], strict=True)]
    children = [_nest(rng, g) for g in groups]
    if top or rng.random() < 0.6:
        names = rng.permutation(["w", "b", "emb", "head", "x"])[: len(children)]
        return {str(n): c for n, c in zip(names, children, strict=True)}
    return children


def random_grads(seed: int, params: Any, steps: int = STEPS, spread: float = 1.5) -> list[Any]:
    """``steps`` gradient trees shaped like ``params``; each step and leaf gets its own random
    scale in ``10**[-spread, 1]`` so that norm-based clipping is hit on some steps only."""
    rng = np.random.default_rng(seed + 10_000)
    out = []
    for _ in range(steps):
        step_scale = 10 ** rng.uniform(-spread, 1.0)
        out.append(
            optree.tree_map(
                lambda p, s=step_scale: (
                    randn(rng, tuple(p.shape)) * s * 10 ** rng.uniform(-0.5, 0.5)
                ),
                params,
            )
        )
    return out


def x64_schedule(schedule: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An optax schedule fed an int64 count.

    optax's transforms count in int32, and with an int32 count ``optax.linear_schedule`` (also
    inside ``join_schedules`` and ``warmup_cosine_decay_schedule``) computes in float32, so
    its values are only float32-accurate. Ours compute schedules in float64 whatever the
    count's dtype; to compare them at float64 precision, optax's schedules get int64 counts.
    """
    return lambda count: schedule(jnp.asarray(count, dtype=jnp.int64))


def to_jax(tree: Any) -> Any:
    """The same pytree with every tensor leaf as a ``jnp`` array (same dtype; 16-bit floats as
    float64, which holds them exactly)."""

    def one(t: torch.Tensor) -> Any:
        if t.is_floating_point() and t.element_size() < 4:
            t = t.to(torch.float64)
        return jnp.asarray(t.detach().numpy())

    return optree.tree_map(one, tree)


def wide(tree: Any) -> Any:
    """The tree with every floating-point tensor as float64 (exact for narrower floats)."""
    return optree.tree_map(lambda t: t.to(torch.float64) if t.is_floating_point() else t, tree)


def bool_mask(params: Any, min_rank: int = 2) -> Any:
    """A tree of Python bools: ``True`` for leaves of rank >= ``min_rank``."""
    return optree.tree_map(lambda p: p.ndim >= min_rank, params)


def _as_np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.element_size() < 4:
            x = x.to(torch.float64)  # (numpy has no bfloat16; the values are kept exactly)
        return x.detach().numpy()
    return np.asarray(x)


def ours_leaves(tree: Any) -> list[np.ndarray]:
    return [_as_np(x) for x in optree.tree_leaves(tree)]


def optax_leaves(tree: Any) -> list[np.ndarray]:
    return [_as_np(x) for x in jax.tree.leaves(tree)]


def absolute(tree: Any) -> Any:
    """The tree with every floating-point tensor replaced by its absolute values."""
    return optree.tree_map(lambda t: t.abs() if t.is_floating_point() else t, tree)


def _scale(magnitude: np.ndarray | None, expected: torch.Tensor) -> torch.Tensor | None:
    """The rule's ``scale`` for one leaf: the magnitude run's values where they are finite, the
    leaf's largest finite magnitude elsewhere (a step whose values are non-finite in the
    magnitude run), never less than the expected values."""
    if magnitude is None:
        return None
    m = torch.from_numpy(np.array(magnitude)).to(torch.float64).abs()
    e = expected.to(torch.float64).abs()
    finite = torch.cat([m[torch.isfinite(m)], e[torch.isfinite(e)]])
    fallback = finite.max() if finite.numel() else torch.zeros((), dtype=torch.float64)
    return torch.maximum(torch.where(torch.isfinite(m), m, fallback), e.nan_to_num(0.0, 0.0, 0.0))


def assert_leaves_close(
    ours: list[np.ndarray],
    theirs: list[np.ndarray],
    what: str,
    ops: Ops = ELEMENTWISE_OPS,
    magnitudes: list[np.ndarray] | None = None,
    check_dtype: bool = True,
) -> None:
    """Integer leaves equal; float leaves of one dtype within ``ops`` roundings of it, relative
    to ``magnitudes`` (the same values computed from absolute inputs: the terms' size, which
    cancellation cannot shrink) or, without them, to each leaf's largest value.
    ``check_dtype=False``: optax's float leaves are a float64 oracle of narrower ones."""
    assert len(ours) == len(theirs), f"{what}: {len(ours)} leaves vs optax's {len(theirs)}"
    mags = [None] * len(ours) if magnitudes is None else magnitudes
    assert len(mags) == len(ours), f"{what}: {len(mags)} magnitudes for {len(ours)} leaves"
    for i, (a, b, m) in enumerate(zip(ours, theirs, mags, strict=True)):
        assert a.shape == b.shape, f"{what}, leaf {i}: shape {a.shape} vs optax's {b.shape}"
        if a.dtype.kind in "biu" or b.dtype.kind in "biu":
            assert a.dtype.kind == b.dtype.kind, f"{what}, leaf {i}: {a.dtype} vs {b.dtype}"
            np.testing.assert_array_equal(a, b, err_msg=f"{what}, leaf {i}")
        else:
            if check_dtype:
                assert a.dtype == b.dtype, f"{what}, leaf {i}: dtype {a.dtype} vs {b.dtype}"
            x, y = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b))
            assert_close_rounding(
                x,
                y,
                dtype=x.dtype,
                ops=ops,
                scale=_scale(m, y),
                check_dtype=check_dtype,
                msg=f"{what}, leaf {i}",
            )


def assert_trees_close(
    ours: Any,
    theirs: Any,
    what: str,
    ops: Ops = ELEMENTWISE_OPS,
    magnitudes: Any = None,
    check_dtype: bool = True,
) -> None:
    """Same structure (as JAX sees it), shapes, dtypes and values (``magnitudes``: our tree
    computed from absolute inputs, see :func:`assert_leaves_close`)."""
    ours_structure = jax.tree.structure(to_jax(ours))
    theirs_structure = jax.tree.structure(theirs)
    assert ours_structure == theirs_structure, f"{what}: {ours_structure} vs {theirs_structure}"
    mags = None if magnitudes is None else ours_leaves(magnitudes)
    assert_leaves_close(ours_leaves(ours), optax_leaves(theirs), what, ops, mags, check_dtype)


def assert_states_close(
    ours: Any,
    theirs: Any,
    what: str,
    ops: Ops = ELEMENTWISE_OPS,
    magnitudes: Any = None,
    check_dtype: bool = True,
) -> None:
    """The array leaves of the two states agree in order, shape, dtype and value (the
    containers may differ: e.g. ``None`` here where optax has a ``MaskedNode``)."""
    mags = None if magnitudes is None else ours_leaves(magnitudes)
    assert_leaves_close(ours_leaves(ours), optax_leaves(theirs), what, ops, mags, check_dtype)


def compare_run(
    ours: Any,
    theirs: Any,
    params: Any,
    grads: Sequence[Any],
    *,
    pass_params: bool = True,
    check_state: bool = True,
    apply: bool = True,
    jit: bool = False,
    before_step: Callable[[int, Any, Any], tuple[Any, Any]] | None = None,
    after_step: Callable[[int, Any, Any, Any], None] | None = None,
    ops: Callable[[int], Ops] | None = None,
) -> tuple[Any, Any]:
    """Runs ``ours`` and ``theirs`` (an optax transform) side by side on the same gradients.

    Both get the same params each step (ours, moved by our updates when ``apply``), so errors do
    not compound. Checks the updates after every step and, with ``check_state``, the states at
    init and after every step. ``before_step(step, our_state, optax_state)`` may return edited
    states (e.g. a changed hyperparameter; it must be pure: it also edits the magnitude run's
    state); ``after_step(step, our_state, optax_state, magnitude_state)`` may add checks.
    ``jit`` compiles optax's update once (for transforms built on ``lax.cond``, which eager JAX
    would recompile on every call).

    Tolerance (``tests/conftest.py``): after step ``t`` (from 0) values agree to ``ops(t)``
    roundings (default: ``(t + 1) * step_ops(params)`` in float64) of the magnitude run's
    values: ``ours`` run alongside in float64 on the absolute values of the gradients and
    params, whose results are the sizes of the terms each value is a sum of (a moment that
    averages gradients of both signs may be far smaller than the terms whose rounding it
    carries).

    Params narrower than float64 (16-bit): optax gets their exact float64 values and is the
    oracle; our updates must keep each param's dtype, and ``ops`` must count our roundings per
    dtype. Returns the final states.
    """
    theirs_update = jax.jit(theirs.update) if jit else theirs.update
    floats = [x for x in optree.tree_leaves(params) if x.is_floating_point()]
    exact = all(x.dtype == torch.float64 for x in floats)
    if ops is None:
        assert exact, "compare_run: count the roundings of params narrower than float64"
        per_step = step_ops(params)
        ops = lambda t: (t + 1) * per_step  # noqa: E731
    s_o = ours.init(params)
    s_m = ours.init(wide(absolute(params)))
    s_t = theirs.init(to_jax(params))
    if check_state:
        assert_states_close(s_o, s_t, "initial state", ops(0), s_m, exact)
    p = params
    for step, g in enumerate(grads):
        if before_step is not None:
            s_m, _ = before_step(step, s_m, s_t)
            s_o, s_t = before_step(step, s_o, s_t)
        pj = to_jax(p)
        u_o, s_o = ours.update(g, s_o, p if pass_params else None)
        u_m, s_m = ours.update(wide(absolute(g)), s_m, wide(absolute(p)) if pass_params else None)
        u_t, s_t = theirs_update(to_jax(g), s_t, pj if pass_params else None)
        if not exact:  # updates in each param's dtype
            for u, x in zip(optree.tree_leaves(u_o), optree.tree_leaves(p), strict=True):
                assert u.dtype == x.dtype, f"update of a {x.dtype} param in {u.dtype}"
        assert_trees_close(u_o, u_t, f"updates at step {step}", ops(step), u_m, exact)
        if check_state:
            assert_states_close(s_o, s_t, f"state after step {step}", ops(step), s_m, exact)
        if after_step is not None:
            after_step(step, s_o, s_t, s_m)
        if apply:
            p = fo.apply_updates(p, u_o)
    return s_o, s_t
