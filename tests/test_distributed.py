"""Distributed training (issue 5): DDP and FSDP2 (``DTensor``) give the numbers of one process.

Two spawned jobs of 2 ranks each (CPU, gloo, a ``FileStore`` rendezvous in ``tmp_path``) do all
the distributed work, so process start-up is paid twice; each writes what it measured to
``rank<r>.pt`` and the tests below compare it with single-process runs done here:

* FSDP2 job: the three training configs (``DreamerV3Optimizer``; ``TransformOptimizer`` with
  ``clip_by_global_norm(0.1)`` + ``adam``; the stepper with accumulation 2 and clipping), the
  functional clipping transforms on ``DTensor`` inputs, an ``Inf`` gradient in one rank's shard
  (``apply_if_finite`` and the stepper's guard), and ``torch.distributed.checkpoint`` round trips
  (2 ranks -> 2 ranks, 1 process -> 2 ranks; 2 ranks -> 1 process is loaded here).
* DDP job: the three configs, and a non-finite loss on one rank (inside and at the end of an
  accumulation window) with the stepper.
"""

from __future__ import annotations

import datetime
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

import functional_opt as fo
from functional_opt import _lists
from functional_opt.adapters import (
    DreamerV3Optimizer,
    MixedPrecisionOptimizationStepper,
    TransformOptimizer,
)

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

WORLD = 2
STEPS = 10  # optimizer steps per training run
HALF = STEPS // 2  # checkpoint after this many steps
AGC = 0.05
MAX_NORM = 0.1
STEPPER_CLIP = 0.05
CONFIGS = ("dreamerv3", "transform", "stepper")
CHECKPOINTED = ("dreamerv3", "transform")
TOL = 1e-6
JOB_TIMEOUT = 180  # seconds for one spawned job (it takes about 10)

