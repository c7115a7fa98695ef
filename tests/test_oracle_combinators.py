"""Oracle tests for the combinators and wrappers: ``chain``, ``named_chain``, ``masked``,
``partition``, ``inject_hyperparams``, ``MultiSteps``/``multi_steps`` and ``apply_if_finite``
match optax (JAX on the CPU, float64) update by update and state by state."""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch
from oracle_utils import (
    ELEMENTWISE_OPS,
    assert_leaves_close,
    assert_states_close,
    bool_mask,
    compare_run,
    jnp,
    optax,
    randn,
    random_grads,
    random_params,
    step_ops,
    x64_schedule,
)

import functional_opt as fo

SEEDS = (0, 3)


def random_mask(seed, params):
    """A random tree of Python bools shaped like ``params``, with both values present."""
    rng = np.random.default_rng(seed + 777)
    leaves, spec = optree.tree_flatten(params)
    flags = [bool(f) for f in rng.random(len(leaves)) < 0.5]
    flags[0], flags[-1] = True, False
    return optree.tree_unflatten(spec, flags)


# --- chain / named_chain ----------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("seed", SEEDS)
def test_chain_matches_optax(seed):
    params = random_params(seed)
    ours = fo.chain(
        fo.clip(1.0),
        fo.trace(0.5, nesterov=True),
        fo.add_decayed_weights(0.05),
        fo.scale_by_schedule(fo.cosine_decay_schedule(-0.1, 8, alpha=0.2)),
        fo.ema(0.3),
    )
    theirs = optax.chain(
        optax.clip(1.0),
        optax.trace(0.5, nesterov=True),
        optax.add_decayed_weights(0.05),
        optax.scale_by_schedule(optax.cosine_decay_schedule(-0.1, 8, alpha=0.2)),
        optax.ema(0.3),
    )
    compare_run(ours, theirs, params, random_grads(seed, params))


@pytest.mark.parametrize("seed", SEEDS)
def test_named_chain_matches_optax(seed):
    params = random_params(seed)
    ours = fo.named_chain(
        ("clip", fo.clip_by_global_norm(1.0)),
        ("adam", fo.scale_by_adam(b1=0.7)),
        ("decay", fo.add_decayed_weights(0.1, bool_mask)),
        ("lr", fo.scale_by_learning_rate(0.1)),
    )
    theirs = optax.named_chain(
        ("clip", optax.clip_by_global_norm(1.0)),
        ("adam", optax.scale_by_adam(b1=0.7)),
        ("decay", optax.add_decayed_weights(0.1, bool_mask)),
        ("lr", optax.scale_by_learning_rate(0.1)),
    )

    def ops(step):
        return (step + 1) * step_ops(params)

    def same_names(step, s_o, s_t, s_m):
        assert list(s_o) == list(s_t)
        for name in s_o:
            assert_states_close(
                s_o[name], s_t[name], f"state[{name!r}] after step {step}", ops(step), s_m[name]
            )

    compare_run(ours, theirs, params, random_grads(seed, params), after_step=same_names)


# --- masked / partition -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask_kind", ["tree", "callable"])
def test_masked_matches_optax(seed, mask_kind):
    params = random_params(seed)
    mask = random_mask(seed, params) if mask_kind == "tree" else bool_mask
    ours = fo.masked(fo.chain(fo.scale_by_adam(b1=0.8), fo.scale(-0.1)), mask)
    theirs = optax.masked(optax.chain(optax.scale_by_adam(b1=0.8), optax.scale(-0.1)), mask)
    compare_run(ours, theirs, params, random_grads(seed, params))


def test_masked_with_prefix_mask_matches_optax():
    rng = np.random.default_rng(5)
    params = {
        "enc": {"w": randn(rng, (2, 3)), "b": randn(rng, (3,))},
        "dec": [randn(rng, ()), randn(rng, (1, 4))],
        "head": randn(rng, (3,)),
    }
    mask = {"enc": True, "dec": False, "head": True}
    ours = fo.masked(fo.trace(0.9), mask)
    theirs = optax.masked(optax.trace(0.9), mask)
    compare_run(ours, theirs, params, random_grads(5, params))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("labels_kind", ["tree", "callable"])
