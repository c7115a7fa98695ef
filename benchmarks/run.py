"""Optimizer-step benchmark: ours vs torch.optim, torchrl and optax, side by side in one process.

Every method steps the same parameters and gradients; methods are interleaved round by round,
and each is reported as the median over rounds of its step time divided by that of
``torch.optim.Adam(fused=True)`` in the same round, on the same workload (absolute times on
shared machines are noise, ratios measured together are not). Steps are timed in CPU time of
the process (``--clock cpu``, the default: time spent waiting for a core that another process
holds is not counted) or wall time (``--clock wall``). torch is pinned to one thread (and
JAX/XLA to one CPU thread) so that another process on the machine cannot make the spinning
OpenMP threads of one method slower than another's.

    python benchmarks/run.py                 # all workloads, writes docs/performance-table.md
    python benchmarks/run.py --quick         # fewer rounds, smaller workloads
    python benchmarks/run.py --scaling       # time vs parameter count and tensor count
    python benchmarks/run.py --cold          # W1's first step with an empty compiler cache
    python benchmarks/run.py --workloads W2  # re-measure W2 only; the others come from the store
    python benchmarks/run.py --distributed   # also the FSDP2 step (benchmarks/distributed.py)

Each run stores what it measured, per workload and method, in ``benchmarks/results.json``
(``--results``), and writes the table from that store: a run limited to some workloads
(``--workloads``) or methods (``--methods``) replaces those cells and keeps the others, each
still a ratio to fused Adam measured side by side in its own run (the table says when each
workload was last measured).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse
import datetime
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

import functional_opt as fo

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
Step = Callable[[], None]


# ----------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        total = 0
        for s in self.shapes:
            n = 1
            for d in s:
                n *= d
            total += n
        return total


def dreamer_mix(scale: float = 1.0) -> list[tuple[int, ...]]:
    """A DreamerV3-sized mix: 60 weight matrices and 60 vectors, about 12.1M params."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(30):
        shapes += [(int(1024 * scale), 256), (1024,)]
    for _ in range(20):
        shapes += [(int(512 * scale), 384), (512,)]
    for _ in range(10):
        shapes += [(int(128 * scale), 256), (128,)]
    return shapes


def workloads(quick: bool) -> list[Workload]:
    s = 0.25 if quick else 1.0
    return [
        Workload("W1: 120 tensors, DreamerV3 mix", dreamer_mix(s)),
        Workload("W2: 2000 tensors x 1000", [(1000,)] * (500 if quick else 2000)),
        Workload("W3: one tensor of 16.8M", [(int(2**24 * s),)]),
        Workload("W1-bf16", dreamer_mix(s), torch.bfloat16),
    ]


def make_params(w: Workload, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in w.shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(w.dtype) * 0.1)
        p.grad = (torch.randn(shape, generator=g) * 0.01).to(w.dtype)
        params.append(p)
    return params


# ----------------------------------------------------------------------------- methods
def torch_adam(params: list[torch.nn.Parameter], **kw: bool) -> Step:
    opt = torch.optim.Adam(params, lr=1e-4, **kw)
    return lambda: opt.step()


def torchrl_dreamer(params: list[torch.nn.Parameter]) -> Step | None:
    try:
        from torchrl.trainers.algorithms import DreamerV3Optimizer as TorchRL
    except ImportError:
        return None
    opt = TorchRL(params, lr=1e-4, warmup_steps=0)
    return lambda: opt.step()


def ours_adapter(
    params: list[torch.nn.Parameter], flat: bool = True, own: bool = False
) -> Step | None:
    try:
        from functional_opt.adapters import DreamerV3Optimizer
    except ImportError:
        return None
    opt = DreamerV3Optimizer(params, lr=1e-4, warmup_steps=0, own_param_storage=own)
    opt.flat_step = flat
    return lambda: opt.step()


def ours_functional(
    params: list[torch.nn.Parameter], compiled: bool = False, donate: bool = False
) -> Step:
    """``tx.update`` then ``apply_updates``; ``compiled``: the update under ``torch.compile``."""
    tx = fo.dreamerv3(lr=1e-4, warmup=0)
    holder = {"p": [p.detach().clone() for p in params]}
    grads = [p.grad for p in params]
    # With donation the update is written into the gradients' buffers, so later steps see other
    # gradient values (the same work: no branch depends on them), as the adapter's steps do.
    holder["s"] = tx.init(holder["p"])
    update = functools.partial(tx.update, donate=True) if donate else tx.update
    if compiled:
        update = torch.compile(update, fullgraph=True)

    def step() -> None:
        u, holder["s"] = update(grads, holder["s"], holder["p"])
        holder["p"] = fo.apply_updates(holder["p"], u, donate=donate)

    return step


