"""Invariants that hold for every transform: inputs are never mutated, ``None`` updates mean "no
gradient" (update ``None``, per-parameter state carried over, global counters advance, global
norms ignore them), state dtypes are stable, checkpoints round-trip, counters saturate, and
dtypes follow the contract (``apply_updates``, DreamerV3 with 16-bit params, ``MultiSteps``).

The checks that hold for any transform are :mod:`functional_opt.testing`'s (the same ones users
run on their own transforms), driven here over every case and hypothesis-drawn trees.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_close_rounding
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import Problem, problems, tleaves, tmap

import functional_opt as fo
from functional_opt.loss_scale import DynamicLossScale, StaticLossScale
from functional_opt.testing import (
    check_checkpoint_round_trip,
    check_dtype_policy,
    check_none_gradients_keep_state,
    check_purity,
)

SETTINGS = settings(max_examples=5, deadline=None)
INT32_MAX = 2**31 - 1


def _dims_mask(p: Any) -> Any:
    return fo.tree.map_params(lambda x: x.dim() > 0, p)


def _parity_labels(p: Any) -> Any:
    return fo.tree.map_params(lambda x: "even" if x.dim() % 2 == 0 else "odd", p)


def _inv_count(c: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + c.to(torch.float64))


CASES: dict[str, Callable[[], Any]] = {
    "identity": fo.identity,
    "scale": lambda: fo.scale(-0.5),
    "scale_by_learning_rate": lambda: fo.scale_by_learning_rate(0.1),
    "scale_by_learning_rate_schedule": lambda: fo.scale_by_learning_rate(
        fo.linear_schedule(0.1, 0.01, 5)
    ),
    "scale_by_schedule": lambda: fo.scale_by_schedule(_inv_count),
    "clip": lambda: fo.clip(0.3),
    "clip_by_global_norm": lambda: fo.clip_by_global_norm(0.5),
    "adaptive_grad_clip": lambda: fo.adaptive_grad_clip(0.05),
    "clip_by_agc": lambda: fo.clip_by_agc(0.1),
    "scale_by_rms": lambda: fo.scale_by_rms(),
    "scale_by_rms_eps_outside": lambda: fo.scale_by_rms(0.8, 1e-3, eps_in_sqrt=False),
    "scale_by_rms_debiased": lambda: fo.scale_by_rms(0.8, bias_correction=True),
    "scale_by_rms_eps_outside_debiased": lambda: fo.scale_by_rms(
        0.8, 1e-6, 0.5, eps_in_sqrt=False, bias_correction=True
    ),
    "scale_by_adam": lambda: fo.scale_by_adam(),
    "scale_by_adam_nesterov": lambda: fo.scale_by_adam(0.8, 0.9, nesterov=True),
    "scale_by_adam_mu_dtype": lambda: fo.scale_by_adam(mu_dtype=torch.float32),
    "trace": lambda: fo.trace(0.9),
    "trace_nesterov": lambda: fo.trace(0.5, nesterov=True),
    "ema": lambda: fo.ema(0.9),
    "ema_no_debias": lambda: fo.ema(0.7, debias=False),
    "add_decayed_weights": lambda: fo.add_decayed_weights(0.1),
    "add_decayed_weights_mask": lambda: fo.add_decayed_weights(0.1, _dims_mask),
    "masked": lambda: fo.masked(fo.scale_by_adam(), _dims_mask),
    "partition": lambda: fo.partition(
        {"even": fo.trace(0.9), "odd": fo.scale_by_adam()}, _parity_labels
    ),
    "apply_if_finite": lambda: fo.apply_if_finite(fo.scale_by_adam(), 2),
    "multi_steps": lambda: fo.MultiSteps(fo.scale_by_adam(), 3).gradient_transformation(),
    "multi_steps_sum": lambda: fo.multi_steps(fo.trace(0.9), 2, use_grad_mean=False),
    "inject_hyperparams_adam": lambda: fo.inject_hyperparams(fo.adam)(learning_rate=0.1),
    "inject_hyperparams_dreamerv3": lambda: fo.inject_hyperparams(fo.dreamerv3)(lr=0.01, warmup=2),
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=2),
    "dreamerv3_full": lambda: fo.dreamerv3(
        1e-2,
        nesterov=True,
        weight_decay=0.1,
        weight_decay_mask=_dims_mask,
        schedule="cosine",
        warmup=1,
        anneal=6,
    ),
    "dreamerv3_no_momentum": lambda: fo.dreamerv3(1e-2, momentum=False, schedule="linear"),
    "adam": lambda: fo.adam(0.1),
    "adamw": lambda: fo.adamw(0.1, weight_decay=0.1),
    "sgd": lambda: fo.sgd(0.1, momentum=0.9, nesterov=True),
    "chain": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adam(0.1)),
    "named_chain": lambda: fo.named_chain(("clip", fo.clip(1.0)), ("opt", fo.sgd(0.1, 0.9))),
}
NAMES = sorted(CASES)


def layout(state: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {k: (v.shape, v.dtype) for k, v in fo.state_to_dict(state).items()}


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(problem=problems(min_steps=4, max_steps=4))
def test_inputs_never_mutated_and_state_layout_stable(name: str, problem: Problem) -> None:
    """``init`` and ``update`` write into none of their inputs and repeat themselves bit for
    bit; updates keep the gradients' structure, dtypes and shapes; the state its layout."""
    tx = CASES[name]()
    check_purity(tx, problem.params, problem.grads)
    check_dtype_policy(tx, problem.params, problem.grads, dtypes=[None])


