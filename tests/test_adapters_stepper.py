"""MixedPrecisionOptimizationStepper: parity with torchrl 0.14.1's stepper, checkpoints, checks.

Only the tests that compare with torchrl's stepper need torchrl (they skip without it); the
others run with plain dicts of tensors where tensordict is missing too.
"""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_bitwise
from torch import nn

import functional_opt.adapters as adapters
from functional_opt.adapters import MixedPrecisionOptimizationStepper
from functional_opt.loss_scale import DynamicLossScale, NoOpLossScale

try:
    from tensordict import TensorDict
except ImportError:  # (an optional dependency, with torchrl: batches are then plain dicts)
    TensorDict = None


@pytest.fixture
def torchrl_stepper() -> Any:
    """torchrl's MixedPrecisionOptimizationStepper (its parity tests skip without torchrl)."""
    return pytest.importorskip("torchrl.trainers").MixedPrecisionOptimizationStepper


# Batches that make a step non-finite: a NaN loss, or a finite loss with NaN gradients.
NAN_LOSS, NAN_GRAD, HUGE = "nan_loss", "nan_grad", "huge"


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class FakeTrainer:
    """The two things a trainer must offer: ``compute_loss`` and ``register_module``."""

    def __init__(self, model: nn.Module, as_dict: bool = False) -> None:
        self.model = model
        self.as_dict = as_dict
        self.modules: dict[str, Any] = {}

    def compute_loss(self, batch: Any) -> Any:
        out = self.model(batch["x"])
        err = out - batch["y"]
        first = self.model[0].weight
        losses = {
            "loss_mse": err.pow(2).mean(),
            "loss_reg": 1e-3 * first.pow(2).sum(),
            "td_error": err.detach().abs(),  # non-scalar, not a loss: reported as its mean
        }
        kind = int(batch["kind"][0]) if "kind" in batch.keys() else 0  # noqa: SIM118
        if kind == 1:  # NaN loss
            losses["loss_mse"] = losses["loss_mse"] * float("nan")
        if kind == 2:  # finite loss (0), NaN gradient
            losses["loss_bad"] = torch.sqrt(0.0 * first.sum())
        return losses if self.as_dict or TensorDict is None else TensorDict(losses, [])

    def register_module(self, name: str, module: Any) -> None:
        self.modules[name] = module


def make_batches(n: int, special: dict[int, str] | None = None, seed: int = 1) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(6, 4, generator=g)
        y = torch.randn(6, 2, generator=g)
        kind = {NAN_LOSS: 1, NAN_GRAD: 2}.get((special or {}).get(i, ""), 0)
        if (special or {}).get(i) == HUGE:  # finite fp32 loss, overflows a scaled fp16 backward
            x, y = x * 3e3, y * 3e3
        batch = {"x": x, "y": y, "kind": torch.full((6,), kind)}
        out.append(batch if TensorDict is None else TensorDict(batch, [6]))
    return out


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def dreamer(model: nn.Module) -> torch.optim.Optimizer:
    dv3 = getattr(adapters, "DreamerV3Optimizer", None)
    if dv3 is None:
        pytest.skip("functional_opt.adapters.DreamerV3Optimizer is not available")
    opt: torch.optim.Optimizer = dv3(model.parameters(), lr=1e-2, warmup_steps=2)
    return opt


