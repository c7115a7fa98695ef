"""Distributed training (issues 5 and 18): DDP, FSDP2 and HSDP (``DTensor``) give the numbers of
one process; gradient accumulation synchronises once per optimizer step.

Three spawned jobs (CPU, gloo, a ``FileStore`` rendezvous in ``tmp_path``; the ranks fork from a
server process that imported this module once) do all the distributed work; each rank writes
what it measured to ``<job>_rank<r>.pt`` and the tests below compare it with single-process runs
done here. Every job runs under a deadline (``JOB_TIMEOUT``), so a hung rank fails its tests.

* HSDP job (4 ranks, a 2 x 2 mesh): the two checkpointed configs, then a DCP checkpoint.
* FSDP2 job (2 ranks): the three training configs (``DreamerV3Optimizer``; ``TransformOptimizer``
  with ``clip_by_global_norm(0.1)`` + ``adamw`` decaying the matrices only; the stepper with
  accumulation 2 and clipping),
  the functional clipping transforms on ``DTensor`` inputs, an ``Inf`` gradient in one rank's
  shard (``apply_if_finite`` and the stepper's guard), ``torch.distributed.checkpoint`` round
  trips (2 ranks -> 2 ranks, 1 process -> 2 ranks, the HSDP job's 4 ranks -> 2 ranks; 2 ranks ->
  1 process is loaded here), accumulation with and without gradient sync (counted), fp16 loss
  scaling with an overflow on one rank, and the collectives of one optimizer step.
* DDP job (2 ranks): the three configs, a non-finite loss on one rank (inside and at the end of
  an accumulation window) with the stepper, and accumulation with ``no_sync`` and with a
  trainer's ``data_parallel_context``.

Collectives are counted by :class:`CollectiveLog`, a dispatch mode that sees those of
``torch.distributed``, of ``DTensor`` and of DDP's and FSDP2's own machinery.

Comparisons with one process follow the suite's tolerance rule (``tests/README.md``) in
lockstep: every optimizer step of a rank is recorded (whole params, gradients and optimizer
state before it, the norms the rank computed, everything after it) and replayed here by a
single-process optimizer of the same config started from exactly that params, state and
gradient. So each step is compared on its own (a trajectory's sensitivity to rounding never
enters), and the data-parallel engine's gradient (torch's business) is given to both sides.
Under DDP every tensor is a whole plain tensor and the optimizer runs the kernels of one process
on the same inputs: bit for bit. Under FSDP2 the norms are sums over the shards in another
order (counted below) and the elementwise math runs on the shards: the rule's rounding bound.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import (
    DREAMERV3_ELEMENTWISE_OPS,
    ELEMENTWISE_OPS,
    MagnitudeRun,
    assert_bitwise,
    assert_close_rounding,
)
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

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
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

WORLD = 2
STEPS = 10  # optimizer steps per training run
HALF = STEPS // 2  # checkpoint after this many steps
AGC = 0.05
DIRECT_MIN = {"mlp": 20, "tiny": 2}  # the engine's direct_min_numel in the direct-route runs
DIRECT_RUNS = [("direct", "mlp"), ("direct", "tiny"), ("direct_dreamerv3", "tiny")]
"""The direct-route runs on local shards (config, model); see _fsdp_engine."""
MAX_NORM = 0.1
STEPPER_CLIP = 0.05
CONFIGS = ("dreamerv3", "transform", "stepper")
CHECKPOINTED = ("dreamerv3", "transform")
JOB_TIMEOUT = 180  # seconds for one spawned job (it takes about 10)

# The jobs are module fixtures, which pytest-xdist would run once per worker that gets a test of
# this module (each job twice, ranks competing for the same cores): the module runs on one worker
# (`--dist loadfile` or `loadgroup`; `make test` runs the suite by file).
pytestmark = pytest.mark.xdist_group("distributed")

# ----------------------------------------------------------------------------------------------
# Rounding counts (the rule's ``ops``, in float32 roundings per implementation; see conftest).


def norm_ops(n: int, ranks: int = WORLD) -> float:
    """A norm of ``n`` elements sharded over ``ranks`` ranks, as ``DTensor`` computes it: each
    rank's sum of squares (``n`` terms at most: ``n``), its square root (halves that, plus 1),
    squared again to combine the shards (doubles it, plus 1), the sum over the ranks
    (``ranks - 1``), and the final ``pow(s, 1/2)`` (halves everything, plus 2: within an ulp).
    Relative to the norm; the single process's own norm (``n / 2 + 1``) is below it."""
    return (n + 2 + 1 + ranks - 1) / 2 + 2


def global_norm_ops(sizes: list[int], ranks: int = WORLD) -> float:
    """``sqrt(sum_i ||x_i||^2)`` over tensors of ``sizes``: each squared norm carries twice its
    norm's count plus the square (a sum of nonnegative terms errs relatively by at most its
    worst term's), the sum of the ``k`` squares (``k``), the square root (halves it, plus 1)."""
    return (2 * max(norm_ops(n, ranks) for n in sizes) + 1 + len(sizes)) / 2 + 1


def step_ops(config: str, n: int, sizes: list[int], ranks: int = WORLD) -> float:
    """One optimizer step of ``config`` for a leaf of ``n`` elements among leaves of ``sizes``
    (the update's state and the new param's update, before it is added to the param).

    The clip factor's relative error enters the second moment squared, and the step (first
    moment over the square root of the second) once from each: twice in all. ``dreamerv3``
    clips each leaf by the ratio of two norms of that leaf; its elementwise math is counted by
    ``DREAMERV3_ELEMENTWISE_OPS`` (which includes the factor's own product and quotient). The
    global-norm clips (``clip_by_global_norm``, the stepper's ``clip_norm``) scale by
    ``c / max(norm, c)`` or ``min(1, c / (norm + 1e-6))``: the norm, a sum or max, a quotient and
    the product with the gradient (+3); then Adam's elementwise math (``ELEMENTWISE_OPS``)."""
    if config in ("dreamerv3", "direct_dreamerv3"):
        return DREAMERV3_ELEMENTWISE_OPS + 2 * (2 * norm_ops(n, ranks))
    return ELEMENTWISE_OPS + 2 * (global_norm_ops(sizes, ranks) + 3)


# ----------------------------------------------------------------------------------------------
# What every process runs (spawned ranks and this one alike).