# ----------------------------------------------------------------------------------------------
# What every process runs (spawned ranks and this one alike).


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 3 output units: FSDP2 shards the last layer unevenly (2 rows and 1 row).
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def make_batches(n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def local(batch: tuple[Tensor, Tensor], rank: int, world: int) -> tuple[Tensor, Tensor]:
    """This rank's equal share of a global batch (data parallelism)."""
    x, y = batch
    return x.chunk(world)[rank], y.chunk(world)[rank]


def make_optimizer(config: str, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    if config == "dreamerv3":
        return DreamerV3Optimizer(params, lr=1e-2, agc=AGC, warmup_steps=0)
    if config == "transform":
        return TransformOptimizer(params, fo.chain(fo.clip_by_global_norm(MAX_NORM), fo.adam(1e-2)))
    return TransformOptimizer(params, fo.adam(1e-2))


class Trainer:
    """What the stepper needs: ``compute_loss`` (mean squared error of this rank's share)."""

    def __init__(self, model: nn.Module, rank: int, world: int) -> None:
        self.model, self.rank, self.world = model, rank, world
        self.poison = False  # make this rank's loss non-finite

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        x, y = local(batch, self.rank, self.world)
        loss = nn.functional.mse_loss(self.model(x), y)
        return {"loss": loss * float("inf") if self.poison else loss}


def full(x: Tensor) -> Tensor:
    """The whole tensor (gathered from the shards of a ``DTensor``)."""
    out = x.full_tensor() if isinstance(x, DTensor) else x
    return out.detach().clone()


def full_params(model: nn.Module) -> dict[str, Tensor]:
    return {k.removeprefix("module."): full(p) for k, p in model.named_parameters()}


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Params, per-parameter optimizer state (whole tensors) and group-level entries."""
    out: dict[str, Any] = {f"param/{k}": v for k, v in full_params(model).items()}
    for name, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            out[f"state/{name.removeprefix('module.')}/{key}"] = full(value)
    for i, group in enumerate(opt.param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, dict):
                for sub, v in value.items():
                    out[f"group{i}/{key}/{sub}"] = full(v)
            else:
                out[f"group{i}/{key}"] = value
    return out


def clip_activity(params: list[Tensor]) -> tuple[float, float]:
    """Before a step: the global gradient norm and the largest per-tensor ratio
    ``||g|| / (agc max(pmin, ||p||))`` (> 1: DreamerV3's clipping is active). Full values."""
    grads = [p.grad for p in params if p.grad is not None]
    gnorms = torch.stack(_lists.norms(grads))
    pnorms = torch.stack(_lists.norms([p.detach() for p in params]))
    ratio = gnorms / (AGC * torch.clamp(pnorms, min=1e-3))
    return float(_lists.global_norm(grads)), float(ratio.max())


def train(
    config: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[Tensor, Tensor]],
    rank: int,
    world: int,
) -> list[tuple[float, float]]:
    """Optimizer steps on ``batches`` (two batches per step for the stepper); returns the clip
    activity of every step (for the stepper: its ``grad_norm`` metric, pre-clip)."""
    params = list(model.parameters())
    log: list[tuple[float, float]] = []
    if config == "stepper":
        stepper = MixedPrecisionOptimizationStepper(
            opt, gradient_accumulation_steps=2, clip_norm=STEPPER_CLIP
        )
        trainer = Trainer(model, rank, world)
        for batch in batches:
            metrics = stepper.step(trainer, batch)
            if "grad_norm" in metrics:
                log.append((float(metrics["grad_norm"]), 0.0))
        assert stepper.optimizer_step_count == len(batches) // 2
        return log
    for batch in batches:
        x, y = local(batch, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        log.append(clip_activity(params))
        opt.step()
        opt.zero_grad()
    return log


def batches_for(config: str) -> list[tuple[Tensor, Tensor]]:
    return make_batches(2 * STEPS if config == "stepper" else STEPS)


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# DCP without an initialized process group works in one process, and says so.
_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _ONE_PROCESS)
        dcp.save(state, checkpoint_id=str(path))


def dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """The load workflow: state dicts of the new model and optimizer (sharded or not) as the
    template, ``dcp.load`` reshards the saved tensors into them, then set them."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _ONE_PROCESS)
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _init(rank: int, world: int, store: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),  # a rank that skips a collective fails, not hangs
    )


def _finish(out: dict[str, Any], path: Path) -> None:
    """Write this rank's results (atomically: the test reads them once both exist), then leave
    the process group."""
    torch.save(out, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    dist.barrier()
    dist.destroy_process_group()


class _InfGrad(torch.autograd.Function):
    """Identity whose backward puts an ``Inf`` into the gradient's first element."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad


# ----------------------------------------------------------------------------------------------
# The FSDP2 job.


def _fsdp_functional(mesh: DeviceMesh) -> dict[str, float]:
    """Max difference between each clipping transform on ``DTensor``s and on whole tensors."""
    torch.manual_seed(3)
    shapes = [(6, 3), (5,), (4, 2, 3, 3), (3, 7)]
    placements = [[Shard(0)], [Shard(0)], [Shard(0)], [Shard(1)]]
    params = [torch.randn(s) for s in shapes]
    grads = [3 * torch.randn(s) for s in shapes]
    dparams = [distribute_tensor(p, mesh, pl) for p, pl in zip(params, placements, strict=True)]
    dgrads = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, placements, strict=True)]
    out = {}
    for name, tx in {
        "clip_by_agc": fo.clip_by_agc(0.05),
        "adaptive_grad_clip": fo.adaptive_grad_clip(0.05),
        "clip_by_global_norm": fo.clip_by_global_norm(0.5),
        "dreamerv3": fo.dreamerv3(1e-2, warmup=0),
    }.items():
        want, _ = tx.update(grads, tx.init(params), params)
        got, _ = tx.update(dgrads, tx.init(dparams), dparams)
        assert all(isinstance(u, DTensor) for u in got)
        assert [u.placements for u in got] == [g.placements for g in dgrads], name
        unchanged = max(float((w - g).abs().max()) for w, g in zip(want, grads, strict=True))
        assert unchanged > 0.1, f"{name} did not clip"
        out[name] = max(float((full(a) - b).abs().max()) for a, b in zip(got, want, strict=True))
    norm = _lists.global_norm(dgrads)
    assert type(norm) is Tensor  # a full value, not a partial DTensor
    out["global_norm"] = float((norm - _lists.global_norm(grads)).abs())
    bad = [g.clone() for g in dgrads]
    if dist.get_rank() == 1:
        bad[2].to_local().view(-1)[0] = float("inf")  # one element of one rank's shard
    out["all_finite_bad"] = float(fo.loss_scale.all_finite(bad))
    out["all_finite_good"] = float(fo.loss_scale.all_finite(dgrads))
    return out


