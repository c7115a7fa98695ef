"""Oracle test: ``functional_opt.dreamerv3`` matches the original DreamerV3 optimizer (Hafner et
al. 2023), rebuilt here from optax pieces in JAX (float64), for every option combination, on
every route of the fused update (chain ops, one compiled kernel per large leaf, stacked runs of
small leaves), in float64 and bfloat16."""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from oracle_utils import (
    bool_mask,
    compare_run,
    jax,
    jnp,
    optax,
    randn,
    random_grads,
    random_params,
    step_ops,
    x64_schedule,
)

import functional_opt as fo
from functional_opt.plain_trees import TREE_MIN, PlainTreeStep

LR = 0.05
WARMUP = 3
ANNEAL = 9
STEPS = 14  # crosses warm-up (0-2), annealing (3-8) and the floor (9+)


class NesterovEmaState(NamedTuple):
    count: Any
    mu: Any


def reference_agc(clip, pmin):
    """Per tensor: ``u * 1 / max(1, ||u|| / (clip * max(pmin, ||p||)))``."""

    def update(updates, state, params=None):
        def one(u, p):
            upper = clip * jnp.maximum(pmin, jnp.linalg.norm(p.ravel()))
            return u * (1.0 / jnp.maximum(1.0, jnp.linalg.norm(u.ravel()) / upper))

        return jax.tree.map(one, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def reference_nesterov_ema(b1):
    """``mu = b1 mu + (1 - b1) u``; ``out = (b1 mu + (1 - b1) u) / (1 - b1**t)``."""

    def init(params):
        return NesterovEmaState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        mu = jax.tree.map(lambda m, u: b1 * m + (1 - b1) * u, state.mu, updates)
        count = state.count + 1
        correction = 1 - b1 ** count.astype(jnp.float64)
        out = jax.tree.map(lambda m, u: (b1 * m + (1 - b1) * u) / correction, mu, updates)
        return out, NesterovEmaState(count, mu)

    return optax.GradientTransformation(init, update)


def reference_schedule(lr, warmup, schedule, anneal):
    if schedule == "const":
        sched = optax.constant_schedule(lr)
    elif schedule == "linear":
        sched = optax.linear_schedule(lr, 0.1 * lr, anneal - warmup)
    else:
        # alpha=0.1: the intended floor of 0.1 * lr (the original code passed 0.1 * lr as alpha).
        sched = optax.cosine_decay_schedule(lr, anneal - warmup, alpha=0.1)
    if warmup > 0:
        sched = optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), sched], [warmup])
    return x64_schedule(sched)


def reference_dreamerv3(
    lr,
    *,
    agc=0.3,
    pmin=1e-3,
    beta1=0.9,
    beta2=0.999,
    eps=1e-20,
    warmup=1000,
    momentum=True,
    nesterov=False,
    weight_decay=0.0,
    weight_decay_mask=None,
    schedule="const",
    anneal=0,
):
    parts = []
    if agc > 0:
        parts.append(reference_agc(agc, pmin))
    parts.append(optax.scale_by_rms(beta2, eps, eps_in_sqrt=False, bias_correction=True))
    if momentum:
        parts.append(reference_nesterov_ema(beta1) if nesterov else optax.ema(beta1, debias=True))
    if weight_decay > 0:
        parts.append(optax.add_decayed_weights(weight_decay, weight_decay_mask))
    parts.append(optax.scale_by_learning_rate(reference_schedule(lr, warmup, schedule, anneal)))
    return optax.chain(*parts)


def _params(seed):
    params = random_params(seed)
    # A zero tensor: its norm is below pmin, so the clip bound uses pmin (it stays zero for the
    # warm-up's first update, whose learning rate is 0).
    params["zero"] = torch.zeros(3, dtype=torch.float64)
    return params