def run_parity(
    torchrl_stepper: Any,
    *,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer] = adam,
    n: int = 9,
    special: dict[int, str] | None = None,
    device: str = "cpu",
    **kwargs: Any,
) -> dict[str, int]:
    """Step torchrl's stepper and ours side by side; compare after every call."""
    ref_model, our_model = make_model().to(device), make_model().to(device)
    ref = torchrl_stepper(make_opt(ref_model), **kwargs)
    ours = MixedPrecisionOptimizationStepper(make_opt(our_model), **kwargs)
    ref_trainer, our_trainer = FakeTrainer(ref_model), FakeTrainer(our_model)
    seen = {"grad_norm": 0, "skips": 0}
    for i, batch in enumerate(make_batches(n, special)):
        batch = batch.to(device)
        scale_before = float(ref.scaler.get_scale()) if ref._use_scaler else 1.0
        expected = ref.step(ref_trainer, batch.clone())
        got = ours.step(our_trainer, batch.clone())
        # torchrl's stepper follows torch.optim and clip_grad_norm_: bit for bit
        assert_bitwise(list(our_model.parameters()), list(ref_model.parameters()), f"call {i}")
        assert isinstance(got, TensorDict)
        for key in expected.keys():  # noqa: SIM118 (a TensorDict iterates its batch dim)
            if key == "grad_norm" and kwargs.get("clip_norm", 1.0) is None:
                continue  # torchrl reports 0.0 without clipping; ours reports the norm
            assert key in got.keys(), f"call {i}: missing {key}"  # noqa: SIM118
            assert_bitwise(got[key], expected[key], f"call {i}: {key}")
        assert set(got.keys()) - set(expected.keys()) <= {
            "grad_norm",
            "grad_scale",
            "skipped_nonfinite_steps",
            "skipped_overflow_steps",
        }
        has_norm = "grad_norm" in got.keys()  # noqa: SIM118
        assert has_norm == ("grad_norm" in expected.keys()), i  # noqa: SIM118
        seen["grad_norm"] += has_norm
        assert ours.optimizer_step_count == ref.optimizer_step_count, i
        assert int(got["skipped_nonfinite_steps"]) == ref._skipped_nonfinite_steps, i
        assert float(got["grad_scale"]) == scale_before, i
        if ref._use_scaler:
            assert float(ours.loss_scale.loss_scale) == ref.scaler.get_scale(), i
        seen["skips"] = int(got["skipped_nonfinite_steps"]) + int(got["skipped_overflow_steps"])
    return seen


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("clip_norm", [1.0, 0.05, None])
def test_parity_fp32(steps: int, clip_norm: float | None, torchrl_stepper: Any) -> None:
    seen = run_parity(torchrl_stepper, gradient_accumulation_steps=steps, clip_norm=clip_norm)
    assert seen["grad_norm"] == 9 // steps


@pytest.mark.parametrize("steps", [1, 3])
def test_parity_bf16_autocast(steps: int, torchrl_stepper: Any) -> None:
    run_parity(
        torchrl_stepper,
        mixed_precision=True,
        autocast_dtype=torch.bfloat16,
        gradient_accumulation_steps=steps,
    )


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("clip_norm", [1.0, None])
def test_parity_fp16_loss_scaling(
    steps: int, clip_norm: float | None, torchrl_stepper: Any
) -> None:
    # torch.amp.GradScaler('cpu') runs, so torchrl's own fp16 path is the reference here;
    # the HUGE batch overflows the scaled fp16 backward: the step is skipped, the scale halves.
    seen = run_parity(
        torchrl_stepper,
        n=12,
        special={4 * steps - 1: HUGE},
        mixed_precision=True,
        autocast_dtype=torch.float16,
        gradient_accumulation_steps=steps,
        clip_norm=clip_norm,
    )
    assert seen["skips"] >= 1