def make_model(kind: str = "mlp") -> nn.Module:
    torch.manual_seed(0)
    if kind == "tiny":
        # FSDP2 gives rank 1 no element of the first layer (1 row) and 1 of 3 rows of the last.
        return nn.Sequential(nn.Linear(4, 1), nn.Tanh(), nn.Linear(1, 3))
    # 3 output units: FSDP2 shards the last layer unevenly (2 rows and 1 row).
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def fast_path(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Which path the last step of ``opt``'s (single) group took: ``"sharded"`` when it ran on
    the local shards of ``DTensor`` params (flat buckets, or the engine's packed buffers), and
    the ranks of the process group its partial sums were summed over."""
    layouts = opt.__dict__.get("_layouts") or [None]
    engine = getattr(layouts[0], "engine", None)
    if engine:  # TransformOptimizer's engine (a PackedGroup)
        ranks = None if engine.group is None else dist.get_process_group_ranks(engine.group)
        return {"sharded": engine.sharded, "ranks": ranks, "steps": engine.steps}
    buckets = opt.__dict__.get("_buckets", {}).get(0)
    if buckets:
        bucket = buckets[1][0]
        group = bucket.group if bucket.sharded else None
        sharded = all(b.sharded for b in buckets[1])
    else:
        return {"sharded": False, "ranks": None}
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return {"sharded": sharded, "ranks": ranks}


def local_data_ptrs(model: nn.Module) -> list[int]:
    """Where each param's local shard lives (FSDP2's storage, never the optimizer's)."""
    return [p._local_tensor.data_ptr() for p in model.parameters()]  # type: ignore[attr-defined]


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
    if config in ("transform", "engine"):
        # AdamW's usual recipe, weight decay on matrices only (a masked stateless transform:
        # on the engine it runs over the packed shards' buffers)
        matrices = lambda ps: fo.tree_map(lambda p: p.ndim > 1, ps)  # noqa: E731
        adamw = fo.adamw(1e-2, weight_decay=0.1, mask=matrices)
        opt = TransformOptimizer(params, fo.chain(fo.clip_by_global_norm(MAX_NORM), adamw))
        if config == "engine":  # the small model steps on the engine (compiled, packed buffers)
            opt.fused_min_numel = 0
        return opt
    if config == "direct":
        # a finite check around a global-norm clip: leafwise given its two reductions, so on the
        # engine its large shards step one at a time in FSDP2's storage (see _fsdp_engine)
        clipped = fo.chain(fo.clip_by_global_norm(MAX_NORM), fo.adamw(1e-2, weight_decay=0.1))
        return TransformOptimizer(params, fo.apply_if_finite(clipped, 3))
    if config == "direct_dreamerv3":  # DreamerV3's chain: each leaf's norms over the ranks
        return TransformOptimizer(params, fo.dreamerv3(1e-2, agc=AGC, warmup=0))
    return TransformOptimizer(params, fo.adam(1e-2))


def reference(config: str) -> str:
    """The config a step is replayed with in one process: ``engine``'s steps by the per-tensor
    path of the same chain (one compiled graph per replayed step would take minutes)."""
    return "transform" if config == "engine" else config


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


def names(model: nn.Module) -> list[str]:
    return [k.removeprefix("module.") for k, _ in model.named_parameters()]


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


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What an optimizer step starts from, as whole tensors: params, gradients, per-parameter
    state (by param name) and the param groups' entries (one group)."""
    named = list(zip(names(model), model.parameters(), strict=True))
    (group,) = opt.param_groups
    entries = {k: v for k, v in group.items() if k != "params"}
    return {
        "params": {n: full(p) for n, p in named},
        "grads": {n: None if p.grad is None else full(p.grad) for n, p in named},
        "state": {
            n: {k: full(v) for k, v in opt.state[p].items()} for n, p in named if p in opt.state
        },
        "group": optree.tree_map(lambda v: full(v) if isinstance(v, Tensor) else v, entries),
    }


def norms_of(params: list[Tensor]) -> dict[str, Tensor]:
    """The norms a step's clipping uses, computed by the core on this process's tensors
    (``DTensor``s under FSDP2): per tensor of the gradients and params, and the global norm."""
    grads = [p.grad for p in params if p.grad is not None]
    return {
        "grad_norms": torch.stack(_lists.norms(grads)),
        "param_norms": torch.stack(_lists.norms([p.detach() for p in params])),
        "global_norm": _lists.global_norm(grads),
    }


def train(
    config: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[Tensor, Tensor]],
    rank: int,
    world: int,
) -> list[dict[str, Any]]:
    """Optimizer steps on ``batches`` (two batches per step for the stepper). Returns a record of
    every step: ``"before"`` (:func:`snapshot` as the optimizer is about to step; for the
    stepper, right after the window's last backward: the accumulated gradient before its
    clipping), ``"norms"`` (:func:`norms_of`; for the stepper its ``grad_norm`` metric) and
    ``"after"`` (:func:`full_state` after the step)."""
    records: list[dict[str, Any]] = []
    if config == "stepper":
        stepper = MixedPrecisionOptimizationStepper(
            opt, gradient_accumulation_steps=2, clip_norm=STEPPER_CLIP
        )
        trainer = Trainer(model, rank, world)
        backward, window = stepper._backward, {"last": False}

        def recording_backward(loss: Tensor) -> None:
            backward(loss)
            if window["last"]:
                records.append({"before": snapshot(model, opt)})

        stepper._backward = recording_backward  # type: ignore[method-assign]
        for i, batch in enumerate(batches):
            window["last"] = i % 2 == 1
            metrics = stepper.step(trainer, batch)
            if window["last"]:
                records[-1]["norms"] = {"grad_norm": metrics["grad_norm"]}
                records[-1]["after"] = full_state(model, opt)
        assert stepper.optimizer_step_count == len(batches) // 2
        return records
    params = list(model.parameters())
    for batch in batches:
        x, y = local(batch, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        records.append({"before": snapshot(model, opt), "norms": norms_of(params)})
        opt.step()
        opt.zero_grad()
        records[-1]["after"] = full_state(model, opt)
    return records


def batches_for(config: str) -> list[tuple[Tensor, Tensor]]:
    return make_batches(2 * STEPS if config == "stepper" else STEPS)


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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
    out["cpu_seconds"] = time.process_time()  # this rank's CPU time (reported by hand)
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
# Counting collectives.


@dataclass(frozen=True)
class Collective:
    """One collective call: the op's name, its kind, and the dtype and size of its input."""

    op: str
    kind: str
    dtype: torch.dtype | None
    numel: int


_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_")


def collective_kind(op: str) -> str:
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, or the op's name."""
    name = op.strip("_").replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        if kind in name:
            return kind
    return name


class CollectiveLog(TorchDispatchMode):
    """While active, records every collective this process issues (a ``Collective`` each, in
    order): ``torch.distributed``'s ops, ``DTensor``'s functional collectives, and those that
    DDP's reducer and FSDP2 issue from C++ or Python, all of which go through the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in _COLLECTIVE_NAMESPACES:
            op = func._schema.name.split("::")[-1]
            if op not in _NOT_COLLECTIVES:
                tensors = [t for t in optree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
                first = tensors[0] if tensors else None
                self.calls.append(
                    Collective(
                        op,
                        collective_kind(op),
                        None if first is None else first.dtype,
                        0 if first is None else first.numel(),
                    )
                )
        return func(*args, **(kwargs or {}))

    def count(self, kind: str) -> int:
        return sum(c.kind == kind for c in self.calls)


def gradient_syncs(calls: list[Collective]) -> int:
    """The collectives of a data-parallel gradient sync among ``calls``: FSDP2's reduce-scatters
    and the all-reduces of floating-point tensors by ``torch.distributed`` (DDP's buckets, an
    HSDP replica all-reduce, an explicit sync); not ``DTensor``'s functional all-reduces (norms)
    nor the stepper's integer flags."""
    return sum(
        c.kind == "reduce_scatter"
        or (c.op == "allreduce_" and c.dtype is not None and c.dtype.is_floating_point)
        for c in calls
    )


def _fsdp_step_collectives(mesh: DeviceMesh, rank: int) -> dict[str, list[Collective]]:
    """The collectives of one optimizer step (after a first one) of the clipping configs (the
    engine's update runs eagerly under the log's dispatch mode: the same reductions)."""
    out = {}
    for config in (*CHECKPOINTED, "engine"):
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        for batch in make_batches(2):
            x, y = local(batch, rank, WORLD)
            nn.functional.mse_loss(model(x), y).backward()
            with CollectiveLog() as log:
                opt.step()
            opt.zero_grad()
        out[config] = log.calls
    return out


# ----------------------------------------------------------------------------------------------
# Gradient accumulation without extra syncs: exact arithmetic, so every order gives the same bits.

ACC = 4  # micro-batches per optimizer step
ACC_CALLS = 10  # windows: calls 0-3 step; 4-5 dropped (call 5's loss is not finite); 6-9 step
ACC_POISON = 5
ACC_LR = 2.0**-4


class TwoHeads(nn.Module):
    """``a(x) + b(x)``: two linear maps (two FSDP2 param groups, one DDP bucket)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.a(x) + self.b(x)
        return out


def exact_model(dtype: torch.dtype = torch.float32) -> TwoHeads:
    """Weights and biases in eighths in [-1/2, 1/2]; inputs and targets in {-1, 0, 1} (below):
    over two SGD steps of 2**-4 every product and sum in a gradient, its accumulation over the
    window and ranks and the update fits in float32's 24 bits (checked against float64)."""
    torch.manual_seed(5)
    model = TwoHeads().to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-4, 5, p.shape) / 8)
    return model