def ours_packed(params: list[torch.nn.Parameter]) -> Step:
    """``tx.update`` then ``apply_updates``, both donated, over packed trees
    (``functional_opt.pack``: params, gradients and moments in one flat buffer per dtype, as a
    ``torch.func.grad`` of packed params returns them)."""
    tx = fo.dreamerv3(lr=1e-4, warmup=0)
    holder = {"p": fo.pack([p.detach() for p in params])}
    grads = fo.pack([p.grad for p in params])
    holder["s"] = tx.init(holder["p"])

    def step() -> None:
        u, holder["s"] = tx.update(grads, holder["s"], holder["p"], donate=True)
        holder["p"] = fo.apply_updates(holder["p"], u, donate=True)

    return step


def ours_compiled_step(params: list[torch.nn.Parameter], packed: bool = False) -> Step:
    """Update and ``apply_updates`` compiled together, both donated (what compiling a whole
    training step gives: inductor adds the update to the params in the update's own pass);
    with ``packed``, over packed trees (``fo.pack``: the graph runs over the buffers, a few ops
    whatever the number of leaves)."""
    tx = fo.dreamerv3(lr=1e-4, warmup=0)
    ps = [p.detach().clone() for p in params]
    gs = [p.grad for p in params if p.grad is not None]
    holder: dict[str, Any] = {"p": fo.pack(ps) if packed else ps}
    grads = fo.pack(gs) if packed else gs
    holder["s"] = tx.init(holder["p"])

    def whole(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        u, s = tx.update(g, s, p, donate=True)
        return fo.apply_updates(p, u, donate=True), s

    compiled = torch.compile(whole, fullgraph=True)

    def step() -> None:
        holder["p"], holder["s"] = compiled(grads, holder["s"], holder["p"])

    return step


def ours_compiled_fused_step(params: list[torch.nn.Parameter]) -> Step:
    """A compiled step that calls ``fo.fused_step``: over a plain tree the step is one op of the
    graph, which runs the engine's step (see ``functional_opt.compiled_step``)."""
    tx = fo.dreamerv3(lr=1e-4, warmup=0)
    holder = {"p": {f"p{i}": p.detach().clone() for i, p in enumerate(params)}}
    grads = {f"p{i}": p.grad for i, p in enumerate(params) if p.grad is not None}
    holder["s"] = tx.init(holder["p"])
    compiled = torch.compile(fo.fused_step(tx), fullgraph=True)

    def step() -> None:
        holder["p"], holder["s"] = compiled(holder["p"], grads, holder["s"])

    return step


def optax_dreamer(params: list[torch.nn.Parameter]) -> Step | None:
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except ImportError:
        return None

    def clip_by_agc(clip: float = 0.3, pmin: float = 1e-3) -> optax.GradientTransformation:
        def update(updates, state, params):  # type: ignore[no-untyped-def]
            def fn(p, u):  # type: ignore[no-untyped-def]
                upper = clip * jnp.maximum(pmin, jnp.linalg.norm(p.ravel()))
                return u * (1 / jnp.maximum(1.0, jnp.linalg.norm(u.ravel()) / upper))

            return jax.tree.map(fn, params, updates), state

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    tx = optax.chain(
        clip_by_agc(),
        optax.scale_by_rms(0.999, 1e-20, eps_in_sqrt=False, bias_correction=True),
        optax.ema(0.9),
        optax.scale_by_learning_rate(1e-4),
    )
    dtype = jnp.bfloat16 if params[0].dtype == torch.bfloat16 else jnp.float32
    p = [jnp.asarray(x.detach().float().numpy(), dtype=dtype) for x in params]
    g = [jnp.asarray(x.grad.float().numpy(), dtype=dtype) for x in params]
    holder = {"p": p, "s": tx.init(p)}

    # params and state donated: XLA updates them in place, as our donated steps do (a fair peer)
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_fn(p, s, g):  # type: ignore[no-untyped-def]
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def step() -> None:
        holder["p"], holder["s"] = step_fn(holder["p"], holder["s"], g)
        jax.block_until_ready(holder["p"])

    return step


PARTITION = "partition(adam: matrices, sgd momentum: vectors)"
"""The name of the bench's ``partition`` chain (its rows in several families)."""

CHAINS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "adam": lambda: fo.adam(1e-4),
    "adamw": lambda: fo.adamw(1e-4, weight_decay=1e-2),
    "sgd momentum": lambda: fo.sgd(1e-4, 0.9),
    "chain(clip_by_global_norm, adamw)": lambda: fo.chain(
        fo.clip_by_global_norm(1.0), fo.adamw(1e-4, weight_decay=1e-2)
    ),
    "adamw, no decay on vectors": lambda: fo.adamw(
        1e-4, weight_decay=1e-2, mask=lambda p: fo.tree_map(lambda x: x.ndim > 1, p)
    ),
    # the chain's definition compiled by the engine, next to the hand-fused DreamerV3Optimizer
    "dreamerv3": lambda: fo.dreamerv3(1e-4, warmup=0),
    # the wrappers (issue 16's "also fast"): a finite check around the clip chain; gradient
    # accumulation, where the median call is a mini-step (3 calls in 4 only accumulate); a
    # partition of the params by rank
    "apply_if_finite(chain(clip_by_global_norm, adamw))": lambda: fo.apply_if_finite(
        fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-4, weight_decay=1e-2)), 3
    ),
    "MultiSteps(adamw, 4), a mini-step": lambda: fo.multi_steps(
        fo.adamw(1e-4, weight_decay=1e-2), 4
    ),
    PARTITION: lambda: fo.chain(
        fo.partition(
            {"adam": fo.scale_by_adam(), "sgd": fo.trace(0.9)},
            lambda ps: fo.tree_map(lambda x: "adam" if x.ndim > 1 else "sgd", ps),
        ),
        fo.scale_by_learning_rate(1e-4),
    ),
}
"""The chains of the engine's targets (issue 16)."""


