"""Misuse (issue 14, section 2): a clear error for every bad argument, nothing silent under faults.

1. Every public factory, schedule, combinator and loss scale of ``functional_opt`` refuses
   generated bad values (wrong types, NaN/inf, out of range, huge ints such as ``2**31``,
   ``2**63`` and ``sys.maxsize``, negative where a count or a rate is expected) with a
   ``ValueError``/``TypeError`` whose message names the argument, and accepts generated good
   values (so the bad-value tests cannot pass by refusing everything). Python values given to
   ``inject_hyperparams`` get the same checks.
2. Generated NaN/Inf faults in guarded chains (``apply_if_finite``), in ``MultiSteps`` and in
   loss scaling (``all_finite``, ``DynamicLossScale.adjust``) leave the params and the guarded
   state bit for bit as they were (compared as integers, so NaN payloads and signed zeros
   count).
3. Regression tests, one per bug of the section, each failing on the code before its fix.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import pytest
import torch
from conftest import assert_close_rounding
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_opt as fo
from functional_opt.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale, all_finite

F32 = torch.finfo(torch.float32)
INT32_MAX = 2**31 - 1
NAN, INF = math.nan, math.inf

# ---------------------------------------------------------------------------------------------
# Helpers.


def bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: NaN payloads and the sign of zero compare."""
    if x.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.detach().contiguous().view(ints).clone()
    return x.detach().clone()


def snapshot(tree: Any) -> list[Any]:
    leaves = optree.tree_leaves(tree, none_is_leaf=True, namespace=fo.tree.NAMESPACE)
    return [bits(x) if isinstance(x, torch.Tensor) else x for x in leaves]


def assert_bit_identical(tree: Any, before: list[Any], what: str) -> None:
    now = snapshot(tree)
    assert len(now) == len(before), what
    for i, (a, b) in enumerate(zip(now, before, strict=True)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype, f"{what}: leaf {i}"
            assert torch.equal(a, b), f"{what}: leaf {i} changed"
        else:
            assert a == b or (a is None and b is None), f"{what}: leaf {i}"


def tmap(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest, none_is_leaf=True)


# ---------------------------------------------------------------------------------------------
# 1. Bad arguments: kinds of argument, with strategies for good and bad values.


def _a_function(count: Any) -> Any:
    return count


WRONG_TYPES: list[Any] = [
    "0.1",
    None,
    [0.1],
    (1,),
    {"a": 1},
    b"1",
    complex(1.0, 1.0),
    torch.ones(2),
    torch.tensor(True),
    torch.tensor(1 + 1j),
]
HUGE_INTS = [2**31, 2**32 + 1, 2**63, sys.maxsize, 10**400]


def _floats(lo: float | None = None, hi: float | None = None, **kw: Any) -> Any:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, **kw)


NON_FINITE = st.sampled_from([NAN, INF, -INF])
BEYOND_F32 = _floats(3.5e38) | _floats(hi=-3.5e38) | st.sampled_from([2**128, 10**400, -(2**200)])


@dataclass(frozen=True)
class Kind:
    """What an argument accepts: ``good`` values, and ``bad`` ones (each must be refused)."""

    good: st.SearchStrategy[Any]
    bad: st.SearchStrategy[Any]

    def injected(self) -> Kind:
        """As a value given to ``inject_hyperparams``, where a callable is a schedule."""
        return Kind(self.good, self.bad.filter(lambda v: not callable(v)))


def _bad(*strategies: st.SearchStrategy[Any], types: bool = True, bools: bool = True) -> Any:
    out = st.one_of(*strategies)
    if types:
        out = out | st.sampled_from([*WRONG_TYPES, _a_function])
    if bools:
        out = out | st.booleans()
    return out


REAL = Kind(
    _floats(-F32.max, F32.max) | st.integers(-(2**100), 2**100), _bad(NON_FINITE, BEYOND_F32)
)
NON_NEG = Kind(
    _floats(0, F32.max) | st.integers(0, 2**100),
    _bad(NON_FINITE, BEYOND_F32, _floats(hi=-1e-300), st.integers(max_value=-1)),
)
POSITIVE = Kind(  # pmin next to agc=0.3 must also keep agc * pmin >= float32's tiny
    _floats(1e-30, 1e30),
    _bad(NON_FINITE, BEYOND_F32, _floats(hi=0.0), st.integers(max_value=0)),
)
UNIT = Kind(
    _floats(0, 0.9999),
    _bad(NON_FINITE, BEYOND_F32, _floats(1.0), _floats(hi=-1e-300), st.integers(1) | st.just(-1)),
)
F32_NORMAL = Kind(  # a positive normal float32
    _floats(F32.tiny, F32.max),
    _bad(NON_FINITE, BEYOND_F32, _floats(hi=0.0), _floats(1e-300, 1e-39), st.integers(max_value=0)),
)
AT_LEAST_1 = Kind(_floats(1.0, F32.max), _bad(NON_FINITE, BEYOND_F32, _floats(hi=0.999)))


def counter_kind(low: int, high: int = INT32_MAX) -> Kind:
    """An integer compared with an int32 counter: in ``[low, high]``."""
    return Kind(
        st.integers(low, high),
        _bad(
            st.integers(max_value=low - 1),
            st.integers(min_value=high + 1),
            st.sampled_from([h for h in HUGE_INTS if h > high]),
            _floats() | st.just(float(max(low, 1))),
        ),
    )


