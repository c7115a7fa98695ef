"""Distributed optimizer-step benchmark: an FSDP2 rank's step vs one process on the same sizes.

Two gloo ranks on this machine (a ``FileStore`` rendezvous, 127.0.0.1), one torch thread each,
shard an MLP of ``layers`` square ``width x width`` linear layers with ``fully_shard`` (the
default: 6 layers of 1024, 6.3M params, about 3.1M per rank). Each optimizer steps the sharded
params with random ``DTensor`` gradients; the median time of ``optimizer.step()`` per rank is
compared with one process (one thread) stepping plain params of the rank's local shard sizes.
Steps are timed in CPU time of the process by default (``--clock cpu``: time spent waiting for
a core that another process holds, or for the other rank in a collective, is not counted) or in
wall time (``--clock wall``, the per-rank latency). Each distributed step is also counted in
collectives (all-reduces, all-gathers, ...), one step under :class:`CollectiveLog`, and one
step without it by the sequence number of the mesh's process group (under a dispatch mode
``torch.compile`` runs no compiled code, so the log sees the eager form of a compiled step: the
number counts the compiled step's own collectives).

    python benchmarks/distributed.py            # the table, as in docs/distributed.md
    python benchmarks/distributed.py --quick    # 2 layers of 512, fewer steps

:func:`rows` returns the measurements (for ``benchmarks/run.py``), :func:`table` formats them.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import functional_opt as fo
from functional_opt.adapters import DreamerV3Optimizer, TransformOptimizer

WORLD = 2
MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# ----------------------------------------------------------------------------- collectives

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_")


def collective_kind(op: str) -> str:
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, or the op's name."""
    name = op.strip("_").replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        if kind in name:
            return kind
    return name


@dataclass(frozen=True)
class Collective:
    """One collective call: the op, its kind, and the dtype and size of its first input."""

    op: str
    kind: str
    dtype: torch.dtype | None
    numel: int