def ours_transform_optimizer(
    params: list[torch.nn.Parameter],
    chain: str,
    bucket: bool = False,
    fused: bool = True,
    vary_lr: bool = False,
) -> Step:
    """``TransformOptimizer`` of a ready-made chain. By default the gradients are separate
    tensors each step (what ``zero_grad()``'s default, set_to_none, gives) and are copied into
    the engine's flat buffer; ``bucket``: the gradients are views of that buffer (bucket views,
    as after ``zero_grad(set_to_none=False)``), so the step copies nothing. ``vary_lr``: the
    group's ``lr`` changes before every step, as an LR scheduler changes it (it must not
    recompile)."""
    from functional_opt.adapters import TransformOptimizer

    opt = TransformOptimizer(params, CHAINS[chain]())
    opt.fused_steps = fused
    if vary_lr:
        group = opt.param_groups[0]

        def scheduled() -> None:
            group["lr"] = group["lr"] * 0.999
            opt.step()

        return FreshGrads(params, scheduled)
    if not bucket:
        return FreshGrads(params, lambda: opt.step())
    # the same gradient tensors every step: from the second step on the packed params' are
    # the engine's views of its gradient buffer
    return lambda: opt.step()


class FreshGrads:
    """A step whose params get gradient tensors other than the last step's (what backward
    leaves after ``zero_grad()``'s default ``set_to_none=True``), set by :meth:`before`
    (outside the timed call: two sets of gradients taken in turn)."""

    def __init__(self, params: list[torch.nn.Parameter], step: Step) -> None:
        self.params = params
        self.step = step
        grads = [p.grad for p in params]
        self.sets = [grads, [None if g is None else g.clone() for g in grads]]
        self.turn = 0

    def before(self) -> None:
        self.turn ^= 1
        for p, g in zip(self.params, self.sets[self.turn], strict=True):
            p.grad = g

    def __call__(self) -> None:
        self.step()


def ours_pure_chain(
    params: list[torch.nn.Parameter], chain: str, engine: bool, packed: bool = True
) -> Step:
    """The pure API, donated update + apply: through ``fo.fused`` (``engine``) over packed
    trees or (``packed=False``) over the plain list of tensors, or over the plain list
    without the engine."""
    tx = CHAINS[chain]()
    if engine:
        tx = fo.fused(tx)
        pack: Callable[[Any], Any] = fo.pack if packed else list
        holder: dict[str, Any] = {"p": pack([p.detach().clone() for p in params])}
        grads: Any = pack([p.grad for p in params])
    else:
        holder = {"p": [p.detach().clone() for p in params]}
        grads = [p.grad for p in params]
    holder["s"] = tx.init(holder["p"])

    def step() -> None:
        u, holder["s"] = tx.update(grads, holder["s"], holder["p"], donate=True)
        holder["p"] = fo.apply_updates(holder["p"], u, donate=True)

    return step