def test_partition_matches_optax(seed, labels_kind):
    params = random_params(seed)
    rng = np.random.default_rng(seed + 99)
    leaves, spec = optree.tree_flatten(params)
    names = ["adam", "sgd", "clip"]
    tree_labels = optree.tree_unflatten(spec, [names[i % 3] for i in rng.permutation(len(leaves))])
    if labels_kind == "tree":
        labels = tree_labels
    else:

        def labels(p):
            return optree.tree_map(lambda x: "adam" if x.ndim < 2 else "sgd", p)

    ours = fo.partition(
        {
            "adam": fo.adam(0.1, b1=0.8),
            "sgd": fo.sgd(0.05, momentum=0.9, nesterov=True),
            "clip": fo.chain(fo.clip(0.2), fo.scale(-0.1)),
        },
        labels,
    )
    theirs = optax.partition(
        {
            "adam": optax.adam(0.1, b1=0.8),
            "sgd": optax.sgd(0.05, momentum=0.9, nesterov=True),
            "clip": optax.chain(optax.clip(0.2), optax.scale(-0.1)),
        },
        labels,
    )

    def same_labels(step, s_o, s_t, s_m):
        assert sorted(s_o.inner_states) == sorted(s_t.inner_states)
        for label in s_o.inner_states:
            assert_states_close(
                s_o.inner_states[label],
                s_t.inner_states[label],
                f"{label} state, step {step}",
                (step + 1) * step_ops(params),
                s_m.inner_states[label],
            )

    compare_run(ours, theirs, params, random_grads(seed, params), after_step=same_labels)


# --- inject_hyperparams -----------------------------------------------------------------------


def _check_hyperparams(step, s_o, s_t, s_m):
    # The inner states here have no norms: elementwise roundings only, summed over the steps.
    ops = (step + 1) * ELEMENTWISE_OPS
    assert sorted(s_o.hyperparams) == sorted(s_t.hyperparams)
    for name in s_o.hyperparams:
        ours, theirs = s_o.hyperparams[name], s_t.hyperparams[name]
        assert isinstance(ours, torch.Tensor) and ours.dim() == 0, name
        assert_leaves_close(
            [ours.numpy()], [np.asarray(theirs)], f"hyperparams[{name!r}] after step {step}", ops
        )
    assert_leaves_close(
        [s_o.count.numpy()], [np.asarray(s_t.count)], f"hyperparams count after step {step}"
    )
    assert_states_close(
        s_o.inner_state, s_t.inner_state, f"inner state after step {step}", ops, s_m.inner_state
    )


def _set(state, name, value, make):
    return state._replace(hyperparams={**state.hyperparams, name: make(value)})


def _change(changes):
    """A ``before_step`` hook that sets ``hyperparams[name] = value`` at the given steps."""

    def hook(step, s_o, s_t):
        for at, name, value in changes:
            if step == at:
                s_o = _set(s_o, name, value, lambda v: torch.tensor(v, dtype=torch.float64))
                s_t = _set(s_t, name, value, lambda v: jnp.asarray(v, dtype=jnp.float64))
        return s_o, s_t

    return hook