STEP = Kind(  # a schedule's step: negatives mean 0 (optax), beyond int32 is never reached
    st.integers(-(2**31), 2**20),
    _bad(
        st.integers(min_value=2**31),
        st.integers(max_value=-(2**31) - 1),
        st.sampled_from(HUGE_INTS),
        _floats() | st.just(5.0),
    ),
)
BOOL = Kind(
    st.booleans(),
    st.sampled_from([0, 1, "yes", "", None, 1.0, torch.tensor(True), _a_function]),
)
DTYPE = Kind(
    st.sampled_from([None, torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    st.sampled_from([torch.int32, torch.bool, torch.complex64, "float32", float, 1, _a_function]),
)
FUNCTION = Kind(
    st.just(lambda count: 0.1 + 0 * count),
    st.sampled_from([0.1, 1, None, "f", torch.tensor(0.1), (_a_function,)]),
)
TRANSFORM = Kind(
    st.builds(lambda: fo.sgd(0.1)),
    st.sampled_from([None, _a_function, "sgd", (_a_function, _a_function), fo.sgd]),
)


def choice(*options: str) -> Kind:
    return Kind(st.sampled_from(options), st.sampled_from(["exp", "", None, 1, "CONST", options]))


def _with(factory: Callable[..., Any], **defaults: Any) -> Callable[..., Any]:
    return lambda **kwargs: factory(**{**defaults, **kwargs})


LR = NON_NEG.injected()  # a callable learning rate is a schedule
AGC = Kind(  # 0 (off), or a clip whose bound clip * pmin (pmin = 1e-3) is a normal float32
    st.just(0.0) | _floats(1e-30, F32.max), NON_NEG.bad
)
D3 = {
    "lr": NON_NEG,
    "agc": AGC,
    "pmin": POSITIVE,
    "beta1": UNIT,
    "beta2": UNIT,
    "eps": F32_NORMAL,
    "warmup": counter_kind(0),
    "anneal": counter_kind(0),
    "momentum": BOOL,
    "nesterov": BOOL,
    "weight_decay": NON_NEG,
    "schedule": choice("const", "linear", "cosine"),
}
ADAM = {
    "learning_rate": LR,
    "b1": UNIT,
    "b2": UNIT,
    "eps": NON_NEG,
    "eps_root": NON_NEG,
    "mu_dtype": DTYPE,
    "nesterov": BOOL,
}
SGD = {
    "learning_rate": LR,
    "momentum": Kind(UNIT.good | st.none(), UNIT.bad.filter(lambda v: v is not None)),
    "nesterov": BOOL,
    "accumulator_dtype": DTYPE,
}

# name -> (factory taking keyword arguments, {argument: kind})
REGISTRY: dict[str, tuple[Callable[..., Any], dict[str, Kind]]] = {
    "scale": (fo.scale, {"step_size": REAL}),
    "scale_by_learning_rate": (
        _with(fo.scale_by_learning_rate, learning_rate=0.1),
        {"learning_rate": LR, "flip_sign": BOOL},
    ),
    "scale_by_schedule": (fo.scale_by_schedule, {"step_size_fn": FUNCTION}),
    "clip": (fo.clip, {"max_delta": NON_NEG}),
    "clip_by_global_norm": (fo.clip_by_global_norm, {"max_norm": F32_NORMAL}),
    "adaptive_grad_clip": (
        _with(fo.adaptive_grad_clip, clipping=0.1),
        {
            "clipping": NON_NEG,
            "eps": NON_NEG,
            "axis": Kind(
                st.sampled_from([None, "torch", 0, -1, (0,), (0, -1), [1, 0], ()]),
                st.sampled_from(
                    ["rows", "", 1.0, True, (0, 0), [0.5], torch.tensor(0), b"1", {"a": 1}]
                ),
            ),
        },
    ),
    "clip_by_agc": (fo.clip_by_agc, {"clip": AGC, "pmin": POSITIVE}),
    "scale_by_rms": (
        fo.scale_by_rms,
        {
            "decay": UNIT,
            "eps": NON_NEG,
            "initial_scale": NON_NEG,
            "eps_in_sqrt": BOOL,
            "bias_correction": BOOL,
        },
    ),
    "scale_by_adam": (fo.scale_by_adam, {k: v for k, v in ADAM.items() if k != "learning_rate"}),
    "trace": (
        _with(fo.trace, decay=0.9),
        {"decay": UNIT, "nesterov": BOOL, "accumulator_dtype": DTYPE},
    ),
    "ema": (
        _with(fo.ema, decay=0.9),
        {"decay": UNIT, "debias": BOOL, "accumulator_dtype": DTYPE},
    ),
    "add_decayed_weights": (fo.add_decayed_weights, {"weight_decay": NON_NEG}),
    "adam": (_with(fo.adam, learning_rate=0.1), ADAM),
    "adamw": (_with(fo.adamw, learning_rate=0.1), {**ADAM, "weight_decay": NON_NEG}),
    "sgd": (_with(fo.sgd, learning_rate=0.1), SGD),
    "dreamerv3": (_with(fo.dreamerv3, anneal=2000), D3),  # cosine needs anneal > warmup
    "dreamerv3_schedule": (
        _with(fo.dreamerv3_schedule, lr=0.1),
        {k: D3[k] for k in ("lr", "warmup", "anneal", "schedule")},
    ),
    "apply_if_finite": (
        _with(fo.apply_if_finite, inner=fo.sgd(0.1), max_consecutive_errors=3),
        {"inner": TRANSFORM, "max_consecutive_errors": counter_kind(0)},
    ),
    "MultiSteps": (
        _with(fo.MultiSteps, opt=fo.sgd(0.1), every_k_schedule=2),
        {
            "opt": TRANSFORM,
            "every_k_schedule": Kind(
                counter_kind(1).good, counter_kind(1).bad.filter(lambda v: not callable(v))
            ),
            "use_grad_mean": BOOL,
            "should_skip_update_fn": Kind(
                st.sampled_from([None, fo.skip_not_finite]),
                st.sampled_from([0.1, 1, "f", torch.tensor(0.1), (fo.skip_not_finite,)]),
            ),
            "accumulator_dtype": DTYPE,
        },
    ),
    "multi_steps": (
        _with(fo.multi_steps, opt=fo.sgd(0.1), every_k_schedule=2),
        {"opt": TRANSFORM, "use_grad_mean": BOOL},
    ),
    "inject_hyperparams": (
        lambda **kw: fo.inject_hyperparams(**{"inner_factory": fo.sgd, **kw}),
        {"inner_factory": FUNCTION, "hyperparam_dtype": DTYPE},
    ),
    "inject_hyperparams(dreamerv3)": (
        lambda **kw: fo.inject_hyperparams(fo.dreamerv3)(**kw),
        {k: v.injected() for k, v in D3.items() if k not in ("momentum", "nesterov", "schedule")},
    ),
    "inject_hyperparams(adam)": (
        lambda **kw: fo.inject_hyperparams(fo.adam)(**{"learning_rate": 0.1, **kw}),
        {k: v.injected() for k, v in ADAM.items() if k not in ("mu_dtype", "nesterov")},
    ),
    "inject_hyperparams(sgd)": (
        lambda **kw: fo.inject_hyperparams(fo.sgd)(**{"learning_rate": 0.1, **kw}),
        {k: SGD[k].injected() for k in ("learning_rate", "momentum")},
    ),
    "constant_schedule": (fo.constant_schedule, {"value": REAL}),
    "linear_schedule": (
        _with(fo.linear_schedule, init_value=1.0, end_value=0.0, transition_steps=5),
        {"init_value": REAL, "end_value": REAL, "transition_steps": STEP, "transition_begin": STEP},
    ),
    "cosine_decay_schedule": (
        _with(fo.cosine_decay_schedule, init_value=1.0, decay_steps=5),
        {"init_value": REAL, "decay_steps": counter_kind(1), "alpha": REAL, "exponent": NON_NEG},
    ),
    "warmup_cosine_decay_schedule": (
        _with(
            fo.warmup_cosine_decay_schedule,
            init_value=0.0,
            peak_value=1.0,
            warmup_steps=2,
            decay_steps=9,
        ),
        {
            "init_value": REAL,
            "peak_value": Kind(_floats(1e-3, 1e3), REAL.bad),
            "end_value": REAL,
            "warmup_steps": counter_kind(0, 8),
            "decay_steps": counter_kind(3),
            "exponent": NON_NEG,
        },
    ),
    "join_schedules": (
        _with(fo.join_schedules, schedules=[fo.constant_schedule(1.0)] * 2, boundaries=[3]),
        {"boundaries": Kind(st.integers(0, INT32_MAX).map(lambda b: [b]), st.nothing())},
    ),
    "chain": (lambda **kw: fo.chain(fo.sgd(0.1), kw["argument"]), {"argument": TRANSFORM}),
    "masked": (
        lambda **kw: fo.masked(mask=True, **{"inner": fo.sgd(0.1), **kw}),
        {"inner": TRANSFORM},
    ),
    "freeze": (
        fo.freeze,
        {
            "mask": Kind(
                st.booleans() | st.just({"w": True, "b": False}),
                st.sampled_from([1, 0.5, "w", None, b"1", torch.tensor(True), {"w": 1}, [0.1]]),
            )
        },
    ),
    "incremental_update": (
        lambda **kw: fo.incremental_update({"w": torch.ones(2)}, {"w": torch.zeros(2)}, **kw),
        {
            "step_size": Kind(
                _floats(0.0, 1.0),
                _bad(
                    NON_FINITE,
                    BEYOND_F32,
                    _floats(1.0, exclude_min=True),
                    _floats(hi=-1e-300),
                    st.integers(2) | st.just(-1),
                ),
            )
        },
    ),
    "periodic_update": (
        lambda **kw: fo.periodic_update(
            {"w": torch.ones(2)}, {"w": torch.zeros(2)}, **{"steps": 0, "update_period": 1, **kw}
        ),
        {
            "steps": Kind(
                st.integers(0, 2**63 - 1),
                _bad(st.integers(max_value=-1), st.sampled_from([2**63, 10**400]), _floats()),
            ),
            "update_period": Kind(
                st.integers(1, 2**63 - 1),
                _bad(st.integers(max_value=0), st.sampled_from([2**63, 10**400]), _floats()),
            ),
        },
    ),
    "snapshot": (
        _with(fo.snapshot, measure_name="n", measure=fo.update_norm),
        {
            "measure_name": Kind(st.text(min_size=1), st.sampled_from(["", None, 1, b"n", ("n",)])),
            "measure": Kind(st.just(fo.update_norm), st.sampled_from([None, 0.1, "f"])),
        },
    ),
    "monitor": (
        fo.monitor,
        {
            "measures": Kind(
                st.just({"n": fo.update_norm}),
                st.sampled_from(
                    [{}, [fo.update_norm], None, {"n": 1.0}, {1: fo.update_norm}, fo.update_norm]
                ),
            )
        },
    ),
    "measure_with_ema": (
        _with(fo.measure_with_ema, measure=fo.update_norm, decay=0.9),
        {
            "measure": Kind(st.just(fo.update_norm), st.sampled_from([None, 0.1, "f"])),
            "decay": UNIT,
            "debias": BOOL,
            "accumulator_dtype": DTYPE,
        },
    ),
    "StaticLossScale": (StaticLossScale, {"scale": F32_NORMAL}),
    "DynamicLossScale": (
        _with(DynamicLossScale, scale=2.0**16, min_scale=F32.tiny),
        {
            "scale": F32_NORMAL,
            "period": counter_kind(1),
            "factor": AT_LEAST_1,
            "min_scale": F32_NORMAL,
            "counter": Kind(
                counter_kind(0).good | st.none(),
                counter_kind(0).bad.filter(lambda v: v is not None),
            ),
        },
    ),
}

CASES = [(name, arg) for name, (_, kinds) in REGISTRY.items() for arg in kinds]


@pytest.mark.parametrize(("name", "arg"), CASES, ids=[f"{n}-{a}" for n, a in CASES])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_bad_value_is_refused_naming_the_argument(name: str, arg: str, data: st.DataObject) -> None:
    factory, kinds = REGISTRY[name]
    if kinds[arg].bad.is_empty:
        return
    value = data.draw(kinds[arg].bad, label=arg)
    with pytest.raises((ValueError, TypeError)) as err:
        factory(**{arg: value})
    assert re.search(rf"\b{re.escape(arg)}\b", str(err.value)), str(err.value)


@pytest.mark.parametrize(("name", "arg"), CASES, ids=[f"{n}-{a}" for n, a in CASES])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_good_value_is_accepted(name: str, arg: str, data: st.DataObject) -> None:
    factory, kinds = REGISTRY[name]
    factory(**{arg: data.draw(kinds[arg].good, label=arg)})


def test_wrong_types_are_type_errors_that_are_also_value_errors() -> None:
    """A wrong type is a ``TypeError``; it is a ``ValueError`` too, as every bad
    hyperparameter was before."""
    for build in (
        lambda: fo.scale("0.1"),
        lambda: fo.dreamerv3(momentum="no"),
        lambda: fo.MultiSteps(fo.sgd(0.1), 2.0),
    ):
        with pytest.raises(TypeError) as err:
            build()
        assert isinstance(err.value, ValueError)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, INT32_MAX), min_size=2, max_size=4))