def with_frozen(problem: Problem, gen: torch.Generator, shape: tuple[int, ...]) -> Any:
    """The problem's params and gradients with a parameter ``frozen`` (tensor leaf 0) added."""
    frozen = torch.randn(shape, generator=gen, dtype=torch.float64)
    params = {"frozen": frozen, "rest": problem.params}
    grads = [
        {"frozen": torch.randn(shape, generator=gen, dtype=torch.float64), "rest": g}
        for g in problem.grads
    ]
    return params, grads


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(problem=problems(min_steps=5, max_steps=5), shape=st.sampled_from([(), (3,), (2, 3)]))
def test_none_leaf_is_an_absent_parameter_and_carries_its_state(
    name: str, problem: Problem, shape: tuple[int, ...]
) -> None:
    """A parameter whose update is always ``None`` behaves as if it were not there (the other
    updates and state entries, global counters and norms included, match a run without it bit
    for bit; its update is ``None`` and its own state stays at its initial value); one that
    had a gradient and then gets ``None`` keeps its state, while counters advance as when
    every update is present."""
    tx = CASES[name]()
    params, grads = with_frozen(problem, torch.Generator().manual_seed(problem.seed), shape)
    # (MultiSteps' running mean counts a None as a zero gradient: its accumulator changes)
    check_none_gradients_keep_state(tx, params, grads, leaves=[0], accumulators=["acc_grads"])


def test_multi_steps_emits_a_window_gradient_for_a_leaf_without_one_at_its_end() -> None:
    """The end of MultiSteps' window: the window's gradient is emitted also for a leaf without
    one on this mini-step, and its accumulator is cleared (never leaks into the next window;
    tests/test_misuse.py checks the values)."""
    tx = CASES["multi_steps"]()  # k = 3
    params = {"frozen": torch.ones(2, dtype=torch.float64), "w": torch.ones(3, dtype=torch.float64)}
    state = tx.init(params)
    for t in range(3):
        g = torch.full((2,), float(t + 1), dtype=torch.float64)
        u, state = tx.update({"frozen": g if t == 0 else None, "w": params["w"]}, state, params)
    assert u["frozen"] is not None
    acc = {k: v for k, v in fo.state_to_dict(state).items() if "acc_grads" in k and "frozen" in k}
    assert acc and not any(bool(v.any()) for v in acc.values())


def test_global_norm_ignores_none_leaves() -> None:
    g = {"a": torch.tensor([3.0, 0.0]), "b": None, "c": torch.tensor(4.0)}
    u, _ = fo.clip_by_global_norm(1.0).update(g, fo.EmptyState())
    assert u["b"] is None
    # the norm (5, exact), the clip factor's quotient and the product: 2 float32 roundings, and
    # the expected values' own (1)
    want = {"a": torch.tensor([0.6, 0.0]), "c": torch.tensor(0.8)}
    for k, v in want.items():
        assert_close_rounding(u[k], v, dtype=torch.float32, ops=3, msg=k)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(problem=problems(min_steps=6, max_steps=6))
def test_checkpoint_round_trip(name: str, problem: Problem) -> None:
    """Saved after three updates, loaded with ``weights_only=True``: the same state and the
    same next updates, bit for bit."""
    check_checkpoint_round_trip(CASES[name](), problem.params, problem.grads)


