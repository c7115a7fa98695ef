"""Nothing half-done (issue 14, section 3): a checkpoint load, an ``add_param_group`` and an
optimizer step either happen whole or leave everything as it was; a compiled kernel that fails
is never run a second time after it may have written; bad stepper inputs get clear errors."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import functional_opt as fo
from functional_opt import _kernels
from functional_opt.adapters import (
    DreamerV3Optimizer,
    MixedPrecisionOptimizationStepper,
    TransformOptimizer,
)

# ------------------------------------------------------------------------------------------
# Helpers


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class DictTrainer:
    """A trainer whose ``compute_loss`` returns a plain dict (or whatever ``result`` makes)."""

    def __init__(self, model: nn.Module, result: Any = None) -> None:
        self.model = model
        self.result = result

    def compute_loss(self, batch: dict[str, Tensor]) -> Any:
        if self.result is not None:
            return self.result(self.model, batch)
        err = self.model(batch["x"]) - batch["y"]
        return {"loss_mse": err.pow(2).mean(), "td_error": err.detach().abs()}


def make_batches(n: int, seed: int = 1) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(6, 4, generator=g), "y": torch.randn(6, 2, generator=g)} for _ in range(n)
    ]


def optimizer_snapshot(opt: torch.optim.Optimizer) -> Any:
    """Everything an optimizer holds, copied (tensors cloned)."""
    return copy.deepcopy(
        (
            {id(p): dict(s) for p, s in opt.state.items()},
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        )
    )


def assert_same(a: Any, b: Any) -> None:
    """Bit-equal nested containers of tensors and plain values."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)  # NaN equals NaN here


def stepper_snapshot(stepper: MixedPrecisionOptimizationStepper) -> Any:
    scale = stepper.loss_scale
    return (
        optimizer_snapshot(stepper.optimizer),
        stepper.optimizer_step_count,
        stepper._skipped_nonfinite_steps,
        stepper._skipped_overflow_steps,
        scale.loss_scale.clone(),
        getattr(scale, "counter", torch.zeros(())).clone(),
        getattr(scale, "period", None),
        getattr(scale, "factor", None),
    )


# ------------------------------------------------------------------------------------------
# MixedPrecisionOptimizationStepper.load_state_dict: all or nothing, every value checked


@pytest.fixture(params=["adam", "transform"])
def stepper_pair(request: pytest.FixtureRequest) -> tuple[MixedPrecisionOptimizationStepper, Any]:
    """A float16 loss-scaled stepper after a few steps, and a checkpoint of an earlier point."""
    model = make_model()
    opt: torch.optim.Optimizer
    if request.param == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = TransformOptimizer(model.parameters(), fo.adam, lr=1e-2)
    stepper = MixedPrecisionOptimizationStepper(
        opt, mixed_precision=True, autocast_dtype=torch.float16
    )
    trainer = DictTrainer(model)
    batches = make_batches(5)
    for batch in batches[:2]:
        stepper.step(trainer, batch)
    checkpoint = copy.deepcopy(stepper.state_dict())
    for batch in batches[2:]:
        stepper.step(trainer, batch)
    return stepper, checkpoint


BAD_STEPPER_ENTRIES: list[tuple[str, Any]] = [
    ("optimizer_step_count", -1),
    ("optimizer_step_count", "3"),
    ("optimizer_step_count", 2.5),
    ("optimizer_step_count", 2**31),
    ("skipped_nonfinite_steps", -2),
    ("skipped_overflow_steps", None),
    ("skipped_overflow_steps", torch.tensor(1.5)),
    ("micro_step", -3),
]

BAD_SCALER_ENTRIES: list[tuple[str, Any]] = [
    ("scale", math.nan),
    ("scale", math.inf),
    ("scale", 0.0),
    ("scale", -1.0),
    ("scale", 1e39),  # overflows float32
    ("scale", "65536"),
    ("growth_interval", 0),
    ("growth_interval", -5),
    ("growth_interval", 2**31),
    ("growth_interval", 2.0),
    ("_growth_tracker", -1),
    ("_growth_tracker", 2000),  # must stay below growth_interval (2000)
    ("growth_factor", math.nan),
    ("growth_factor", 0.5),
]


@pytest.mark.parametrize(("key", "value"), BAD_STEPPER_ENTRIES, ids=repr)
def test_stepper_load_rejects_a_bad_counter_and_changes_nothing(
    stepper_pair: tuple[MixedPrecisionOptimizationStepper, Any], key: str, value: Any
) -> None:
    stepper, checkpoint = stepper_pair
    before = stepper_snapshot(stepper)
    bad = copy.deepcopy(checkpoint)
    bad[key] = value
    with pytest.raises(ValueError, match=key):
        stepper.load_state_dict(bad)
    assert_same(stepper_snapshot(stepper), before)  # the optimizer was not loaded either