def test_join_schedules_boundaries_must_be_sorted(boundaries: list[int]) -> None:
    schedules = [fo.constant_schedule(float(i)) for i in range(len(boundaries) + 1)]
    if boundaries == sorted(boundaries):
        fo.join_schedules(schedules, boundaries)
    else:
        with pytest.raises(ValueError, match="boundaries"):
            fo.join_schedules(schedules, boundaries)


@pytest.mark.parametrize(
    "boundaries", [[2**31], [-1], [1.5], [True], ["3"], [sys.maxsize], [2**63]]
)
def test_join_schedules_boundaries_are_counter_steps(boundaries: list[Any]) -> None:
    with pytest.raises((ValueError, TypeError), match=r"boundaries\[0\]"):
        fo.join_schedules([fo.constant_schedule(1.0)] * 2, boundaries)


def test_join_schedules_schedules_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"schedules\[1\]"):
        fo.join_schedules([fo.constant_schedule(1.0), 0.5], [3])


def test_named_chain_and_partition_refuse_non_transforms() -> None:
    with pytest.raises(TypeError):
        fo.named_chain(("a", fo.sgd(0.1)), ("b", _a_function))  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError)):
        fo.partition({"a": _a_function}, lambda p: "a")  # type: ignore[dict-item]


@pytest.mark.parametrize("bad", [NAN, INF, -INF, "3", None])
def test_a_schedules_count_must_be_a_finite_number(bad: Any) -> None:
    fn = fo.linear_schedule(1.0, 0.0, 10)
    with pytest.raises((ValueError, TypeError), match="count"):
        fn(bad)
    assert float(fn(2**40)) == 0.0  # past the end: the end value