class CollectiveLog(TorchDispatchMode):
    """While active, records every collective this process issues, in order: the ops of
    ``torch.distributed`` (also those DDP's reducer and FSDP2 issue) and ``DTensor``'s
    functional collectives, which all pass through the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in _NAMESPACES:
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

    def counts(self) -> dict[str, int]:
        """Calls per kind."""
        return dict(Counter(c.kind for c in self.calls))


# ----------------------------------------------------------------------------- optimizers


def _clipped_adamw() -> fo.GradientTransformation:
    return fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3, weight_decay=1e-2))


def optimizers() -> dict[str, MakeOptimizer]:
    """The optimizers compared: ours (DreamerV3, the engine's Adam-family chains) and torch's
    Adam."""
    return {
        "DreamerV3Optimizer": lambda ps: DreamerV3Optimizer(ps, lr=1e-4, warmup_steps=0),
        "TransformOptimizer(fo.dreamerv3)": lambda ps: TransformOptimizer(
            ps, fo.dreamerv3(1e-4, warmup=0)
        ),
        "TransformOptimizer(adamw)": lambda ps: TransformOptimizer(
            ps, fo.adamw(1e-3, weight_decay=1e-2)
        ),
        "TransformOptimizer(chain(clip_by_global_norm, adamw))": lambda ps: TransformOptimizer(
            ps, _clipped_adamw()
        ),
        "TransformOptimizer(apply_if_finite(chain(clip_by_global_norm, adamw)))": (
            lambda ps: TransformOptimizer(ps, fo.apply_if_finite(_clipped_adamw(), 3))
        ),
        "torch.optim.Adam(foreach=True)": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    }


def clock_fn(clock: str) -> Callable[[], float]:
    return time.process_time if clock == "cpu" else time.perf_counter


def time_steps(
    opt: torch.optim.Optimizer, steps: int, warmup: int, clock: str, sync: Callable[[], None]
) -> float:
    """Median seconds of ``opt.step()`` over ``steps`` steps after ``warmup`` untimed ones;
    ``sync`` lines the ranks up before each step."""
    return time_interleaved([opt], steps, warmup, clock, sync)[0]


def time_interleaved(
    opts: list[torch.optim.Optimizer],
    steps: int,
    warmup: int,
    clock: str,
    sync: Callable[[], None],
) -> list[float]:
    """:func:`time_steps` of several optimizers in turn, a step of each per round, so that
    whatever else the machine does in that time weighs on them alike (their ratio is then
    steadier than that of two runs one after the other)."""
    now = clock_fn(clock)
    times: list[list[float]] = [[] for _ in opts]
    for i in range(warmup + steps):
        for opt, column in zip(opts, times, strict=True):
            sync()
            start = now()
            opt.step()
            end = now()
            if i >= warmup:
                column.append(end - start)
    return [statistics.median(column) for column in times]


# ----------------------------------------------------------------------------- the ranks


def _rank(rank: int, world: int, store: str, out_dir: str, config: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        results: dict[str, Any] = {}
        for name, make in optimizers().items():
            torch.manual_seed(0)
            model = nn.Sequential(
                *[nn.Linear(config["width"], config["width"]) for _ in range(config["layers"])]
            )
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            params = list(model.parameters())
            gen = torch.Generator().manual_seed(1 + rank)
            for p in params:
                local = p.to_local()  # type: ignore[attr-defined]
                grad = 1e-3 * torch.randn(local.shape, generator=gen)
                p.grad = DTensor.from_local(
                    grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            opt = make(params)
            opt.step()  # state created (and any kernel compiled) before counting and timing
            with CollectiveLog() as log:
                opt.step()
            group = mesh.get_group(0)
            seq = group._get_sequence_number_for_group()
            opt.step()
            issued = group._get_sequence_number_for_group() - seq
            shapes = [tuple(p.to_local().shape) for p in params]  # type: ignore[attr-defined]
            # The same optimizer on plain params of this rank's local sizes, both ranks at once
            # (what the machine gives two processes that share its memory and caches, without
            # any sharding), timed in turn with the sharded step, under the same conditions.
            plain = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
            for q in plain:
                q.grad = 1e-3 * torch.randn(q.shape, generator=gen)
            plain_opt = make(plain)
            plain_opt.step()
            seconds, both = time_interleaved(
                [opt, plain_opt], config["steps"], config["warmup"], config["clock"], dist.barrier
            )
            results[name] = {
                "seconds": seconds,
                "plain_seconds": both,
                "collectives": log.counts(),
                "issued": issued,
                "local_shapes": shapes,
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def single_process(
    shapes: Iterable[tuple[int, ...]], steps: int, warmup: int, clock: str
) -> dict[str, float]:
    """Median step seconds of each optimizer in this process (one thread) on plain params of
    ``shapes`` with random gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, make in optimizers().items():
            gen = torch.Generator().manual_seed(0)
            params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
            for p in params:
                p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
            opt = make(params)
            opt.step()
            out[name] = time_steps(opt, steps, warmup, clock, lambda: None)
        return out
    finally:
        torch.set_num_threads(threads)


def rows(
    layers: int = 6,
    width: int = 1024,
    steps: int = 15,
    warmup: int = 3,
    clock: str = "cpu",
    timeout: float = 600.0,
) -> list[dict[str, Any]]:
    """One row per optimizer: ``name``, ``single_ms`` (one process, the rank's local sizes),
    ``fsdp_ms`` (the slower rank's median), ``ratio``, ``collectives`` (per step, by kind, on
    one rank), ``issued`` (collectives of a step without the log, on the mesh's group),
    ``local_params`` and ``clock``."""
    config = {"layers": layers, "width": width, "steps": steps, "warmup": warmup, "clock": clock}
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank,
            args=(WORLD, str(Path(tmp) / "store"), tmp, config),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the ranks did not finish within {timeout} s")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]
    shapes = next(iter(ranks[0].values()))["local_shapes"]
    single = single_process(shapes, steps, warmup, clock)
    out = []
    for name, seconds in single.items():
        fsdp = max(r[name]["seconds"] for r in ranks)
        both = max(r[name]["plain_seconds"] for r in ranks)
        out.append(
            {
                "name": name,
                "single_ms": 1e3 * seconds,
                "fsdp_ms": 1e3 * fsdp,
                "ratio": fsdp / seconds,
                "both_ms": 1e3 * both,
                "ratio_both": fsdp / both,
                "collectives": ranks[0][name]["collectives"],
                "issued": ranks[0][name]["issued"],
                "local_params": sum(int(torch.Size(s).numel()) for s in shapes),
                "clock": clock,
            }
        )
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    clock = results[0]["clock"] if results else "cpu"
    lines = [
        f"| optimizer | single process, same local sizes ({clock} ms) | FSDP2, per rank "
        f"({clock} ms) | ratio | plain local sizes, both ranks at once ({clock} ms) | FSDP2 / "
        "that | collectives per step (one rank) | issued on the mesh |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(r["collectives"].items())) or "none"
        lines.append(
            f"| `{r['name']}` | {r['single_ms']:.1f} | {r['fsdp_ms']:.1f} | "
            f"{r['ratio']:.2f}x | {r['both_ms']:.1f} | {r['ratio_both']:.2f}x | {counts} | "
            f"{r.get('issued', '?')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="2 layers of 512, 5 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.steps, args.warmup = 2, 512, 5, 2
    results = rows(args.layers, args.width, args.steps, args.warmup, args.clock)
    print(
        f"{WORLD} gloo ranks, 1 thread each; {args.layers} x Linear({args.width}, {args.width}) "
        f"fully sharded: {results[0]['local_params']:,} params per rank"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
