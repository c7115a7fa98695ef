"""Data-parallel training with functional_opt: DDP or FSDP2, on CPU (gloo) or GPUs (NCCL).

    torchrun --nproc-per-node 2 docs/examples/distributed_train.py                # FSDP2
    torchrun --nproc-per-node 2 docs/examples/distributed_train.py --engine ddp   # DDP
    python docs/examples/distributed_train.py                                      # one process

A small regression MLP is trained with ``DreamerV3Optimizer`` driven by
``MixedPrecisionOptimizationStepper`` (gradient accumulation 2, global-norm clipping). Every
rank takes its equal share of each global batch, so all three commands compute the same model:
the printed checksum agrees to float32 rounding. The script then saves a
``torch.distributed.checkpoint`` (DCP) checkpoint; ``--resume`` continues from it, with any
number of processes and either engine (DCP reshards on load), e.g.

    torchrun --nproc-per-node 2 docs/examples/distributed_train.py --steps 10
    python docs/examples/distributed_train.py --steps 20 --resume   # same checksum as --steps 20
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from functional_opt.adapters import DreamerV3Optimizer, MixedPrecisionOptimizationStepper

ACCUMULATION = 2  # micro-batches per optimizer step
GLOBAL_BATCH = 32  # samples per micro-batch, over all ranks


class Trainer:
    """What the stepper calls: ``compute_loss`` on this rank's share of a global batch."""

    def __init__(self, model: nn.Module, rank: int, world: int, device: torch.device) -> None:
        self.model, self.rank, self.world, self.device = model, rank, world, device

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        x, y = (t.chunk(self.world)[self.rank].to(self.device) for t in batch)
        return {"loss": nn.functional.mse_loss(self.model(x), y)}


def global_batch(index: int) -> tuple[Tensor, Tensor]:
    """Micro-batch ``index`` of a synthetic regression task (the same on every rank)."""
    g = torch.Generator().manual_seed(index)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x, torch.sin(x[:, :2] * 2) + 0.1 * torch.randn(GLOBAL_BATCH, 2, generator=g)


def full_tensor(x: Tensor) -> Tensor:
    """A whole tensor: FSDP2's parameters are ``DTensor`` shards (a collective gathers them)."""
    full = getattr(x, "full_tensor", None)
    return (full() if full is not None else x).detach()


def checkpoint_state(
    net: nn.Module, optimizer: torch.optim.Optimizer, stepper: MixedPrecisionOptimizationStepper
) -> dict[str, Any]:
    """What DCP saves (and, for a new model and optimizer, the template it loads into): the
    model's and the optimizer's state dicts keyed by parameter name (``DTensor`` shards under
    FSDP2), and the stepper's own state (counters, loss scale), the same on every rank."""
    return {
        "model": get_model_state_dict(net),
        "optim": get_optimizer_state_dict(net, optimizer),
        "stepper": {k: v for k, v in stepper.state_dict().items() if k != "optimizer"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["fsdp2", "ddp"], default="fsdp2")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/distributed_train"))
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        local_rank = 0
        # DCP works without a process group too, and says so once per call: quieten it.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    run(args, distributed, device)
    if distributed:
        # The model and optimizer are gone with run(): a DDP wrapper that outlives the process
        # group can deadlock gloo's teardown at exit.
        dist.barrier()
        dist.destroy_process_group()


def run(args: argparse.Namespace, distributed: bool, device: torch.device) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if GLOBAL_BATCH % world:
        raise SystemExit(f"the global batch ({GLOBAL_BATCH}) must split evenly over {world} ranks")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(8, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 2)
    ).to(device)
    net: nn.Module = model
    if distributed and args.engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # parameters, gradients and optimizer state: DTensors
    elif distributed:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    # Build the optimizer after wrapping: FSDP2 replaces the parameters with sharded ones.
    optimizer = DreamerV3Optimizer(net.parameters(), lr=3e-3, agc=0.3, warmup_steps=5)
    stepper = MixedPrecisionOptimizationStepper(
        optimizer, gradient_accumulation_steps=ACCUMULATION, clip_norm=1.0
    )
    trainer = Trainer(net, rank, world, device)

    if args.resume:
        # The new model and optimizer (sharded or not) are the template; DCP reshards into it.
        state = checkpoint_state(net, optimizer, stepper)
        dcp.load(state, checkpoint_id=str(args.checkpoint))
        set_model_state_dict(net, state["model"])
        set_optimizer_state_dict(net, optimizer, state["optim"])
        stepper.load_state_dict({**state["stepper"], "optimizer": optimizer.state_dict()})

    metrics: dict[str, Tensor] = {}
    while stepper.optimizer_step_count < args.steps:
        start = stepper.optimizer_step_count * ACCUMULATION
        for index in range(start, start + ACCUMULATION):
            metrics = stepper.step(trainer, global_batch(index))

    dcp.save(checkpoint_state(net, optimizer, stepper), checkpoint_id=str(args.checkpoint))

    checksum = sum(float(full_tensor(p).double().sum()) for p in model.parameters())
    if rank == 0:
        loss = float(metrics["loss"]) if metrics else float("nan")
        print(
            f"{args.engine if distributed else 'single process'} x{world}: "
            f"{stepper.optimizer_step_count} steps, last loss {loss:.5f}, "
            f"grad_norm {float(metrics.get('grad_norm', float('nan'))):.5f}, "
            f"parameter checksum {checksum:.6f}; checkpoint in {args.checkpoint}"
        )


if __name__ == "__main__":
    main()