# ---------------------------------------------------------------------------------------------
# 2. Faults: NaN/Inf leave params and the guarded state bit for bit as they were.

SHAPES = [(), (3,), (2, 3)]


@st.composite
def trees(draw: st.DrawFn, steps: int, signed_zeros: bool = True) -> tuple[Any, list[Any]]:
    """Params (float32/float64 leaves, some elements -0.0) and ``steps`` gradient trees."""
    n = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    dtypes = [draw(st.sampled_from([torch.float32, torch.float64])) for _ in range(n)]
    shapes = [draw(st.sampled_from(SHAPES)) for _ in range(n)]
    params = {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        p = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        if signed_zeros and draw(st.booleans()):
            p.view(-1)[0] = -0.0
        params[f"p{i}"] = p
    grads = [
        {
            k: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            for k, p in params.items()
        }
        for _ in range(steps)
    ]
    return params, grads


@st.composite
def faults(draw: st.DrawFn, grads: list[Any]) -> list[bool]:
    """Puts NaN/Inf into some of the gradient trees (in place); returns which are faulty."""
    out = []
    for g in grads:
        faulty = draw(st.booleans())
        if faulty:
            key = draw(st.sampled_from(sorted(g)))
            leaf = g[key].view(-1)
            leaf[draw(st.integers(0, leaf.numel() - 1))] = draw(NON_FINITE)
        out.append(faulty)
    return out


INNERS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "sgd_momentum": lambda: fo.sgd(0.1, momentum=0.9),
    "adam": lambda: fo.adam(0.1),
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=0),
    "dreamerv3_chain": lambda: fo.dreamerv3(1e-2, warmup=2, weight_decay=0.1, _fused=False),
    "clip_adamw": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(0.1)),
    "multi_steps_adam": lambda: fo.multi_steps(fo.adam(0.1), 2),
}


@pytest.mark.parametrize("inner", sorted(INNERS))
@settings(max_examples=12, deadline=None)
@given(data=st.data(), max_errors=st.integers(0, 3))
def test_apply_if_finite_skips_faults_bit_for_bit(
    inner: str, data: st.DataObject, max_errors: int
) -> None:
    params, grads = data.draw(trees(steps=6))
    faulty = data.draw(faults(grads))
    tx = fo.apply_if_finite(INNERS[inner](), max_errors)
    state = tx.init(params)
    consecutive = total = 0
    for t, g in enumerate(grads):
        before_p, before_s = snapshot(params), snapshot(state.inner_state)
        updates, state = tx.update(g, state, params)
        params = fo.apply_updates(params, updates)
        consecutive = consecutive + 1 if faulty[t] else 0
        total += faulty[t]
        if faulty[t] and consecutive <= max_errors:
            assert_bit_identical(params, before_p, f"params after skipped step {t}")
            assert_bit_identical(state.inner_state, before_s, f"inner state after step {t}")
        assert int(state.notfinite_count) == consecutive
        assert int(state.total_notfinite) == total
        assert bool(state.last_finite) == (not faulty[t])


@pytest.mark.parametrize("inner", ["adam", "dreamerv3", "sgd_momentum"])
@settings(max_examples=12, deadline=None)
@given(data=st.data(), k=st.integers(1, 3))
def test_multi_steps_of_guarded_inner_drops_faulty_windows_bit_for_bit(
    inner: str, data: st.DataObject, k: int
) -> None:
    """``MultiSteps(apply_if_finite(inner), k)``: a fault anywhere in a window makes its mean
    non-finite; the window is dropped at its end: params and the inner state stay bit for bit,
    the accumulators are cleared (the next window is as if the faulty one never happened)."""
    params, grads = data.draw(trees(steps=3 * k))
    faulty = data.draw(faults(grads))
    guarded = fo.apply_if_finite(INNERS[inner](), INT32_MAX)
    ms = fo.MultiSteps(guarded, k)
    state = ms.init(params)
    window_start = (snapshot(params), snapshot(state.inner_opt_state.inner_state))
    for t, g in enumerate(grads):
        updates, state = ms.update(g, state, params)
        params = fo.apply_updates(params, updates)
        if (t + 1) % k:
            assert_bit_identical(params, window_start[0], f"params inside a window, step {t}")
            continue
        if any(faulty[t + 1 - k : t + 1]):
            assert_bit_identical(params, window_start[0], f"params after faulty window {t}")
            inner_state = state.inner_opt_state.inner_state
            assert_bit_identical(inner_state, window_start[1], f"inner state, window {t}")
        for a in fo.tree.leaves(state.acc_grads):
            assert torch.equal(bits(a), bits(torch.zeros_like(a))), f"accumulator left at {t}"
        window_start = (snapshot(params), snapshot(state.inner_opt_state.inner_state))