def test_checkpoint_round_trip_with_loss_scales() -> None:
    params = {"w": torch.ones(3)}
    state = (fo.adam(0.1).init(params), DynamicLossScale(8.0, period=3), StaticLossScale(4.0))
    ls = state[1].adjust(torch.tensor(True)).adjust(torch.tensor(True))
    state = (state[0], ls, state[2])
    buffer = io.BytesIO()
    torch.save(fo.state_to_dict(state), buffer)
    buffer.seek(0)
    template = (fo.adam(0.1).init(params), DynamicLossScale(period=3), StaticLossScale(1.0))
    restored = fo.state_from_dict(template, torch.load(buffer, weights_only=True))
    assert int(restored[1].counter) == 2 and float(restored[1].loss_scale) == 8.0
    assert float(restored[1].adjust(torch.tensor(True)).loss_scale) == 16.0
    assert float(restored[2].loss_scale) == 4.0


COUNTER_NAMES = ("count", "gradient_step", "notfinite_count", "total_notfinite")


@pytest.mark.parametrize("name", NAMES)
def test_counters_saturate(name: str) -> None:
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64), "b": torch.tensor(0.5)}
    grads = {"w": torch.tensor([0.1, 0.2], dtype=torch.float64), "b": torch.tensor(-0.3)}
    tx = CASES[name]()
    d = fo.state_to_dict(tx.init(params))
    tops = {k: v for k, v in d.items() if k.split(".")[-1] in COUNTER_NAMES}
    for k, v in tops.items():
        assert v.dtype in (torch.int32, torch.int64), k
        d[k] = torch.full_like(v, torch.iinfo(v.dtype).max)
    state = fo.state_from_dict(tx.init(params), d)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
        for u in tleaves(updates):
            assert bool(torch.isfinite(u).all())
        new = fo.state_to_dict(state)
        for k, v in tops.items():
            top = torch.iinfo(v.dtype).max
            want = 0 if k.endswith("notfinite_count") and "total" not in k else top
            assert int(new[k]) == want, f"{k} = {int(new[k])}"


def test_apply_if_finite_counters_saturate_on_non_finite() -> None:
    tx = fo.apply_if_finite(fo.sgd(0.1), 3)
    params = {"w": torch.ones(2)}
    state = tx.init(params)._replace(
        notfinite_count=torch.tensor(INT32_MAX, dtype=torch.int32),
        total_notfinite=torch.tensor(INT32_MAX, dtype=torch.int32),
    )
    _, state = tx.update({"w": torch.tensor([math.nan, 1.0])}, state, params)
    assert int(state.notfinite_count) == INT32_MAX
    assert int(state.total_notfinite) == INT32_MAX
    assert not bool(state.last_finite)


def test_safe_increment_saturates() -> None:
    for dtype in (torch.int32, torch.int64):
        top = torch.iinfo(dtype).max
        assert int(fo.safe_increment(torch.tensor(top, dtype=dtype))) == top
        assert int(fo.safe_increment(torch.tensor(top - 1, dtype=dtype))) == top
        assert fo.safe_increment(torch.tensor(0, dtype=dtype)).dtype == dtype