def _fsdp_inf_transform(mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """``apply_if_finite``: an Inf in rank 1's shard of one gradient skips the step on both."""
    model = shard_model(make_model(), mesh)
    tx = fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(MAX_NORM), fo.adam(1e-2)), 3)
    opt = TransformOptimizer(model.parameters(), tx)
    batches = make_batches(3)
    snapshots = []
    for i, batch in enumerate(batches):
        x, y = local(batch, rank, WORLD)
        nn.functional.mse_loss(model(x), y).backward()
        if i == 1 and rank == 1:
            model[0].weight.grad.to_local().view(-1)[-1] = float("inf")
        opt.step()
        opt.zero_grad()
        snapshots.append(full_state(model, opt))
    return {"snapshots": snapshots}


def _fsdp_inf_stepper(mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """The stepper's guard: rank 1's backward puts an Inf into the first layer's gradient, which
    after the reduce-scatter is in rank 0's shard only; both ranks skip the step."""
    model = shard_model(make_model(), mesh)
    opt = DreamerV3Optimizer(model.parameters(), lr=1e-2, agc=AGC, warmup_steps=0)
    stepper = MixedPrecisionOptimizationStepper(opt, gradient_accumulation_steps=2, clip_norm=1.0)
    trainer = Trainer(model, rank, WORLD)
    inject = {"on": False}

    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return _InfGrad.apply(output) if inject["on"] else output  # type: ignore[no-any-return]

    model[0].register_forward_hook(hook)
    snapshots = []
    for i, batch in enumerate(make_batches(6)):
        inject["on"] = i == 3 and rank == 1  # the last call of the second window
        metrics = stepper.step(trainer, batch)
        if i % 2 == 1:
            snapshots.append(full_state(model, opt))
    return {
        "snapshots": snapshots,
        "skipped": int(metrics["skipped_nonfinite_steps"]),
        "steps": stepper.optimizer_step_count,
    }


def _fsdp_checkpoints(mesh: DeviceMesh, rank: int, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in CHECKPOINTED:
        batches = batches_for(config)
        # 2 ranks -> 2 ranks: save after HALF steps, load into a new model and optimizer.
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        train(config, model, opt, batches[:HALF], rank, WORLD)
        dcp_save(model, opt, root / f"fsdp_{config}")
        out[f"saved_{config}"] = full_state(model, opt)
        gathered = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out[f"gathered_{config}"] = {
            "model": get_model_state_dict(model, options=gathered),
            "optim": get_optimizer_state_dict(model, opt, options=gathered),
        }
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        dcp_load(model, opt, root / f"fsdp_{config}")
        out[f"loaded_{config}"] = full_state(model, opt)
        train(config, model, opt, batches[HALF:], rank, WORLD)
        out[f"resumed_{config}"] = full_state(model, opt)
        # 1 process -> 2 ranks: the checkpoint this test process saved before the job.
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        dcp_load(model, opt, root / f"single_{config}")
        out[f"loaded_single_{config}"] = full_state(model, opt)
        train(config, model, opt, batches[HALF:], rank, WORLD)
        out[f"resumed_single_{config}"] = full_state(model, opt)
    return out


def _fsdp_job(rank: int, world: int, store: str, root: str) -> None:
    _init(rank, world, store)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for config in CONFIGS:
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        out[f"log_{config}"] = train(config, model, opt, batches_for(config), rank, world)
        out[f"final_{config}"] = full_state(model, opt)
        if config == "dreamerv3":
            states = next(iter(opt.state.values()))
            out["state_placements"] = {k: v.placements for k, v in states.items()}
    out["functional"] = _fsdp_functional(mesh)
    out["inf_transform"] = _fsdp_inf_transform(mesh, rank)
    out["inf_stepper"] = _fsdp_inf_stepper(mesh, rank)
    out.update(_fsdp_checkpoints(mesh, rank, Path(root)))
    _finish(out, Path(root) / f"fsdp_rank{rank}.pt")


# ----------------------------------------------------------------------------------------------
# The DDP job.


def _ddp_nonfinite(rank: int) -> dict[str, Any]:
    """A non-finite loss on rank 1 only: inside a window (no rank back-propagates: the window is
    dropped everywhere) and on a window's last call (the all-reduced gradient is non-finite)."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer("stepper", ddp.parameters())
    stepper = MixedPrecisionOptimizationStepper(opt, gradient_accumulation_steps=2, clip_norm=1.0)
    trainer = Trainer(ddp, rank, WORLD)
    snapshots = []
    for i, batch in enumerate(make_batches(8)):
        trainer.poison = rank == 1 and i in (2, 6)  # call 2 opens a window, call 6 closes one
        metrics = stepper.step(trainer, batch)
        snapshots.append(full_state(ddp, opt))
    return {
        "snapshots": snapshots,
        "skipped": int(metrics["skipped_nonfinite_steps"]),
        "steps": stepper.optimizer_step_count,
    }


def _ddp_job(rank: int, world: int, store: str, root: str) -> None:
    _init(rank, world, store)
    out: dict[str, Any] = {}
    for config in CONFIGS:
        out.update(_ddp_train(config, rank, world))
    out["nonfinite"] = _ddp_nonfinite(rank)
    _finish(out, Path(root) / f"ddp_rank{rank}.pt")


def _ddp_train(config: str, rank: int, world: int) -> dict[str, Any]:
    # In a function: the DDP wrapper (whose reducer holds the process group) is gone before
    # the process group is destroyed.
    ddp = nn.parallel.DistributedDataParallel(make_model())
    opt = make_optimizer(config, ddp.parameters())
    log = train(config, ddp, opt, batches_for(config), rank, world)
    return {f"log_{config}": log, f"final_{config}": full_state(ddp, opt)}


# ----------------------------------------------------------------------------------------------
# Fixtures: single-process references, then one spawned job per engine.


def spawn(job: Callable[..., None], root: Path, name: str) -> list[dict[str, Any]]:
    """Run ``job`` on WORLD spawned ranks; a rank's exception fails the test with its traceback.

    A job that outlives JOB_TIMEOUT is killed: it fails the test, unless every rank had already
    written its results (then it hung on exit, in torch's gloo teardown: ``ProcessGroupGloo``'s
    destructor can deadlock with its worker thread over the GIL; not what is tested here).
    """
    files = [root / f"{name}_rank{r}.pt" for r in range(WORLD)]
    context = mp.start_processes(
        job, args=(WORLD, str(root / f"{name}.store"), str(root)), nprocs=WORLD, join=False
    )
    deadline = time.monotonic() + JOB_TIMEOUT
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            if not all(f.exists() for f in files):
                pytest.fail(f"the {name} job did not finish within {JOB_TIMEOUT} s")
            break
    return [torch.load(f, weights_only=False) for f in files]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def single(root: Path) -> dict[str, Any]:
    """One process, no wrapper: the reference runs, and a checkpoint after HALF steps."""
    out: dict[str, Any] = {}
    for config in CONFIGS:
        model = make_model()
        opt = make_optimizer(config, model.parameters())
        out[f"log_{config}"] = train(config, model, opt, batches_for(config), 0, 1)
        out[f"final_{config}"] = full_state(model, opt)
    for config in CHECKPOINTED:
        model = make_model()
        opt = make_optimizer(config, model.parameters())
        train(config, model, opt, batches_for(config)[:HALF], 0, 1)
        dcp_save(model, opt, root / f"single_{config}")
        out[f"saved_{config}"] = full_state(model, opt)
    return out


@pytest.fixture(scope="module")
def fsdp(root: Path, single: dict[str, Any]) -> list[dict[str, Any]]:
    return spawn(_fsdp_job, root, "fsdp")


@pytest.fixture(scope="module")
def ddp(root: Path) -> list[dict[str, Any]]:
    return spawn(_ddp_job, root, "ddp")


def max_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> float:
    keys = [k for k in a if k.startswith(prefix) and isinstance(a[k], Tensor)]
    assert keys and set(keys) == {k for k in b if k.startswith(prefix) and isinstance(b[k], Tensor)}
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# ----------------------------------------------------------------------------------------------
# 1. FSDP2 and 2. DDP give the numbers of one process.


def test_clipping_is_active(single: dict[str, Any]) -> None:
    assert max(ratio for _, ratio in single["log_dreamerv3"]) > 1  # agc clips some tensor
    assert max(norm for norm, _ in single["log_transform"]) > MAX_NORM
    assert max(norm for norm, _ in single["log_stepper"]) > STEPPER_CLIP


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_matches_single_process(
    engine: str, config: str, single: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    ranks = request.getfixturevalue(engine)
    want = single[f"final_{config}"]
    for result in ranks:
        got = result[f"final_{config}"]
        assert max_diff(got, want, "param/") < TOL
        assert max_diff(got, want, "state/") < TOL
        # Norms (global, per tensor; the stepper's grad_norm) are of whole tensors on every rank.
        logged = torch.tensor(result[f"log_{config}"])
        assert torch.allclose(logged, torch.tensor(single[f"log_{config}"]), rtol=1e-5, atol=0)
    assert_identical(ranks[0][f"final_{config}"], ranks[1][f"final_{config}"])


def test_fsdp_state_is_sharded_like_the_params(fsdp: list[dict[str, Any]]) -> None:
    assert fsdp[0]["state_placements"] == {"rms": (Shard(0),), "momentum": (Shard(0),)}


def test_transforms_on_dtensors_use_whole_tensor_norms(fsdp: list[dict[str, Any]]) -> None:
    for result in fsdp:
        out = result["functional"]
        for name in ("clip_by_agc", "adaptive_grad_clip", "clip_by_global_norm", "dreamerv3"):
            assert out[name] < TOL, name
        assert out["global_norm"] < TOL
        assert out["all_finite_bad"] == 0.0 and out["all_finite_good"] == 1.0


# ----------------------------------------------------------------------------------------------
# 3. A non-finite gradient (or loss) on one rank skips the step on every rank.


def test_fsdp_inf_in_one_shard_skips_everywhere(fsdp: list[dict[str, Any]]) -> None:
    for result in fsdp:
        before, skipped, after = result["inf_transform"]["snapshots"]
        assert_identical(
            {k: v for k, v in before.items() if not k.startswith("group")},
            {k: v for k, v in skipped.items() if not k.startswith("group")},
        )
        assert int(skipped["group0/transform_state/notfinite_count"]) == 1
        assert int(after["group0/transform_state/notfinite_count"]) == 0
        assert max_diff(after, before, "param/") > 0  # training goes on
    assert_identical(
        fsdp[0]["inf_transform"]["snapshots"][2], fsdp[1]["inf_transform"]["snapshots"][2]
    )
    for result in fsdp:
        window1, window2, window3 = result["inf_stepper"]["snapshots"]
        assert_identical(window1, window2)  # the second window's step was skipped
        assert max_diff(window3, window2, "param/") > 0
        assert result["inf_stepper"]["skipped"] == 1 and result["inf_stepper"]["steps"] == 2
    assert_identical(fsdp[0]["inf_stepper"]["snapshots"][2], fsdp[1]["inf_stepper"]["snapshots"][2])


def test_ddp_nonfinite_loss_on_one_rank_skips_everywhere(ddp: list[dict[str, Any]]) -> None:
    a, b = ddp[0]["nonfinite"], ddp[1]["nonfinite"]
    for result in (a, b):
        snaps = result["snapshots"]
        assert_identical(snaps[1], snaps[2])  # call 2: window dropped, nothing changed
        assert_identical(snaps[4], snaps[6])  # window of calls 5-6: step skipped
        assert max_diff(snaps[4], snaps[1], "param/") > 0  # window of calls 3-4 stepped
        assert result["skipped"] == 2 and result["steps"] == 2
    for sa, sb in zip(a["snapshots"], b["snapshots"], strict=True):
        assert_identical(sa, sb)  # the ranks never diverge


# ----------------------------------------------------------------------------------------------
# 4. torch.distributed.checkpoint round trips.


@pytest.mark.parametrize("config", CHECKPOINTED)
def test_dcp_two_ranks_to_two_ranks(config: str, fsdp: list[dict[str, Any]]) -> None:
    for result in fsdp:
        assert_identical(result[f"loaded_{config}"], result[f"saved_{config}"])
        # Continued training is bit-identical to the uninterrupted run.
        assert_identical(result[f"resumed_{config}"], result[f"final_{config}"])


@pytest.mark.parametrize("config", CHECKPOINTED)
def test_dcp_one_process_to_two_ranks(
    config: str, fsdp: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    for result in fsdp:
        assert_identical(result[f"loaded_single_{config}"], single[f"saved_{config}"])
        assert max_diff(result[f"resumed_single_{config}"], single[f"final_{config}"]) < TOL


@pytest.mark.parametrize("config", CHECKPOINTED)
def test_dcp_two_ranks_to_one_process(
    config: str, fsdp: list[dict[str, Any]], single: dict[str, Any], root: Path
) -> None:
    saved = fsdp[0]
    batches = batches_for(config)[HALF:]
    model = make_model()
    opt = make_optimizer(config, model.parameters())
    dcp_load(model, opt, root / f"fsdp_{config}")
    assert_identical(full_state(model, opt), saved[f"saved_{config}"])
    train(config, model, opt, batches, 0, 1)
    resumed = full_state(model, opt)
    # Bit-identical to continuing in one process from the gathered (full) state dicts.
    ref_model = make_model()
    ref_opt = make_optimizer(config, ref_model.parameters())
    gathered = saved[f"gathered_{config}"]
    full_options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(ref_model, gathered["model"], options=full_options)
    set_optimizer_state_dict(ref_model, ref_opt, gathered["optim"], options=full_options)
    train(config, ref_model, ref_opt, batches, 0, 1)
    assert_identical(resumed, full_state(ref_model, ref_opt))
    assert max_diff(resumed, single[f"final_{config}"]) < TOL


def test_stepper_process_group_option() -> None:
    opt = TransformOptimizer(make_model().parameters(), fo.adam(1e-2))
    assert MixedPrecisionOptimizationStepper(opt).process_group == "auto"
    assert MixedPrecisionOptimizationStepper(opt, process_group=None).process_group is None
    with pytest.raises(ValueError, match="process_group"):
        MixedPrecisionOptimizationStepper(opt, process_group="world")  # type: ignore[arg-type]
