"""Oracle tests: every transform, alias and schedule with an optax namesake matches optax itself
(JAX on the CPU, float64) update by update, and state by state, on random pytrees."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import SCHEDULE_OPS, assert_close_rounding
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_utils import (
    STEPS,
    assert_trees_close,
    bool_mask,
    compare_run,
    jax,
    jnp,
    optax,
    randn,
    random_grads,
    random_params,
    step_ops,
    to_jax,
    x64_schedule,
)

import functional_opt as fo
from functional_opt import _kernels

SEEDS = (0, 1)


def _pair(ours, theirs):
    return lambda params: (ours, theirs)


# Each case maps the params (to build masks from) to (our transform, optax's transform).
CASES = {
    "scale": _pair(fo.scale(0.37), optax.scale(0.37)),
    "scale_negative": _pair(fo.scale(-2.5), optax.scale(-2.5)),
    "lr_float": _pair(fo.scale_by_learning_rate(0.1), optax.scale_by_learning_rate(0.1)),
    "lr_float_no_flip": _pair(
        fo.scale_by_learning_rate(0.1, flip_sign=False),
        optax.scale_by_learning_rate(0.1, flip_sign=False),
    ),
    "lr_schedule": _pair(
        fo.scale_by_learning_rate(fo.linear_schedule(0.2, 0.01, 8, 2)),
        optax.scale_by_learning_rate(x64_schedule(optax.linear_schedule(0.2, 0.01, 8, 2))),
    ),
    "lr_schedule_no_flip": _pair(
        fo.scale_by_learning_rate(fo.cosine_decay_schedule(0.3, 7, 0.1), flip_sign=False),
        optax.scale_by_learning_rate(optax.cosine_decay_schedule(0.3, 7, 0.1), flip_sign=False),
    ),
    "scale_by_schedule": _pair(
        fo.scale_by_schedule(fo.cosine_decay_schedule(1.5, 7, alpha=0.1, exponent=2.0)),
        optax.scale_by_schedule(optax.cosine_decay_schedule(1.5, 7, alpha=0.1, exponent=2.0)),
    ),
    "clip": _pair(fo.clip(0.3), optax.clip(0.3)),
    "clip_by_global_norm": _pair(fo.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)),
    "clip_by_global_norm_loose": _pair(fo.clip_by_global_norm(8.0), optax.clip_by_global_norm(8.0)),
    "adaptive_grad_clip": _pair(fo.adaptive_grad_clip(0.05), optax.adaptive_grad_clip(0.05)),
    "adaptive_grad_clip_eps": _pair(
        fo.adaptive_grad_clip(1.0, eps=0.5), optax.adaptive_grad_clip(1.0, eps=0.5)
    ),
    "add_decayed_weights": _pair(fo.add_decayed_weights(0.1), optax.add_decayed_weights(0.1)),
    "add_decayed_weights_mask_tree": lambda params: (
        fo.add_decayed_weights(0.1, bool_mask(params)),
        optax.add_decayed_weights(0.1, bool_mask(params)),
    ),
    "add_decayed_weights_mask_fn": _pair(
        fo.add_decayed_weights(0.1, bool_mask), optax.add_decayed_weights(0.1, bool_mask)
    ),
    "adam": _pair(fo.adam(0.05), optax.adam(0.05)),
    "adam_nesterov_schedule": _pair(
        fo.adam(fo.linear_schedule(0.1, 0.0, 10), b1=0.8, nesterov=True),
        optax.adam(x64_schedule(optax.linear_schedule(0.1, 0.0, 10)), b1=0.8, nesterov=True),
    ),
    "adamw": _pair(fo.adamw(0.05, weight_decay=0.1), optax.adamw(0.05, weight_decay=0.1)),
    "adamw_mask_tree": lambda params: (
        fo.adamw(0.05, weight_decay=0.1, mask=bool_mask(params)),
        optax.adamw(0.05, weight_decay=0.1, mask=bool_mask(params)),
    ),
    "adamw_mask_fn_nesterov": _pair(
        fo.adamw(0.05, eps_root=1e-8, weight_decay=0.2, mask=bool_mask, nesterov=True),
        optax.adamw(0.05, eps_root=1e-8, weight_decay=0.2, mask=bool_mask, nesterov=True),
    ),
    "sgd": _pair(fo.sgd(0.1), optax.sgd(0.1)),
    "sgd_momentum": _pair(fo.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9)),
    "sgd_nesterov": _pair(
        fo.sgd(0.1, momentum=0.9, nesterov=True), optax.sgd(0.1, momentum=0.9, nesterov=True)
    ),
    "sgd_nesterov_schedule": _pair(
        fo.sgd(fo.cosine_decay_schedule(0.1, 6), 0.5, True),
        optax.sgd(optax.cosine_decay_schedule(0.1, 6), 0.5, True),
    ),
}

for _sqrt, _bc, _init in itertools.product((True, False), (True, False), (0.0, 0.3)):
    CASES[f"scale_by_rms-eps_in_sqrt={_sqrt}-bias_correction={_bc}-initial_scale={_init}"] = _pair(
        fo.scale_by_rms(0.8, 1e-3, _init, eps_in_sqrt=_sqrt, bias_correction=_bc),
        optax.scale_by_rms(0.8, 1e-3, _init, eps_in_sqrt=_sqrt, bias_correction=_bc),
    )
for _nesterov, _eps_root in itertools.product((False, True), (0.0, 1e-4)):
    CASES[f"scale_by_adam-nesterov={_nesterov}-eps_root={_eps_root}"] = _pair(
        fo.scale_by_adam(0.8, 0.95, 1e-6, _eps_root, nesterov=_nesterov),
        optax.scale_by_adam(0.8, 0.95, 1e-6, _eps_root, nesterov=_nesterov),
    )
for _nesterov in (False, True):
    CASES[f"trace-nesterov={_nesterov}"] = _pair(
        fo.trace(0.7, nesterov=_nesterov), optax.trace(0.7, nesterov=_nesterov)
    )
for _debias in (False, True):
    CASES[f"ema-debias={_debias}"] = _pair(
        fo.ema(0.6, debias=_debias), optax.ema(0.6, debias=_debias)
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_transform_matches_optax(case, seed):
    params = random_params(seed)
    ours, theirs = CASES[case](params)
    compare_run(ours, theirs, params, random_grads(seed, params))


def test_global_norm_clipping_is_exercised():
    # The random gradients must sometimes be clipped and sometimes not, or the case above could
    # not tell clip_by_global_norm(1.0) from identity or from always-rescaling.
    params = random_params(0)
    norms = [
        float(torch.linalg.vector_norm(torch.stack([g.norm() for g in fo.tree.leaves(grads)])))
        for grads in random_grads(0, params)
    ]
    assert min(norms) < 1.0 < max(norms)


AGC_SHAPES = {
    "scalar": (),
    "vector": (5,),
    "matrix": (3, 4),
    "column": (4, 1),
    "row": (1, 4),
    "multihead": (2, 3, 4),
    "squeezable": (1, 1, 4),
    "conv": (3, 3, 2, 4),
    "conv3d": (2, 2, 2, 2, 3),  # optax >= 0.2.5 reduces 5-D kernels over axes 0-3
}


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_grad_clip_unit_layout_matches_optax(seed):
    rng = np.random.default_rng(seed)
    params = {k: randn(rng, s) for k, s in AGC_SHAPES.items()}
    params["zeros"] = torch.zeros(3, 2, dtype=torch.float64)  # every unit takes the eps floor
    grads = [
        {k: randn(rng, tuple(v.shape)) * 10 ** rng.uniform(-1.5, 0.5) for k, v in params.items()}
        for _ in range(4)
    ]
    ours, theirs = fo.adaptive_grad_clip(0.2, eps=1e-2), optax.adaptive_grad_clip(0.2, eps=1e-2)
    theirs_update = jax.jit(theirs.update)  # these shapes are not in the eager-kernel cache
    state = ours.init(params)
    clipped = kept = 0
    for g in grads:
        updates, state = ours.update(g, state, params)
        expected, _ = theirs_update(to_jax(g), theirs.init(to_jax(params)), to_jax(params))
        assert_trees_close(updates, expected, "adaptive_grad_clip updates", step_ops(params))
        same = [u == x for u, x in zip(updates.values(), g.values(), strict=True)]  # unclipped
        kept += sum(int(s.sum()) for s in same)
        clipped += sum(int((~s).sum()) for s in same)
    assert clipped > 0 and kept > 0


# --- schedules ------------------------------------------------------------------------------

COUNTS = [*range(0, 40), 57, 100, 999, 10_000]

SCHEDULES = {
    "constant": (fo.constant_schedule(0.3), optax.constant_schedule(0.3)),
    "linear": (fo.linear_schedule(1.0, 0.1, 10), optax.linear_schedule(1.0, 0.1, 10)),
    "linear_increasing": (fo.linear_schedule(0.0, 2.0, 7), optax.linear_schedule(0.0, 2.0, 7)),
    "linear_begin": (
        fo.linear_schedule(1.0, -0.5, 10, transition_begin=5),
        optax.linear_schedule(1.0, -0.5, 10, transition_begin=5),
    ),
    "linear_no_steps": (fo.linear_schedule(0.7, 0.1, 0), optax.linear_schedule(0.7, 0.1, 0)),
    "linear_negative_begin": (
        fo.linear_schedule(0.7, 0.1, 5, transition_begin=-3),
        optax.linear_schedule(0.7, 0.1, 5, transition_begin=-3),
    ),
    "cosine": (fo.cosine_decay_schedule(2.0, 15), optax.cosine_decay_schedule(2.0, 15)),
    "cosine_alpha": (
        fo.cosine_decay_schedule(2.0, 15, alpha=0.2),
        optax.cosine_decay_schedule(2.0, 15, alpha=0.2),
    ),
    "cosine_alpha_exponent": (
        fo.cosine_decay_schedule(1.0, 20, alpha=0.1, exponent=2.5),
        optax.cosine_decay_schedule(1.0, 20, alpha=0.1, exponent=2.5),
    ),
    "warmup_cosine": (
        fo.warmup_cosine_decay_schedule(0.0, 1.0, 5, 20),
        optax.warmup_cosine_decay_schedule(0.0, 1.0, 5, 20),
    ),
    "warmup_cosine_end_exponent": (
        fo.warmup_cosine_decay_schedule(0.1, 2.0, 4, 30, end_value=0.05, exponent=1.5),
        optax.warmup_cosine_decay_schedule(0.1, 2.0, 4, 30, end_value=0.05, exponent=1.5),
    ),
    "join": (
        fo.join_schedules(
            [
                fo.constant_schedule(1.0),
                fo.linear_schedule(1.0, 0.0, 5),
                fo.cosine_decay_schedule(0.5, 9, alpha=0.3),
            ],
            [3, 10],
        ),
        optax.join_schedules(
            [
                optax.constant_schedule(1.0),
                optax.linear_schedule(1.0, 0.0, 5),
                optax.cosine_decay_schedule(0.5, 9, alpha=0.3),
            ],
            [3, 10],
        ),
    ),
}


def _assert_schedule_matches(ours, theirs, counts, scale=None):
    """Ours and optax's values over ``counts`` agree to the rule's schedule count, relative to
    the largest value or to ``scale`` (the terms' magnitude, where a schedule is cut short)."""
    # int64 counts: see oracle_utils.x64_schedule.
    expected = torch.tensor(
        [float(np.asarray(theirs(jnp.asarray(c, dtype=jnp.int64)))) for c in counts],
        dtype=torch.float64,
    )
    for kind in (torch.int32, int):
        values = []
        for c in counts:
            value = ours(torch.tensor(c, dtype=kind) if kind is not int else c)
            assert isinstance(value, torch.Tensor) and value.dim() == 0
            values.append(value)
        got = torch.stack(values)
        # XLA on the CPU flushes subnormal results to zero (and its inputs: a schedule of a
        # subnormal size is 0 there), so ours is compared in the same model of arithmetic
        tiny = torch.finfo(torch.float64).tiny
        got = torch.where(got.abs() < tiny, torch.zeros_like(got), got)
        assert_close_rounding(
            got,
            expected,
            dtype=torch.float64,
            ops=SCHEDULE_OPS,
            scale=scale,
            msg=f"counts {list(counts)} as {kind}",
        )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_matches_optax(name):
    _assert_schedule_matches(*SCHEDULES[name], COUNTS)


# Zero, or at least 1e-30 in magnitude: XLA's CPU backend (optax's side) flushes subnormal
# numbers to zero, torch keeps them (a subnormal ``end`` once made the two differ by |end|), and
# tinier values make subnormal products of the schedules' fractions.
_values = st.one_of(st.just(0.0), st.floats(1e-30, 5.0), st.floats(-5.0, -1e-30))


@settings(max_examples=10, deadline=None, database=None)
@given(
    init=_values,
    end=_values,
    steps=st.integers(-2, 20),
    begin=st.integers(-3, 10),
    alpha=st.floats(0.0, 1.0),
    decay_steps=st.integers(1, 20),
    exponent=st.floats(0.5, 3.0),
    boundary=st.integers(0, 15),
)
def test_random_schedules_match_optax(
    init, end, steps, begin, alpha, decay_steps, exponent, boundary
):
    counts = range(0, 40, 3)
    lin = (
        fo.linear_schedule(init, end, steps, begin),
        optax.linear_schedule(init, end, steps, begin),
    )
    cos = (
        fo.cosine_decay_schedule(init, decay_steps, alpha, exponent),
        optax.cosine_decay_schedule(init, decay_steps, alpha, exponent),
    )
    # terms: a linear ramp's (init - end) * frac + end, up to |init| + 2 |end| (shown in part
    # only when the counts or the boundary stop before its end); a cosine's, up to 3 |init|
    terms = max(abs(init) + 2 * abs(end), 3 * abs(init))
    _assert_schedule_matches(*lin, counts, terms)
    _assert_schedule_matches(*cos, counts, terms)
    _assert_schedule_matches(
        fo.join_schedules([lin[0], cos[0]], [boundary]),
        optax.join_schedules([lin[1], cos[1]], [boundary]),
        counts,
        terms,
    )


# --- random tree structures --------------------------------------------------------------


@pytest.mark.numerics
@settings(max_examples=6, deadline=None, database=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_chain_on_random_tree_structures(seed):
    params = random_params(seed)
    ours = fo.chain(
        fo.clip_by_global_norm(2.0),
        fo.scale_by_adam(b1=0.8, nesterov=True),
        fo.add_decayed_weights(1e-2),
        fo.scale_by_learning_rate(0.1),
    )
    theirs = optax.chain(
        optax.clip_by_global_norm(2.0),
        optax.scale_by_adam(b1=0.8, nesterov=True),
        optax.add_decayed_weights(1e-2),
        optax.scale_by_learning_rate(0.1),
    )
    compare_run(ours, theirs, params, random_grads(seed, params, steps=STEPS))


# --- 16-bit params and apply_updates' compiled add -----------------------------------------

# bfloat16 params and gradients against optax on their exact float64 values. Roundings of one
# update in bfloat16 (ATen rounds each bfloat16 op's float32 result once) and in float32 (the
# Python hyperparameters cast to float32, norms accumulated in float32: a sum over at most every
# element, n + 2), counted per transform; moments kept in bfloat16 (optax's rule: the param's
# dtype) are rounded again every step, so their roundings add up over the steps (``per_step``).
BF16_CASES = {
    # name: (ours, theirs, bf16 roundings once, bf16 roundings per step, with a norm)
    "scale": (fo.scale(0.37), optax.scale(0.37), 1, 0, False),
    # (the bound 0.3 itself is rounded to bfloat16 before it clamps)
    "clip": (fo.clip(0.3), optax.clip(0.3), 1, 0, False),
    "clip_by_global_norm": (
        fo.clip_by_global_norm(1.0),
        optax.clip_by_global_norm(1.0),
        1,
        0,
        True,
    ),
    # 0.1 p (1) and the sum (1)
    "add_decayed_weights": (
        fo.add_decayed_weights(0.1),
        optax.add_decayed_weights(0.1),
        2,
        0,
        False,
    ),
    # momentum 0.9 m + g (2 per step), the learning rate's product (1)
    "sgd_momentum": (fo.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9), 1, 2, False),
    # first moment (3 per step), second (g^2 and 3: 4 per step); bias corrections, square
    # root, + eps, quotient, learning rate (6 once)
    "adam": (fo.adam(0.05), optax.adam(0.05), 6, 4, False),
}
BF16_STEPS = 4


@pytest.mark.numerics
@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bfloat16_params_match_float64_optax(case):
    ours, theirs, once, per_step, norm = BF16_CASES[case]
    params = jax.tree.map(lambda x: x.to(torch.bfloat16), random_params(2))
    grads = [
        jax.tree.map(lambda x: x.to(torch.bfloat16), g)
        for g in random_grads(2, params, steps=BF16_STEPS)
    ]
    n = sum(int(x.numel()) for x in jax.tree.leaves(params))

    def ops(step):
        return {
            torch.bfloat16: once + per_step * (step + 1),
            torch.float32: 4 + (n + 2 if norm else 0),
            torch.float64: (step + 1) * step_ops(params),
        }

    compare_run(ours, theirs, params, grads, ops=ops)


@pytest.mark.numerics
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("size", [7, _kernels.ADD_MIN + 3], ids=["small", "compiled-add"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_apply_updates_matches_optax(dtype, size, donate):
    # p + u rounded once to the param's dtype (16-bit leaves of ADD_MIN+ elements take the
    # compiled add when donated); optax adds the exact float64 values: one rounding.
    rng = np.random.default_rng(size)
    params = {"w": randn(rng, (size,)).to(dtype), "b": randn(rng, (3,)).to(dtype)}
    updates = {k: (randn(rng, tuple(v.shape)) * 1e-2).to(dtype) for k, v in params.items()}
    # (copied before a donated add writes into the params: JAX may share their memory)
    theirs = optax.apply_updates(to_jax(params), to_jax(updates))
    expected = {k: torch.tensor(np.array(v)) for k, v in theirs.items()}
    scale = {k: params[k].double().abs() + updates[k].double().abs() for k in params}
    got = fo.apply_updates(params, updates, donate=donate)
    for k in params:
        assert got[k].dtype == dtype
        assert_close_rounding(
            got[k], expected[k], dtype=dtype, ops=1, scale=scale[k], check_dtype=False, msg=k
        )
