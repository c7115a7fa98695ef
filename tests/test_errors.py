"""Errors: bad hyperparameters raise ``ValueError`` naming the argument and the value, mismatched
trees name the first differing path, checkpoints with the wrong keys/shapes/dtypes are refused."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import functional_opt as fo
from functional_opt.loss_scale import DynamicLossScale, StaticLossScale

NAN, INF = math.nan, math.inf


def _sched(c: torch.Tensor) -> torch.Tensor:
    return c.to(torch.float64)


def _with(factory: Callable[..., Any], **defaults: Any) -> Callable[..., Any]:
    """``factory`` with some arguments filled in (overridable by keyword)."""
    return lambda **kwargs: factory(**{**defaults, **kwargs})


AGC = _with(fo.adaptive_grad_clip, clipping=0.1)
ADAM = _with(fo.adam, learning_rate=0.1)
ADAMW = _with(fo.adamw, learning_rate=0.1)
SGD = _with(fo.sgd, learning_rate=0.1)
FINITE = _with(fo.apply_if_finite, inner=fo.sgd(0.1))
MULTI = _with(fo.MultiSteps, opt=fo.sgd(0.1))
MULTI_FN = _with(fo.multi_steps, opt=fo.sgd(0.1))
D3_SCHED = _with(fo.dreamerv3_schedule, lr=0.1)
LINEAR = _with(fo.linear_schedule, init_value=1.0, end_value=0.0, transition_steps=5)
COSINE = _with(fo.cosine_decay_schedule, init_value=1.0, decay_steps=5)
WARMUP_COSINE = _with(
    fo.warmup_cosine_decay_schedule, init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=9
)

# (id, factory, argument name, bad value): the factory is called with ``{name: value}``.
BAD: list[tuple[str, Callable[..., Any], str, Any]] = [
    ("scale", fo.scale, "step_size", NAN),
    ("scale", fo.scale, "step_size", INF),
    ("scale", fo.scale, "step_size", "0.1"),
    ("scale_by_learning_rate", fo.scale_by_learning_rate, "learning_rate", NAN),
    ("scale_by_learning_rate", fo.scale_by_learning_rate, "learning_rate", -INF),
    ("scale_by_schedule", fo.scale_by_schedule, "step_size_fn", 0.1),
    ("clip", fo.clip, "max_delta", -1.0),
    ("clip", fo.clip, "max_delta", NAN),
    ("clip_by_global_norm", fo.clip_by_global_norm, "max_norm", 0.0),
    ("clip_by_global_norm", fo.clip_by_global_norm, "max_norm", -1.0),
    ("adaptive_grad_clip", AGC, "clipping", -0.1),
    ("adaptive_grad_clip", AGC, "eps", -1e-3),
    ("clip_by_agc", fo.clip_by_agc, "clip", -0.3),
    ("clip_by_agc", fo.clip_by_agc, "pmin", -1e-3),
    ("scale_by_rms", fo.scale_by_rms, "decay", 1.0),
    ("scale_by_rms", fo.scale_by_rms, "decay", -0.1),
    ("scale_by_rms", fo.scale_by_rms, "eps", -1e-8),
    ("scale_by_rms", fo.scale_by_rms, "initial_scale", -1.0),
    ("scale_by_adam", fo.scale_by_adam, "b1", 1.0),
    ("scale_by_adam", fo.scale_by_adam, "b1", True),
    ("scale_by_adam", fo.scale_by_adam, "b2", 1.5),
    ("scale_by_adam", fo.scale_by_adam, "b2", -0.5),
    ("scale_by_adam", fo.scale_by_adam, "eps", -1e-8),
    ("scale_by_adam", fo.scale_by_adam, "eps_root", -1e-8),
    ("trace", fo.trace, "decay", 1.0),
    ("trace", fo.trace, "decay", -0.9),
    ("ema", fo.ema, "decay", 1.0),
    ("ema", fo.ema, "decay", NAN),
    ("add_decayed_weights", fo.add_decayed_weights, "weight_decay", -0.1),
    ("adam", ADAM, "learning_rate", NAN),
    ("adam", ADAM, "b1", 1.0),
    ("adamw", ADAMW, "weight_decay", -1.0),
    ("sgd", SGD, "momentum", 1.0),
    ("apply_if_finite", FINITE, "max_consecutive_errors", -1),
    ("apply_if_finite", FINITE, "max_consecutive_errors", 1.5),
    ("MultiSteps", MULTI, "every_k_schedule", 0),
    ("MultiSteps", MULTI, "every_k_schedule", -2),
    ("MultiSteps", MULTI, "every_k_schedule", 2.5),
    ("multi_steps", MULTI_FN, "every_k_schedule", 0),
    ("dreamerv3", fo.dreamerv3, "lr", -1e-4),
    ("dreamerv3", fo.dreamerv3, "lr", NAN),
    ("dreamerv3", fo.dreamerv3, "agc", -0.3),
    ("dreamerv3", fo.dreamerv3, "pmin", -1e-3),
    ("dreamerv3", fo.dreamerv3, "beta1", 1.0),
    ("dreamerv3", fo.dreamerv3, "beta2", 1.5),
    ("dreamerv3", fo.dreamerv3, "eps", -1e-20),
    ("dreamerv3", fo.dreamerv3, "warmup", -1),
    ("dreamerv3", fo.dreamerv3, "warmup", 10.5),
    ("dreamerv3", fo.dreamerv3, "anneal", -1),
    ("dreamerv3", fo.dreamerv3, "weight_decay", -0.1),
    ("dreamerv3", fo.dreamerv3, "schedule", "exp"),
    ("dreamerv3_schedule", D3_SCHED, "schedule", "step"),
    ("constant_schedule", fo.constant_schedule, "value", NAN),
    ("linear_schedule", LINEAR, "init_value", NAN),
    ("linear_schedule", LINEAR, "end_value", INF),
    ("cosine_decay_schedule", COSINE, "decay_steps", 0),
    ("cosine_decay_schedule", COSINE, "decay_steps", -3),
    ("cosine_decay_schedule", COSINE, "init_value", NAN),
    ("cosine_decay_schedule", COSINE, "alpha", INF),
    ("warmup_cosine_decay_schedule", WARMUP_COSINE, "peak_value", NAN),
    ("warmup_cosine_decay_schedule", WARMUP_COSINE, "end_value", INF),
    ("StaticLossScale", StaticLossScale, "scale", 0.0),
    ("StaticLossScale", StaticLossScale, "scale", -2.0),
    ("StaticLossScale", StaticLossScale, "scale", INF),
    ("DynamicLossScale", DynamicLossScale, "scale", 0.0),
    ("DynamicLossScale", DynamicLossScale, "scale", NAN),
    ("DynamicLossScale", DynamicLossScale, "period", 0),
    ("DynamicLossScale", DynamicLossScale, "period", 2.0),
    ("DynamicLossScale", DynamicLossScale, "factor", 0.5),
    ("DynamicLossScale", DynamicLossScale, "factor", INF),
    ("DynamicLossScale", DynamicLossScale, "min_scale", 0.0),
    ("DynamicLossScale", DynamicLossScale, "min_scale", -1.0),
]


@pytest.mark.parametrize(
    ("factory", "name", "value"),
    [pytest.param(f, n, v, id=f"{i}-{n}={v!r}") for i, f, n, v in BAD],
)
def test_bad_hyperparameter_raises_naming_argument_and_value(
    factory: Callable[..., Any], name: str, value: Any
) -> None:
    pattern = rf"\b{re.escape(name)}\b.*{re.escape(repr(value))}"
    with pytest.raises(ValueError, match=pattern):
        factory(**{name: value})


@pytest.mark.parametrize(
    ("factory", "name", "value"),
    [
        pytest.param(f, n, v, id=f"{i}-{n}={v!r}")
        for i, f, n, v in BAD
        if isinstance(v, float) and n != "step_size_fn"
    ],
)
def test_tensor_hyperparameters_are_not_inspected(
    factory: Callable[..., Any], name: str, value: Any
) -> None:
    """A 0-d tensor (an injected hyperparameter) is accepted whatever it holds: reading it would
    sync with the device."""
    factory(**{name: torch.tensor(value)})


def test_good_boundary_values_are_accepted() -> None:
    fo.scale_by_rms(decay=0.0, eps=0.0, initial_scale=0.0)
    fo.scale_by_adam(b1=0.0, b2=0.0, eps=0.0, eps_root=0.0)
    fo.trace(0.0)
    fo.ema(0.0)
    fo.clip(0.0)
    fo.clip_by_agc(0.0, 0.0)
    fo.adaptive_grad_clip(0.0, 0.0)
    fo.add_decayed_weights(0.0)
    fo.apply_if_finite(fo.sgd(0.1), 0)
    fo.MultiSteps(fo.sgd(0.1), 1)
    fo.dreamerv3(lr=0.0, agc=0.0, warmup=0, anneal=0, weight_decay=0.0)
    fo.dreamerv3(schedule="cosine", warmup=0, anneal=1)
    fo.dreamerv3(schedule="linear", warmup=10, anneal=5)  # anneal <= warmup: constant lr
    DynamicLossScale(scale=1.0, period=1, factor=1.0, min_scale=1e-30)
    fo.linear_schedule(1.0, 0.0, 0)  # optax: a constant init_value


@pytest.mark.parametrize(("warmup", "anneal"), [(10, 10), (10, 5), (1000, 0), (0, 0)])
def test_dreamerv3_cosine_needs_anneal_after_warmup(warmup: int, anneal: int) -> None:
    with pytest.raises(ValueError, match=rf"anneal.*{anneal}.*warmup.*{warmup}"):
        fo.dreamerv3(schedule="cosine", warmup=warmup, anneal=anneal)


@pytest.mark.parametrize("decay_steps", [2, 1, 0])
def test_warmup_cosine_decay_needs_decay_after_warmup(decay_steps: int) -> None:
    with pytest.raises(ValueError, match=rf"decay_steps.*{decay_steps}.*warmup_steps.*2"):
        fo.warmup_cosine_decay_schedule(0.0, 1.0, 2, decay_steps)


def test_join_schedules_needs_one_more_schedule_than_boundaries() -> None:
    with pytest.raises(ValueError, match=r"2 schedules and 2 boundaries"):
        fo.join_schedules([fo.constant_schedule(1.0)] * 2, [3, 5])


def test_inject_hyperparams_unknown_static_args() -> None:
    with pytest.raises(ValueError, match=r"static_args \['nope'\].*adam"):
        fo.inject_hyperparams(fo.adam, static_args=("nope", "b1"))
    with pytest.raises(ValueError, match=r"static_args \['colour'\]"):
        fo.inject_hyperparams(fo.dreamerv3, static_args="colour")
    fo.inject_hyperparams(fo.dreamerv3, static_args="schedule")


def test_partition_label_without_transform() -> None:
    params = {"a": torch.ones(2), "b": torch.ones(3)}
    tx = fo.partition({"x": fo.sgd(0.1)}, {"a": "x", "b": "y"})
    with pytest.raises(ValueError, match=r"'y'.*no transform"):
        tx.init(params)
    with pytest.raises(ValueError, match=r"at least one transform"):
        fo.partition({}, {"a": "x"})


@pytest.mark.parametrize(
    ("mask", "where"),
    [
        ({"a": True, "b": False, "c": True}, r"\['c'\]"),
        ({"a": True}, r"\['b'\]"),
        ({"a": True, "b": [True, False, True]}, r"\['b'\]\[2\]"),
        ({"a": True, "b": (True, False)}, r"\['b'\]"),
    ],
)
def test_masked_mask_of_wrong_structure(mask: Any, where: str) -> None:
    params = {"a": torch.ones(2), "b": [torch.ones(3), torch.ones(())]}
    with pytest.raises(ValueError, match=rf"mask.*{where}"):
        fo.masked(fo.sgd(0.1, 0.9), mask).init(params)


def test_masked_mask_leaves_must_be_bools() -> None:
    with pytest.raises(ValueError, match=r"mask.*bools.*1"):
        fo.masked(fo.sgd(0.1), {"a": 1}).init({"a": torch.ones(2)})


def test_chain_and_named_chain_arguments() -> None:
    with pytest.raises(TypeError, match=r"argument 1 is a int"):
        fo.chain(fo.sgd(0.1), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unique.*'a', 'a'"):
        fo.named_chain(("a", fo.sgd(0.1)), ("a", fo.sgd(0.1)))
    with pytest.raises(TypeError, match=r"GradientTransformation"):
        fo.MultiSteps(lambda g: g, 2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Mismatched trees.

x = torch.ones(2)
PARAMS = {"a": x, "b": [x, x]}
MISMATCHED = [
    pytest.param({"a": x, "b": [x, x], "c": x}, r"\['c'\]", id="extra-key"),
    pytest.param({"b": [x, x]}, r"\['a'\]", id="missing-key"),
    pytest.param({"a": x, "aa": x, "b": [x, x]}, r"\['aa'\]", id="extra-key-in-the-middle"),
    pytest.param({"a": x, "b": (x, x)}, r"\['b'\]", id="tuple-for-list"),
    pytest.param({"a": x, "b": [x]}, r"\['b'\]\[1\]", id="short-list"),
    pytest.param({"a": x, "b": [x, x, x]}, r"\['b'\]\[2\]", id="long-list"),
    pytest.param({"a": [x], "b": [x, x]}, r"\['a'\]", id="leaf-vs-node"),
]

STATEFUL = {
    "scale_by_adam": fo.scale_by_adam,
    "scale_by_rms": fo.scale_by_rms,
    "trace": lambda: fo.trace(0.9),
    "ema": lambda: fo.ema(0.9),
    "dreamerv3": lambda: fo.dreamerv3(warmup=0),
    "multi_steps": lambda: fo.multi_steps(fo.sgd(0.1, 0.9), 2),
    "apply_if_finite": lambda: fo.apply_if_finite(fo.trace(0.9), 1),
    "masked": lambda: fo.masked(fo.trace(0.9), lambda p: fo.tree.map_params(lambda _: True, p)),
    "inject_hyperparams": lambda: fo.inject_hyperparams(fo.adam)(learning_rate=0.1),
}


def _first_line_names(err: pytest.ExceptionInfo[BaseException], where: str) -> None:
    message = str(err.value)
    assert re.search(r"first differ", message), message
    assert re.search(where, message), message


@pytest.mark.parametrize(("updates", "where"), MISMATCHED)
@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_updates_vs_state_mismatch_names_first_path(name: str, updates: Any, where: str) -> None:
    tx = STATEFUL[name]()
    state = tx.init(PARAMS)
    with pytest.raises(ValueError) as err:
        tx.update(updates, state, updates)
    _first_line_names(err, where)


NEEDS_PARAMS = {
    "adaptive_grad_clip": lambda: fo.adaptive_grad_clip(0.1),
    "clip_by_agc": lambda: fo.clip_by_agc(0.1),
    "add_decayed_weights": lambda: fo.add_decayed_weights(0.1),
    "dreamerv3": lambda: fo.dreamerv3(warmup=0, weight_decay=0.1),
    "masked": lambda: fo.masked(fo.sgd(0.1), {"a": True, "b": False}),
}


@pytest.mark.parametrize(("params", "where"), MISMATCHED)
@pytest.mark.parametrize("name", sorted(NEEDS_PARAMS))
def test_updates_vs_params_mismatch_names_first_path(name: str, params: Any, where: str) -> None:
    tx = NEEDS_PARAMS[name]()
    state = tx.init(PARAMS)
    with pytest.raises(ValueError) as err:
        tx.update(PARAMS, state, params)
    _first_line_names(err, where)


@pytest.mark.parametrize(("updates", "where"), MISMATCHED)
def test_apply_updates_mismatch_names_first_path(updates: Any, where: str) -> None:
    with pytest.raises(ValueError, match=r"updates.*structure of the params") as err:
        fo.apply_updates(PARAMS, updates)
    _first_line_names(err, where)


def test_root_level_list_vs_tuple() -> None:
    with pytest.raises(ValueError, match=r"first differ at <root>"):
        fo.apply_updates([x, x], (x, x))
    tx = fo.trace(0.9)
    with pytest.raises(ValueError, match=r"first differ at <root>"):
        tx.update((x, x), tx.init([x, x]))


@pytest.mark.parametrize("name", ["adaptive_grad_clip", "clip_by_agc", "add_decayed_weights"])
def test_missing_params_is_a_clear_error(name: str) -> None:
    tx = NEEDS_PARAMS[name]()
    with pytest.raises(ValueError, match=r"needs params"):
        tx.update(PARAMS, tx.init(PARAMS))


def test_param_none_where_update_present() -> None:
    tx = fo.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match=r"params is None at \['b'\]\[0\]"):
        tx.update(PARAMS, tx.init(PARAMS), {"a": x, "b": [None, x]})


# ---------------------------------------------------------------------------------------------
# state_from_dict.


def _trained_state() -> tuple[fo.GradientTransformation, Any, dict[str, torch.Tensor]]:
    tx = fo.chain(fo.clip_by_global_norm(1.0), fo.dreamerv3(1e-3, warmup=2))
    params = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    state = tx.init(params)
    _, state = tx.update({"w": torch.ones(3, 2), "b": torch.ones(2)}, state, params)
    return tx, state, fo.state_to_dict(state)


def _refused(template: Any, d: dict[str, torch.Tensor], err: type, pattern: str) -> None:
    before_t = {k: v.clone() for k, v in fo.state_to_dict(template).items()}
    before_d = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
    result: list[Any] = []
    with pytest.raises(err, match=pattern):
        result.append(fo.state_from_dict(template, d))
    assert not result
    after_t = fo.state_to_dict(template)
    assert set(after_t) == set(before_t)
    assert all(torch.equal(after_t[k], v) for k, v in before_t.items())
    assert set(d) == set(before_d)
    for k, v in before_d.items():
        assert torch.equal(d[k], v) if isinstance(v, torch.Tensor) else d[k] is v


def test_state_from_dict_missing_key() -> None:
    _, state, d = _trained_state()
    key = sorted(d)[1]
    del d[key]
    _refused(state, d, KeyError, rf"missing keys \[{re.escape(repr(key))}\]")


def test_state_from_dict_extra_key() -> None:
    _, state, d = _trained_state()
    d["1.0.nu.extra"] = torch.zeros(2)
    _refused(state, d, KeyError, r"unexpected keys \['1\.0\.nu\.extra'\]")


def test_state_from_dict_wrong_shape() -> None:
    _, state, d = _trained_state()
    key = next(k for k, v in sorted(d.items()) if v.dim() == 2)
    d[key] = torch.zeros(2, 3, dtype=d[key].dtype)
    _refused(state, d, ValueError, rf"{re.escape(key)}.*shape \(2, 3\).*expected \(3, 2\)")


def test_state_from_dict_wrong_dtype() -> None:
    _, state, d = _trained_state()
    key = next(k for k, v in sorted(d.items()) if v.is_floating_point())
    d[key] = d[key].double()
    _refused(state, d, ValueError, rf"{re.escape(key)}.*dtype torch\.float64.*torch\.float32")


def test_state_from_dict_counter_dtype() -> None:
    _, state, d = _trained_state()
    key = next(k for k in sorted(d) if k.endswith("count"))
    d[key] = d[key].long()
    _refused(state, d, ValueError, rf"{re.escape(key)}.*int64.*int32")


def test_state_from_dict_non_tensor() -> None:
    _, state, d = _trained_state()
    key = sorted(d)[0]
    d[key] = 3  # type: ignore[assignment]
    _refused(state, d, ValueError, rf"{re.escape(key)}.*not a tensor")


def test_state_from_dict_later_error_returns_nothing_partial() -> None:
    """Only the last key is wrong: nothing is built or returned for the earlier, valid ones."""
    _, state, d = _trained_state()
    last = sorted(d, key=list(fo.state_to_dict(state)).index)[-1]
    d[last] = torch.zeros(7, dtype=d[last].dtype)
    _refused(state, d, ValueError, re.escape(last))


def test_state_to_dict_rejects_non_tensor_leaves() -> None:
    with pytest.raises(TypeError, match=r"not a tensor"):
        fo.state_to_dict({"count": 3})
