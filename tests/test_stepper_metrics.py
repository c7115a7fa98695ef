"""The stepper's optional DreamerV3 metrics against a float64 reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from functional_opt.adapters import DreamerV3Optimizer, MixedPrecisionOptimizationStepper


class Trainer:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def compute_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss_mse": ((self.model(x) - y) ** 2).mean()}


def _rms(xs: list[torch.Tensor]) -> float:
    flat = torch.cat([x.double().reshape(-1) for x in xs])
    return math.sqrt(float((flat**2).mean()))


def _window_grad(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The window's gradient (mean of the micro-batch losses), in float64."""
    ref = copy.deepcopy(model).double()
    loss = sum(((ref(x.double()) - y.double()) ** 2).mean() for x, y in batches) / len(batches)
    return list(torch.autograd.grad(loss, list(ref.parameters())))


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip_norm", [None, 0.05])
def test_dreamerv3_metrics_match_reference(accumulation: int, clip_norm: float | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = DreamerV3Optimizer(model.parameters(), lr=1e-2, warmup_steps=0)
    stepper = MixedPrecisionOptimizationStepper(
        opt, gradient_accumulation_steps=accumulation, clip_norm=clip_norm, dreamerv3_metrics=True
    )
    trainer = Trainer(model)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        batches = [
            (torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
            for _ in range(accumulation)
        ]
        grad = _window_grad(model, batches)
        seen: dict[int, torch.Tensor] = {}  # each param's .grad once backward accumulated it
        hooks = [
            p.register_post_accumulate_grad_hook(
                lambda q, j=j, out=seen: out.__setitem__(j, q.grad.clone())
            )
            for j, p in enumerate(model.parameters())
        ]
        before = [p.detach().clone() for p in model.parameters()]
        for batch in batches:
            metrics = stepper.step(trainer, batch)
        for hook in hooks:
            hook.remove()
        after = [p.detach() for p in model.parameters()]
        updates = [a - b for a, b in zip(after, before, strict=True)]  # as the stepper takes them
        assert float(metrics["updates"]) == step + 1
        # The metrics are RMS values of float32 tensors the test sees too (the window's
        # gradient as backward accumulated it, the updates as after - before, the params),
        # computed in float32: n squares and their sum (n + 1 roundings), the mean, the sqrt
        # and the cast (3), all terms positive: (n + 4) roundings relative to the value.
        n = sum(p.numel() for p in model.parameters())
        rel = (n + 4) * torch.finfo(torch.float32).eps
        window = [seen[j] for j in range(len(seen))]
        assert math.isclose(float(metrics["grad_rms"]), _rms(window), rel_tol=rel)
        assert math.isclose(float(metrics["update_rms"]), _rms(updates), rel_tol=rel)
        assert math.isclose(float(metrics["param_rms"]), _rms(after), rel_tol=rel)
        # and the window's gradient is the float64 one (backward's own rounding: loose check)
        assert math.isclose(_rms(window), _rms(grad), rel_tol=1e-3)
        assert float(metrics["grad_overflow"]) == 0.0 and float(metrics["update_rms"]) > 0


def test_metrics_are_off_by_default_and_validated() -> None:
    model = nn.Linear(2, 1)
    stepper = MixedPrecisionOptimizationStepper(torch.optim.SGD(model.parameters(), lr=0.1))
    out = stepper.step(Trainer(model), (torch.randn(4, 2), torch.randn(4, 1)))
    assert "update_rms" not in out and "grad_norm" in out
    with pytest.raises(ValueError, match="dreamerv3_metrics"):
        MixedPrecisionOptimizationStepper(
            torch.optim.SGD(model.parameters(), lr=0.1),
            dreamerv3_metrics=1,  # type: ignore[arg-type]
        )