@settings(max_examples=12, deadline=None)
@given(data=st.data(), k=st.integers(2, 3))
def test_guarded_multi_steps_skips_faulty_mini_steps_bit_for_bit(
    data: st.DataObject, k: int
) -> None:
    """``apply_if_finite(MultiSteps(adam, k))``: a faulty mini-step is never accumulated; the
    whole MultiSteps state (counters, accumulators, Adam) and the params stay bit for bit."""
    params, grads = data.draw(trees(steps=3 * k))
    faulty = data.draw(faults(grads))
    tx = fo.apply_if_finite(fo.multi_steps(fo.adam(0.1), k), INT32_MAX)
    state = tx.init(params)
    for t, g in enumerate(grads):
        before_p, before_s = snapshot(params), snapshot(state.inner_state)
        updates, state = tx.update(g, state, params)
        params = fo.apply_updates(params, updates)
        if faulty[t]:
            assert_bit_identical(params, before_p, f"params after faulty mini-step {t}")
            assert_bit_identical(state.inner_state, before_s, f"MultiSteps state, step {t}")


INT_DTYPES = st.sampled_from([torch.int32, torch.int64, torch.uint8, torch.bool])


@st.composite
def fault_trees(draw: st.DrawFn) -> tuple[Any, bool]:
    """A tree of 16/32/64-bit leaves (0-d, empty and ``None`` ones included) with NaN/Inf at
    generated places; whether it has any."""
    leaves: dict[str, Any] = {}
    bad = False
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["tensor", "empty", "none", "int"]))
        if kind == "none":
            leaves[f"x{i}"] = None
            continue
        if kind == "int":  # integers and bools are finite
            leaves[f"x{i}"] = torch.tensor([draw(st.integers(0, 5)), 1], dtype=draw(INT_DTYPES))
            continue
        shape = (0,) if kind == "empty" else draw(st.sampled_from(SHAPES))
        dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]))
        x = torch.full(shape, draw(_floats(-100, 100)), dtype=dtype)
        if x.numel() and draw(st.booleans()):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(NON_FINITE)
            bad = True
        leaves[f"x{i}"] = x
    return leaves, bad


def test_all_finite_refuses_non_tensor_leaves() -> None:
    with pytest.raises(TypeError, match=r"\['b'\]\[0\]"):
        all_finite({"a": torch.ones(2), "b": [1.0]})


@settings(max_examples=60, deadline=None)
@given(fault_trees())
def test_all_finite_sees_every_fault(case: tuple[Any, bool]) -> None:
    tree, bad = case
    flag = all_finite(tree)
    assert flag.dtype == torch.bool and flag.dim() == 0
    assert bool(flag) == (not bad)


def _grad_scaler_reference(
    scale: float, period: int, finite: list[bool]
) -> list[tuple[float, int]]:
    s = torch.tensor(scale, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    out = []
    for ok in finite:
        torch._amp_update_scale_(s, tracker, torch.tensor(0.0 if ok else 1.0), 2.0, 0.5, period)
        out.append((float(s), int(tracker)))
    return out


@settings(max_examples=20, deadline=None)
@given(data=st.data(), period=st.integers(1, 4), exponent=st.integers(2, 20))
def test_loss_scaled_step_with_faults(data: st.DataObject, period: int, exponent: int) -> None:
    """A mixed-precision step: scaled gradients (with generated NaN/Inf), unscaled, checked
    with ``all_finite``, applied through ``apply_if_finite`` and fed to ``adjust``: on a fault
    the params and Adam's state stay bit for bit, and the scale follows torch's GradScaler."""
    params, grads = data.draw(trees(steps=6))
    scaled = [tmap(lambda x: x * 2.0**exponent, g) for g in grads]
    faulty = data.draw(faults(scaled))
    ls = DynamicLossScale(2.0**exponent, period, 2.0, F32.tiny)
    tx = fo.apply_if_finite(fo.adam(0.1), INT32_MAX)
    state = tx.init(params)
    want = _grad_scaler_reference(2.0**exponent, period, [not f for f in faulty])
    for t, g in enumerate(scaled):
        before_p, before_s = snapshot(params), snapshot(state.inner_state)
        unscaled = ls.unscale(g)
        finite = all_finite(unscaled)
        assert bool(finite) == (not faulty[t])
        updates, state = tx.update(unscaled, state, params)
        params = fo.apply_updates(params, updates)
        ls = ls.adjust(finite)
        if faulty[t]:
            assert_bit_identical(params, before_p, f"params after faulty step {t}")
            assert_bit_identical(state.inner_state, before_s, f"Adam's state, step {t}")
        assert (float(ls.loss_scale), int(ls.counter)) == want[t], t


# ---------------------------------------------------------------------------------------------
# MultiSteps and None gradients: a window's gradient is emitted with that window, never later.


@pytest.mark.numerics
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    k=st.integers(1, 4),
    windows=st.integers(1, 3),
    mean=st.booleans(),
)
def test_multi_steps_none_gradients_never_leak(
    data: st.DataObject, k: int, windows: int, mean: bool
) -> None:
    """Random ``None`` patterns: each emission is the window's sum (or sum / k) of the leaf's
    gradients, ``None`` only for a leaf without gradients in the window, and the accumulators
    are zero after it; the inner transform (SGD with momentum) sees exactly those means."""
    params, grads = data.draw(trees(steps=k * windows, signed_zeros=False))
    keys = sorted(params)
    for g in grads:
        for key in keys:
            if data.draw(st.booleans(), label=f"drop {key}"):
                g[key] = None
    ms = fo.MultiSteps(
        fo.sgd(1.0, momentum=0.5), k, use_grad_mean=mean, accumulator_dtype=torch.float64
    )
    state = ms.init(params)
    seen: dict[str, float] = {}  # the largest gradient of each leaf so far
    momentum: dict[str, torch.Tensor] = {
        key: torch.zeros_like(p, dtype=torch.float64) for key, p in params.items()
    }
    for w in range(windows):
        for m in range(k):
            g = grads[w * k + m]
            updates, state = ms.update(g, state, params)
            if m < k - 1:
                for key in keys:
                    if g[key] is None:
                        assert updates[key] is None
                    else:
                        assert torch.equal(bits(updates[key]), bits(torch.full_like(g[key], -0.0)))
        window = grads[w * k : (w + 1) * k]
        for key in keys:
            got = [g[key].double() for g in window if g[key] is not None]
            if not got:
                assert updates[key] is None, (w, key)
                continue
            total = sum(got)
            avg = total / k if mean else total
            momentum[key] = avg + 0.5 * momentum[key]
            assert updates[key] is not None, (w, key)
            # Counted per window (errors carried in the momentum add up over windows): the
            # float64 accumulator rounds 3 times per mini-step (sub, div, add; sum: 1) and
            # once per zero-filled mini-step (mul); the emitted mean is cast to the leaf's
            # dtype (1) and the momentum rounds twice (mul, add) in it. Relative to the largest
            # gradient of the windows so far, doubled (|momentum| <= 2 max |mean|).
            seen[key] = max(seen.get(key, 0.0), max(float(x.abs().max()) for x in got))
            dtype = params[key].dtype
            ops: dict[torch.dtype, float] = {torch.float64: (w + 1) * 4 * k}
            ops[dtype] = ops.get(dtype, 0) + (w + 1) * 3
            assert_close_rounding(
                updates[key].double(),
                -momentum[key],
                dtype=dtype,
                ops=ops,
                scale=2 * seen[key],
                msg=f"window {w}, {key}",
            )
        for a in fo.tree.leaves(state.acc_grads):
            assert not bool(a.any()), f"an accumulator survived window {w}"


