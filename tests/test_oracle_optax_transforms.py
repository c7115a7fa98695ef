"""Oracle tests for issue 17's optax pieces: target network updates, ``zero_nans``,
``set_to_zero``, ``freeze``, ``MultiSteps(should_skip_update_fn=...)`` with ``skip_not_finite``
and ``skip_large_updates``, ``snapshot``/``monitor``/``measure_with_ema`` and
``adaptive_grad_clip(axis=...)`` against optax itself (JAX on the CPU, float64), step by step.

Tolerances follow ``tests/conftest.py`` (see ``oracle_utils``): selections and copies exactly
(``ops=0``), formulas at their rounding counts relative to the terms' magnitudes.
"""

from __future__ import annotations

import functools

import numpy as np
import optree
import pytest
import torch
from oracle_utils import (
    absolute,
    assert_states_close,
    assert_trees_close,
    bool_mask,
    compare_run,
    jax,
    optax,
    randn,
    random_grads,
    random_params,
    step_ops,
    to_jax,
)

import functional_opt as fo

SEEDS = (0, 1)


def _poison(grads, bad_steps, seed):
    """Copies of ``grads`` with one element of one leaf set to NaN, +Inf or -Inf at
    ``bad_steps`` (NaN at least once)."""
    rng = np.random.default_rng(seed)
    out = []
    for step, g in enumerate(grads):
        if step in bad_steps:
            leaves, spec = optree.tree_flatten(g)
            leaves = [x.clone() for x in leaves]
            target = leaves[int(rng.integers(len(leaves)))].view(-1)
            value = np.nan if step == min(bad_steps) else rng.choice([np.nan, np.inf, -np.inf])
            target[int(rng.integers(target.numel()))] = float(value)
            g = optree.tree_unflatten(spec, leaves)
        out.append(g)
    return out


# --- target networks --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("step_size", [0.0, 0.05, 0.5, 1.0])
def test_incremental_update_matches_optax(seed, step_size):
    new = random_params(seed)
    old = random_grads(seed, new, steps=1)[0]  # random values in new's structure
    ours = fo.incremental_update(new, old, step_size)
    theirs = optax.incremental_update(to_jax(new), to_jax(old), step_size)
    # two products and a sum, relative to the terms (the same function on absolute values)
    magnitudes = fo.incremental_update(absolute(new), absolute(old), step_size)
    assert_trees_close(ours, theirs, "incremental_update", 3, magnitudes)


@pytest.mark.parametrize("period", [1, 3])
def test_periodic_update_matches_optax(period):
    new = random_params(2)
    old = random_grads(2, new, steps=1)[0]
    for step in range(7):
        theirs = optax.periodic_update(to_jax(new), to_jax(old), step, period)
        for steps in (step, torch.tensor(step, dtype=torch.int32)):
            ours = fo.periodic_update(new, old, steps, period)
            assert_trees_close(ours, theirs, f"periodic_update at {steps!r}", ops=0)


# --- guards -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_zero_nans_matches_optax(seed):
    params = random_params(seed)
    grads = _poison(random_grads(seed, params, steps=8), {1, 4, 5}, seed)
    compare_run(fo.zero_nans(), optax.zero_nans(), params, grads, apply=False)


@pytest.mark.parametrize("seed", SEEDS)
def test_set_to_zero_matches_optax(seed):
    params = random_params(seed)
    compare_run(fo.set_to_zero(), optax.set_to_zero(), params, random_grads(seed, params, 4))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask", ["tree", "all", "none"])
def test_freeze_matches_optax(seed, mask):
    params = random_params(seed)
    m = {"tree": bool_mask(params), "all": True, "none": False}[mask]
    compare_run(
        fo.freeze(m), optax.transforms.freeze(m), params, random_grads(seed, params, steps=4)
    )


# --- MultiSteps(should_skip_update_fn=...) ----------------------------------------------------


@pytest.mark.parametrize(("seed", "k"), [(0, 3), (1, 1)])
def test_multi_steps_skip_not_finite_matches_optax(seed, k):
    params = random_params(seed)
    grads = _poison(random_grads(seed, params, steps=10), {1, 4, 5, 9}, seed)
    ours = fo.MultiSteps(
        fo.adam(0.1), k, should_skip_update_fn=fo.skip_not_finite, accumulator_dtype=None
    )
    theirs = optax.MultiSteps(
        optax.adam(0.1), k, should_skip_update_fn=optax.skip_not_finite, accumulator_dtype=None
    )
    s_o, _ = compare_run(
        ours.gradient_transformation(), theirs.gradient_transformation(), params, grads, jit=True
    )
    emitted = (10 - 4) // k
    assert int(s_o.gradient_step) == emitted