def exact_batches(dtype: torch.dtype = torch.float32) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(-1, 2, (8, 4), generator=g).to(dtype),
            torch.randint(-1, 2, (8, 3), generator=g).to(dtype),
        )
        for _ in range(ACC_CALLS)
    ]


class ExactTrainer:
    """Half the mean over this rank's rows of the squared error; the last rank's loss is not
    finite on call ACC_POISON."""

    def __init__(self, model: nn.Module, rank: int, world: int) -> None:
        self.model, self.rank, self.world, self.calls = model, rank, world, 0

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        x, y = local(batch, self.rank, self.world)
        loss = 0.5 * (self.model(x) - y).square().sum(dim=1).mean()
        if self.calls == ACC_POISON and self.rank == self.world - 1:
            loss = loss * float("inf")
        self.calls += 1
        return {"loss": loss}


class AveragingContext:
    """A trainer's ``data_parallel_context`` as torchrl's: ``sync_gradients`` averages the
    gradients over the ranks (one all-reduce each); it counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def sync_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls += 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


def accumulate(
    model: nn.Module,
    rank: int,
    world: int,
    sync_modules: nn.Module | None = None,
    context: AveragingContext | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The stepper (accumulation ACC, SGD, no clipping) over ``exact_batches``: the gradient
    syncs of every call, the whole params after every call, and the counters."""
    opt = TransformOptimizer(model.parameters(), fo.sgd(ACC_LR))
    stepper = MixedPrecisionOptimizationStepper(
        opt, gradient_accumulation_steps=ACC, clip_norm=None, sync_modules=sync_modules
    )
    trainer = ExactTrainer(model, rank, world)
    if context is not None:
        trainer.data_parallel_context = context  # type: ignore[attr-defined]
    syncs, params = [], []
    for batch in exact_batches(dtype):
        with CollectiveLog() as log:
            stepper.step(trainer, batch)
        syncs.append(gradient_syncs(log.calls))
        params.append(full_params(model))
    return {
        "syncs": syncs,
        "params": params,
        "steps": stepper.optimizer_step_count,
        "skipped": stepper.state_dict()["skipped_nonfinite_steps"],
    }


def shard_heads(mesh: DeviceMesh) -> TwoHeads:
    model = exact_model()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_accumulation(mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    model = shard_heads(mesh)
    return {
        "deferred": accumulate(model, rank, WORLD, sync_modules=model),
        "every": accumulate(shard_heads(mesh), rank, WORLD),
    }


def _ddp_accumulation(rank: int) -> dict[str, Any]:
    deferred = nn.parallel.DistributedDataParallel(exact_model())
    context = AveragingContext()
    out = {
        "deferred": accumulate(deferred, rank, WORLD, sync_modules=deferred),
        "every": accumulate(nn.parallel.DistributedDataParallel(exact_model()), rank, WORLD),
        "context": accumulate(exact_model(), rank, WORLD, context=context),
    }
    out["context_calls"] = context.calls
    return out


# ----------------------------------------------------------------------------------------------
# fp16 loss scaling under FSDP2.


def _fsdp_fp16(mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """The stepper with float16 autocast and loss scaling (accumulation 2, syncs deferred):
    rank 1's backward puts an Inf into the first layer's gradient on the last call of the
    second window (an overflow in one rank's contribution only)."""
    model = shard_model(make_model(), mesh)
    opt = make_optimizer("stepper", model.parameters())
    stepper = MixedPrecisionOptimizationStepper(
        opt,
        mixed_precision=True,
        autocast_dtype=torch.float16,
        gradient_accumulation_steps=2,
        clip_norm=1.0,
        sync_modules=model,
    )
    trainer = Trainer(model, rank, WORLD)
    inject = {"on": False}

    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return _InfGrad.apply(output) if inject["on"] else output  # type: ignore[no-any-return]

    model[0].register_forward_hook(hook)
    windows = []
    for i, batch in enumerate(make_batches(6)):
        inject["on"] = i == 3 and rank == 1
        metrics = stepper.step(trainer, batch)
        if i % 2 == 1:
            windows.append(
                {
                    "state": full_state(model, opt),
                    "scale": stepper.loss_scale.loss_scale.clone(),
                    "used_scale": metrics["grad_scale"],
                    "overflows": int(metrics["skipped_overflow_steps"]),
                }
            )
    return {"windows": windows, "steps": stepper.optimizer_step_count}


# ----------------------------------------------------------------------------------------------
# The HSDP job (4 ranks: 2 replicas x 2 shards).

HSDP_WORLD = 4


def hsdp_mesh(world: int) -> DeviceMesh:
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def _hsdp_job(rank: int, world: int, store: str, root: str) -> None:
    """The checkpointed configs on a 2-D mesh (``fully_shard`` on it is HSDP: each param
    sharded over the second dimension, replicated over the first; every rank a data-parallel
    rank): the first HALF steps recorded (lockstep with one process), then a DCP checkpoint
    that the FSDP2 job (2 ranks) loads."""
    _init(rank, world, store)
    mesh = hsdp_mesh(world)
    out: dict[str, Any] = {}
    for config in CHECKPOINTED:
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        out[f"records_{config}"] = train(
            config, model, opt, batches_for(config)[:HALF], rank, world
        )
        out[f"fast_{config}"] = fast_path(opt)
        out[f"placements_{config}"] = [
            (tuple(p.placements), tuple(v.placements for v in opt.state[p].values()))
            for p in model.parameters()
        ]
        dcp_save(model, opt, Path(root) / f"hsdp_{config}")
        out[f"saved_{config}"] = full_state(model, opt)
    # TransformOptimizer's engine on the shards, its norms summed over the shard dimension
    model = shard_model(make_model(), mesh)
    opt = make_optimizer("engine", model.parameters())
    out["records_engine"] = train("engine", model, opt, batches_for("engine")[:HALF], rank, world)
    out["fast_engine"] = fast_path(opt)
    _finish(out, Path(root) / f"hsdp_rank{rank}.pt")


def _fsdp_from_hsdp(mesh: DeviceMesh, rank: int, root: Path) -> dict[str, Any]:
    """4 ranks (HSDP) -> 2 ranks (FSDP2): load, then the remaining steps (recorded)."""
    out: dict[str, Any] = {}
    for config in CHECKPOINTED:
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        dcp_load(model, opt, root / f"hsdp_{config}")
        out[f"loaded_hsdp_{config}"] = full_state(model, opt)
        out[f"records_resumed_hsdp_{config}"] = train(
            config, model, opt, batches_for(config)[HALF:], rank, WORLD
        )
    return out


# ----------------------------------------------------------------------------------------------
# The FSDP2 job.


FUNCTIONAL = ("clip_by_agc", "adaptive_grad_clip", "clip_by_global_norm", "dreamerv3")


def functional_transform(name: str) -> fo.GradientTransformation:
    return {
        "clip_by_agc": lambda: fo.clip_by_agc(0.05),
        "adaptive_grad_clip": lambda: fo.adaptive_grad_clip(0.05),
        "clip_by_global_norm": lambda: fo.clip_by_global_norm(0.5),
        "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=0),
    }[name]()


def functional_inputs() -> tuple[list[Tensor], list[Tensor]]:
    torch.manual_seed(3)
    shapes = [(6, 3), (5,), (4, 2, 3, 3), (3, 7)]
    return [torch.randn(s) for s in shapes], [3 * torch.randn(s) for s in shapes]


def _fsdp_functional(mesh: DeviceMesh) -> dict[str, Any]:
    """Each clipping transform on ``DTensor``s (whole results) and on whole tensors."""
    params, grads = functional_inputs()
    placements = [[Shard(0)], [Shard(0)], [Shard(0)], [Shard(1)]]
    dparams = [distribute_tensor(p, mesh, pl) for p, pl in zip(params, placements, strict=True)]
    dgrads = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, placements, strict=True)]
    out: dict[str, Any] = {}
    for name in FUNCTIONAL:
        tx = functional_transform(name)
        want, _ = tx.update(grads, tx.init(params), params)
        got, _ = tx.update(dgrads, tx.init(dparams), dparams)
        assert all(isinstance(u, DTensor) for u in got)
        assert [u.placements for u in got] == [g.placements for g in dgrads], name
        out[name] = {"got": [full(u) for u in got], "want": want}
    norm = _lists.global_norm(dgrads)
    assert type(norm) is Tensor  # a full value, not a partial DTensor
    out["global_norm"] = {"got": norm, "want": _lists.global_norm(grads)}
    bad = [g.clone() for g in dgrads]
    if dist.get_rank() == 1:
        bad[2].to_local().view(-1)[0] = float("inf")  # one element of one rank's shard
    out["all_finite_bad"] = bool(fo.loss_scale.all_finite(bad))
    out["all_finite_good"] = bool(fo.loss_scale.all_finite(dgrads))
    return out