def ours_fused_step(params: list[torch.nn.Parameter], chain: str, packed: bool = True) -> Step:
    """``fo.fused_step``: the pure donated update and ``apply_updates`` compiled as one graph
    over packed trees; ``packed=False``: over the plain list of tensors (a leafwise chain is
    stepped leaf by leaf in place, one compiled call per leaf)."""
    tx = CHAINS[chain]()
    step = fo.fused_step(tx)
    pack: Callable[[Any], Any] = fo.pack if packed else (lambda x: x)
    holder: dict[str, Any] = {"p": pack([p.detach().clone() for p in params])}
    grads = pack([p.grad.clone() for p in params])  # type: ignore[union-attr]
    holder["s"] = tx.init(holder["p"])

    def run() -> None:
        holder["p"], holder["s"] = step(holder["p"], grads, holder["s"])

    return run


def heavyball_adamw(params: list[torch.nn.Parameter]) -> Step | None:
    try:
        import heavyball  # type: ignore[import-not-found]
    except ImportError:
        return None
    opt = heavyball.AdamW(params, lr=1e-4)
    return lambda: opt.step()


PURE_PLAIN = (
    "adam",
    "adamw",
    "sgd momentum",
    "dreamerv3",
    "chain(clip_by_global_norm, adamw)",
    "apply_if_finite(chain(clip_by_global_norm, adamw))",
    PARTITION,
)
"""The chains whose pure update and ``fused_step`` over plain trees the bench times."""


METHODS: dict[str, Callable[[list[torch.nn.Parameter]], Step | None]] = {
    "Adam fused": lambda ps: torch_adam(ps, fused=True),
    "Adam foreach": lambda ps: torch_adam(ps, foreach=True),
    "torchrl DreamerV3Optimizer": torchrl_dreamer,
    "optax DreamerV3 chain (jit)": optax_dreamer,
    "ours: functional eager": ours_functional,
    "ours: functional eager, donated": lambda ps: ours_functional(ps, donate=True),
    "ours: functional eager, donated, packed trees": ours_packed,
    "ours: functional compiled": lambda ps: ours_functional(ps, compiled=True),
    "ours: functional compiled, donated": lambda ps: ours_functional(ps, True, True),
    "ours: compiled step (update + apply), donated": ours_compiled_step,
    "ours: compiled step (update + apply), donated, packed trees": lambda ps: ours_compiled_step(
        ps, packed=True
    ),
    "ours: compiled step calling fused_step (one op)": ours_compiled_fused_step,
    "ours: DreamerV3Optimizer, generic path": lambda ps: ours_adapter(ps, flat=False),
    "ours: DreamerV3Optimizer": ours_adapter,
    "ours: DreamerV3Optimizer(own_param_storage=True)": lambda ps: ours_adapter(ps, own=True),
    "heavyball AdamW": heavyball_adamw,
    **{
        f"ours: TransformOptimizer({c})": functools.partial(ours_transform_optimizer, chain=c)
        for c in CHAINS
    },
    **{
        f"ours: TransformOptimizer({c}), bucket-view grads": functools.partial(
            ours_transform_optimizer, chain=c, bucket=True
        )
        for c in ("adam", "chain(clip_by_global_norm, adamw)")
    },
    "ours: TransformOptimizer(adam), per-tensor path (before the engine)": functools.partial(
        ours_transform_optimizer, chain="adam", fused=False
    ),
    "ours: TransformOptimizer(adamw), lr changed before every step": functools.partial(
        ours_transform_optimizer, chain="adamw", vary_lr=True
    ),
    **{
        f"ours: pure fused {c}, packed, donated": functools.partial(
            ours_pure_chain, chain=c, engine=True
        )
        for c in ("adam", "chain(clip_by_global_norm, adamw)", PARTITION)
    },
    **{
        f"ours: pure fused {c}, plain trees, donated": functools.partial(
            ours_pure_chain, chain=c, engine=True, packed=False
        )
        for c in PURE_PLAIN
    },
    **{
        f"ours: pure fused_step {c}, packed": functools.partial(ours_fused_step, chain=c)
        for c in ("adam", "chain(clip_by_global_norm, adamw)", "dreamerv3", PARTITION)
    },
    **{
        f"ours: pure fused_step {c}, plain trees": functools.partial(
            ours_fused_step, chain=c, packed=False
        )
        for c in (
            *PURE_PLAIN,
            "adamw, no decay on vectors",
            "MultiSteps(adamw, 4), a mini-step",
        )
    },
    "ours: pure chain(clip_by_global_norm, adamw), plain trees, donated": functools.partial(
        ours_pure_chain, chain="chain(clip_by_global_norm, adamw)", engine=False
    ),
}