@pytest.mark.parametrize("seed", SEEDS)
def test_inject_hyperparams_adamw_with_changes_matches_optax(seed):
    params = random_params(seed)
    # A callable mask must be static, or (as in optax) it would be taken for a schedule.
    ours = fo.inject_hyperparams(fo.adamw, "mask", hyperparam_dtype=torch.float64)(
        learning_rate=0.1, b1=0.8, weight_decay=0.05, mask=bool_mask
    )
    theirs = optax.inject_hyperparams(optax.adamw, "mask", hyperparam_dtype=jnp.float64)(
        learning_rate=0.1, b1=0.8, weight_decay=0.05, mask=bool_mask
    )
    compare_run(
        ours,
        theirs,
        params,
        random_grads(seed, params),
        check_state=False,
        before_step=_change([(4, "learning_rate", 0.02), (7, "b1", 0.5), (7, "weight_decay", 0.3)]),
        after_step=_check_hyperparams,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_inject_hyperparams_schedule_matches_optax(seed):
    params = random_params(seed)
    ours = fo.inject_hyperparams(fo.sgd, hyperparam_dtype=torch.float64)(
        learning_rate=fo.linear_schedule(0.1, 0.01, 6, 2), momentum=0.9, nesterov=True
    )
    theirs = optax.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.float64)(
        learning_rate=x64_schedule(optax.linear_schedule(0.1, 0.01, 6, 2)),
        momentum=0.9,
        nesterov=True,
    )
    assert float(ours.init(params).hyperparams["learning_rate"]) == pytest.approx(0.1)
    compare_run(
        ours,
        theirs,
        params,
        random_grads(seed, params),
        check_state=False,
        before_step=_change([(5, "momentum", 0.2)]),
        after_step=_check_hyperparams,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_inject_hyperparams_static_args_matches_optax(seed):
    params = random_params(seed)
    ours = fo.inject_hyperparams(
        fo.scale_by_rms, static_args=("initial_scale",), hyperparam_dtype=torch.float64
    )(decay=0.8, eps=1e-3, initial_scale=0.5, eps_in_sqrt=False, bias_correction=True)
    theirs = optax.inject_hyperparams(
        optax.scale_by_rms, static_args=("initial_scale",), hyperparam_dtype=jnp.float64
    )(decay=0.8, eps=1e-3, initial_scale=0.5, eps_in_sqrt=False, bias_correction=True)
    s_o = ours.init(params)
    assert "initial_scale" not in s_o.hyperparams
    compare_run(
        ours,
        theirs,
        params,
        random_grads(seed, params),
        check_state=False,
        before_step=_change([(6, "decay", 0.95), (6, "eps", 1e-1)]),
        after_step=_check_hyperparams,
    )


# --- MultiSteps -------------------------------------------------------------------------------


def _every_k(step):
    # 1, 2, 3, 1, 2, 3, ...: works on our int32 tensors and on JAX arrays alike.
    return 1 + step % 3


@pytest.mark.parametrize("form", ["object", "gradient_transformation", "multi_steps"])
@pytest.mark.parametrize("use_grad_mean", [True, False])
@pytest.mark.parametrize("every_k", [1, 3, "callable"], ids=["k=1", "k=3", "k=callable"])
def test_multi_steps_matches_optax(every_k, use_grad_mean, form):
    seed = 11
    params = random_params(seed)
    k = _every_k if every_k == "callable" else every_k
    ours_ms = fo.MultiSteps(fo.adam(0.1, b1=0.8), k, use_grad_mean, accumulator_dtype=torch.float64)
    theirs_ms = optax.MultiSteps(
        optax.adam(0.1, b1=0.8), k, use_grad_mean, accumulator_dtype=jnp.float64
    )
    if form == "object":
        ours = ours_ms
    elif form == "gradient_transformation":
        ours = ours_ms.gradient_transformation()
    else:
        ours = fo.multi_steps(
            fo.adam(0.1, b1=0.8), k, use_grad_mean, accumulator_dtype=torch.float64
        )
    emitted = []

    def check_has_updated(step, s_o, s_t, s_m):
        del s_m
        has = ours_ms.has_updated(s_o)
        assert isinstance(has, torch.Tensor)
        assert bool(has) == bool(theirs_ms.has_updated(s_t)), f"has_updated at step {step}"
        emitted.append(bool(has))

    compare_run(
        ours,
        theirs_ms.gradient_transformation(),
        params,
        random_grads(seed, params, steps=14),
        jit=True,
        after_step=check_has_updated,
    )
    expected = {1: 14, 3: 4, "callable": 7}[every_k]  # windows 1,2,3,1,2,3,1 close at 14
    assert sum(emitted) == expected


# --- apply_if_finite --------------------------------------------------------------------------


def _poison(grads, bad_steps, seed):
    """Copies of ``grads`` with one element of one leaf set to NaN, +Inf or -Inf at
    ``bad_steps``."""
    rng = np.random.default_rng(seed)
    out = []
    for step, g in enumerate(grads):
        if step in bad_steps:
            leaves, spec = optree.tree_flatten(g)
            leaves = [x.clone() for x in leaves]
            target = leaves[int(rng.integers(len(leaves)))].view(-1)
            target[int(rng.integers(target.numel()))] = float(rng.choice([np.nan, np.inf, -np.inf]))
            g = optree.tree_unflatten(spec, leaves)
        out.append(g)
    return out


def _finite_counters_hook(records):
    def hook(step, s_o, s_t, s_m):
        del s_m
        for name in ("notfinite_count", "last_finite", "total_notfinite"):
            ours, theirs = getattr(s_o, name), getattr(s_t, name)
            assert isinstance(ours, torch.Tensor)
            np.testing.assert_array_equal(ours.numpy(), np.asarray(theirs), err_msg=name)
        records.append((int(s_o.notfinite_count), bool(s_o.last_finite)))

    return hook


@pytest.mark.parametrize("seed", SEEDS)
def test_apply_if_finite_with_stateful_inner_matches_optax(seed):
    # Runs of at most 2 non-finite steps are rejected; the final run of 3 is applied anyway on
    # its last step (the inner Adam state then becomes NaN, as in optax).
    params = random_params(seed)
    grads = _poison(random_grads(seed, params, steps=13), {2, 5, 6, 10, 11, 12}, seed)
    ours = fo.apply_if_finite(fo.adam(0.1), max_consecutive_errors=2)
    theirs = optax.apply_if_finite(optax.adam(0.1), max_consecutive_errors=2)
    records = []
    s_o, _ = compare_run(
        ours,
        theirs,
        params,
        grads,
        apply=False,
        jit=True,
        after_step=_finite_counters_hook(records),
    )
    assert int(s_o.total_notfinite) == 6
    assert [r[0] for r in records] == [0, 0, 1, 0, 0, 1, 2, 0, 0, 0, 1, 2, 3]
    assert int(s_o.inner_state[0].count) == 7 + 1  # 7 finite updates and one forced


@pytest.mark.parametrize("max_errors", [0, 1])
def test_apply_if_finite_gives_up_after_max_consecutive_errors(max_errors):
    # The inner state is a step counter, so every "apply anyway" shows up in it and its
    # NaN updates don't poison later steps.
    seed = 4
    params = random_params(seed)
    bad = {1, 2, 3, 6, 7, 9}
    grads = _poison(random_grads(seed, params), bad, seed)
    ours = fo.apply_if_finite(
        fo.scale_by_schedule(fo.linear_schedule(1.0, 0.5, 10)), max_consecutive_errors=max_errors
    )
    theirs = optax.apply_if_finite(
        optax.scale_by_schedule(x64_schedule(optax.linear_schedule(1.0, 0.5, 10))),
        max_consecutive_errors=max_errors,
    )
    records = []
    s_o, _ = compare_run(
        ours,
        theirs,
        params,
        grads,
        apply=False,
        jit=True,
        after_step=_finite_counters_hook(records),
    )
    forced = sum(1 for n, _ in records if n > max_errors)
    assert forced == {0: 6, 1: 3}[max_errors]
    assert int(s_o.inner_state.count) == len(grads) - len(bad) + forced
    assert [r[1] for r in records] == [s not in bad for s in range(len(grads))]