def _fsdp_tiny(mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """DreamerV3Optimizer on the tiny model (rank 1 holds no element of two params, and 1 of 3
    rows of two others), 3 steps recorded; the first with FSDP2's fresh gradients, then with
    gradients kept (``zero_grad(set_to_none=False)``: FSDP2 adds into the optimizer's views)."""
    model = shard_model(make_model("tiny"), mesh)
    opt = make_optimizer("dreamerv3", model.parameters())
    ptrs = local_data_ptrs(model)
    records = []
    for batch in batches_for("dreamerv3")[:3]:
        x, y = local(batch, rank, WORLD)
        nn.functional.mse_loss(model(x), y).backward()
        records.append(
            {"before": snapshot(model, opt), "norms": norms_of(list(model.parameters()))}
        )
        with CollectiveLog() as log:
            opt.step()
        opt.zero_grad(set_to_none=False)
        records[-1]["after"] = full_state(model, opt)
        records[-1]["collectives"] = log.calls
    return {
        "records_tiny": records,
        "tiny_local_numels": [p.to_local().numel() for p in model.parameters()],  # type: ignore[attr-defined]
        "fast_tiny": fast_path(opt),
        "storage_kept_tiny": local_data_ptrs(model) == ptrs,
    }


def _fsdp_engine(mesh: DeviceMesh, rank: int, root: Path) -> dict[str, Any]:
    """TransformOptimizer's engine (clip_by_global_norm + masked adamw compiled over packed
    buffers) on FSDP2's local shards: the MLP (its last layer sharded unevenly) for STEPS steps
    with a DCP checkpoint after HALF, loaded into a new model and optimizer that takes the other
    HALF steps; then the tiny model (rank 1 holds no element of two params) for 3 steps. Every step
    is recorded for lockstep, with the collectives the compiled step issued (the shard group's
    sequence number counts them: a dispatch mode would make torch.compile run no compiled code)
    and whether the engine took it."""
    group = mesh.get_group(0)
    out: dict[str, Any] = {}

    def run(
        model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[Tensor, Tensor]]
    ) -> list[dict[str, Any]]:
        params = list(model.parameters())
        records = []
        for batch in batches:
            x, y = local(batch, rank, WORLD)
            nn.functional.mse_loss(model(x), y).backward()
            records.append({"before": snapshot(model, opt), "norms": norms_of(params)})
            engine_steps = fast_path(opt).get("steps", 0)
            seq = group._get_sequence_number_for_group()
            opt.step()
            records[-1]["collectives"] = group._get_sequence_number_for_group() - seq
            records[-1]["on_engine"] = fast_path(opt).get("steps", 0) == engine_steps + 1
            opt.zero_grad()
            records[-1]["after"] = full_state(model, opt)
        return records

    batches = batches_for("engine")
    model = shard_model(make_model(), mesh)
    opt = make_optimizer("engine", model.parameters())
    ptrs = local_data_ptrs(model)
    records = run(model, opt, batches[:HALF])
    dcp_save(model, opt, root / "fsdp_engine")
    out["saved_engine"] = full_state(model, opt)
    out["records_engine"] = records + run(model, opt, batches[HALF:])
    out["final_engine"] = full_state(model, opt)
    out["fast_engine"] = fast_path(opt)
    out["storage_kept_engine"] = local_data_ptrs(model) == ptrs
    out["state_placements_engine"] = {
        k: v.placements for k, v in opt.state[model[0].weight].items()
    }
    model = shard_model(make_model(), mesh)
    opt = make_optimizer("engine", model.parameters())
    dcp_load(model, opt, root / "fsdp_engine")
    out["loaded_engine"] = full_state(model, opt)
    out["records_resumed_engine"] = run(model, opt, batches[HALF:])
    out["resumed_engine"] = full_state(model, opt)
    model = shard_model(make_model("tiny"), mesh)
    opt = make_optimizer("engine", model.parameters())
    ptrs = local_data_ptrs(model)
    out["records_engine_tiny"] = run(model, opt, batches[:3])
    out["fast_engine_tiny"] = fast_path(opt)
    out["storage_kept_engine_tiny"] = local_data_ptrs(model) == ptrs
    # The direct route on local shards: shards of at least DIRECT_MIN elements step alone (the
    # ranks' direct params differ, their collectives may not: rank 0 holds 32 elements of the
    # MLP's last weight, rank 1 16; of the tiny model rank 1 steps no shard directly, and rank 0
    # all four, its one small shard too, where the default direct_rest_max applies); an Inf in
    # rank 1's shard of the last bias skips the finite-checked step everywhere.
    for config, kind in DIRECT_RUNS:
        model = shard_model(make_model(kind), mesh)
        opt = make_optimizer(config, model.parameters())
        opt.fused_min_numel, opt.direct_min_numel = 0, DIRECT_MIN[kind]  # type: ignore[attr-defined]
        if (config, kind) != ("direct", "tiny"):  # (that run: the default, few small ones too)
            opt.direct_rest_max = 0  # type: ignore[attr-defined]
        ptrs = local_data_ptrs(model)
        records = run(model, opt, batches[:2])
        if config == "direct":
            x, y = local(batches[2], rank, WORLD)
            nn.functional.mse_loss(model(x), y).backward()
            if rank == 1:
                last = list(model.parameters())[-1].grad
                last._local_tensor.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            before, seq = full_state(model, opt), group._get_sequence_number_for_group()
            opt.step()
            calls = group._get_sequence_number_for_group() - seq
            opt.zero_grad()
            out[f"inf_{config}_{kind}"] = {
                "before": before,
                "after": full_state(model, opt),
                "collectives": calls,
            }
        out[f"records_{config}_{kind}"] = records + run(model, opt, batches[3:4])
        out[f"fast_{config}_{kind}"] = fast_path(opt)
        out[f"direct_params_{config}_{kind}"] = opt._layouts[0].engine.direct  # type: ignore[attr-defined]
        out[f"storage_kept_{config}_{kind}"] = local_data_ptrs(model) == ptrs
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
        out[f"records_resumed_single_{config}"] = train(
            config, model, opt, batches[HALF:], rank, WORLD
        )
    return out