def test_multi_steps_none_on_the_emitting_step_emits_the_window_mean() -> None:
    """Issue 14: a leaf ``None`` on the emitting mini-step kept its accumulated gradient into
    the next window (whose emission then applied both windows' gradients)."""
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    ms = fo.MultiSteps(fo.sgd(1.0), 2)
    state = ms.init(params)
    g0 = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0, 8.0])}
    _, state = ms.update(g0, state, params)
    u, state = ms.update({"a": torch.tensor([3.0, 4.0]), "b": None}, state, params)
    assert torch.equal(u["a"], torch.tensor([-2.0, -3.0]))
    assert u["b"] is not None and torch.equal(u["b"], torch.tensor([-2.0, -4.0]))  # (4, 8) / 2
    assert torch.equal(state.acc_grads["b"], torch.zeros(2))
    g = {"a": torch.ones(2), "b": torch.ones(2)}
    _, state = ms.update(g, state, params)
    u, state = ms.update(g, state, params)
    assert torch.equal(u["b"], -torch.ones(2))  # only this window's gradients


def test_multi_steps_mean_counts_a_missing_gradient_as_zero() -> None:
    """A leaf present on mini-steps 0 and 2 of 3: the window mean is (g0 + g2) / 3, as ``.grad``
    after three backward passes of ``loss / 3`` (it was (2 g0 + g2) / 3)."""
    params = {"a": torch.zeros((), dtype=torch.float64)}
    ms = fo.MultiSteps(fo.sgd(1.0), 3, accumulator_dtype=torch.float64)
    state = ms.init(params)
    one = torch.tensor(3.0, dtype=torch.float64)
    _, state = ms.update({"a": one}, state, params)
    _, state = ms.update({"a": None}, state, params)
    u, state = ms.update({"a": 2 * one}, state, params)
    assert float(u["a"]) == -3.0  # every step exact: 3; 3 * 1 / 2; 1.5 + (6 - 1.5) / 3


def test_multi_steps_frozen_leaf_stays_none_and_untouched() -> None:
    params = {"a": torch.ones(2), "frozen": torch.ones(3)}
    ms = fo.MultiSteps(fo.adamw(0.1, weight_decay=0.5), 2)
    state = ms.init(params)
    for _ in range(4):
        u, state = ms.update({"a": torch.ones(2), "frozen": None}, state, params)
        assert u["frozen"] is None
    inner = state.inner_opt_state[0]
    assert torch.equal(inner.mu["frozen"], torch.zeros(3))
    assert torch.equal(inner.nu["frozen"], torch.zeros(3))


@pytest.mark.numerics
def test_vmapped_multi_steps_accumulates_gaps_as_zero() -> None:
    """Under vmap (the ``torch.where`` path) the running mean counts a missing gradient as zero
    too, so a leaf present on the emitting mini-step emits the same mean as eagerly."""
    params = {"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    ms = fo.MultiSteps(fo.sgd(1.0), 3, accumulator_dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    grads = [
        {
            "a": torch.randn(2, 3, generator=gen, dtype=torch.float64),
            "b": torch.randn(2, generator=gen, dtype=torch.float64),
        }
        for _ in range(3)
    ]
    grads[1]["a"] = None
    state = torch.func.vmap(ms.init)(params)
    eager_state = ms.init({"a": params["a"][0], "b": params["b"][0]})
    for g in grads:
        missing = [k for k, v in g.items() if v is None]

        def step(present: Any, st: Any, p: Any, missing: list[str] = missing) -> Any:
            u, st = ms.update({**present, **dict.fromkeys(missing)}, st, p)
            return {k: v for k, v in u.items() if v is not None}, st

        present = {k: v for k, v in g.items() if v is not None}
        u, state = torch.func.vmap(step)(present, state, params)
        one = {k: None if v is None else v[0] for k, v in g.items()}
        ue, eager_state = ms.update(one, eager_state, {"a": params["a"][0], "b": params["b"][0]})
    # vmap runs the per-tensor ops, eager the multi-tensor ones: 7 float64 roundings each
    # (3 per present mini-step, 1 for the zero-fill), the exact mean 2 more; relative to the
    # gradients' magnitude.
    size = max(float(grads[i]["a"].abs().max()) for i in (0, 2))
    assert_close_rounding(u["a"][0], ue["a"], dtype=torch.float64, ops=7, scale=size)
    want = -(grads[0]["a"][0] + grads[2]["a"][0]) / 3
    assert_close_rounding(u["a"][0], want, dtype=torch.float64, ops=9, scale=size)


# ---------------------------------------------------------------------------------------------
# 3. Regression tests for the listed bugs.


def test_apply_if_finite_max_consecutive_errors_must_fit_int32() -> None:
    """Issue 14: ``sys.maxsize`` wrapped to -1 against the int32 counter: NaN went through."""
    for bad in (sys.maxsize, 2**31, 2**32):
        with pytest.raises(ValueError, match="max_consecutive_errors"):
            fo.apply_if_finite(fo.sgd(0.1), bad)


def test_apply_if_finite_with_the_largest_max_never_applies_a_nan() -> None:
    """At ``2**31 - 1`` the saturating count never exceeds the maximum."""
    params = {"w": torch.ones(2)}
    tx = fo.apply_if_finite(fo.sgd(0.1), INT32_MAX)
    state = tx.init(params)
    state = state._replace(notfinite_count=torch.tensor(INT32_MAX - 1, dtype=torch.int32))
    for _ in range(3):
        u, state = tx.update({"w": torch.tensor([NAN, 1.0])}, state, params)
        assert bool((u["w"] == 0).all())
    assert int(state.notfinite_count) == INT32_MAX


