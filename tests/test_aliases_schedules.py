"""The optimizers ``lion``, ``lamb``, ``rmsprop``, ``adagrad``, ``nadam``, ``radam``,
``adabelief`` and the schedules ``exponential_decay``, ``piecewise_constant_schedule``,
``polynomial_schedule``, ``warmup_exponential_decay_schedule``, ``sgdr_schedule`` (issue 17,
section 2): schedules against optax in float64 over generated arguments; every argument's bad
values refused naming it (and good ones accepted); the optimizers' step sizes drive
``TransformOptimizer``'s ``group["lr"]``; donation, ``vmap`` (no host syncs, no Python branch on
a tensor) and purity.

Schedule tolerances: each schedule is also computed in :class:`Tracked` float64 numbers (see
``test_oracle_optax_aliases.py``), whose bound counts every rounding where it happens;
``sgdr_schedule``'s cosine cycles use ``SCHEDULE_OPS`` relative to the cycle's terms, as the
cosine schedules' own oracle test does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import pytest
import torch
from conftest import (
    ELEMENTWISE_OPS,
    SCHEDULE_OPS,
    MagnitudeRun,
    assert_bitwise,
    assert_close_rounding,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_utils import jnp, optax
from test_misuse import (
    BOOL,
    DTYPE,
    F32,
    LR,
    NON_FINITE,
    NON_NEG,
    REAL,
    STEP,
    UNIT,
    Kind,
    _bad,
    _floats,
    _with,
    counter_kind,
)
from test_oracle_optax_aliases import FTZ, Tracked

import functional_opt as fo
from functional_opt.adapters import TransformOptimizer

COUNTS = [*range(0, 40), 57, 100, 999, 10_000, 2**31 - 1]


def _optax_values(schedule: Callable[[Any], Any], counts: list[int]) -> torch.Tensor:
    # int64 counts: optax computes in float32 from int32 ones (oracle_utils.x64_schedule)
    return torch.tensor(
        [float(np.asarray(schedule(jnp.asarray(c, dtype=jnp.int64)))) for c in counts],
        dtype=torch.float64,
    )


def _ours(schedule: fo.schedules.Schedule, counts: list[int]) -> torch.Tensor:
    values = [schedule(torch.tensor(c, dtype=torch.int32)) for c in counts]
    for v in values:
        assert v.dtype == torch.float64 and v.dim() == 0
    return torch.stack(values)


def _check(ours: torch.Tensor, theirs: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """``|ours - optax| <= B eps`` with ``B`` the tracked bound in units of ``eps / 2``."""
    assert_close_rounding(ours, theirs, dtype=torch.float64, ops=1, scale=bound + FTZ, msg=what)


def _exponential_ref(init, steps, rate, begin, staircase, end, t: int) -> Tracked:
    begin = max(begin, 0)
    if steps <= 0 or rate == 0 or t - begin <= 0:
        value = Tracked(init)
    else:
        p = Tracked(t - begin) / steps
        if staircase:  # floor of a quotient: an integer unless within its error of one
            q = math.floor((t - begin) / steps)
            p = Tracked(q)
        power = Tracked.power(rate, p.v)
        # the exponent's error moves the power by |ln(rate)| times it, relatively
        power = Tracked(power.v, power.b + power.v.abs() * abs(math.log(rate)) * p.b)
        value = init * power
    if end is not None:
        upper = rate >= 1
        v = min(float(value.v), end) if upper else max(float(value.v), end)
        value = Tracked(v, value.b)  # (near a tie either side's value: within its error)
    return value


@settings(max_examples=15, deadline=None, database=None)
@given(
    init=_floats(-5.0, 5.0, allow_subnormal=False),
    steps=st.integers(-2, 12),
    rate=st.sampled_from([0.0, 0.1, 0.5, 0.93, 1.0, 1.07, 2.0]),
    begin=st.integers(-3, 10),
    staircase=st.booleans(),
    end=st.none() | _floats(-1.0, 3.0, allow_subnormal=False),
)
def test_exponential_decay_matches_optax(init, steps, rate, begin, staircase, end):
    if rate > 1 and steps > 0 and (end is None or init < 0) and init != 0:
        last = (2**31 - 1 - max(begin, 0)) / steps
        last = math.floor(last) if staircase else last
        if math.log(abs(init)) + last * math.log(rate) > math.log(F32.max):
            with pytest.raises(ValueError, match="decay_rate"):
                fo.exponential_decay(init, steps, rate, begin, staircase, end)
            return
    # (growing: optax's 0 * inf is NaN at huge counts, where ours stays 0)
    counts = COUNTS[:40] if rate > 1 else COUNTS
    ours_fn = fo.exponential_decay(init, steps, rate, begin, staircase, end)
    theirs_fn = optax.exponential_decay(init, steps, rate, begin, staircase, end)
    refs = [_exponential_ref(init, steps, rate, begin, staircase, end, t) for t in counts]
    bound = torch.stack([r.b for r in refs])
    _check(_ours(ours_fn, counts), _optax_values(theirs_fn, counts), bound, "exponential_decay")


def _polynomial_ref(init, end, power, steps, begin, t: int) -> Tracked:
    begin = max(begin, 0)
    if steps <= 0:
        return Tracked(init)
    frac = 1 - Tracked(min(max(t - begin, 0), steps)) / steps
    v = frac.v.clamp(min=0) ** power
    # the base's error moves the power by power * frac**(power - 1) times it
    slope = power * frac.v ** (power - 1) if float(frac.v) > 0 else torch.zeros(())
    powered = Tracked(v, slope * frac.b + 4 * v.abs())
    return (Tracked(init) - end) * powered + end


@settings(max_examples=15, deadline=None, database=None)
@given(
    init=_floats(-5.0, 5.0, allow_subnormal=False),
    end=_floats(-5.0, 5.0, allow_subnormal=False),
    power=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.7]),
    steps=st.integers(-2, 20),
    begin=st.integers(-3, 10),
)
def test_polynomial_schedule_matches_optax(init, end, power, steps, begin):
    ours_fn = fo.polynomial_schedule(init, end, power, steps, begin)
    theirs_fn = optax.polynomial_schedule(init, end, power, steps, begin)
    refs = [_polynomial_ref(init, end, power, steps, begin, t) for t in COUNTS]
    bound = torch.stack([r.b for r in refs])
    _check(_ours(ours_fn, COUNTS), _optax_values(theirs_fn, COUNTS), bound, "polynomial")


@settings(max_examples=15, deadline=None, database=None)
@given(
    init=_floats(-5.0, 5.0, allow_subnormal=False),
    # (XLA flushes subnormal inputs and results to zero: no factors that make them)
    table=st.dictionaries(st.integers(-3, 60), st.just(0.0) | _floats(1e-3, 3.0), max_size=4),
)
def test_piecewise_constant_schedule_matches_optax(init, table):
    ours_fn = fo.piecewise_constant_schedule(init, table)
    theirs_fn = optax.piecewise_constant_schedule(init, table)
    bounds = []
    for t in COUNTS:
        value = Tracked(init)
        for boundary, factor in sorted(table.items()):
            if t >= boundary:
                value = value * factor
        bounds.append(value.b)
    _check(_ours(ours_fn, COUNTS), _optax_values(theirs_fn, COUNTS), torch.stack(bounds), "pc")


@settings(max_examples=10, deadline=None, database=None)
@given(
    init=_floats(0.0, 1.0, allow_subnormal=False),
    peak=_floats(0.5, 2.0),
    warmup=st.integers(0, 8),
    steps=st.integers(1, 6),
    rate=st.sampled_from([0.3, 0.9, 1.1]),
    begin=st.integers(0, 5),
    staircase=st.booleans(),
    end=st.none() | _floats(0.0, 3.0, allow_subnormal=False),
)
def test_warmup_exponential_decay_schedule_matches_optax(
    init, peak, warmup, steps, rate, begin, staircase, end
):
    counts = COUNTS[:44]
    if rate > 1 and end is None:
        end = 3.0  # (a growing schedule needs its bound: test_growing_exponential_decay_...)
    args = (init, peak, warmup, steps, rate, begin, staircase, end)
    ours_fn = fo.warmup_exponential_decay_schedule(*args)
    theirs_fn = optax.warmup_exponential_decay_schedule(*args)
    bounds = []
    for t in counts:
        if t < warmup:  # the linear warm-up: (init - peak) * (1 - t / warmup) + peak
            frac = 1 - Tracked(t) / warmup
            bounds.append(((Tracked(init) - peak) * frac + peak).b)
        else:
            bounds.append(_exponential_ref(peak, steps, rate, begin, staircase, end, t - warmup).b)
    _check(_ours(ours_fn, counts), _optax_values(theirs_fn, counts), torch.stack(bounds), "wexp")


cycle = st.fixed_dictionaries(
    {
        "init_value": _floats(0.0, 1.0, allow_subnormal=False),
        "peak_value": _floats(0.5, 2.0),
        "warmup_steps": st.integers(0, 4),
        "decay_steps": st.integers(5, 15),
    },
    optional={"end_value": _floats(0.0, 0.4, allow_subnormal=False), "exponent": _floats(0.5, 2.0)},
)


@settings(max_examples=10, deadline=None, database=None)
@given(cycles=st.lists(cycle, min_size=1, max_size=3))
def test_sgdr_schedule_matches_optax(cycles):
    ours = _ours(fo.sgdr_schedule(cycles), COUNTS[:45])
    theirs = _optax_values(optax.sgdr_schedule(cycles), COUNTS[:45])
    # terms: a warm-up's up to |init| + 2 |peak|, a cosine's up to 3 |peak| (as the cosine and
    # warm-up oracle tests count them)
    terms = max(
        max(abs(c["init_value"]) + 2 * c["peak_value"], 3 * c["peak_value"]) for c in cycles
    )
    assert_close_rounding(ours, theirs, dtype=torch.float64, ops=SCHEDULE_OPS, scale=terms)


def test_sgdr_restarts_at_each_cycle_end():
    sched = fo.sgdr_schedule(
        [
            {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 2, "decay_steps": 10},
            {"init_value": 0.0, "peak_value": 0.5, "warmup_steps": 2, "decay_steps": 6},
        ]
    )
    values = [float(sched(t)) for t in range(18)]
    assert values[0] == 0.0 and values[2] == 1.0 and values[10] == 0.0 and values[12] == 0.5
    assert values[9] < 0.05 and values[15] < 0.1 and values[16] == values[17] == 0.0


def test_schedules_run_under_vmap_free_of_host_syncs():
    counts = torch.arange(0, 50, dtype=torch.int32)
    for sched in (
        fo.exponential_decay(1.0, 3, 0.5, 2, True, 0.1),
        fo.exponential_decay(0.0, 3, 2.0, end_value=1.0),
        fo.polynomial_schedule(1.0, 0.1, 2.0, 10, 3),
        fo.piecewise_constant_schedule(1.0, {5: 0.5, 20: 0.1}),
        fo.warmup_exponential_decay_schedule(0.0, 1.0, 5, 4, 0.5),
        fo.sgdr_schedule(
            [{"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 2, "decay_steps": 8}] * 2
        ),
    ):
        batched = torch.func.vmap(sched)(counts)
        one_by_one = torch.stack([sched(c) for c in counts])
        # vectorized and scalar pow/cos kernels: the schedules' count, relative to the largest
        # value (conftest.SCHEDULE_OPS)
        assert_close_rounding(batched, one_by_one, dtype=torch.float64, ops=SCHEDULE_OPS)
        assert torch.isfinite(batched).all()


def test_growing_exponential_from_zero_stays_zero():
    # 0 * 2**(huge) must not be NaN; the bound caps it
    sched = fo.exponential_decay(0.0, 1, 2.0, end_value=1.0)
    assert float(sched(2**31 - 1)) == 0.0
    assert float(fo.exponential_decay(0.5, 1, 2.0, end_value=3.0)(2**31 - 1)) == 3.0


# --- bad arguments -----------------------------------------------------------------------

UNIT_CLOSED = Kind(
    _floats(0, 1),  # (1 is a good interpolation weight: drop it from UNIT's bad values)
    UNIT.bad.filter(lambda v: not (type(v) in (int, float) and v == 1)),
)
THRESHOLD = Kind(_floats(4.0, F32.max), _bad(NON_FINITE, _floats(hi=3.999)))
MOMENTUM = Kind(UNIT.good | st.none(), UNIT.bad.filter(lambda v: v is not None))
END = Kind(REAL.good | st.none(), REAL.bad.filter(lambda v: v is not None))
CYCLE = {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 1, "decay_steps": 5}
TABLE = Kind(
    st.dictionaries(st.integers(-(2**31), 2**31 - 1), _floats(0.0, 10.0), max_size=3),
    st.sampled_from(
        [
            {1: -0.1},
            {1: math.nan},
            {1: math.inf},
            {1.5: 0.1},
            {2**31: 0.1},
            {"1": 0.1},
            {1: "a"},
            {1: 1e30, 2: 1e30},
            [(1, 0.1)],
            "x",
            0.1,
        ]
    ),
)
CYCLES = Kind(
    st.lists(st.just(CYCLE), min_size=1, max_size=3),
    st.sampled_from(
        [
            [],
            CYCLE,
            "x",
            None,
            [5],
            [{**CYCLE, "decay_steps": 0}],
            [{**CYCLE, "init_value": math.nan}],
            [{**CYCLE, "bogus": 1}],
            [{"init_value": 0.0}],
            [{**CYCLE, "decay_steps": 2**30}] * 3,
        ]
    ),
)

ALIASES = {
    "lion": (
        _with(fo.lion, learning_rate=0.1),
        {
            "learning_rate": LR,
            "b1": UNIT_CLOSED,
            "b2": UNIT,
            "mu_dtype": DTYPE,
            "weight_decay": NON_NEG,
        },
    ),
    "lamb": (
        _with(fo.lamb, learning_rate=0.1),
        {
            "learning_rate": LR,
            "b1": UNIT,
            "b2": UNIT,
            "eps": NON_NEG,
            "eps_root": NON_NEG,
            "weight_decay": NON_NEG,
        },
    ),
    "rmsprop": (
        _with(fo.rmsprop, learning_rate=0.1),
        {
            "learning_rate": LR,
            "decay": UNIT,
            "eps": NON_NEG,
            "initial_scale": NON_NEG,
            "eps_in_sqrt": BOOL,
            "centered": BOOL,
            "momentum": MOMENTUM,
            "nesterov": BOOL,
            "bias_correction": BOOL,
        },
    ),
    "adagrad": (
        _with(fo.adagrad, learning_rate=0.1),
        {"learning_rate": LR, "initial_accumulator_value": NON_NEG, "eps": NON_NEG},
    ),
    "nadam": (
        _with(fo.nadam, learning_rate=0.1),
        {
            "learning_rate": LR,
            "b1": UNIT,
            "b2": UNIT,
            "eps": NON_NEG,
            "eps_root": NON_NEG,
            "mu_dtype": DTYPE,
            "nesterov": BOOL,
        },
    ),
    "radam": (
        _with(fo.radam, learning_rate=0.1),
        {
            "learning_rate": LR,
            "b1": UNIT,
            "b2": UNIT,
            "eps": NON_NEG,
            "eps_root": NON_NEG,
            "threshold": THRESHOLD,
            "nesterov": BOOL,
        },
    ),
    "adabelief": (
        _with(fo.adabelief, learning_rate=0.1),
        {
            "learning_rate": LR,
            "b1": UNIT,
            "b2": UNIT,
            "eps": NON_NEG,
            "eps_root": NON_NEG,
            "nesterov": BOOL,
        },
    ),
    "scale_by_lion": (
        fo.scale_by_lion,
        {
            "b1": UNIT_CLOSED,
            "b2": UNIT,
            "mu_dtype": DTYPE,
            "mode": Kind(
                st.sampled_from(["hard", "smooth", "refined"]),
                st.sampled_from(["sign", "", None, 1, "HARD"]),
            ),
            "smooth_beta": REAL,
        },
    ),
    "scale_by_trust_ratio": (
        fo.scale_by_trust_ratio,
        {"min_norm": NON_NEG, "trust_coefficient": NON_NEG, "eps": NON_NEG},
    ),
    "scale_by_rss": (fo.scale_by_rss, {"initial_accumulator_value": NON_NEG, "eps": NON_NEG}),
    "scale_by_stddev": (
        fo.scale_by_stddev,
        {
            "decay": UNIT,
            "eps": NON_NEG,
            "initial_scale": NON_NEG,
            "eps_in_sqrt": BOOL,
            "bias_correction": BOOL,
        },
    ),
    "exponential_decay": (
        _with(
            fo.exponential_decay, init_value=1.0, transition_steps=5, decay_rate=0.5, end_value=2.0
        ),
        {
            "init_value": REAL,
            "transition_steps": STEP,
            "decay_rate": NON_NEG,
            "transition_begin": STEP,
            "staircase": BOOL,
            "end_value": END,
        },
    ),
    "polynomial_schedule": (
        _with(fo.polynomial_schedule, init_value=1.0, end_value=0.0, power=2.0, transition_steps=5),
        {
            "init_value": REAL,
            "end_value": REAL,
            "power": NON_NEG,
            "transition_steps": STEP,
            "transition_begin": STEP,
        },
    ),
    "piecewise_constant_schedule": (
        _with(fo.piecewise_constant_schedule, init_value=1.0),
        {"init_value": REAL, "boundaries_and_scales": TABLE},
    ),
    "warmup_exponential_decay_schedule": (
        _with(
            fo.warmup_exponential_decay_schedule,
            init_value=0.0,
            peak_value=1.0,
            warmup_steps=3,
            transition_steps=5,
            decay_rate=0.5,
            end_value=2.0,
        ),
        {
            "init_value": REAL,
            "peak_value": REAL,
            "warmup_steps": counter_kind(0),
            "transition_steps": STEP,
            "decay_rate": NON_NEG,
            "transition_begin": STEP,
            "staircase": BOOL,
            "end_value": END,
        },
    ),
    "sgdr_schedule": (fo.sgdr_schedule, {"cosine_kwargs": CYCLES}),
}
CASES = [(name, arg) for name, (_, kinds) in ALIASES.items() for arg in kinds]


@pytest.mark.parametrize(("name", "arg"), CASES, ids=[f"{n}-{a}" for n, a in CASES])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_bad_value_is_refused_naming_the_argument(name: str, arg: str, data: st.DataObject) -> None:
    factory, kinds = ALIASES[name]
    value = data.draw(kinds[arg].bad, label=arg)
    with pytest.raises((ValueError, TypeError)) as err:
        factory(**{arg: value})
    assert re.search(rf"\b{re.escape(arg)}\b", str(err.value)), str(err.value)


@pytest.mark.parametrize(("name", "arg"), CASES, ids=[f"{n}-{a}" for n, a in CASES])
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_good_value_is_accepted(name: str, arg: str, data: st.DataObject) -> None:
    factory, kinds = ALIASES[name]
    factory(**{arg: data.draw(kinds[arg].good, label=arg)})


def test_growing_exponential_decay_beyond_float32_is_refused():
    with pytest.raises(ValueError, match="decay_rate"):
        fo.exponential_decay(1.0, 10, 1.5)
    with pytest.raises(ValueError, match="decay_rate"):
        fo.exponential_decay(-1.0, 10, 1.5, end_value=2.0)  # an upper bound does not stop it
    fo.exponential_decay(1.0, 10, 1.5, end_value=2.0)  # bounded: accepted
    fo.exponential_decay(1.0, 2**30, 1.0001)  # stays below float32's max: accepted


# --- the optimizers through TransformOptimizer, donation, vmap ---------------------------

OPTIMIZERS: dict[str, Callable[[float], fo.GradientTransformation]] = {
    "lion": lambda lr: fo.lion(lr, weight_decay=0.1),
    "lamb": lambda lr: fo.lamb(lr, weight_decay=0.01),
    "rmsprop": lambda lr: fo.rmsprop(lr),
    "rmsprop_centered_momentum": lambda lr: fo.rmsprop(lr, centered=True, momentum=0.9),
    "rmsprop_nesterov": lambda lr: fo.rmsprop(lr, momentum=0.5, nesterov=True),
    "adagrad": lambda lr: fo.adagrad(lr),
    "nadam": lambda lr: fo.nadam(lr),
    "radam": lambda lr: fo.radam(lr, b2=0.9),
    "adabelief": lambda lr: fo.adabelief(lr),
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((5, 3), (3,), ())]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_group_lr_drives_the_optimizer(name):
    params = _params()
    opt = TransformOptimizer(params, OPTIMIZERS[name](1e-4))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-12)
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert any(not torch.equal(p, q) for p, q in zip(params, before, strict=True))
    opt.param_groups[0]["lr"] = 0.0
    frozen = [p.detach().clone() for p in params]
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    for p, q in zip(params, frozen, strict=True):
        assert torch.equal(p, q)


def test_rmsprop_with_momentum_declares_its_learning_rate():
    assert fo.base.step_size(fo.rmsprop(0.03, momentum=0.9)) == fo.base.StepSize(-0.03, False)
    assert fo.base.step_size(fo.rmsprop(0.03)).factor == -0.03
    with pytest.raises(fo.base.UnknownStepSize):  # a schedule's lr is not a constant
        fo.base.step_size(fo.rmsprop(fo.exponential_decay(0.1, 5, 0.5), momentum=0.9))


def _tree(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g),
        "s": torch.randn((), generator=g),
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_donated_updates_equal_pure_ones_and_inputs_stay(name):
    tx = OPTIMIZERS[name](0.01)
    params = _tree(0)
    pure_state = tx.init(params)
    donated_state = tx.init(params)
    for step in range(8):
        grads = _tree(step + 1)
        kept = optree.tree_map(torch.clone, (grads, pure_state))
        u_pure, pure_state_next = tx.update(grads, pure_state, params)
        assert_bitwise((grads, pure_state), kept, "pure update changed its inputs")
        pure_state = pure_state_next
        u_don, donated_state = tx.update(
            optree.tree_map(torch.clone, grads), donated_state, params, donate=True
        )
        assert_bitwise(u_don, u_pure, f"step {step}")
        assert_bitwise(donated_state, pure_state, f"state after step {step}")
        params = fo.apply_updates(params, u_pure)


def test_radam_under_vmap_crosses_its_switch_without_host_syncs():
    # a Python branch on the counter (or .item()) would fail under vmap
    tx = fo.radam(0.01, b2=0.9)
    members = [_tree(s) for s in range(3)]
    stacked = optree.tree_map(lambda *xs: torch.stack(xs), *members)
    state = torch.func.vmap(tx.init)(stacked)
    states = [tx.init(m) for m in members]
    magnitudes = [MagnitudeRun(tx, m) for m in members]
    for step in range(8):  # rectified from step 6 on (test_oracle_optax_aliases)
        grads = [_tree(10 + 3 * step + s) for s in range(3)]
        batched = optree.tree_map(lambda *xs: torch.stack(xs), *grads)
        u, state = torch.func.vmap(tx.update)(batched, state, stacked)
        for i in range(3):
            ui, states[i] = tx.update(grads[i], states[i], members[i])
            # the same formula batched and per member, RAdam's factor computed alike from the
            # counter: the namesakes' count per step (ELEMENTWISE_OPS covers adam's chain),
            # relative to the magnitude run's values
            mag, _ = magnitudes[i].update(grads[i], members[i])
            assert_close_rounding(
                optree.tree_map(lambda x, i=i: x[i], u),
                ui,
                dtype=torch.float32,
                ops=(step + 1) * ELEMENTWISE_OPS,
                scale=mag,
            )