PARAM_NORM_RUNS = ("dreamerv3", "direct_dreamerv3")
"""The sharded DreamerV3 steps whose param norms come from the last step (see
_fsdp_param_norms): the flat buckets, and the engine's direct route."""


def reused_squares(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """How many large shards' sums of squares ``opt``'s last sharded step took from the step
    before instead of reading the shard, of how many it could have."""
    layouts = opt.__dict__.get("_layouts") or [None]
    engine = getattr(layouts[0], "engine", None)
    if engine:
        return engine.reused_squares, len(engine.direct)
    buckets = opt.__dict__["_buckets"][0][1]
    return sum(b.reused_squares for b in buckets), sum(len(b.direct) for b in buckets)


def _fsdp_param_norms(mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """A sharded DreamerV3 step takes each large shard's ``||p||^2`` from the step before (its
    update took it as it wrote the shard) unless something wrote the param since. Per config,
    two identical tiny models and optimizers A and B train on the same batches with real
    forward and backward passes for 4 steps; before step 3 every param of both is scaled in
    place under ``torch.no_grad()`` and B forgets what it kept (``forget_param_norms``: it
    reads every shard); before step 4 only the last weight of both is scaled. Records, per
    step, how many squares each reused (of how many), and both models' whole params after
    it."""
    import functional_opt.adapters.flat_dreamerv3 as flat

    out: dict[str, Any] = {}
    batches = batches_for("dreamerv3")
    direct = flat.DIRECT
    flat.DIRECT = 2  # (the tiny model's shards step on the flat path's direct route too)
    try:
        for config in PARAM_NORM_RUNS:
            pairs = []
            for _ in range(2):
                model = shard_model(make_model("tiny"), mesh)
                opt = make_optimizer(config, model.parameters())
                if config == "direct_dreamerv3":  # (as the direct-route run of the tiny model)
                    opt.fused_min_numel = 0  # type: ignore[attr-defined]
                    opt.direct_min_numel = DIRECT_MIN["tiny"]  # type: ignore[attr-defined]
                pairs.append((model, opt))
            records = []
            for t in range(4):
                if t >= 2:
                    with torch.no_grad():
                        for model, _ in pairs:
                            for p in model.parameters() if t == 2 else [model[-1].weight]:
                                p.mul_(1.5)
                if t == 2:
                    pairs[1][1].forget_param_norms()  # type: ignore[attr-defined]
                record: dict[str, Any] = {}
                for name, (model, opt) in zip("AB", pairs, strict=True):
                    x, y = local(batches[t], rank, WORLD)
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    record[f"reused_{name}"] = reused_squares(opt)
                    record[name] = full_params(model)
                records.append(record)
            out[config] = records
    finally:
        flat.DIRECT = direct
    return out


def _fsdp_job(rank: int, world: int, store: str, root: str) -> None:
    _init(rank, world, store)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for config in CONFIGS:
        model = shard_model(make_model(), mesh)
        opt = make_optimizer(config, model.parameters())
        ptrs = local_data_ptrs(model)
        out[f"records_{config}"] = train(config, model, opt, batches_for(config), rank, world)
        out[f"final_{config}"] = full_state(model, opt)
        out[f"fast_{config}"] = fast_path(opt)
        out[f"storage_kept_{config}"] = local_data_ptrs(model) == ptrs
        if config == "dreamerv3":
            states = next(iter(opt.state.values()))
            out["state_placements"] = {k: v.placements for k, v in states.items()}
    out.update(_fsdp_tiny(mesh, rank))
    out.update(_fsdp_engine(mesh, rank, Path(root)))
    out["functional"] = _fsdp_functional(mesh)
    out["inf_transform"] = _fsdp_inf_transform(mesh, rank)
    out["inf_stepper"] = _fsdp_inf_stepper(mesh, rank)
    out.update(_fsdp_checkpoints(mesh, rank, Path(root)))
    out["accumulation"] = _fsdp_accumulation(mesh, rank)
    out["fp16"] = _fsdp_fp16(mesh, rank)
    out["step_collectives"] = _fsdp_step_collectives(mesh, rank)
    out["param_norms"] = _fsdp_param_norms(mesh, rank)
    out.update(_fsdp_from_hsdp(mesh, rank, Path(root)))
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
    out["accumulation"] = _ddp_accumulation(rank)
    _finish(out, Path(root) / f"ddp_rank{rank}.pt")


def _ddp_train(config: str, rank: int, world: int) -> dict[str, Any]:
    # In a function: the DDP wrapper (whose reducer holds the process group) is gone before
    # the process group is destroyed.
    ddp = nn.parallel.DistributedDataParallel(make_model())
    opt = make_optimizer(config, ddp.parameters())
    records = train(config, ddp, opt, batches_for(config), rank, world)
    return {f"records_{config}": records, f"final_{config}": full_state(ddp, opt)}


# ----------------------------------------------------------------------------------------------
# Fixtures: a single-process checkpoint, then one spawned job per engine.


def spawn(
    job: Callable[..., None], root: Path, name: str, world: int = WORLD
) -> list[dict[str, Any]]:
    """Run ``job`` on ``world`` spawned ranks; a rank's exception fails the test with its traceback.

    A job that outlives JOB_TIMEOUT is killed: it fails the test, unless every rank had already
    written its results (then it hung on exit, in torch's gloo teardown: ``ProcessGroupGloo``'s
    destructor can deadlock with its worker thread over the GIL; not what is tested here).
    """
    files = [root / f"{name}_rank{r}.pt" for r in range(world)]
    # Ranks fork from a server process that imported this module once (start-up is mostly
    # imports: about 2.5 s of CPU per process, times 8 ranks, on a 2-core machine).
    multiprocessing.set_forkserver_preload([job.__module__])
    context = mp.start_processes(
        job,
        args=(world, str(root / f"{name}.store"), str(root)),
        nprocs=world,
        join=False,
        start_method="forkserver",
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
    """One process, no wrapper: a checkpoint after HALF steps (the 1 -> 2 ranks load)."""
    out: dict[str, Any] = {}
    for config in CHECKPOINTED:
        model = make_model()
        opt = make_optimizer(config, model.parameters())
        train(config, model, opt, batches_for(config)[:HALF], 0, 1)
        dcp_save(model, opt, root / f"single_{config}")
        out[f"saved_{config}"] = full_state(model, opt)
    return out


@pytest.fixture(scope="module")
def hsdp(root: Path) -> list[dict[str, Any]]:
    return spawn(_hsdp_job, root, "hsdp", HSDP_WORLD)


@pytest.fixture(scope="module")
def fsdp(root: Path, single: dict[str, Any], hsdp: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
# Lockstep: one recorded step replayed by one process.


class GradientTrainer:
    """A trainer whose loss ``sum_i <p_i, g_i>`` gives the params exactly the gradients ``g``
    (the backward of a sum and a product by 1: no rounding)."""

    def __init__(self, model: nn.Module, grads: list[Tensor]) -> None:
        self.params, self.grads = list(model.parameters()), grads

    def compute_loss(self, batch: Any) -> dict[str, Tensor]:
        terms = [(p * g).sum() for p, g in zip(self.params, self.grads, strict=True)]
        return {"loss": torch.stack(terms).sum()}


def build_at(
    config: str,
    snap: dict[str, Any],
    dtype: torch.dtype,
    magnitudes: bool = False,
    kind: str = "mlp",
) -> tuple[nn.Module, torch.optim.Optimizer, list[Tensor]]:
    """A single-process model and optimizer of ``config`` holding ``snap``'s params and state (in
    ``dtype``; their absolute values with ``magnitudes``), and ``snap``'s gradients."""

    def cast(v: Tensor) -> Tensor:
        if not v.is_floating_point():
            return v.clone()
        v = v.to(dtype)
        return v.abs() if magnitudes else v.clone()

    model = make_model(kind).to(dtype)
    order = names(model)
    with torch.no_grad():
        for n, p in zip(order, model.parameters(), strict=True):
            p.copy_(cast(snap["params"][n]))
    opt = make_optimizer(reference(config), model.parameters())
    state = {
        i: {k: cast(v) for k, v in snap["state"][n].items()}
        for i, n in enumerate(order)
        if n in snap["state"]
    }
    group = optree.tree_map(lambda v: cast(v) if isinstance(v, Tensor) else v, snap["group"])
    opt.load_state_dict(
        {"state": state, "param_groups": [{**group, "params": list(range(len(order)))}]}
    )
    return model, opt, [cast(snap["grads"][n]) for n in order]


def replay(
    config: str,
    snap: dict[str, Any],
    dtype: torch.dtype,
    magnitudes: bool = False,
    kind: str = "mlp",
) -> Any:
    """One step of ``config`` in one process from ``snap`` (see :func:`build_at`): the norms it
    used (as :func:`norms_of`, or the stepper's ``grad_norm``) and :func:`full_state` after it.
    The stepper (accumulation 1) gets the gradient through :class:`GradientTrainer`."""
    model, opt, grads = build_at(config, snap, dtype, magnitudes, kind)
    if config == "stepper":
        stepper = MixedPrecisionOptimizationStepper(
            opt, gradient_accumulation_steps=1, clip_norm=STEPPER_CLIP, process_group=None
        )
        metrics = stepper.step(GradientTrainer(model, grads), None)
        norms = {"grad_norm": metrics["grad_norm"]}
    else:
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        norms = norms_of(list(model.parameters()))
        opt.step()
    return norms, full_state(model, opt)


def check_step(
    config: str, record: dict[str, Any], exact: bool, msg: str, kind: str = "mlp"
) -> None:
    """``record`` (a rank's step) against its replay in this process: bit for bit when
    ``exact``, else at the rule's bound for :func:`step_ops` (and :func:`norm_ops` for the
    norms), relative to the magnitudes of the terms (the replay on absolute values, float64)."""
    before = record["before"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        norms, after = replay(config, before, torch.float32, kind=kind)
        _, magnitude = replay(config, before, torch.float64, magnitudes=True, kind=kind)
    finally:
        torch.set_num_threads(threads)
    if exact:
        assert_bitwise(record["norms"], norms, msg)
        assert_bitwise(record["after"], after, msg)
        return
    sizes = [p.numel() for p in before["params"].values()]
    f32 = torch.float32
    for key in ("grad_norms", "param_norms") if "grad_norms" in norms else ():
        for i, n in enumerate(sizes):
            got, want = record["norms"][key][i], norms[key][i]
            assert_close_rounding(got, want, dtype=f32, ops=norm_ops(n), msg=f"{msg}: {key}[{i}]")
    for key in ("global_norm", "grad_norm"):
        if key in norms:
            got, want = record["norms"][key], norms[key]
            assert_close_rounding(got, want, dtype=f32, ops=global_norm_ops(sizes), msg=msg)
    assert record["after"].keys() == after.keys()
    for key, want in after.items():
        got, what = record["after"][key], f"{msg}: {key}"
        kind, _, rest = key.partition("/")
        if kind == "param":
            p = before["params"][rest].abs().double()
            ops = step_ops(config, p.numel(), sizes) + 1  # + 1: the update added to the param
            scale = p + (magnitude[key] - p).abs()  # |p| + |update|
            assert_close_rounding(got, want, dtype=f32, ops=ops, scale=scale, msg=what)
        elif kind == "state":
            n = before["params"][rest.rpartition("/")[0]].numel()
            ops = step_ops(config, n, sizes)
            assert_close_rounding(got, want, dtype=f32, ops=ops, scale=magnitude[key], msg=what)
        else:  # counters and options
            assert_bitwise(got, want, what)


def check_lockstep(
    config: str, ranks: list[dict[str, Any]], key: str, exact: bool, kind: str = "mlp"
) -> None:
    records = ranks[0][key]
    for other in ranks[1:]:
        assert_bitwise(other[key], records, f"{key}: the ranks differ")  # whole values everywhere
    for t, record in enumerate(records):
        check_step(config, record, exact, f"{key}, step {t + 1}", kind)


# ----------------------------------------------------------------------------------------------
# 1. FSDP2 and 2. DDP give the numbers of one process.


def test_clipping_is_active(fsdp: list[dict[str, Any]]) -> None:
    def logged(config: str, key: str) -> Tensor:
        return torch.stack([r["norms"][key] for r in fsdp[0][f"records_{config}"]])

    pmin = 1e-3  # DreamerV3Optimizer's default parameter_norm_min
    ratios = logged("dreamerv3", "grad_norms") / (
        AGC * logged("dreamerv3", "param_norms").clamp(min=pmin)
    )
    assert ratios.max() > 1  # agc clips some tensor
    assert logged("transform", "global_norm").max() > MAX_NORM
    assert logged("engine", "global_norm").max() > MAX_NORM
    assert logged("stepper", "grad_norm").max() > STEPPER_CLIP


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_matches_single_process(engine: str, config: str, request: pytest.FixtureRequest) -> None:
    """Every step in lockstep with one process (bit for bit under DDP, where the optimizer
    runs one process's kernels on whole tensors); both ranks hold the same whole values."""
    ranks = request.getfixturevalue(engine)
    assert len(ranks[0][f"records_{config}"]) == STEPS
    check_lockstep(config, ranks, f"records_{config}", exact=engine == "ddp")
    assert_identical(ranks[0][f"final_{config}"], ranks[1][f"final_{config}"])
    assert_bitwise(ranks[0][f"final_{config}"], ranks[0][f"records_{config}"][-1]["after"])


def test_fsdp_dreamerv3_steps_on_local_shards(fsdp: list[dict[str, Any]]) -> None:
    """DreamerV3Optimizer's flat buckets serve FSDP2's DTensor params (their local shards, the
    norms' partial sums all-reduced over the mesh), and FSDP2's storage of the params stays."""
    for rank, result in enumerate(fsdp):
        assert result["fast_dreamerv3"] == {"sharded": True, "ranks": [0, 1]}, rank
        assert result["storage_kept_dreamerv3"], rank


def test_fsdp_dreamerv3_uneven_and_empty_shards(fsdp: list[dict[str, Any]]) -> None:
    """Rank 1 holds no element of the first layer: the same one all-reduce on every rank, and
    every step in lockstep with one process (fresh gradients, then kept ones)."""
    assert fsdp[0]["tiny_local_numels"] == [4, 1, 2, 2]
    assert fsdp[1]["tiny_local_numels"] == [0, 0, 1, 1]
    for result in fsdp:
        assert result["fast_tiny"]["sharded"] and result["storage_kept_tiny"]
        for record in result["records_tiny"]:
            calls = record.pop("collectives")
            assert [c.kind for c in calls] == ["all_reduce"], calls
    check_lockstep("dreamerv3", fsdp, "records_tiny", exact=False, kind="tiny")


def engine_records(result: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """``key``'s records, after checking that the engine took every step over the local shards
    with one collective (the compiled step's all-reduce of the global norm's partial sums)."""
    records = result[key]
    for t, record in enumerate(records):
        assert record.pop("on_engine"), f"{key}, step {t + 1}: not on the engine"
        assert record.pop("collectives") == 1, f"{key}, step {t + 1}"
    return records


def test_fsdp_transform_engine_steps_on_local_shards(fsdp: list[dict[str, Any]]) -> None:
    """TransformOptimizer's engine serves FSDP2's DTensor params: every step compiled over the
    local shards with one all-reduce (the global norm), in lockstep with one process; FSDP2's
    storage of the params stays, the state is sharded like the params, and a DCP checkpoint
    saved there loads into a new optimizer that continues bit for bit."""
    for rank, result in enumerate(fsdp):
        assert result["fast_engine"] == {"sharded": True, "ranks": [0, 1], "steps": STEPS}, rank
        assert result["storage_kept_engine"], rank
        assert result["state_placements_engine"] == {"mu": (Shard(0),), "nu": (Shard(0),)}
        for key in ("records_engine", "records_resumed_engine"):
            result[key] = engine_records(result, key)
        assert_identical(result["loaded_engine"], result["saved_engine"])
        assert_identical(result["resumed_engine"], result["final_engine"])
    check_lockstep("engine", fsdp, "records_engine", exact=False)
    check_lockstep("engine", fsdp, "records_resumed_engine", exact=False)


def test_fsdp_transform_engine_uneven_and_empty_shards(fsdp: list[dict[str, Any]]) -> None:
    """Rank 1 holds no element of the tiny model's first layer: its engine still takes every
    step with the same one all-reduce, in lockstep with one process."""
    for result in fsdp:
        assert result["fast_engine_tiny"]["sharded"] and result["storage_kept_engine_tiny"]
        result["records_engine_tiny"] = engine_records(result, "records_engine_tiny")
    check_lockstep("engine", fsdp, "records_engine_tiny", exact=False, kind="tiny")


@pytest.mark.parametrize(("config", "kind"), DIRECT_RUNS)
def test_fsdp_direct_route_on_local_shards(
    config: str, kind: str, fsdp: list[dict[str, Any]]
) -> None:
    """A leafwise transform steps its large local shards one at a time in FSDP2's storage,
    every rank with one all-reduce per step although the ranks' direct params differ: a finite
    check around a global-norm clip (the finite count and the sum of squares together), and
    DreamerV3's chain (every leaf's norms of gradient and param); in lockstep with one process.
    An Inf in one rank's shard skips the finite-checked step on both ranks."""
    want = {"mlp": ([0, 2, 4], [0, 2]), "tiny": ([0, 2, 3], [])}[kind]
    if (config, kind) == ("direct", "tiny"):  # the default direct_rest_max: rank 0's bias too
        want = ([0, 1, 2, 3], [])
    for rank, result in enumerate(fsdp):
        assert result[f"direct_params_{config}_{kind}"] == want[rank], rank
        assert result[f"fast_{config}_{kind}"]["sharded"], rank
        assert result[f"storage_kept_{config}_{kind}"], rank
        key = f"records_{config}_{kind}"
        result[key] = engine_records(result, key)
        if config != "direct":
            continue
        inf = result[f"inf_{config}_{kind}"]
        assert inf["collectives"] == 1, rank
        for name, value in inf["before"].items():
            if name.startswith(("param/", "state/")):
                assert_bitwise(inf["after"][name], value, f"rank {rank}: {name} after the Inf")
    check_lockstep(config, fsdp, f"records_{config}_{kind}", exact=False, kind=kind)


@pytest.mark.parametrize("config", PARAM_NORM_RUNS)
def test_fsdp_dreamerv3_reuses_param_norms_until_a_param_is_written(
    config: str, fsdp: list[dict[str, Any]]
) -> None:
    """A sharded DreamerV3 step reads no large shard for its norm when the shard's last update
    took it (forward and backward in between included), and reads every shard written since
    (the version counters of the shard and its DTensor): after every param is scaled in place,
    A (which kept its squares) steps bit for bit as B (which dropped them); after the last
    weight is scaled, only its shard is read again."""
    for rank, result in enumerate(fsdp):
        records = result["param_norms"][config]
        n = records[0]["reused_A"][1]
        # (rank 0's tiny shards step on the direct route, its last weight's too; rank 1's none)
        assert n >= 2 if rank == 0 else n == 0, (rank, n)
        want = [0, n, 0, n - 1] if rank == 0 else [0] * 4
        assert [r["reused_A"][0] for r in records] == want, rank
        assert records[2]["reused_B"][0] == 0, rank
        for t, record in enumerate(records):
            for name, value in record["A"].items():
                assert_bitwise(value, record["B"][name], f"rank {rank}, step {t + 1}: {name}")


def test_fsdp_state_is_sharded_like_the_params(fsdp: list[dict[str, Any]]) -> None:
    assert fsdp[0]["state_placements"] == {"rms": (Shard(0),), "momentum": (Shard(0),)}


def functional_ops(name: str, n: int, sizes: list[int]) -> float:
    """Roundings of each transform's update of a leaf of ``n`` elements, sharded vs whole: the
    per-tensor clips take two norms of the leaf (unit-wise: of at most ``n`` elements each),
    then ``clip * max(pmin, ||p||)``, a quotient and the product with the gradient (+3);
    ``clip_by_global_norm`` the global norm and +3 (see :func:`step_ops`); ``dreamerv3``'s first
    update its count in :func:`step_ops`."""
    if name == "clip_by_global_norm":
        return global_norm_ops(sizes) + 3
    if name == "dreamerv3":
        return step_ops("dreamerv3", n, sizes)
    return 2 * norm_ops(n) + 3


def test_transforms_on_dtensors_use_whole_tensor_norms(fsdp: list[dict[str, Any]]) -> None:
    params, grads = functional_inputs()
    sizes = [p.numel() for p in params]
    for result in fsdp:
        out = result["functional"]
        for name in FUNCTIONAL:
            got, want = out[name]["got"], out[name]["want"]
            unchanged = max(float((w - g).abs().max()) for w, g in zip(want, grads, strict=True))
            assert unchanged > 0.1, f"{name} did not clip"
            magnitude, _ = MagnitudeRun(functional_transform(name), params).update(grads, params)
            for i, n in enumerate(sizes):
                assert_close_rounding(
                    got[i],
                    want[i],
                    dtype=torch.float32,
                    ops=functional_ops(name, n, sizes),
                    scale=magnitude[i],
                    msg=f"{name}: leaf {i}",
                )
        norm = out["global_norm"]
        assert_close_rounding(
            norm["got"], norm["want"], dtype=torch.float32, ops=global_norm_ops(sizes)
        )
        assert out["all_finite_bad"] is False and out["all_finite_good"] is True


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
    # The resumed steps in lockstep with one process.
    check_lockstep(config, fsdp, f"records_resumed_single_{config}", exact=False)


@pytest.mark.parametrize("config", CHECKPOINTED)
def test_dcp_two_ranks_to_one_process(config: str, fsdp: list[dict[str, Any]], root: Path) -> None:
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


def test_stepper_process_group_option() -> None:
    opt = TransformOptimizer(make_model().parameters(), fo.adam(1e-2))
    assert MixedPrecisionOptimizationStepper(opt).process_group == "auto"
    assert MixedPrecisionOptimizationStepper(opt, process_group=None).process_group is None
    with pytest.raises(ValueError, match="process_group"):
        MixedPrecisionOptimizationStepper(opt, process_group="world")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# 5. Gradient accumulation synchronises gradients once per optimizer step.


@pytest.fixture(scope="module")
def exact_single() -> dict[str, Any]:
    """The accumulation run in one process; its float32 params equal its float64 twin's bit for
    bit (every operation was exact, so any order of the same sums gives these bits)."""
    run = accumulate(exact_model(), 0, 1)
    wide = accumulate(exact_model(torch.float64), 0, 1, dtype=torch.float64)
    for narrow, exact in zip(run["params"], wide["params"], strict=True):
        for name, p in narrow.items():
            assert torch.equal(p.double(), exact[name]), f"{name} was rounded"
    assert run["steps"] == 2 and run["skipped"] == 1
    return run


@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_accumulation_syncs_once_per_optimizer_step(
    engine: str, request: pytest.FixtureRequest
) -> None:
    """Gradient syncs per call over ACC_CALLS calls of a window of 4 (the second window is
    dropped on its second call): every micro-batch without ``sync_modules``, only each window's
    last one with it; a ``data_parallel_context`` is called once per optimizer step."""
    for result in request.getfixturevalue(engine):
        acc = result["accumulation"]
        every, deferred = acc["every"]["syncs"], acc["deferred"]["syncs"]
        g = every[0]  # one reduce-scatter per FSDP2 param group, one all-reduce per DDP bucket
        assert g == (2 if engine == "fsdp" else 1)
        assert every == [g, g, g, g, g, 0, g, g, g, g]
        assert deferred == [0, 0, 0, g, 0, 0, 0, 0, 0, g]
        if engine == "ddp":
            assert acc["context"]["syncs"] == [0, 0, 0, 4, 0, 0, 0, 0, 0, 4]  # one per param
            assert acc["context_calls"] == 2


@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_accumulation_without_sync_gives_the_same_numbers(
    engine: str, request: pytest.FixtureRequest, exact_single: dict[str, Any]
) -> None:
    """Deferred, every-micro-batch and explicit (context) syncs, and one process: the same bits
    after every call (exact arithmetic). A window dropped after a backward without sync leaves
    nothing behind (FSDP2 keeps such gradients unsharded, out of ``optimizer.zero_grad``'s
    reach)."""
    for result in request.getfixturevalue(engine):
        for name, run in result["accumulation"].items():
            if isinstance(run, dict):
                assert (run["steps"], run["skipped"]) == (2, 1), name
                assert_bitwise(run["params"], exact_single["params"], f"{engine} {name}")


# ----------------------------------------------------------------------------------------------
# 5b. The collectives of a sharded step (the CollectiveLog harness).


@pytest.mark.parametrize("config", ["dreamerv3", "transform", "engine"])
def test_fsdp_step_resolves_its_norms_in_one_collective(
    config: str, fsdp: list[dict[str, Any]]
) -> None:
    """An optimizer step on FSDP2 shards communicates only to resolve norms, and all the norms of
    one step (per tensor, global) in one all-reduce."""
    for result in fsdp:
        calls = result["step_collectives"][config]
        assert all(c.kind == "all_reduce" for c in calls), calls  # the rest runs on the shards
        assert len(calls) == 1, calls


# ----------------------------------------------------------------------------------------------
# 6. fp16 loss scaling under FSDP2.


def test_fsdp_fp16_overflow_on_one_rank_skips_everywhere(fsdp: list[dict[str, Any]]) -> None:
    for result in fsdp:
        first, overflow, after = result["fp16"]["windows"]
        # Nothing is half-updated: params, moments and counters exactly as before, on the rank
        # whose shard got the Inf and on the other alike.
        assert_bitwise(overflow["state"], first["state"])
        assert float(overflow["used_scale"]) == float(first["scale"]) == 2.0**16
        assert float(overflow["scale"]) == 2.0**15  # backed off once
        assert (overflow["overflows"], after["overflows"]) == (1, 1)
        assert max_diff(after["state"], overflow["state"], "param/") > 0  # training goes on
        assert result["fp16"]["steps"] == 2
    assert_bitwise(fsdp[1]["fp16"], fsdp[0]["fp16"])  # the scale too, on every rank


# ----------------------------------------------------------------------------------------------
# 7. HSDP (2 replicas x 2 shards on 4 ranks).


@pytest.mark.parametrize("config", CHECKPOINTED)
def test_hsdp_matches_single_process(config: str, hsdp: list[dict[str, Any]]) -> None:
    """In lockstep with one process; a ``(Replicate, Shard)`` norm sums 2 shards' partials."""
    for rank, result in enumerate(hsdp):
        if config == "dreamerv3":  # local shards; norms summed over the shard dimension only
            assert result["fast_dreamerv3"] == {
                "sharded": True,
                "ranks": [rank - rank % 2, rank - rank % 2 + 1],
            }
        for param, state in result[f"placements_{config}"]:
            assert param == (Replicate(), Shard(0))
            assert all(s == param for s in state)  # state sharded like the params
    check_lockstep(config, hsdp, f"records_{config}", exact=False)


def test_hsdp_transform_engine_matches_single_process(hsdp: list[dict[str, Any]]) -> None:
    """TransformOptimizer's engine on HSDP's shards: its global norm summed over the shard
    dimension only (its group's ranks), every step in lockstep with one process."""
    for rank, result in enumerate(hsdp):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert result["fast_engine"] == {"sharded": True, "ranks": pair, "steps": HALF}
    check_lockstep("engine", hsdp, "records_engine", exact=False)


@pytest.mark.parametrize("config", CHECKPOINTED)
def test_dcp_hsdp_four_ranks_to_fsdp_two_ranks(
    config: str, fsdp: list[dict[str, Any]], hsdp: list[dict[str, Any]]
) -> None:
    for result in fsdp:
        assert_identical(result[f"loaded_hsdp_{config}"], hsdp[0][f"saved_{config}"])
    check_lockstep(config, fsdp, f"records_resumed_hsdp_{config}", exact=False)


def test_stepper_sync_modules_option() -> None:
    model = make_model()
    opt = TransformOptimizer(model.parameters(), fo.adam(1e-2))
    with pytest.raises(ValueError, match="no DistributedDataParallel or fully_shard"):
        MixedPrecisionOptimizationStepper(opt, sync_modules=model)  # nothing to defer
    with pytest.raises(ValueError, match=r"sync_modules\[1\] must be an nn"):
        MixedPrecisionOptimizationStepper(opt, sync_modules=[model, "model"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="sync_modules must be an nn"):
        MixedPrecisionOptimizationStepper(opt, sync_modules=3)  # type: ignore[arg-type]


def test_stepper_rejects_a_data_parallel_context_without_sync_gradients() -> None:
    model = make_model()
    stepper = MixedPrecisionOptimizationStepper(
        TransformOptimizer(model.parameters(), fo.adam(1e-2))
    )
    trainer = Trainer(model, 0, 1)
    trainer.data_parallel_context = object()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="sync_gradients"):
        stepper.step(trainer, make_batches(1)[0])