def test_skipped_step_keeps_negative_zero_params() -> None:
    """A skipped step's update is -0.0: ``apply_updates`` turned a -0.0 param into +0.0."""
    params = {"w": torch.tensor([-0.0, 1.0])}
    tx = fo.apply_if_finite(fo.adam(0.1), 5)
    state = tx.init(params)
    updates, state = tx.update({"w": torch.tensor([INF, 1.0])}, state, params)
    out = fo.apply_updates(params, updates)
    assert torch.equal(bits(out["w"]), bits(params["w"]))


def test_multi_steps_non_emitting_update_keeps_negative_zero_params() -> None:
    params = {"w": torch.tensor([-0.0, 2.0])}
    ms = fo.MultiSteps(fo.sgd(0.1), 2)
    updates, _ = ms.update({"w": torch.ones(2)}, ms.init(params), params)
    assert torch.equal(bits(fo.apply_updates(params, updates)["w"]), bits(params["w"]))


@pytest.mark.parametrize("period", [2**31, 2**32 + 1, 2**63, sys.maxsize])
def test_dynamic_loss_scale_period_must_fit_int32(period: int) -> None:
    """Issue 14: ``period >= 2**31`` wrapped: the scale doubled on every finite step."""
    with pytest.raises(ValueError, match="period"):
        DynamicLossScale(period=period)


def test_dynamic_loss_scale_counter_saturates() -> None:
    """An int32 counter at its maximum used to wrap to -2**31 (and never reach ``period``)."""
    ls = DynamicLossScale(8.0, period=INT32_MAX, counter=torch.tensor(INT32_MAX, dtype=torch.int32))
    ls = ls.adjust(torch.tensor(True))
    assert float(ls.loss_scale) == 16.0 and int(ls.counter) == 0


def test_dynamic_loss_scale_takes_only_a_bool_flag() -> None:
    """A float flag was cast to bool, which reads NaN as ``True`` (finite)."""
    ls = DynamicLossScale(8.0)
    with pytest.raises(TypeError, match="grads_finite"):
        ls.adjust(torch.tensor(NAN))
    with pytest.raises(TypeError, match="grads_finite"):
        StaticLossScale(2.0).adjust(torch.tensor(1))
    with pytest.raises(TypeError, match="grads_finite"):
        NoOpLossScale().adjust("yes")  # type: ignore[arg-type]
    assert float(ls.adjust(False).loss_scale) == 4.0


def test_dynamic_loss_scale_below_its_floor_never_grows_on_overflow() -> None:
    """``DynamicLossScale(0.5)`` (floor 1.0): an overflow raised the scale to 1.0."""
    ls = DynamicLossScale(0.5).adjust(torch.tensor(False))
    assert float(ls.loss_scale) == 0.5


@pytest.mark.parametrize("scale", [1e-45, 1e-40, 1e39])
def test_loss_scales_must_be_normal_float32(scale: float) -> None:
    """A scale that is subnormal in float32 has an infinite float32 reciprocal (unscaled
    gradients inf); one beyond float32's range is inf."""
    for make in (StaticLossScale, DynamicLossScale):
        with pytest.raises(ValueError, match="scale"):
            make(scale)


@pytest.mark.parametrize("k", [2**31, 2**32 + 1, sys.maxsize])
def test_multi_steps_k_must_fit_int32(k: int) -> None:
    """Issue 14: ``k >= 2**31`` never emitted; ``2**32 + 1`` emitted every step."""
    with pytest.raises(ValueError, match="every_k_schedule"):
        fo.MultiSteps(fo.sgd(0.1), k)
    ms = fo.MultiSteps(fo.sgd(0.1), lambda step: k)
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="every_k_schedule"):
        ms.update({"w": torch.ones(2)}, ms.init(params), params)


def test_multi_steps_tensor_k_is_clamped_not_wrapped() -> None:
    ms = fo.MultiSteps(fo.sgd(0.1), lambda step: torch.tensor(2**32 + 1))
    params = {"w": torch.ones(2)}
    state = ms.init(params)
    for _ in range(3):
        u, state = ms.update({"w": torch.ones(2)}, state, params)
        assert bool((u["w"] == 0).all())  # never emits within 2**31 - 1 mini-steps


def test_inject_hyperparams_checks_python_values() -> None:
    """Issue 14: ``inject_hyperparams(dreamerv3)(lr=-1.0, beta1=1.0)`` was accepted (NaN)."""
    with pytest.raises(ValueError, match=r"\blr\b"):
        fo.inject_hyperparams(fo.dreamerv3)(lr=-1.0, beta1=1.0)
    with pytest.raises(ValueError, match="beta1"):
        fo.inject_hyperparams(fo.dreamerv3)(beta1=1.0)
    with pytest.raises(ValueError, match="pmin"):
        fo.inject_hyperparams(fo.dreamerv3)(pmin=0.0)
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        fo.inject_hyperparams(fo.apply_if_finite)(fo.sgd(0.1), 2**31)


def test_inject_hyperparams_checks_values_as_stored() -> None:
    """``b2 = 0.99999999`` is valid, but 1.0 once stored in float32: ``1 - b2**t = 0``."""
    params = {"w": torch.ones(2)}
    tx = fo.inject_hyperparams(fo.adam)(0.1, b2=0.99999999)
    with pytest.raises(ValueError, match=r"b2=0\.99999999"):
        tx.init(params)
    tx64 = fo.inject_hyperparams(fo.adam, hyperparam_dtype=torch.float64)(0.1, b2=0.99999999)
    u, _ = tx64.update({"w": torch.ones(2)}, tx64.init(params), params)
    assert bool(torch.isfinite(u["w"]).all())


@pytest.mark.parametrize("fused", [True, False])
def test_dreamerv3_degenerate_values_are_refused(fused: bool) -> None:
    """Issue 14: ``pmin=0`` (and ``eps=0``) turned a zero param with a zero gradient into NaN."""
    for bad in ({"pmin": 0.0}, {"eps": 0.0}, {"eps": 1e-45}, {"agc": 1e-20, "pmin": 1e-20}):
        with pytest.raises(ValueError, match="pmin" if "pmin" in bad else "eps"):
            fo.dreamerv3(**bad, _fused=fused)  # type: ignore[arg-type]
    fo.dreamerv3(agc=0.0, pmin=0.0, _fused=fused)  # no clipping: pmin unused