@pytest.mark.parametrize(("key", "value"), BAD_SCALER_ENTRIES, ids=repr)
def test_stepper_load_rejects_a_bad_loss_scale_and_changes_nothing(
    stepper_pair: tuple[MixedPrecisionOptimizationStepper, Any], key: str, value: Any
) -> None:
    stepper, checkpoint = stepper_pair
    before = stepper_snapshot(stepper)
    bad = copy.deepcopy(checkpoint)
    bad["scaler"][key] = value
    if key == "growth_factor" and value == value:
        bad["scaler"]["backoff_factor"] = 1 / value  # consistent, but a shrinking "growth"
    with pytest.raises(ValueError):
        stepper.load_state_dict(bad)
    assert_same(stepper_snapshot(stepper), before)


def test_stepper_load_with_a_bad_optimizer_entry_changes_nothing(
    stepper_pair: tuple[MixedPrecisionOptimizationStepper, Any],
) -> None:
    stepper, checkpoint = stepper_pair
    before = stepper_snapshot(stepper)
    bad = copy.deepcopy(checkpoint)
    bad["optimizer_step_count"] = 17
    bad["optimizer"]["param_groups"] = bad["optimizer"]["param_groups"] * 2
    with pytest.raises(ValueError):
        stepper.load_state_dict(bad)
    assert_same(stepper_snapshot(stepper), before)


def test_stepper_load_of_a_good_checkpoint_takes_every_value(
    stepper_pair: tuple[MixedPrecisionOptimizationStepper, Any],
) -> None:
    stepper, checkpoint = stepper_pair
    tensors = copy.deepcopy(checkpoint)
    # Counters and the scale may come as 0-d tensors (e.g. through a tensor-only format).
    tensors["optimizer_step_count"] = torch.tensor(checkpoint["optimizer_step_count"])
    tensors["scaler"]["scale"] = torch.tensor(checkpoint["scaler"]["scale"])
    for sd in (checkpoint, tensors):
        stepper.load_state_dict(sd)
        assert stepper.optimizer_step_count == checkpoint["optimizer_step_count"]
        assert float(stepper.loss_scale.loss_scale) == checkpoint["scaler"]["scale"]
        assert stepper.state_dict()["scaler"] == checkpoint["scaler"]


# ------------------------------------------------------------------------------------------
# The stepper's inputs: compute_loss's result and device_type


@pytest.mark.parametrize(
    "result",
    [
        lambda model, batch: (model(batch["x"]) - batch["y"]).pow(2).mean(),  # a bare tensor
        lambda model, batch: [("loss", (model(batch["x"]) - batch["y"]).pow(2).mean())],
        lambda model, batch: {"loss_a": 1.0},  # a Python float
        lambda model, batch: {"loss_a": model(batch["x"]).sum(1)},  # not one element
        lambda model, batch: {"loss_a": torch.ones((), dtype=torch.int64)},
    ],
    ids=["tensor", "list", "float", "vector", "int-tensor"],
)
def test_compute_loss_must_return_a_mapping_of_loss_tensors(result: Any) -> None:
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="compute_loss"):
        stepper.step(DictTrainer(model, result), make_batches(1)[0])
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q) and p.grad is None


@pytest.mark.parametrize("device_type", ["foo", "cuda:0", "", "meta", 3])
def test_unknown_device_type_is_refused_at_construction(device_type: Any) -> None:
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="device_type"):
        MixedPrecisionOptimizationStepper(opt, device_type=device_type)


# ------------------------------------------------------------------------------------------
# _kernels.call: only a compile failure falls back, and only before anything was written


@pytest.fixture
def fresh_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "_COMPILED", {})
    monkeypatch.setattr(_kernels, "_FAILED", set())


def _add_kernel() -> Any:
    def add_into(x: Tensor, y: Tensor) -> None:  # a fresh function: its own compiled kernel
        x.copy_(x + y)

    return add_into


def test_a_bad_argument_surfaces_as_itself_and_keeps_the_kernel(fresh_kernels: None) -> None:
    fn = _add_kernel()
    x = torch.zeros(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "torch.compile failed" warning
        with pytest.raises(RuntimeError, match="size of tensor"):
            _kernels.call(fn, x, torch.ones(4))
        assert fn not in _kernels._FAILED
        assert torch.equal(x, torch.zeros(5))
        _kernels.call(fn, x, torch.ones(5))
    assert torch.equal(x, torch.ones(5))
    kernel = _kernels.compiled(fn, x, torch.ones(5))
    assert kernel._graphs == 1 and kernel.direct is not None  # compiled, in use


def test_an_error_after_the_compiled_code_ran_is_not_rerun(fresh_kernels: None) -> None:
    fn = _add_kernel()
    x, y = torch.zeros(5), torch.ones(5)
    _kernels.call(fn, x, y)
    kernel = _kernels.compiled(fn, x, y)
    direct = kernel.direct
    assert direct is not None

    class Failing:
        def __call__(self, args: tuple[Any, ...]) -> Any:
            direct(args)  # writes x ...
            raise RuntimeError("device lost")  # ... then fails

    kernel.direct = Failing()  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeError, match="device lost"):
            _kernels.call(fn, x, y)
    assert torch.equal(x, torch.full((5,), 2.0))  # applied once, not twice
    assert fn not in _kernels._FAILED