def peak_extra_bytes(step: Step) -> int | None:
    """Peak bytes allocated (net of frees) during one call of ``step``, from torch's profiler
    (torch's CPU allocator only: JAX's memory is not seen)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Each allocation and free counted once, in the event that made it (an event's total usage
    # also counts its children's). An event's own frees are applied at its end and its own
    # allocations at its start, so the result is never below the true peak.
    changes = []
    for e in prof.events():
        own = e.self_cpu_memory_usage
        if own:
            changes.append((e.time_range.end if own < 0 else e.time_range.start, own))
    running = peak = 0
    for _, own in sorted(changes):
        running += own
        peak = max(peak, running)
    return peak


def copy_bandwidth(numel: int = 2**24, repeats: int = 15) -> float:
    """Measured streaming bandwidth in bytes/s: the better of a large float32 copy (8 bytes per
    element) and ``c = a + b`` (12 bytes per element, the read-read-write pattern of an
    optimizer step), as medians."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    best = 0.0
    for nbytes, fn in ((8, lambda: c.copy_(a)), (12, lambda: torch.add(a, b, out=c))):
        fn()
        times = []
        for _ in range(repeats):
            start = clock()
            fn()
            times.append(clock() - start)
        best = max(best, nbytes * numel / statistics.median(times))
    return best


SKIP = {
    ("ours: functional compiled", "W2"),
    ("ours: functional compiled, donated", "W2"),
    ("ours: compiled step (update + apply), donated", "W2"),
    ("ours: compiled step calling fused_step (one op)", "W2"),
}
"""(method, workload) pairs not run: compiling an update over 2000 separate tensors takes
minutes (one compile of the donated update had not finished after 20), which no user would
pay."""


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


MEMORY_BUDGET = 8 << 30
"""Bytes of workload tensors :func:`bench` lets the methods it interleaves hold at once (the
machines this runs on have about 24 GB: W3's 16.8M params over every method held at once did
not fit). More methods run in batches, each interleaved with fused Adam."""

PER_METHOD = 8
"""Tensors of the workload's size a method holds, about (params, gradients, two moments, the
pure methods' copies, staging and update buffers)."""