@pytest.mark.parametrize("seed", [0])
def test_multi_steps_skip_large_updates_matches_optax(seed):
    params = random_params(seed)
    grads = random_grads(seed, params, steps=10)
    squared = [sum(float((x.double() ** 2).sum()) for x in optree.tree_leaves(g)) for g in grads]
    bound = float(np.median(squared)) * 1.0001
    # No squared norm within rounding of the bound: both sides take the same decisions.
    assert min(abs(s - bound) for s in squared) > 1e-6 * bound
    ours = fo.MultiSteps(
        fo.sgd(0.1, momentum=0.9),
        2,
        should_skip_update_fn=functools.partial(fo.skip_large_updates, max_squared_norm=bound),
        accumulator_dtype=None,
    )
    theirs = optax.MultiSteps(
        optax.sgd(0.1, momentum=0.9),
        2,
        should_skip_update_fn=functools.partial(optax.skip_large_updates, max_squared_norm=bound),
        accumulator_dtype=None,
    )
    s_o, _ = compare_run(
        ours.gradient_transformation(), theirs.gradient_transformation(), params, grads, jit=True
    )
    assert sum(s >= bound for s in squared) == 5  # half the mini-steps were skipped
    assert int(s_o.gradient_step) == 5 // 2


# --- monitoring -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0])
def test_snapshot_matches_optax(seed):
    params = random_params(seed)
    ours = fo.chain(fo.sgd(0.1, momentum=0.9), fo.snapshot("norm", fo.update_norm))
    theirs = optax.chain(optax.sgd(0.1, momentum=0.9), optax.snapshot("norm", optax.tree.norm))
    compare_run(ours, theirs, params, random_grads(seed, params, steps=5))


@pytest.mark.parametrize("seed", SEEDS)
def test_monitor_matches_optax(seed):
    params = random_params(seed)
    ours = fo.monitor(
        {"norm": fo.update_norm, "norm_ema": fo.measure_with_ema(fo.update_norm, 0.9)}
    )
    theirs = optax.monitor(
        {"norm": optax.tree.norm, "norm_ema": optax.measure_with_ema(optax.tree.norm, 0.9)}
    )

    def after_step(step, s_o, s_t, s_m):
        ops = (step + 1) * step_ops(params)
        assert_states_close(s_o.measurements, s_t.measurements, f"measurements {step}", ops)
        assert_states_close(s_o.measure_states, s_t.measure_states, f"states {step}", ops)

    # (optax's monitor starts with no measurements, ours with those of the params: the states
    # are compared after each update only)
    compare_run(
        ours,
        theirs,
        params,
        random_grads(seed, params, steps=5),
        check_state=False,
        after_step=after_step,
    )


# --- adaptive_grad_clip(axis=...) ---------------------------------------------------------------

AXIS_SHAPES = ((3, 4), (2, 3, 4), (2, 2, 3, 3), (4, 1), (1, 5))


@pytest.mark.parametrize("axis", [1, (0, -1), ()])
def test_adaptive_grad_clip_axis_matches_optax(axis):
    rng = np.random.default_rng(5)
    params = {f"p{i}": randn(rng, s) for i, s in enumerate(AXIS_SHAPES)}
    ours, theirs = (
        fo.adaptive_grad_clip(0.2, 1e-2, axis=axis),
        optax.adaptive_grad_clip(0.2, 1e-2, axis=axis),
    )
    update = jax.jit(theirs.update)
    clipped = kept = 0
    for step in range(3):
        g = {
            k: randn(rng, tuple(v.shape)) * 10 ** rng.uniform(-1.5, 0.5) for k, v in params.items()
        }
        u, _ = ours.update(g, ours.init(params), params)
        expected, _ = update(to_jax(g), theirs.init(to_jax(params)), to_jax(params))
        assert_trees_close(u, expected, f"axis={axis} step {step}", step_ops(params))
        same = [(a == b) for a, b in zip(u.values(), g.values(), strict=True)]
        kept += sum(int(s.sum()) for s in same)
        clipped += sum(int((~s).sum()) for s in same)
    assert clipped > 0 and kept > 0


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 2, 2), (4, 1)])
def test_adaptive_grad_clip_torch_layout_is_optax_over_the_input_axes(shape):
    # axis="torch" on a rank >= 2 weight is optax's axis=(1, ..., ndim-1)
    rng = np.random.default_rng(6)
    p = {"w": randn(rng, shape)}
    g = {"w": randn(rng, shape) * 0.5}
    ours = fo.adaptive_grad_clip(0.1, axis="torch")
    theirs = optax.adaptive_grad_clip(0.1, axis=tuple(range(1, len(shape))))
    u, _ = ours.update(g, ours.init(p), p)
    expected, _ = jax.jit(theirs.update)(to_jax(g), theirs.init(to_jax(p)), to_jax(p))
    assert_trees_close(u, expected, "axis='torch'", step_ops(p))
