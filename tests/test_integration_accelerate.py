"""Our optimizers under Hugging Face accelerate's real ``Accelerator`` (CPU, tiny model).

``prepare(model, optimizer, scheduler)``, ``gradient_accumulation_steps=2``, bf16 autocast,
``clip_grad_norm_``, and ``save_state()``/``load_state()`` with accelerate's default safetensors
model file: a run resumed from a checkpoint ends with exactly the params and optimizer state of
an uninterrupted run. Each optimizer is a ``DreamerV3Optimizer`` or a ``TransformOptimizer`` of a
ready-made chain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bitwise
from torch import nn

import functional_opt as fo
from functional_opt.adapters import DreamerV3Optimizer, TransformOptimizer

accelerate = pytest.importorskip("accelerate")
accelerate_state = pytest.importorskip("accelerate.state")
safetensors_torch = pytest.importorskip("safetensors.torch")

BATCH, ACCUMULATE = 8, 2
MICRO_BATCHES = 8  # 4 optimizer steps; the checkpoint is taken after the first 4 micro-batches
CLIP = 0.5


def make_dreamerv3(params: Any) -> torch.optim.Optimizer:
    return DreamerV3Optimizer(params, lr=3e-2, warmup_steps=2)


def make_chain(params: Any) -> torch.optim.Optimizer:
    return TransformOptimizer(params, fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "dreamerv3": make_dreamerv3,
    "chain": make_chain,
}


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> Iterator[None]:
    """accelerate keeps its settings in process-wide singletons: start and end each test clean."""
    accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(MICRO_BATCHES):
        x = torch.rand(BATCH, 4, generator=g) * 4 - 2
        out.append((x, torch.sin(x[:, :1]) * x[:, 1:2] + x[:, 2:3]))
    return out


class Run:
    """A model, optimizer and scheduler prepared by a fresh ``Accelerator``."""

    def __init__(self, make_optimizer: Callable[[Any], torch.optim.Optimizer], seed: int) -> None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        self.accelerator = accelerate.Accelerator(
            cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATE
        )
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        # accelerate returns the outputs in float32: look inside for autocast's bfloat16
        self.output_dtypes: set[torch.dtype] = set()
        model[2].register_forward_hook(lambda _m, _i, out: self.output_dtypes.add(out.dtype))
        opt = make_optimizer(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
        self.model, self.opt, self.sched = self.accelerator.prepare(model, opt, sched)
        self.steps = 0

    def train(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        acc = self.accelerator
        for x, y in data:
            with acc.accumulate(self.model):
                out = self.model(x)
                acc.backward(nn.functional.mse_loss(out.float(), y))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(self.model.parameters(), CLIP)
                    self.steps += 1
                self.opt.step()  # accelerate skips it inside an accumulation window
                self.sched.step()
                self.opt.zero_grad()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_save_state_and_load_state_resume_exactly(kind: str, tmp_path: Path) -> None:
    make = OPTIMIZERS[kind]
    data = batches()
    straight = Run(make, seed=0)
    initial = [p.detach().clone() for p in straight.model.parameters()]
    straight.train(data)
    assert straight.steps == MICRO_BATCHES // ACCUMULATE
    assert straight.output_dtypes == {torch.bfloat16}  # autocast ran, params stay float32
    final = {k: v.detach().clone() for k, v in straight.model.state_dict().items()}
    final_opt = straight.opt.state_dict()
    final_lr = straight.opt.param_groups[0]["lr"]

    first = Run(make, seed=0)
    first.train(data[: MICRO_BATCHES // 2])
    ckpt = tmp_path / "ckpt"
    first.accelerator.save_state(ckpt)  # default: the model in safetensors
    saved = safetensors_torch.load_file(ckpt / "model.safetensors")
    assert set(saved) == set(first.model.state_dict())  # every param, none dropped as shared
    for name, value in first.model.state_dict().items():
        assert torch.equal(saved[name], value)

    resumed = Run(make, seed=1)  # other weights: the checkpoint must replace them
    resumed.accelerator.load_state(ckpt)
    resumed.train(data[MICRO_BATCHES // 2 :])
    assert resumed.steps == MICRO_BATCHES // ACCUMULATE // 2

    for name, value in resumed.model.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, final[name]), name
    assert any(not torch.equal(p, q) for p, q in zip(final.values(), initial, strict=True))
    assert_bitwise(resumed.opt.state_dict(), final_opt)
    assert resumed.opt.param_groups[0]["lr"] == final_lr
    assert final_lr == pytest.approx(1e-2 * (3 if kind == "dreamerv3" else 1) / 5, rel=1e-12)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_accumulated_steps_match_a_plain_loop(kind: str) -> None:
    """accelerate's accumulation, clipping and scheduler stepping give the same params as the
    same steps written by hand (mean of the micro-batch losses, clip_grad_norm_, autocast)."""
    make = OPTIMIZERS[kind]
    data = batches()
    run = Run(make, seed=0)
    run.train(data)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    for i in range(0, MICRO_BATCHES, ACCUMULATE):
        for x, y in data[i : i + ACCUMULATE]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            (nn.functional.mse_loss(out.float(), y) / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    for p, q in zip(run.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