FACTORS = (
    [True, False],  # momentum
    [False, True],  # nesterov
    ["none", "all", "mask"],  # weight decay
    ["const", "linear", "cosine"],
    [0, WARMUP],
    [0.0, 0.3],  # agc
)
ALL_COMBOS = list(itertools.product(*FACTORS))


def covering_pairs(combos: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """A few of ``combos`` in which every pair of values of two factors occurs: the first and
    the last combo, then greedily the one that covers most pairs not yet covered (the first of
    equals). All 144 combinations took 33 s; each option acts on its own term of the update,
    so what can interact is pairs (12 combos)."""

    def pairs(c: tuple[object, ...]) -> set[tuple[int, object, int, object]]:
        return {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}

    chosen = [combos[0], combos[-1]]
    todo = set().union(*map(pairs, combos)) - pairs(combos[0]) - pairs(combos[-1])
    while todo:
        best = max(combos, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


COMBOS = covering_pairs(ALL_COMBOS)


def _id(combo):
    momentum, nesterov, wd, schedule, warmup, agc = combo
    return f"mom={momentum}-nest={nesterov}-wd={wd}-{schedule}-warmup={warmup}-agc={agc}"


@pytest.mark.parametrize("combo", COMBOS, ids=[_id(c) for c in COMBOS])
def test_dreamerv3_matches_reference(combo):
    momentum, nesterov, wd, schedule, warmup, agc = combo
    seed = ALL_COMBOS.index(combo)
    params = _params(seed)
    options = {
        "agc": agc,
        "warmup": warmup,
        "momentum": momentum,
        "nesterov": nesterov,
        "weight_decay": 0.0 if wd == "none" else 0.1,
        "weight_decay_mask": bool_mask(params) if wd == "mask" else None,
        "schedule": schedule,
        "anneal": ANNEAL,
    }
    compare_run(
        fo.dreamerv3(LR, **options),
        reference_dreamerv3(LR, **options),
        params,
        random_grads(seed, params, steps=STEPS),
    )


@pytest.mark.parametrize("nesterov", [False, True])
def test_dreamerv3_callable_mask_and_other_hyperparameters(nesterov):
    params = _params(1)
    options = {
        "agc": 0.1,
        "pmin": 0.5,
        "beta1": 0.7,
        "beta2": 0.9,
        "eps": 1e-6,
        "warmup": 2,
        "nesterov": nesterov,
        "weight_decay": 0.3,
        "weight_decay_mask": bool_mask,
        "schedule": "cosine",
        "anneal": 7,
    }
    compare_run(
        fo.dreamerv3(0.2, **options),
        reference_dreamerv3(0.2, **options),
        params,
        random_grads(1, params, steps=STEPS),
    )


@pytest.mark.parametrize("warmup", [0, WARMUP])
def test_dreamerv3_linear_with_anneal_not_after_warmup_is_constant(warmup):
    # anneal <= warmup: optax.linear_schedule with transition_steps <= 0 is the constant lr.
    params = _params(2)
    options = {"warmup": warmup, "schedule": "linear", "anneal": warmup}
    compare_run(
        fo.dreamerv3(LR, **options),
        reference_dreamerv3(LR, **options),
        params,
        random_grads(2, params, steps=8),
    )


@pytest.mark.numerics
def test_dreamerv3_defaults_match_reference():
    params = _params(3)
    compare_run(
        fo.dreamerv3(), reference_dreamerv3(4e-5, warmup=1000), params, random_grads(3, params)
    )


# --- the fused update's compiled routes, and bfloat16 ----------------------------------------


def _route_params(seed, dtype):
    """A leaf large enough for its own compiled kernel call (the engine's direct route), and
    small leaves it stages through packed buffers (a run of one shape, a lone one, a zero one,
    whose clip bound is pmin)."""
    rng = np.random.default_rng(seed)
    params = {
        "big": randn(rng, (64, TREE_MIN // 64 + 1)) * 0.3,
        "run": [randn(rng, (2, 3)) for _ in range(5)],
        "small": randn(rng, (3,)),
        "zero": torch.zeros(3, dtype=torch.float64),
    }
    return jax.tree.map(lambda x: x.to(dtype), params)


def _spy_engine(monkeypatch):
    """Whether each eager update took the engine's route over plain trees."""
    taken = []
    real = PlainTreeStep.update

    def update(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(PlainTreeStep, "update", update)
    return taken


# (the kernels implement momentum without Nesterov, and a weight-decay mask runs the chain)
ROUTE_OPTIONS = [
    {"agc": 0.3, "weight_decay": 0.0, "schedule": "const", "warmup": 0},
    {"agc": 0.0, "weight_decay": 0.1, "schedule": "cosine", "warmup": WARMUP},
    {"agc": 0.3, "weight_decay": 0.1, "schedule": "linear", "warmup": WARMUP},
]
ROUTE_IDS = ["agc-const", "decay-cosine", "agc-decay-linear"]


def _options(options):
    return {"anneal": ANNEAL, **options}


# (each option compiles its dreamerv3's engine: the second code path of the CPU runs the one
# that takes every part of the chain, agc, decay and a schedule)
ROUTE_PARAMS = [
    pytest.param(o, id=i, marks=[pytest.mark.numerics] if i == "agc-decay-linear" else [])
    for o, i in zip(ROUTE_OPTIONS, ROUTE_IDS, strict=True)
]


@pytest.mark.parametrize("options", ROUTE_PARAMS)
def test_dreamerv3_compiled_routes_match_reference(options, monkeypatch):
    # float64: the engine compiles for float64 too, so the float64 reference checks it at
    # float64's rounding (the default count: per step, the elementwise chain plus the norms'
    # sums over every element, times the steps).
    params = _route_params(7, torch.float64)
    kwargs = _options(options)
    taken = _spy_engine(monkeypatch)
    compare_run(
        fo.dreamerv3(LR, **kwargs),
        reference_dreamerv3(LR, **kwargs),
        params,
        random_grads(7, params, steps=STEPS),
    )
    assert taken and all(taken)  # (the engine: the large leaf direct, the others staged)


# Roundings of a bfloat16 update, compared with the float64 reference run on the same
# (exactly widened) params and gradients. In bfloat16, on the chain's route (which the engine
# compiles; inductor may keep some values in float32, rounding less): the clipped gradient (1); the
# normalized step r = g' / sqrt(nu'), rounded to bfloat16 (1, plus g''s 1 and half of nu''s 2,
# g'^2's: 3); the momentum, a float32 average of such terms (3: averaging does not add the
# terms' relative errors up, it only adds its own roundings); its bias-corrected value rounded
# to bfloat16 (1: 4); weight decay's product and sum (2: 6); the learning rate's product (1:
# 7). In float32, per step: the elementwise math (14) and the norms of the clip factor
# (a sum over at most every element: n + 2), and the averages' own roundings, which do add up
# (3 per step). The reference's own float64 roundings: the default count.
BF16_OPS = 7
F32_ELEMENTWISE_OPS = 14
F32_AVERAGE_OPS = 3


@pytest.mark.parametrize("options", ROUTE_PARAMS)
def test_dreamerv3_bfloat16_matches_float64_reference(options, monkeypatch):
    params = _route_params(8, torch.bfloat16)
    kwargs = _options(options)
    per_step = step_ops(params)

    def ops(step):
        return {
            torch.bfloat16: BF16_OPS,
            torch.float32: F32_ELEMENTWISE_OPS + per_step + F32_AVERAGE_OPS * (step + 1),
            torch.float64: (step + 1) * per_step,
        }

    grads = [jax.tree.map(lambda x: x.to(torch.bfloat16), g) for g in random_grads(8, params)]
    taken = _spy_engine(monkeypatch)
    compare_run(
        fo.dreamerv3(LR, **kwargs), reference_dreamerv3(LR, **kwargs), params, grads, ops=ops
    )
    assert taken and all(taken)
