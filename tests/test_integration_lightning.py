"""Our optimizers driven by PyTorch Lightning's real ``Trainer`` (CPU, tiny model, few steps).

``configure_optimizers`` returns a ``DreamerV3Optimizer``, or a ``TransformOptimizer`` of a
ready-made chain with a step-interval LR scheduler; training uses ``gradient_clip_val``,
``accumulate_grad_batches=2`` and ``precision="bf16-mixed"``; ``trainer.fit(ckpt_path=...)``
resumes to exactly the params and optimizer state of an uninterrupted run; and
``LearningRateMonitor`` logs the learning rate that drives our steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bitwise
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import functional_opt as fo
from functional_opt.adapters import DreamerV3Optimizer, TransformOptimizer

pl = pytest.importorskip("lightning.pytorch")
loggers = pytest.importorskip("lightning.pytorch.loggers")

# Lightning 2.6.6 still calls torch's deprecated pytree ``LeafSpec`` (only Lightning's code).
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"
    ":FutureWarning:lightning.pytorch.utilities._pytree"
)

BATCH, N_BATCHES, ACCUMULATE = 8, 4, 2
STEPS_PER_EPOCH = N_BATCHES // ACCUMULATE


def data() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(BATCH * N_BATCHES, 4, generator=g) * 4 - 2
    y = torch.sin(x[:, :1]) * x[:, 1:2] + x[:, 2:3]
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def make_dreamerv3(params: Any) -> Any:
    return DreamerV3Optimizer(params, lr=3e-2, warmup_steps=2)


def make_chain(params: Any) -> Any:
    opt = TransformOptimizer(params, fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


OPTIMIZERS: dict[str, Callable[[Any], Any]] = {"dreamerv3": make_dreamerv3, "chain": make_chain}


class Regression(pl.LightningModule):
    def __init__(self, make_optimizer: Callable[[Any], Any], seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.make_optimizer = make_optimizer
        self.output_dtypes: set[torch.dtype] = set()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.output_dtypes.add(out.dtype)
        return nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> Any:
        return self.make_optimizer(self.parameters())


class MemoryLogger(loggers.Logger):
    """Keeps the logged metrics in memory (no files)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.metrics.append((-1 if step is None else step, dict(metrics)))


def trainer(tmp_path: Path, epochs: int, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": epochs,
        "precision": "bf16-mixed",
        "gradient_clip_val": 0.5,
        "accumulate_grad_batches": ACCUMULATE,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_fit_resumes_from_a_checkpoint_exactly(kind: str, tmp_path: Path) -> None:
    make = OPTIMIZERS[kind]
    start = Regression(make)
    initial = [p.detach().clone() for p in start.parameters()]
    straight = Regression(make)
    run = trainer(tmp_path / "straight", epochs=4)
    run.fit(straight, data())
    assert run.global_step == 4 * STEPS_PER_EPOCH

    first = Regression(make)
    half = trainer(tmp_path / "first", epochs=2)
    half.fit(first, data())
    assert half.global_step == 2 * STEPS_PER_EPOCH
    ckpt = tmp_path / "half.ckpt"
    half.save_checkpoint(ckpt)

    resumed = Regression(make, seed=1)  # other weights: the checkpoint must replace them
    rest = trainer(tmp_path / "resumed", epochs=4)
    rest.fit(resumed, data(), ckpt_path=ckpt)
    assert rest.global_step == 4 * STEPS_PER_EPOCH

    for p, q, p0 in zip(straight.parameters(), resumed.parameters(), initial, strict=True):
        assert p.dtype == torch.float32 and not torch.equal(p, p0)  # trained in fp32
        assert torch.equal(p, q)
    assert straight.output_dtypes == resumed.output_dtypes == {torch.bfloat16}  # autocast ran
    assert_bitwise(run.optimizers[0].state_dict(), rest.optimizers[0].state_dict())
    if kind == "chain":
        lr = run.optimizers[0].param_groups[0]["lr"]
        assert lr == pytest.approx(1e-2 / (1 + 4 * STEPS_PER_EPOCH), rel=1e-12)
        assert rest.optimizers[0].param_groups[0]["lr"] == lr
    else:
        assert rest.optimizers[0].param_groups[0]["step"] == 4 * STEPS_PER_EPOCH


def test_gradient_clip_val_clips_what_the_optimizer_reads(tmp_path: Path) -> None:
    """Lightning clips the accumulated gradient (inside the step's closure) before we read it."""
    norms: list[torch.Tensor] = []

    class Recording(DreamerV3Optimizer):
        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            super().step()
            return loss

    model = Regression(lambda params: Recording(params, lr=1e-2, warmup_steps=0))
    trainer(tmp_path, epochs=1, gradient_clip_val=1e-3).fit(model, data())
    assert len(norms) == STEPS_PER_EPOCH
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6): the clipped norm is below max_norm,
    # while these gradients are far larger before clipping.
    assert all(float(norm) <= 1e-3 * (1 + 16 * torch.finfo(torch.float32).eps) for norm in norms)
    assert all(float(norm) > 0.5e-3 for norm in norms)


def test_learning_rate_monitor_logs_the_lr_that_drives_the_step(tmp_path: Path) -> None:
    """The scheduler's lr reaches LearningRateMonitor, and lr 0 freezes the params."""

    def make(params: Any) -> Any:
        opt = TransformOptimizer(params, fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 2 else 0.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    runs = {}
    for steps in (2, 4):
        logger = MemoryLogger()
        model = Regression(make)
        monitor = pl.callbacks.LearningRateMonitor(logging_interval="step")
        run = trainer(
            tmp_path / str(steps),
            epochs=-1,
            max_steps=steps,
            logger=logger,
            callbacks=[monitor],
            log_every_n_steps=1,
        )
        run.fit(model, data())
        runs[steps] = (model, logger)
    model2, _ = runs[2]
    model4, logger = runs[4]
    key = "lr-TransformOptimizer"
    lrs = [(step, metrics[key]) for step, metrics in logger.metrics if key in metrics]
    # logged at every batch, i.e. twice per optimizer step with accumulation
    assert sorted(set(lrs)) == [(0, 1e-2), (1, 1e-2), (2, 0.0), (3, 0.0)]
    assert len(lrs) == 4 * ACCUMULATE
    initial = Regression(make).parameters()
    for p2, p4, p0 in zip(model2.parameters(), model4.parameters(), initial, strict=True):
        assert not torch.equal(p2, p0)
        assert torch.equal(p2, p4)  # steps 3 and 4 ran with lr 0