# ---------------------------------------------------------------------------------------------
# Dtypes.

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SHORT = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", NAMES)
def test_updates_keep_the_incoming_dtype(name: str, dtype: torch.dtype) -> None:
    """Every transform returns each update in its incoming dtype, 0-d leaves included (type
    promotion with a 0-d tensor hyperparameter or schedule value must not widen them), and its
    state keeps its dtypes from step to step."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"s": (), "v": (3,), "m": (2, 3)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    check_dtype_policy(CASES[name](), params, steps=4, seed=3, dtypes=[dtype])


@pytest.mark.parametrize("param_dtype", FLOATS)
@pytest.mark.parametrize("update_dtype", FLOATS)
def test_apply_updates_keeps_param_dtype(
    param_dtype: torch.dtype, update_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    p64 = {"a": torch.randn(3, 2, generator=gen, dtype=torch.float64), "b": [torch.randn(())]}
    u64 = tmap(lambda x: torch.randn(x.shape, generator=gen, dtype=torch.float64) * 0.1, p64)
    params = tmap(lambda x: x.to(param_dtype), p64)
    updates = tmap(lambda x: x.to(update_dtype), u64)
    new = fo.apply_updates(params, updates)
    wide = torch.promote_types(param_dtype, update_dtype)
    for n, p, u in zip(tleaves(new), tleaves(params), tleaves(updates), strict=True):
        assert n.dtype == param_dtype
        want = (p.double() + u.double()).to(param_dtype)  # the exact sum, rounded once
        # the sum in the promoted dtype (1), rounded to the param's (1)
        ops = {param_dtype: 1, wide: 1} if wide != param_dtype else {param_dtype: 1}
        scale = p.double().abs() + u.double().abs()
        assert_close_rounding(n, want, dtype=param_dtype, ops=ops, scale=scale)


def test_apply_updates_mixed_dtypes_and_none() -> None:
    params = {SHORT[d]: torch.ones(2, dtype=d) for d in FLOATS}
    updates = {k: torch.full((2,), 0.5, dtype=torch.float32) for k in params}
    updates["fp64"] = None
    new = fo.apply_updates(params, updates)
    for k, p in params.items():
        assert new[k].dtype == p.dtype
    assert torch.equal(new["fp64"], params["fp64"])
    assert torch.equal(new["bf16"], torch.full((2,), 1.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("grad_dtype", ["param", torch.float32])
def test_dreamerv3_moments_float32_for_16bit(nesterov: bool, grad_dtype: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    params = {SHORT[d]: torch.randn(4, 3, generator=gen).to(d) for d in FLOATS}
    tx = fo.dreamerv3(1e-3, warmup=1, nesterov=nesterov, weight_decay=0.1)
    state = tx.init(params)
    for _ in range(4):
        grads = {
            k: torch.randn(4, 3, generator=gen).to(p.dtype if grad_dtype == "param" else grad_dtype)
            for k, p in params.items()
        }
        updates, state = tx.update(grads, state, params)
        for k, u in updates.items():
            assert u.dtype == grads[k].dtype, k
            assert bool(torch.isfinite(u).all()), k
        moments = {k: v for k, v in fo.state_to_dict(state).items() if v.is_floating_point()}
        assert len(moments) == 2 * len(params)  # nu and the momentum, per parameter
        for key, v in moments.items():
            p = params[key.split(".")[-1]]
            want = torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype
            assert v.dtype == want, key
        params = fo.apply_updates(params, updates)
        for k, p in params.items():
            assert p.dtype.is_floating_point and SHORT[p.dtype] == k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("inner", ["adam", "dreamerv3"])
def test_multi_steps_update_dtypes_stable(dtype: torch.dtype, inner: str) -> None:
    gen = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(3, 2, generator=gen).to(dtype), "b": torch.randn(()).to(dtype)}
    opt = fo.adam(0.1) if inner == "adam" else fo.dreamerv3(0.1, warmup=0)
    ms = fo.MultiSteps(opt, 3)
    state = ms.init(params)
    first = layout(state)
    for k, v in fo.state_to_dict(state).items():
        if k.startswith("acc_grads"):
            assert v.dtype == torch.promote_types(torch.float32, dtype)
    emitted = 0
    for t in range(7):
        grads = {k: torch.randn(p.shape, generator=gen).to(dtype) for k, p in params.items()}
        updates, state = ms.update(grads, state, params)
        emitted += bool(ms.has_updated(state))
        for k, u in updates.items():
            assert u.dtype == dtype, (t, k)
        assert layout(state) == first, t
    assert emitted == 2


@pytest.mark.parametrize("k", [1, 2, 3])
def test_multi_steps_bf16_emits_mean(k: int) -> None:
    """bf16 gradients accumulate in float32; the mean reaches the inner transform."""
    ms = fo.MultiSteps(fo.identity(), k)
    params = {"w": torch.zeros(2, dtype=torch.bfloat16)}
    state = ms.init(params)
    values = [torch.tensor([1.0, 3.0]) * (i + 1) for i in range(k)]
    for i, v in enumerate(values):
        updates, state = ms.update({"w": v.to(torch.bfloat16)}, state, params)
        if i < k - 1:
            assert torch.equal(updates["w"], torch.zeros(2, dtype=torch.bfloat16))
    want = (sum(values) / k).to(torch.bfloat16)
    assert updates["w"].dtype == torch.bfloat16
    # float32 sums of small integers (exact), the quotient by k (1) and the bfloat16 cast (1),
    # as the expected value is computed
    ops = {torch.float32: 1, torch.bfloat16: 1}
    assert_close_rounding(updates["w"], want, dtype=torch.bfloat16, ops=ops)