def test_a_compile_failure_falls_back_once_before_any_write(
    fresh_kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_backend(self: Any, gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(_kernels._Compiled, "_backend", broken_backend)
    fn = _add_kernel()
    x, y = torch.zeros(5), torch.ones(5)
    with pytest.warns(RuntimeWarning, match="torch.compile of add_into failed"):
        _kernels.call(fn, x, y)
    assert torch.equal(x, y)  # run once, eagerly
    assert fn in _kernels._FAILED
    _kernels.call(fn, x, y)  # eager from now on, without a warning
    assert torch.equal(x, 2 * y)


# ------------------------------------------------------------------------------------------
# TransformOptimizer: add_param_group and step are all or nothing


def two_group_optimizer(kind: str) -> tuple[torch.optim.Optimizer, nn.Module]:
    model = make_model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    opt: torch.optim.Optimizer
    if kind == "factory":
        opt = TransformOptimizer(groups, fo.adam, lr=1e-2)
    elif kind == "ready-made":
        opt = TransformOptimizer(groups, fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)))
    else:
        opt = DreamerV3Optimizer(groups, lr=1e-2, warmup_steps=0)
    return opt, model


def backward(model: nn.Module, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(6, 4, generator=g)).square().mean().backward()


def everything(opt: torch.optim.Optimizer, model: nn.Module) -> Any:
    return ([p.detach().clone() for p in model.parameters()], optimizer_snapshot(opt))


KINDS = ["factory", "ready-made", "dreamerv3"]


@pytest.mark.parametrize("kind", KINDS)
def test_add_param_group_with_a_bad_option_adds_nothing(kind: str) -> None:
    opt, model = two_group_optimizer(kind)
    bad_option = {"factory": "b1", "ready-made": "lr", "dreamerv3": "beta1"}[kind]
    extra = nn.Parameter(torch.ones(3))
    before = len(opt.param_groups)
    with pytest.raises(ValueError, match=bad_option):
        opt.add_param_group({"params": [extra], bad_option: 1.5 if kind != "ready-made" else -1})
    assert len(opt.param_groups) == before
    backward(model)
    opt.step()  # still works
    opt.add_param_group({"params": [extra]})  # and the param can still be added
    assert len(opt.param_groups) == before + 1


def test_add_param_group_with_a_bad_group_state_adds_nothing() -> None:
    opt, _ = two_group_optimizer("factory")
    extra = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="group-level state"):
        opt.add_param_group({"params": [extra], "transform_state": {"count": torch.zeros(3)}})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["option", "static option", "gradient shape"])
def test_a_step_failing_in_a_later_group_changes_no_group(kind: str, fault: str) -> None:
    opt, model = two_group_optimizer(kind)
    backward(model, seed=1)
    opt.step()
    backward(model, seed=2)
    last = opt.param_groups[1]
    if fault == "option":  # a value a scheduler or a user could set
        last["lr"] = -1.0
    elif fault == "static option":
        if kind != "factory":
            pytest.skip("only the factory has non-numeric options")
        last["nesterov"] = "yes"
    else:  # the gradient of the last param has the wrong shape (a reshaped .data)
        p = last["params"][-1]
        assert p.grad is not None
        p.grad.data = p.grad.data.reshape(-1, 1)
    before = everything(opt, model)
    with pytest.raises((ValueError, TypeError)):
        opt.step()
    assert_same(everything(opt, model), before)


def test_a_failing_update_leaves_no_new_state() -> None:
    """State created for params on their first gradient goes when their update fails."""

    calls = {"n": 0}

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("transform failed")
        return updates, state

    failing = fo.GradientTransformation(lambda params: fo.EmptyState(), update)
    model = make_model()
    opt = TransformOptimizer(
        model.parameters(), fo.chain(fo.scale_by_adam(), failing, fo.scale(-1e-2))
    )
    first = next(iter(model.parameters()))
    first.grad = torch.ones_like(first)
    opt.step()  # only the first param has state now
    assert list(opt.state) == [first]
    params = [p.detach().clone() for p in model.parameters()]
    backward(model)
    with pytest.raises(RuntimeError, match="transform failed"):
        opt.step()
    assert list(opt.state) == [first]  # the others' fresh state was dropped
    for p, q in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", KINDS)
def test_named_parameters_still_make_groups(kind: str) -> None:
    model = make_model()
    opt: torch.optim.Optimizer
    if kind == "factory":
        opt = TransformOptimizer(model.named_parameters(), fo.adam, lr=1e-2)
    elif kind == "ready-made":
        opt = TransformOptimizer(model.named_parameters(), fo.adam(1e-2))
    else:
        opt = DreamerV3Optimizer(model.named_parameters(), lr=1e-2, warmup_steps=0)
    names = [name for name, _ in model.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    backward(model)
    opt.step()
    opt.load_state_dict(opt.state_dict())