@pytest.mark.parametrize("fused", [True, False])
def test_dreamerv3_smallest_accepted_values_keep_zero_params_finite(fused: bool) -> None:
    params = {"w": torch.zeros(3), "h": torch.zeros(4, dtype=torch.bfloat16)}
    grads = {"w": torch.zeros(3), "h": torch.zeros(4, dtype=torch.bfloat16)}
    tx = fo.dreamerv3(1e-2, agc=1.0, pmin=F32.tiny, eps=F32.tiny, warmup=0, _fused=fused)
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        params = fo.apply_updates(params, updates)
    for x in fo.tree.leaves((params, state)):
        if x.is_floating_point():
            assert bool(torch.isfinite(x).all())


@pytest.mark.parametrize(
    "build",
    [
        lambda: fo.adam(-1.0),
        lambda: fo.adamw(-1e-3),
        lambda: fo.sgd(-0.1),
        lambda: fo.scale_by_learning_rate(-0.1),
        lambda: fo.dreamerv3(-1e-4),
    ],
)
def test_negative_learning_rates_are_refused(build: Callable[[], Any]) -> None:
    """Issue 14 (as torch.optim): ``adam``/``sgd``/``adamw`` accepted a negative rate."""
    with pytest.raises(ValueError, match=r"\b(learning_rate|lr)\b"):
        build()


@pytest.mark.parametrize(
    "build",
    [
        lambda: fo.linear_schedule(NAN, 0.0, 10),
        lambda: fo.cosine_decay_schedule(1.0, 10, exponent=NAN),
        lambda: fo.cosine_decay_schedule(1.0, 10, exponent=-1.0),
        lambda: fo.warmup_cosine_decay_schedule(NAN, 1.0, 2, 10),
        lambda: fo.warmup_cosine_decay_schedule(0.0, 5e-324, 2, 10, end_value=1.0),
        lambda: fo.linear_schedule(1e308, -1e308, 10),
        lambda: fo.linear_schedule(1.0, 0.0, 10.0),
        lambda: fo.cosine_decay_schedule(1.0, 2**31),
        lambda: fo.linear_schedule(1.0, 0.0, 10, transition_begin=2**31 - 5),
        lambda: fo.dreamerv3_schedule(NAN),
        lambda: fo.dreamerv3_schedule(1e-3, warmup=2**31),
        lambda: fo.dreamerv3(warmup=2**31),
    ],
)
def test_schedule_arguments_that_give_nan_or_unreachable_steps_are_refused(
    build: Callable[[], Any],
) -> None:
    """Issue 14: NaN schedule arguments gave NaN learning rates; so did finite ones whose
    difference or ratio overflows; steps past an int32 counter are never reached."""
    with pytest.raises((ValueError, TypeError)):
        build()


def test_warmup_cosine_with_a_tensor_peak_needs_no_host_read() -> None:
    """A tensor ``peak_value`` was compared with 0 in Python (a host sync; an error under
    vmap)."""
    peaks = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)

    def at(peak: torch.Tensor) -> torch.Tensor:
        return fo.warmup_cosine_decay_schedule(0.0, peak, 2, 10, end_value=0.5)(6)

    got = torch.func.vmap(at)(peaks)
    for i, peak in enumerate(peaks.tolist()):
        want = fo.warmup_cosine_decay_schedule(0.0, peak, 2, 10, end_value=0.5 if peak else 0.0)(6)
        if peak:
            assert float(got[i]) == float(want), i
        else:
            assert float(got[i]) == 0.0


def test_clip_by_global_norm_bound_must_be_normal_float32() -> None:
    """``max_norm`` below float32's smallest normal was 0 in float32: 0 / 0 = NaN for a zero
    gradient."""
    with pytest.raises(ValueError, match="max_norm"):
        fo.clip_by_global_norm(1e-50)
    u, _ = fo.clip_by_global_norm(F32.tiny).update({"w": torch.zeros(3)}, fo.EmptyState())
    assert bool(torch.isfinite(u["w"]).all())


def test_wrappers_forward_exactly_their_inner_transforms_keywords() -> None:
    """``apply_if_finite``, ``MultiSteps`` and ``inject_hyperparams`` accept the keywords their
    inner transform takes (a user's ``rng=``) and refuse others, on every mini-step."""
    seen: list[Any] = []

    def noisy(rate: float = 1.0) -> fo.GradientTransformation:
        def update(updates: Any, state: Any, params: Any = None, *, rng: Any = None) -> Any:
            seen.append(rng)
            return updates, state

        return fo.GradientTransformation(lambda p: fo.EmptyState(), update)

    params = {"w": torch.ones(2)}
    grads = {"w": torch.ones(2)}
    wrapped = [  # (transform, whether its inner transform runs on steps 0 and 1)
        (fo.apply_if_finite(noisy(), 2), (True, True)),
        (fo.multi_steps(noisy(), 2), (False, True)),
        (fo.inject_hyperparams(noisy)(rate=0.5), (True, True)),
        (fo.chain(fo.apply_if_finite(noisy(), 2), fo.sgd(0.1)), (True, True)),
    ]
    for tx, runs in wrapped:
        state = tx.init(params)
        for step in range(2):
            with pytest.raises(TypeError, match="'inplace'"):
                tx.update(grads, state, params, inplace=True)
            seen.clear()
            _, state = tx.update(grads, state, params, rng=step)
            assert seen == ([step] if runs[step] else []), seen


def test_numpy_scalars_are_numbers() -> None:
    """numpy scalars (from configs, ``np.linspace`` sweeps) are numbers: checked like Python
    ones, and injected as hyperparameters (a float32 one as a float, not cast to int64)."""
    np = pytest.importorskip("numpy")
    fo.adam(np.float32(0.1), b1=np.float64(0.9))
    fo.MultiSteps(fo.sgd(0.1), np.int64(3))
    with pytest.raises(ValueError, match="every_k_schedule"):
        fo.MultiSteps(fo.sgd(0.1), np.int64(2**40))
    with pytest.raises(TypeError, match="learning_rate"):
        fo.sgd(np.bool_(True))
    state = fo.inject_hyperparams(fo.sgd)(np.float32(0.25)).init({"w": torch.ones(2)})
    assert state.hyperparams["learning_rate"].dtype == torch.float32
    assert float(state.hyperparams["learning_rate"]) == 0.25