@pytest.mark.parametrize(
    ("steps", "special"),
    [
        (3, {4: NAN_LOSS}),  # middle of the second window: it restarts at call 5
        (3, {2: NAN_LOSS, 6: NAN_LOSS}),  # last call of a window; first call of another
        (1, {1: NAN_LOSS, 3: NAN_GRAD}),
        (3, {5: NAN_GRAD}),
    ],
)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_parity_nonfinite(
    steps: int, special: dict[int, str], precision: str, torchrl_stepper: Any
) -> None:
    dtype = {"fp32": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    seen = run_parity(
        torchrl_stepper,
        n=12,
        special=special,
        mixed_precision=precision != "fp32",
        autocast_dtype=dtype,
        gradient_accumulation_steps=steps,
    )
    assert seen["skips"] == len(special)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_parity_cuda(dtype: torch.dtype, torchrl_stepper: Any) -> None:
    seen = run_parity(
        torchrl_stepper,
        n=12,
        special={3: HUGE, 4: NAN_LOSS, 9: NAN_GRAD},
        device="cuda",
        mixed_precision=True,
        autocast_dtype=dtype,
        gradient_accumulation_steps=3,
    )
    assert seen["skips"] >= 2


@pytest.mark.parametrize("steps", [1, 3])
def test_parity_with_dreamerv3_optimizer(steps: int, torchrl_stepper: Any) -> None:
    run_parity(
        torchrl_stepper,
        make_opt=dreamer,
        n=12,
        special={4: NAN_LOSS, 7: HUGE},
        mixed_precision=True,
        autocast_dtype=torch.float16,
        gradient_accumulation_steps=steps,
    )


def test_nonfinite_gradient_skipped_even_without_clipping() -> None:
    # torchrl only guards the step when clip_norm is set (it would write NaN into the params);
    # ours always skips a step whose gradient is non-finite.
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(adam(model), clip_norm=None)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = stepper.step(FakeTrainer(model), make_batches(1, {0: NAN_GRAD})[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert stepper.optimizer_step_count == 0 and int(metrics["skipped_nonfinite_steps"]) == 1
    assert float(metrics["grad_norm"]) == 0.0


def test_metrics_without_clipping_report_the_norm() -> None:
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(adam(model), clip_norm=None)
    batch = make_batches(1)[0]
    ref = make_model()
    FakeTrainer(ref).compute_loss(batch)["loss_mse"].add(
        FakeTrainer(ref).compute_loss(batch)["loss_reg"]
    ).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    got = stepper.step(FakeTrainer(model), batch)
    assert torch.equal(got["grad_norm"], expected)


def test_dict_losses_give_dict_metrics() -> None:
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(adam(model), gradient_accumulation_steps=2)
    trainer = FakeTrainer(model, as_dict=True)
    batches = make_batches(2)
    first = stepper.step(trainer, {"x": batches[0]["x"], "y": batches[0]["y"]})
    second = stepper.step(trainer, {"x": batches[1]["x"], "y": batches[1]["y"]})
    assert type(first) is dict and type(second) is dict
    assert "grad_norm" not in first and "grad_norm" in second
    for metrics in (first, second):
        assert all(v.ndim == 0 and not v.requires_grad for v in metrics.values())
        assert metrics["grad_scale"] == 1.0
    assert stepper.optimizer_step_count == 1
    assert all(p.grad is None for p in model.parameters())


def test_no_loss_key_raises() -> None:
    class NoLoss:
        def compute_loss(self, batch: Any) -> dict[str, torch.Tensor]:
            return {"value": model(batch).sum()}

    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(adam(model))
    with pytest.raises(RuntimeError, match="loss"):
        stepper.step(NoLoss(), torch.randn(2, 4))


def test_nonfinite_loss_logs_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(adam(model), gradient_accumulation_steps=2)
    trainer = FakeTrainer(model)
    batches = make_batches(4, {1: NAN_LOSS})
    before = [p.detach().clone() for p in model.parameters()]
    stepper.step(trainer, batches[0])
    with caplog.at_level(logging.WARNING, logger="functional_opt.adapters.stepper"):
        metrics = stepper.step(trainer, batches[1])
    assert "non-finite" in caplog.text
    assert int(metrics["skipped_nonfinite_steps"]) == 1
    assert "grad_norm" not in metrics.keys()  # noqa: SIM118
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    stepper.step(trainer, batches[2])
    assert stepper.optimizer_step_count == 0  # the window restarted after the NaN
    stepper.step(trainer, batches[3])
    assert stepper.optimizer_step_count == 1


def test_loss_scale_follows_gradscaler_rules() -> None:
    """The fp16 loss scale evolves as torch.amp.GradScaler('cpu') does (2**16, x2 after
    ``growth_interval`` finite steps, x0.5 on overflow), via DynamicLossScale.adjust."""
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(
        adam(model), mixed_precision=True, autocast_dtype=torch.float16
    )
    assert isinstance(stepper.loss_scale, DynamicLossScale)
    assert float(stepper.loss_scale.loss_scale) == 2.0**16
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    sd = stepper.state_dict()
    sd["scaler"] = scaler.state_dict() | {"scale": 2.0**16}
    stepper.load_state_dict(sd)  # growth_interval 3, as the reference scaler
    trainer = FakeTrainer(model)
    dummy = nn.Parameter(torch.zeros(1))  # drives the reference GradScaler through its API
    dummy_opt = torch.optim.SGD([dummy], lr=0.0)
    pattern = {2: HUGE, 3: HUGE, 9: HUGE}
    for batch in make_batches(14, pattern):
        stepper.step(trainer, batch)
        finite = not bool(batch["x"].abs().max() > 1e3)
        scaler.scale(dummy.sum()).backward()
        if not finite:
            dummy.grad.fill_(float("inf"))
        scaler.step(dummy_opt)
        scaler.update()
        dummy_opt.zero_grad()
        assert float(stepper.loss_scale.loss_scale) == scaler.get_scale()
        assert int(stepper.loss_scale.counter) == scaler._get_growth_tracker()
    assert stepper.state_dict()["scaler"]["_growth_tracker"] == scaler._get_growth_tracker()
    assert int(stepper.state_dict()["skipped_overflow_steps"]) == 3


def test_no_loss_scale_without_fp16() -> None:
    for kwargs in ({}, {"mixed_precision": True}, {"autocast_dtype": torch.float16}):
        stepper = MixedPrecisionOptimizationStepper(adam(make_model()), **kwargs)
        assert isinstance(stepper.loss_scale, NoOpLossScale)
        assert "scaler" not in stepper.state_dict()


def _roundtrip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("make_opt", [adam, dreamer], ids=["adam", "dreamerv3"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"gradient_accumulation_steps": 3},
        {"mixed_precision": True, "autocast_dtype": torch.float16, "clip_norm": None},
    ],
)
def test_checkpoint_roundtrip_is_bit_identical(
    kwargs: dict[str, Any], make_opt: Callable[[nn.Module], torch.optim.Optimizer]
) -> None:
    batches = make_batches(14, {2: HUGE, 4: NAN_LOSS, 9: NAN_GRAD})
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(make_opt(model), **kwargs)
    trainer = FakeTrainer(model)
    cut = 8  # a window boundary: the NaN loss at call 4 restarted the window at call 5
    for batch in batches[:cut]:
        stepper.step(trainer, batch)
    checkpoint = _roundtrip({"model": model.state_dict(), "stepper": stepper.state_dict()})
    for batch in batches[cut:]:
        stepper.step(trainer, batch)

    fresh = make_model(seed=123)
    fresh.load_state_dict(checkpoint["model"])
    resumed = MixedPrecisionOptimizationStepper(make_opt(fresh), **kwargs)
    resumed.load_state_dict(checkpoint["stepper"])
    for batch in batches[cut:]:
        resumed.step(FakeTrainer(fresh), batch)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
    assert resumed.optimizer_step_count == stepper.optimizer_step_count
    assert resumed.state_dict().keys() == stepper.state_dict().keys()
    for key in ("skipped_nonfinite_steps", "skipped_overflow_steps", "scaler"):
        assert resumed.state_dict().get(key) == stepper.state_dict().get(key)


def test_checkpoint_mid_window_raises() -> None:
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(adam(model), gradient_accumulation_steps=3)
    stepper.step(FakeTrainer(model), make_batches(1)[0])
    with pytest.raises(RuntimeError, match="mid-accumulation"):
        stepper.state_dict()
    sd = MixedPrecisionOptimizationStepper(adam(make_model())).state_dict()
    sd["micro_step"] = 4
    with pytest.raises(ValueError, match="mid-accumulation"):
        stepper.load_state_dict(sd)


def test_checkpoints_interchange_with_torchrl(torchrl_stepper: Any) -> None:
    kwargs: dict[str, Any] = {"mixed_precision": True, "autocast_dtype": torch.float16}
    batches = make_batches(8, {1: HUGE})
    ref_model, our_model = make_model(), make_model()
    ref = torchrl_stepper(adam(ref_model), **kwargs)
    ours = MixedPrecisionOptimizationStepper(adam(our_model), **kwargs)
    for batch in batches[:4]:
        ref.step(FakeTrainer(ref_model), batch)
        ours.step(FakeTrainer(our_model), batch)
    ref_sd, our_sd = _roundtrip(ref.state_dict()), _roundtrip(ours.state_dict())
    assert our_sd["scaler"] == ref_sd["scaler"]
    ours.load_state_dict(ref_sd)  # torchrl -> ours
    ref.load_state_dict(our_sd)  # ours -> torchrl
    for batch in batches[4:]:
        ref.step(FakeTrainer(ref_model), batch)
        ours.step(FakeTrainer(our_model), batch)
    for p, q in zip(ref_model.parameters(), our_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert ours.optimizer_step_count == ref.optimizer_step_count
    assert float(ours.loss_scale.loss_scale) == ref.scaler.get_scale()


def test_register_and_optimizer_step_count() -> None:
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(adam(model), gradient_accumulation_steps=2)
    trainer = FakeTrainer(model)
    stepper.register(trainer)
    stepper.register(trainer, name="other")
    assert trainer.modules == {"optimization_stepper": stepper, "other": stepper}
    for batch in make_batches(5):
        stepper.step(trainer, batch)
    assert stepper.optimizer_step_count == 2


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 2.0}, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"clip_norm": float("inf")}, "clip_norm"),
        ({"clip_norm": "1"}, "clip_norm"),
        ({"autocast_dtype": "float16"}, "autocast_dtype"),
        ({"autocast_dtype": torch.int8}, "autocast_dtype"),
        ({"mixed_precision": 1}, "mixed_precision"),
        ({"device_type": ""}, "device_type"),
    ],
)
def test_validation(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        MixedPrecisionOptimizationStepper(adam(make_model()), **kwargs)


def test_optimizer_must_be_an_optimizer() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        MixedPrecisionOptimizationStepper(list(make_model().parameters()))  # type: ignore[arg-type]


def test_device_type_defaults_to_the_params() -> None:
    assert MixedPrecisionOptimizationStepper(adam(make_model())).device_type == "cpu"
    model = copy.deepcopy(make_model())
    assert MixedPrecisionOptimizationStepper(adam(model), device_type="cuda").device_type == "cuda"