def bench(
    w: Workload, rounds: int, methods: list[str], memory: dict[str, int | None]
) -> dict[str, float]:
    """Each method's median step time in seconds, and under ``"<name> / Adam fused"`` its
    median over rounds of the ratio to fused Adam's time in the same round. Methods whose
    tensors would exceed :data:`MEMORY_BUDGET` together run in batches, each with fused Adam
    (a ratio is always to fused Adam measured side by side with it)."""
    others = [m for m in methods if m != "Adam fused"]
    size = w.numel * w.dtype.itemsize * PER_METHOD
    per_batch = max(1, MEMORY_BUDGET // max(size, 1) - 1)
    if "Adam fused" not in methods or len(others) <= per_batch:
        return _bench_batch(w, rounds, methods, memory)
    out: dict[str, float] = {}
    for start in range(0, len(others), per_batch):
        batch = ["Adam fused", *others[start : start + per_batch]]
        found = _bench_batch(w, rounds, batch, memory)
        if start:  # (fused Adam's own time: from the first batch)
            found = {k: v for k, v in found.items() if not k.startswith("Adam fused")}
        out.update(found)
    return out


def _bench_batch(
    w: Workload, rounds: int, methods: list[str], memory: dict[str, int | None]
) -> dict[str, float]:
    """:func:`bench` of methods that run together."""
    steps: dict[str, Step] = {}
    for name in methods:
        if (name, w.name.split(":")[0]) in SKIP:
            continue
        params = make_params(w)
        step = METHODS[name](params)
        if step is None:
            continue
        before = getattr(step, "before", None)
        start = time.perf_counter()
        if before is not None:
            before()
        step()  # warm-up (and compile)
        first = time.perf_counter() - start
        print(f"  {name}: first call {first:.2f} s", file=sys.stderr)
        if before is not None:
            before()
        step()
        if before is not None:
            before()
        memory[name] = None if "optax" in name else peak_extra_bytes(step)
        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            before = getattr(step, "before", None)
            if before is not None:
                before()
            gc.collect()
            start = clock()
            step()
            times[name].append(clock() - start)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    base = times.get("Adam fused")
    if base:
        for name, ts in times.items():
            out[f"{name} / Adam fused"] = statistics.median(
                t / b for t, b in zip(ts, base, strict=True)
            )
    return out


COLD: list[tuple[str, int]] = [
    ("ours: compiled step (update + apply), donated", 0),
    ("ours: compiled step (update + apply), donated, packed trees", 0),
    ("ours: compiled step (update + apply), donated, packed trees", 1),
    ("ours: compiled step calling fused_step (one op)", 0),
    ("ours: DreamerV3Optimizer", 0),
    ("ours: functional eager, donated", 0),
    ("ours: TransformOptimizer(adam)", 0),
    ("ours: TransformOptimizer(adam)", 1),
    ("ours: pure fused_step chain(clip_by_global_norm, adamw), packed", 0),
    ("ours: pure fused_step chain(clip_by_global_norm, adamw), packed", 1),
    ("ours: pure fused_step adam, plain trees", 0),
    ("ours: pure fused_step adam, plain trees", 1),
    ("ours: pure fused_step chain(clip_by_global_norm, adamw), plain trees", 0),
    ("ours: TransformOptimizer(chain(clip_by_global_norm, adamw))", 0),
    ("ours: TransformOptimizer(apply_if_finite(chain(clip_by_global_norm, adamw)))", 0),
]
"""The methods whose first step is timed with a cold compiler cache (``--cold``), each with the
index of its workload in :func:`workloads`."""


class ColdCall(NamedTuple):
    """A first step with an empty compiler cache, in seconds: ``whole``, in a fresh process
    with nothing compiled; ``after_probe``, in another, after inductor's probe of the CPU's
    vector instruction sets (``probe`` seconds), which compiles a few test programs into the
    cache once per cache directory (every later ``torch.compile`` on that machine finds them
    there), whatever is compiled."""

    whole: float
    probe: float
    after_probe: float


_COLD_STEP = (
    "import sys, time; sys.path.insert(0, sys.argv[1]); import run as B; "
    "w = B.workloads(False)[int(sys.argv[3])]; "
    "step = B.METHODS[sys.argv[2]](B.make_params(w)); "
    "probe = 0.0\n"
    "if sys.argv[4] == '1':\n"
    "    import torch._inductor.cpu_vec_isa as isa\n"
    "    t = time.perf_counter(); isa.valid_vec_isa_list(); probe = time.perf_counter() - t\n"
    "t = time.perf_counter(); step(); print(probe, time.perf_counter() - t)"
)


def cold_first_call(name: str, workload: int = 0) -> ColdCall | None:
    """``name``'s first step on ``workloads()[workload]`` in fresh processes with an empty
    inductor cache (what a user's first run pays for compiling), whole and after the CPU probe
    (see :class:`ColdCall`), or ``None`` on failure."""
    import subprocess
    import tempfile

    times = []
    for probe_first in ("0", "1"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
            args = [sys.executable, "-c", _COLD_STEP, str(Path(__file__).parent), name]
            args += [str(workload), probe_first]
            done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
        try:
            times.append([float(x) for x in done.stdout.strip().splitlines()[-1].split()])
        except (ValueError, IndexError):
            print(f"  cold first call of {name} failed: {done.stderr[-500:]}", file=sys.stderr)
            return None
    return ColdCall(times[0][1], times[1][0], times[1][1])


def scaling(rounds: int) -> str:
    """Step time vs parameter count (one tensor) and vs tensor count (4M params in all)."""
    rows = ["| params | tensors | Adam fused ms | ours ms | ratio |", "|---|---|---|---|---|"]
    cases = [(n, 1) for n in (2**20, 2**22, 2**24, 2**26)]
    cases += [(2**22, k) for k in (100, 1000, 10000)]
    for numel, count in cases:
        w = Workload(f"{numel}x{count}", [(numel // count,)] * count)
        res = bench(w, rounds, ["Adam fused", "ours: DreamerV3Optimizer"], {})
        a, o = res["Adam fused"], res["ours: DreamerV3Optimizer"]
        ratio = res["ours: DreamerV3Optimizer / Adam fused"]
        rows.append(
            f"| {numel / 2**20:.0f}M | {count} | {1e3 * a:.2f} | {1e3 * o:.2f} | {ratio:.2f}x |"
        )
        print(rows[-1])
    return "\n".join(rows)


def chart(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m in METHODS if m != "Adam fused" and any(m in r for r in results.values())]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(results))]
        ys = [r.get(f"{name} / Adam fused", 0.0) for r in results.values()]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="Adam fused = 1")
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(results))])
    ax.set_xticklabels([w.split(":")[0] for w in results])
    ax.set_ylabel("step time / torch.optim.Adam(fused=True)")
    ax.set_title("Optimizer step time relative to fused Adam (lower is better; 1 thread)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(
    results: dict[str, dict[str, float]], bandwidth: dict[str, float], numels: dict[str, int]
) -> str:
    """Each method's ratio to fused Adam per workload (``bandwidth``: each workload's measured
    streaming bandwidth, for the traffic estimate)."""
    names = [*METHODS, "traffic estimate (36 B/param at the measured copy bandwidth)"]
    lines = [
        "| method | " + " | ".join(results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for name in names:
        cells = []
        for wname, res in results.items():
            base = res.get("Adam fused")
            if name.startswith("traffic estimate"):
                bytes_per = 36 if "bf16" not in wname else 26  # bf16 g, p; fp32 moments
                ratio = bytes_per * numels[wname] / bandwidth[wname] / base if base else None
            else:
                ratio = res.get(f"{name} / Adam fused")
            cells.append("n/a" if ratio is None else f"{ratio:.2f}x")
        if any(cell != "n/a" for cell in cells):  # a method measured on no workload: no row
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Fused Adam median step: "
        + ", ".join(
            f"{w.split(':')[0]} {1000 * r['Adam fused']:.1f} ms" for w, r in results.items()
        )
    )
    return "\n".join(lines)


START, END = "<!-- table:start -->", "<!-- table:end -->"


def write_table(path: Path, text: str) -> None:
    """Put ``text`` between the table markers of ``path`` (the whole file if it has none)."""
    old = path.read_text() if path.exists() else ""
    if START in old and END in old:
        head, rest = old.split(START, 1)
        _, tail = rest.split(END, 1)
        path.write_text(f"{head}{START}\n{text}\n{END}{tail}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


SECTIONS = "sections below the table"
"""The store's entry for the texts of ``--cold``, ``--scaling`` and ``--distributed``."""


def load_store(path: Path) -> dict[str, dict[str, Any]]:
    """The stored measurements, by workload name (empty if there are none)."""
    if not path.exists():
        return {}
    data: dict[str, dict[str, Any]] = json.loads(path.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument(
        "--workloads",
        nargs="*",
        default=None,
        help="measure only these (W1 W2 W3 W1-bf16); the others' columns come from --results",
    )
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "performance.md")
    parser.add_argument("--chart", type=Path, default=ROOT / "docs" / "performance.png")
    parser.add_argument("--scaling", action="store_true", help="also time vs size/tensor count")
    parser.add_argument(
        "--cold", action="store_true", help="also time W1's first step with a cold compile cache"
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="also time an FSDP2 rank's step (benchmarks/distributed.py, 2 gloo ranks)",
    )
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="cpu", help="time steps in CPU or wall time"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {sorted(METHODS)}")
    known = [w.name.split(":")[0] for w in workloads(args.quick)]
    if args.workloads is not None and not set(args.workloads) <= set(known):
        parser.error(f"unknown workloads {sorted(set(args.workloads) - set(known))}; {known}")
    global clock
    clock = CLOCKS[args.clock]
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}")
    # First, as in a user's fresh process: measured after the workloads (this process then holds
    # gigabytes of them), the same first step took 15-17 s instead of 10-12 s.
    cold = {
        f"{name} on W{index + 1}": cold_first_call(name, index)
        for name, index in (COLD if args.cold else [])
    }
    bandwidth = copy_bandwidth()
    print(f"streaming bandwidth: {bandwidth / 1e9:.2f} GB/s")
    store = {} if args.quick else load_store(args.results)
    today = datetime.date.today().isoformat()
    for w in workloads(args.quick):
        short = w.name.split(":")[0]
        if args.workloads is not None and short not in args.workloads:
            continue
        print(f"{w.name} ({w.numel / 1e6:.1f}M params, {len(w.shapes)} tensors)")
        memory: dict[str, int | None] = {}
        results = bench(w, 5 if args.quick else args.rounds, args.methods, memory)
        # the methods measured now replace theirs; rows measured by an earlier run stay (each
        # row's ratio is to fused Adam measured side by side in that row's own run)
        kept = store.get(w.name, {})
        store[w.name] = {
            "results": {**kept.get("results", {}), **results},
            "memory": {**kept.get("memory", {}), **memory},
            "numel": w.numel,
            "bandwidth": bandwidth,
            "measured": today,
            "clock": args.clock,
        }
        if not args.quick:  # each workload as soon as it is measured: a long run can be cut
            args.results.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
    order = [w.name for w in workloads(args.quick) if w.name in store]
    results_by = {name: store[name]["results"] for name in order}
    numels = {name: store[name]["numel"] for name in order}
    text = table(results_by, {name: store[name]["bandwidth"] for name in order}, numels)
    text += "\n\nPeak extra memory of one step (torch allocator, MB): " + "; ".join(
        f"{name.split(':')[0]}: "
        + ", ".join(
            f"{m} {b / 2**20:.0f}" for m, b in store[name]["memory"].items() if b is not None
        )
        for name in order
    )
    text += "\n\nMeasured " + ", ".join(
        f"{name.split(':')[0]} on {store[name]['measured']} "
        f"({store[name]['clock']} time, streaming bandwidth "
        f"{store[name]['bandwidth'] / 1e9:.1f} GB/s)"
        for name in order
    )
    text += f"; torch {torch.__version__}, {torch.get_num_threads()} thread."
    # the sections below the table: measured now, or as the store has them from an earlier run
    sections: dict[str, str] = dict(store.get(SECTIONS, {}))
    if cold:
        sections["cold"] = (
            f"First step in a fresh process with an empty compiler cache ({today}): "
            + ", ".join(
                f"{name} {'failed' if t is None else f'{t.whole:.1f} s'}"
                + ("" if t is None else f" ({t.after_probe:.1f} s after the CPU probe)")
                for name, t in cold.items()
            )
            + ". Of the whole first step, inductor's probe of the CPU (test programs for its "
            + "vector instruction sets, compiled once per cache directory whatever is "
            + f"compiled, and there for every later process) took {_span(cold)}."
        )
    if args.scaling:
        sections["scaling"] = scaling(5 if args.quick else args.rounds)
    if args.distributed:
        sections["distributed"] = distributed_table(args.quick, args.clock)
    for name in ("cold", "scaling", "distributed"):
        if name in sections:
            text += "\n\n" + sections[name]
    if not args.quick:
        store[SECTIONS] = sections
        args.results.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
    print(text)
    write_table(args.out, text)
    chart(results_by, args.chart)
    return 0


def _span(cold: dict[str, ColdCall | None]) -> str:
    """The range of the CPU probe's times over the cold first steps measured."""
    probes = [t.probe for t in cold.values() if t is not None]
    return f"{min(probes):.1f}-{max(probes):.1f} s" if probes else "(none measured)"


def distributed_table(quick: bool, clock_name: str) -> str:
    """The FSDP2 rows of :mod:`distributed` (2 gloo ranks), as a markdown table with its
    setting."""
    sys.path.insert(0, str(Path(__file__).parent))
    import distributed

    # (200 steps: a step is a few ms, and the median of 15 moved by 10% between runs)
    layers, width, steps, warmup = (2, 512, 5, 2) if quick else (6, 1024, 200, 3)
    rows = distributed.rows(layers, width, steps, warmup, clock_name)
    return (
        f"FSDP2, {distributed.WORLD} gloo ranks of one thread, {layers} x Linear({width}, "
        f"{width}) fully sharded ({rows[0]['local_params']:,} params per rank), against one "
        "process stepping plain params of the rank's local sizes "
        "(`benchmarks/distributed.py`):\n\n" + distributed.table(rows)
    )


if __name__ == "__main__":
    sys.exit(main())
