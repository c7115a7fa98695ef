"""The engine's direct route: with a transform that treats every leaf on its own
(``functional_opt.base.leafwise``), ``TransformOptimizer`` steps its large params one at a time
in their own storage, one compiled call each, reading the gradient where it is.

The per-leaf claims are checked eagerly and bit for bit (a leafwise transform run on one leaf
does the same ops as on the whole tree). The optimizer's steps are compared with its per-tensor
path by rule 2 of tests/README.md: compiled and eager code round the same math differently."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import (
    DREAMERV3_ELEMENTWISE_OPS,
    ELEMENTWISE_OPS,
    assert_bitwise,
    assert_close_rounding,
    assert_same_steps_then_sync,
    second_path,
    step_with_grads,
)
from torch import Tensor

import functional_opt as fo
from functional_opt import tree
from functional_opt.adapters import TransformOptimizer
from functional_opt.base import leafwise
from functional_opt.leaf_step import GivenPack

LEAFWISE: dict[str, Callable[[], fo.GradientTransformation]] = {
    "adam": lambda: fo.adam(1e-2),
    "adamw": lambda: fo.adamw(1e-2, weight_decay=0.1),
    "sgd-nesterov": lambda: fo.sgd(1e-2, 0.9, nesterov=True),
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=2, _fused=False),
    "lion": lambda: fo.lion(1e-3),
    "adagrad": lambda: fo.adagrad(1e-2),
    "clip-agc-rms": lambda: fo.chain(
        fo.clip_by_agc(0.3), fo.scale_by_rms(0.99), fo.clip(0.5), fo.scale(-1e-2)
    ),
    "injected-adam": lambda: fo.inject_hyperparams(fo.adam)(learning_rate=1e-2),
    "multi-steps": lambda: fo.MultiSteps(fo.adam(1e-2), 2).gradient_transformation(),
    "scheduled": lambda: fo.chain(
        fo.scale_by_adam(), fo.scale_by_learning_rate(fo.cosine_decay_schedule(1e-2, 10))
    ),
}


def _halved(updates: Any, params: Any) -> Any:
    g, at = tree.split(updates, elementwise=True)
    return at.updates([x * 0.5 for x in g])


NOT_LEAFWISE: dict[str, Callable[[], fo.GradientTransformation]] = {
    "global-norm-clip": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)),
    # (a user's elementwise transform that declares only that: nothing says it is leafwise)
    "undeclared-halving": lambda: fo.chain(fo.stateless(_halved, elementwise=True), fo.adam(1e-2)),
    "apply-if-finite": lambda: fo.apply_if_finite(fo.adam(1e-2), 3),
    # (a window over a global-norm clip: the clip looks across leaves, on emitting steps)
    "multi-steps": lambda: fo.MultiSteps(
        fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)), 2
    ).gradient_transformation(),
}


def _leaves(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 4), (7,), (3, 2, 2)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


@pytest.mark.parametrize("name", list(LEAFWISE))
def test_a_leafwise_transform_updates_each_leaf_as_if_alone(name: str) -> None:
    """The declaration's promise: over three steps, the update of each leaf of a tree (and its
    state) is bit for bit that of the leaf alone, and the state that is not per parameter comes
    out the same from every one-leaf run."""
    tx = LEAFWISE[name]()
    assert leafwise(tx)
    params = _leaves(0)
    state = tx.init(params)
    alone = [tx.init([p]) for p in params]
    for step in range(3):
        grads = _leaves(10 + step)
        updates, state = tx.update(grads, state, params)
        for i, (g, p) in enumerate(zip(grads, params, strict=True)):
            u, alone[i] = tx.update([g], alone[i], [p])
            assert_bitwise(u[0], updates[i])
        params = [p + u for p, u in zip(params, updates, strict=True)]
    leaves = optree.tree_leaves(state, namespace=tree.NAMESPACE)
    for i in range(len(params)):
        mine = optree.tree_leaves(alone[i], namespace=tree.NAMESPACE)
        per_param = [x for x in leaves if x.shape == params[i].shape and x.ndim > 0]
        assert len(mine) == len(leaves) - len(per_param) * (len(params) - 1) or not per_param
    for i in range(1, len(params)):
        shared = [x for x in optree.tree_leaves(alone[i], namespace=tree.NAMESPACE) if x.ndim == 0]
        first = [x for x in optree.tree_leaves(alone[0], namespace=tree.NAMESPACE) if x.ndim == 0]
        assert_bitwise(shared, first)


@pytest.mark.parametrize("name", list(NOT_LEAFWISE))
def test_transforms_that_look_across_leaves_are_not_leafwise(name: str) -> None:
    assert not leafwise(NOT_LEAFWISE[name]())


def test_a_transform_that_declares_nothing_is_not_leafwise() -> None:
    tx = fo.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))
    assert not leafwise(tx)


# --------------------------------------------------------------------------------- adapter
class _Model(torch.nn.Module):
    """Two large matrices (stepped directly), a small one and vectors (packed)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 96)
        self.b = torch.nn.Linear(96, 64)
        self.c = torch.nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


_MODEL_NUMEL = sum(p.numel() for p in _Model().parameters())


def _direct(make: Callable[[Any], TransformOptimizer], params: Any) -> TransformOptimizer:
    opt = make(params)
    opt.fused_min_numel = 0
    opt.direct_min_numel = 1000
    opt.direct_rest_max = 0  # (the small params packed: both routes in one group)
    return opt


MAKERS: dict[str, tuple[Callable[[Any], TransformOptimizer], int]] = {
    # (the maker, the roundings per element of one update beyond ELEMENTWISE_OPS)
    "factory-adam": (lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-2), 0),
    "ready-made-adamw": (lambda ps: TransformOptimizer(ps, fo.adamw(1e-2, weight_decay=0.1)), 0),
    "sgd-momentum": (lambda ps: TransformOptimizer(ps, fo.sgd, lr=1e-2, momentum=0.9), 0),
    # the clip's norms over the largest leaf, per update
    "dreamerv3": (
        lambda ps: TransformOptimizer(ps, fo.dreamerv3, lr=1e-2, warmup=2),
        DREAMERV3_ELEMENTWISE_OPS + 96 * 64 + 2,
    ),
    # leafwise given the global norm (summed over every element of the model): the direct
    # params take its total from passes over all params first (the finite check of
    # apply_if_finite takes the same route: tested over plain trees below)
    "clip-adamw": (
        lambda ps: TransformOptimizer(
            ps, fo.chain(fo.clip_by_global_norm(0.05), fo.adamw(1e-2, weight_decay=0.1))
        ),
        _MODEL_NUMEL + 4,
    ),
}


# (the second CPU code path: dreamerv3's per-leaf norms and clip-adamw's global one; the others
# are the same route over simpler math)
@pytest.mark.parametrize("name", second_path(list(MAKERS), on=["dreamerv3", "clip-adamw"]))
def test_large_params_step_in_their_own_storage_like_the_per_tensor_path(name: str) -> None:
    """Lockstep with the per-tensor path (the engine's params reset to the reference's after
    each step, so each update is compared alone): the large params take the direct route, the
    others the packed one; the params keep their storage, the gradients are never written,
    the direct params' state entries are tensors of their own, and the group's lr drives the
    direct route too (a changed lr applies at once, 0 freezes)."""
    make, extra = MAKERS[name]
    torch.manual_seed(0)
    model = _Model()
    ref_model = copy.deepcopy(model)
    opt = _direct(make, model.parameters())
    ref = make(ref_model.parameters())
    ref.fused_steps = False
    ptrs = [p.data_ptr() for p in model.parameters()]
    for step in range(4):
        if step == 2:
            for o in (opt, ref):
                o.param_groups[0]["lr"] = 5e-3
        x = torch.randn(8, 16)
        before = [p.detach().clone() for p in ref_model.parameters()]
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
        ref.step()
        assert_bitwise([p.grad for p in model.parameters()], grads)
        got = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
        want = [p.detach() - b for p, b in zip(ref_model.parameters(), before, strict=True)]
        ops = (ELEMENTWISE_OPS + extra) * (step + 1) + 2
        scale = [b.abs() + 1e-2 for b in before]
        assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                p.copy_(q)
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    params = list(model.parameters())
    assert [params[i].numel() for i in engine.direct] == [96 * 16, 64 * 96]
    if name == "clip-adamw":  # the norm pass: one multi-tensor norm of the gradients
        assert list(engine.gradient_passes.values()) == [(1, ("squares",))]
    assert engine.rest, "the small params are packed"
    assert [p.data_ptr() for p in params] == ptrs
    buffers = {b.untyped_storage().data_ptr() for bs in engine.state.values() for b in bs}
    for i in engine.direct:
        for value in opt.state[params[i]].values():
            if value.ndim:
                assert value.untyped_storage().data_ptr() not in buffers
    frozen = [p.detach().clone() for p in params]
    opt.param_groups[0]["lr"] = 0.0
    opt.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    assert_bitwise([p.detach() for p in params], frozen)


def test_the_state_that_is_not_per_parameter_packs_and_unpacks_whole() -> None:
    """The direct steps take the counters and other shared state as one buffer per dtype: each
    leaf comes back bit for bit, in its shape, as a view of its buffer; a pack refuses leaves
    of another shape or dtype."""
    given = [
        torch.tensor(3, dtype=torch.int64),
        torch.tensor([0.5, -2.0]),
        torch.tensor(7, dtype=torch.int64),
        torch.randn(2, 3),
        torch.tensor(1.25, dtype=torch.float64),
    ]
    pack = GivenPack(given)
    buffers = pack.pack(given)
    assert [b.dtype for b in buffers] == [torch.int64, torch.float32, torch.float64]
    back = pack.unpack(buffers)
    assert_bitwise(back, given)
    for x, buf in zip(back, (buffers[pack.slots[i][0]] for i in range(len(given))), strict=True):
        assert x.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert [b.shape for b in pack.empty()] == [b.shape for b in buffers]
    assert pack.fits([x.clone() for x in given])
    assert not pack.fits([*given[:3], torch.randn(3, 2), given[4]])
    assert not pack.fits([*given[:4], given[4].float()])
    assert not pack.fits(given[:4])


def test_the_direct_step_compiles_once_for_params_of_every_size() -> None:
    """One compiled graph serves the direct params of one rank whatever their sizes, and later
    calls go straight to it."""
    torch.manual_seed(2)
    model = _Model()
    opt = _direct(lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-2), model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    compiled = list(engine.leaf_steps[0, (), True].compiled.values())
    assert len(compiled) == 1
    assert compiled[0]._graphs == 1
    assert compiled[0].direct is not None
    assert {key[0] for key in engine.leaf_kernels} == set(engine.direct)  # kept, called straight


def test_a_direct_step_is_traced_once_for_each_params_dtype() -> None:
    """The direct kernels take the lr ratio in a dtype dynamo keeps as a tensor: a 0-d float64
    CPU tensor is traced as a symbolic float (its ``item()``) that the compile cannot keep, and
    dynamo then traces and compiles the whole step a second time (1.3-2 s of a first step).
    With the compiler's caches off (as in a first run), each kernel (float32, float64) goes
    through AOT autograd once; with the lr changed between steps (a ratio other than 1) the
    params stay within rounding of the per-tensor path's."""
    from torch._dynamo.utils import counters

    shapes = [(40, 30), (30, 40)]
    runs = []
    for fused in (True, False):
        gen = torch.Generator().manual_seed(4)
        params = [
            torch.nn.Parameter(torch.randn(s, generator=gen, dtype=d))
            for s, d in zip(shapes, (torch.float32, torch.float64), strict=True)
        ]
        # (a ready-made adam: a changed lr is a ratio to its own)
        opt = _direct(lambda ps: TransformOptimizer(ps, fo.adam(1e-2)), params)
        opt.fused_steps = fused
        counters.clear()
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            for lr in (1e-2, 3e-3, 2e-2):
                opt.param_groups[0]["lr"] = lr
                grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
                step_with_grads([(params, opt)], grads)
        if fused:
            assert dict(counters["aot_autograd"]).get("total") == 2, dict(counters["aot_autograd"])
            assert dict(counters["aot_autograd"]).get("ok") == 2
        runs.append([p.detach().clone() for p in params])
    for got, want in zip(*runs, strict=True):
        assert_close_rounding(got, want, dtype=got.dtype, ops=3 * (ELEMENTWISE_OPS + 2))


@pytest.mark.numerics
def test_a_group_of_only_large_params_steps_them_all_directly() -> None:
    """Two large params and nothing else: no packed buffers at all; the state that is not per
    parameter (the counters) comes from the direct calls; lockstep with the per-tensor path."""
    torch.manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(30, 50))]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    make = MAKERS["dreamerv3"][0]
    opt, ref = _direct(make, params), make(ref_params)
    ref.fused_steps = False
    for step in range(3):
        gen = torch.Generator().manual_seed(30 + step)
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        before = [p.detach().clone() for p in ref_params]
        step_with_grads([(params, opt), (ref_params, ref)], grads)
        got = [p.detach() - b for p, b in zip(params, before, strict=True)]
        want = [p.detach() - b for p, b in zip(ref_params, before, strict=True)]
        ops = (ELEMENTWISE_OPS + DREAMERV3_ELEMENTWISE_OPS + 50 * 30 + 2) * (step + 1) + 2
        scale = [b.abs() + 1e-2 for b in before]
        assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        with torch.no_grad():
            for p, q in zip(params, ref_params, strict=True):
                p.copy_(q)
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine.direct == [0, 1] and engine.layout is None
    # the group-level state (the counters) as the per-tensor path has it
    mine, theirs = opt.state_dict()["param_groups"][0], ref.state_dict()["param_groups"][0]
    counters = [k for k, v in mine.items() if isinstance(v, dict)]
    assert counters
    for k in counters:
        assert_bitwise(mine[k], theirs[k])


# (the route does not depend on the transform: the one with reductions, whose totals the small
# params join; dreamerv3's direct steps are in the lockstep above, which also covers this math
# on the second CPU code path)
@pytest.mark.parametrize("name", ["clip-adamw"])
def test_few_small_params_beside_large_ones_step_directly_too(name: str) -> None:
    """With the default ``direct_rest_max``, the few small params beside the large ones (the
    biases and the small matrix) take the direct route too: no packed buffers, no gradient
    copied; lockstep with the per-tensor path. More of them than ``direct_rest_max``: packed."""
    make, extra = MAKERS[name]
    torch.manual_seed(4)
    model = _Model()
    ref_model = copy.deepcopy(model)
    opt = make(model.parameters())
    opt.fused_min_numel, opt.direct_min_numel = 0, 1000
    assert opt.direct_rest_max == 8
    ref = make(ref_model.parameters())
    ref.fused_steps = False
    for step in range(3):
        x = torch.randn(8, 16)
        before = [p.detach().clone() for p in ref_model.parameters()]
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        ops = (ELEMENTWISE_OPS + extra) * (step + 1) + 2
        assert_same_steps_then_sync(
            list(model.parameters()), list(ref_model.parameters()), before, ops
        )
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine.direct == list(range(6)) and engine.layout is None and not engine.rest
    # one more small param than the default allows beside the two large ones: packed
    params = [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(30, 50))]
    params += [torch.nn.Parameter(torch.randn(5)) for _ in range(9)]
    crowded = make(params)
    crowded.fused_min_numel, crowded.direct_min_numel = 0, 1000
    for p in params:
        p.grad = torch.randn_like(p)
    crowded.step()
    engine = crowded._layouts[0].engine  # type: ignore[union-attr]
    assert engine.direct == [0, 1] and len(engine.rest) == 9


def test_params_that_share_memory_are_not_stepped_directly() -> None:
    """Weights tied by storage stay on the packed route (their updates are computed from the
    values before the step and added one after the other, as torch's optimizers add them), and
    stay tied."""
    torch.manual_seed(3)
    enc = torch.nn.Linear(48, 64, bias=False)
    dec = torch.nn.Linear(64, 48, bias=False)
    dec.weight.data = enc.weight.data.t()
    other = torch.nn.Parameter(torch.randn(64, 40))
    small = [torch.nn.Parameter(torch.randn(8)) for _ in range(3)]
    params = [enc.weight, dec.weight, other, *small]
    opt = _direct(lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-2), params)
    for _ in range(2):
        opt.zero_grad()
        x = torch.randn(5, 48)
        loss = dec(enc(x)).pow(2).mean() + (other * 2).sum() + sum(s.sum() for s in small)
        loss.backward()
        opt.step()
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine.direct == [2]
    assert_bitwise(dec.weight.detach(), enc.weight.detach().t())


def test_a_checkpoint_of_direct_params_round_trips() -> None:
    """state_dict() with direct params loads (weights_only) into a fresh optimizer, whose next
    steps give the same params bit for bit; and into one on the per-tensor path."""
    torch.manual_seed(4)
    model = _Model()
    make = MAKERS["dreamerv3"][0]
    opt = _direct(make, model.parameters())
    batches = [torch.randn(8, 16) for _ in range(4)]
    for x in batches[:2]:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twin = copy.deepcopy(model)
    loaded = _direct(make, twin.parameters())
    buf.seek(0)
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    for x in batches[2:]:
        for m, o in ((model, opt), (twin, loaded)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    assert_bitwise(list(twin.parameters()), list(model.parameters()))


def test_direct_route_off_packs_every_param() -> None:
    torch.manual_seed(5)
    model = _Model()
    opt = _direct(lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-2), model.parameters())
    opt.direct_min_numel = 0
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine.direct == []
    assert len(engine.rest) == len(list(model.parameters()))


def test_a_transform_that_is_not_leafwise_packs_every_param() -> None:
    torch.manual_seed(6)
    model = _Model()
    opt = _direct(
        lambda ps: TransformOptimizer(ps, NOT_LEAFWISE["undeclared-halving"]()),
        model.parameters(),
    )
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert opt._layouts[0].engine.direct == []  # type: ignore[union-attr]


# ------------------------------------------------------------------ pure API, plain trees
def _plain(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": [torch.randn(s, generator=gen, dtype=dtype) for s in [(40, 30), (30, 40)]],
        "b": [torch.randn(s, generator=gen, dtype=dtype) for s in [(30,), (40,)]],
        "head": torch.randn(50, 24, generator=gen, dtype=dtype),
    }


def close_after_steps(params: Any, ref: Any, extra: int, steps: int) -> None:
    """``params`` within rounding of ``ref`` after ``steps`` steps of an update of ``extra``
    roundings per element beyond ``ELEMENTWISE_OPS`` (scaled by ``|ref| + 1e-2``)."""
    scale = [p.abs() + 1e-2 for p in tree.leaves(ref)]
    assert_close_rounding(
        tree.leaves(params),
        tree.leaves(ref),
        dtype=torch.float32,
        ops=(ELEMENTWISE_OPS + extra) * steps + 2,
        scale=scale,
    )


class _Calls:
    """Counts the compiled per-leaf calls (each goes through ``Kernel.kept_call``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = fo.engine._kernels.Kernel.kept_call

        def spy(kernel: Any, kept: Any, key: Any, args: Any) -> Any:
            self.count += 1
            return original(kernel, kept, key, args)

        monkeypatch.setattr(fo.engine._kernels.Kernel, "kept_call", spy)


# (adam with and without injected hyperparameters; dreamerv3, which reads the params and takes
# per-leaf norms, also on the second CPU code path; adamw and sgd are the same route, in the
# adapter's lockstep above)
@pytest.mark.parametrize(
    "name", second_path(["adam", "dreamerv3", "injected-adam"], on=["dreamerv3"])
)
def test_fused_step_over_a_plain_tree_steps_its_large_leaves_in_place(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fo.fused_step`` of a leafwise transform over a plain tree: each large leaf is stepped
    by one compiled call in its own storage, the small ones staged through packed buffers; three
    steps agree with ``update`` + ``apply_updates`` within rounding. The params stay the caller's
    tensors (donated, written in place), so does the large leaves' state; the small leaves'
    state moves into the step's buffers once and stays there."""
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    calls = _Calls(monkeypatch)
    tx = LEAFWISE[name]()
    params, ref = _plain(0), _plain(0)
    state, ref_state = tx.init(params), tx.init(ref)
    ptrs = [p.data_ptr() for p in tree.leaves(params)]
    large_state = [x.data_ptr() for x in tree.leaves(state) if x.numel() >= 1000]
    step = fo.fused_step(tx)
    state_ptrs: list[int] = []
    for k in range(3):
        grads = _plain(10 + k)
        updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        params, state = step(params, grads, state)
        extra = DREAMERV3_ELEMENTWISE_OPS + 40 * 30 + 2 if name == "dreamerv3" else 0
        close_after_steps(params, ref, extra, k + 1)
        if k == 0:
            state_ptrs = [x.data_ptr() for x in tree.leaves(state) if x.ndim]
    assert calls.count == 3 * 3  # the three large leaves, each step
    assert [p.data_ptr() for p in tree.leaves(params)] == ptrs
    assert [x.data_ptr() for x in tree.leaves(state) if x.numel() >= 1000] == large_state
    assert [x.data_ptr() for x in tree.leaves(state) if x.ndim] == state_ptrs


@pytest.mark.parametrize("route", second_path(["fused_step", "adapter"], on=["fused_step"]))
def test_a_mini_step_only_accumulates_and_writes_no_param(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MultiSteps`` of a leafwise transform is leafwise: its large leaves take the direct
    route, one compiled step per stage (a mini-step that only accumulates, the emitting one).
    A mini-step writes no param at all (their version counters stay), large or staged, and the
    emitting one agrees with ``update`` + ``apply_updates`` (or the per-tensor path) within
    rounding: the window's accumulation, then Adam."""
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    calls = _Calls(monkeypatch)

    def make() -> fo.GradientTransformation:
        return fo.MultiSteps(fo.adamw(1e-2, weight_decay=0.1), 2).gradient_transformation()

    tx = make()
    assert leafwise(tx)
    params, ref = _plain(0), _plain(0)
    opt: Any = None
    if route == "adapter":
        flat = tree.leaves(params)
        opt = _direct(lambda ps: TransformOptimizer(ps, make()), flat)
        state: Any = None
    else:
        state = tx.init(params)
        step = fo.fused_step(tx)
    ref_state = tx.init(ref)
    leaves = tree.leaves(params)
    for k in range(4):
        grads = _plain(20 + k)
        versions = [p._version for p in leaves]
        before = [p.clone() for p in leaves]
        updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        if opt is not None:
            for p, g in zip(leaves, tree.leaves(grads), strict=True):
                p.grad = g
            opt.step()
        else:
            params, state = step(params, grads, state)
        if k % 2 == 0:  # a mini-step
            assert [p._version for p in leaves] == versions
            assert_bitwise(leaves, before)
        else:  # the window's mean (3 roundings per mini-step), then AdamW, then p + u
            assert_close_rounding(
                leaves,
                tree.leaves(ref),
                dtype=torch.float32,
                ops=(ELEMENTWISE_OPS + 3 * 2) * (k // 2 + 1) + 2,
                scale=[p.abs() + 1e-2 for p in tree.leaves(ref)],
            )
        with torch.no_grad():  # lockstep: each window starts from the reference's params
            for p, q in zip(leaves, tree.leaves(ref), strict=True):
                p.copy_(q)
    if opt is not None:
        engine = opt._layouts[0].engine
        assert len(engine.direct) == 3
        assert len({key[2] for key in engine.leaf_kernels}) == 2  # a kernel per stage
    else:
        assert calls.count == 4 * 3  # the three large leaves, each step


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["adam", "global-norm-clip"])
def test_fused_step_over_a_plain_tree_stages_every_leaf_without_a_large_one(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No leaf of LEAF_MIN elements, or a transform that is not leafwise: every leaf is staged
    (no per-leaf kernel), the params are stepped in their own storage and agree with the donated
    eager update and ``apply_updates`` within rounding; from the second step on the state's
    leaves are the same views, not copied again."""
    calls = _Calls(monkeypatch)
    tx = {**LEAFWISE, **NOT_LEAFWISE}[name]()
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 10**6)
    params, ref = _plain(1), _plain(1)
    state, ref_state = tx.init(params), tx.init(ref)
    ptrs = [p.data_ptr() for p in tree.leaves(params)]
    step = fo.fused_step(tx)
    seen: list[list[Tensor]] = []
    for k in range(3):
        grads = _plain(20 + k)
        updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref, donate=True)
        ref = fo.apply_updates(ref, updates, donate=True)
        params, state = step(params, grads, state)
        seen.append([x for x in tree.leaves(state) if x.ndim])
        assert_close_rounding(
            tree.leaves(params),
            tree.leaves(ref),
            dtype=torch.float32,
            ops=ELEMENTWISE_OPS * (k + 1) + 2,
            scale=[p.abs() + 1e-2 for p in tree.leaves(ref)],
        )
        assert_close_rounding(
            [x for x in tree.leaves(state) if x.ndim],
            [x for x in tree.leaves(ref_state) if x.ndim],
            dtype=torch.float32,
            ops=ELEMENTWISE_OPS * (k + 1),
        )
    assert calls.count == 0
    assert [p.data_ptr() for p in tree.leaves(params)] == ptrs
    assert all(a is b for a, b in zip(seen[1], seen[2], strict=True))
    assert all(a is b for a, b in zip(seen[0], seen[1], strict=True))


def test_two_fused_steps_of_one_transform_both_step() -> None:
    """``dreamerv3()`` keeps one engine runner for all its uses. The first step of a second
    ``fused_step`` of it probes, without params, whether the transform reads them; that probe
    used to reach the graph the first ``fused_step`` had compiled with params, whose guard
    traced it again and raised an uncaught dynamo error. Both steps now agree."""
    tx = fo.dreamerv3(1e-2, warmup=0)
    results = []
    for _ in range(2):
        params = _plain(1)
        state = tx.init(params)
        params, state = fo.fused_step(tx)(params, _plain(20), state)
        results.append(tree.leaves(params))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize(
    "name", second_path(sorted(NOT_LEAFWISE), on=["global-norm-clip", "multi-steps"])
)
def test_fused_step_stages_a_transform_that_is_not_leafwise(name: str) -> None:
    """A fusable transform that is not leafwise (a global norm, a mask over the tree, a guard,
    mini-steps) over a plain tree: every leaf staged in the tree's own structure (a mask sees
    it), four steps within rounding of the eager update, a non-finite gradient skipped as the
    eager guard skips it."""
    tx = NOT_LEAFWISE[name]()
    params, ref = _leaves(0), _leaves(0)
    state, ref_state = tx.init(params), tx.init(ref)
    ptrs = [p.data_ptr() for p in params]
    step = fo.fused_step(tx)
    for k in range(4):
        grads = _leaves(30 + k)
        if k == 2:
            grads[1][3] = float("nan")
        updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        params, state = step(params, grads, state)
        assert_close_rounding(
            params,
            ref,
            dtype=torch.float64,
            ops=ELEMENTWISE_OPS * (k + 1) + 2,
            scale=[p.abs() + 1e-2 for p in ref],
        )
    assert [p.data_ptr() for p in params] == ptrs
    staged = [x for x in tree.leaves(state) if isinstance(x, Tensor) and x.ndim]
    assert staged and all(x._base is not None for x in staged)  # views of the step's buffers


def test_fused_step_copies_in_a_state_it_did_not_make() -> None:
    """A state whose leaves are not the step's views (a copy, a state loaded from a checkpoint)
    is copied into the step's buffers: the result is the same as with the step's own."""
    tx = fo.adam(1e-2)
    a, b = _plain(2), _plain(2)
    sa, sb = tx.init(a), tx.init(b)
    step_a, step_b = fo.fused_step(tx), fo.fused_step(tx)
    for k in range(3):
        grads = _plain(40 + k)
        a, sa = step_a(a, copy.deepcopy(grads), sa)
        b, sb = step_b(b, grads, copy.deepcopy(sb))  # never the views it returned
    assert_bitwise(tree.leaves(b), tree.leaves(a))
    assert_bitwise(tree.leaves(sb), tree.leaves(sa))


def test_fused_step_stages_leaves_of_several_dtypes() -> None:
    """float32 and bfloat16 leaves in one plain tree: one staging buffer each, results as the
    eager donated step gives them within each dtype's rounding."""
    tx = fo.adam(1e-2)

    def tree_of(seed: int) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {
            "a": torch.randn(6, 5, generator=gen),
            "b": torch.randn(7, generator=gen).to(torch.bfloat16),
            "c": torch.randn(3, generator=gen),
        }

    params, ref = tree_of(3), tree_of(3)
    state, ref_state = tx.init(params), tx.init(ref)
    step = fo.fused_step(tx)
    for k in range(3):
        grads = tree_of(50 + k)
        updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref, donate=True)
        ref = fo.apply_updates(ref, updates, donate=True)
        params, state = step(params, grads, state)
    for key in params:
        dtype = params[key].dtype
        assert params[key].dtype == ref[key].dtype
        assert_close_rounding(
            [params[key].double()],
            [ref[key].double()],
            dtype=dtype,
            ops=ELEMENTWISE_OPS * 3 + 2,
            scale=[ref[key].double().abs() + 1e-2],
        )


def test_add_into_fused_route_is_a_plain_add() -> None:
    """``_lists.add_into``'s fused route (torch's fused SGD with lr=-1) gives ``t + u`` bit for
    bit, in float32 and float64; ``fused_add_ok`` refuses what it cannot take."""
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float64):
        ts = [torch.randn(n, generator=gen, dtype=dtype) for n in (1, 5, 1000)]
        us = [torch.randn(n, generator=gen, dtype=dtype) * 1e-3 for n in (1, 5, 1000)]
        want = [t + u for t, u in zip(ts, us, strict=True)]
        assert fo._lists.fused_add_ok(ts)
        fo._lists.add_into(ts, us, fused=True)
        assert_bitwise(ts, want)
    assert not fo._lists.fused_add_ok([torch.randn(3, 4).t()])
    assert not fo._lists.fused_add_ok([torch.randn(3, dtype=torch.bfloat16)])
    assert not fo._lists.fused_add_ok([torch.randn(3), torch.randn(3, dtype=torch.float64)])


def test_fused_step_stages_a_param_that_is_not_contiguous() -> None:
    """A transposed param in a plain tree is staged and written in its own (strided) storage,
    as the eager donated step writes it."""
    tx = fo.adam(1e-2)

    def tree_of(seed: int) -> list[Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(4, 6, generator=gen).t(), torch.randn(5, generator=gen)]

    params, ref = tree_of(4), tree_of(4)
    grads = [g.contiguous() for g in tree_of(60)]
    state, ref_state = tx.init(params), tx.init(ref)
    params, state = fo.fused_step(tx)(params, grads, state)
    updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref, donate=True)
    ref = fo.apply_updates(ref, updates, donate=True)
    assert not params[0].is_contiguous()
    assert_close_rounding(params, ref, dtype=torch.float32, ops=ELEMENTWISE_OPS + 2)


_GIVEN_REDUCTIONS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "clip-adamw": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1)),
    "finite-clip-adam": lambda: fo.apply_if_finite(
        fo.chain(fo.clip_by_global_norm(0.5), fo.adam(1e-2)), 3
    ),
    # the norm is of the moments' output: its pass reads the state too
    "adam-then-clip": lambda: fo.chain(
        fo.scale_by_adam(), fo.clip_by_global_norm(0.1), fo.scale(-1e-2)
    ),
}


def _fused_steps_as_eager(
    tx: fo.GradientTransformation,
    name: str,
    steps: int,
    at: int,
    where: Callable[[dict[str, Any]], tuple[Tensor, tuple[int, ...]]],
) -> None:
    """``steps`` steps of ``fo.fused_step(tx)`` over :func:`_plain` trees, each within rounding
    of the eager update; on step ``at`` one gradient element (``where``: the leaf and index) is
    a NaN for the chains with a finite check (``name`` starting ``finite``), else 1e3."""
    params, ref = _plain(5), _plain(5)
    state, ref_state = tx.init(params), tx.init(ref)
    step = fo.fused_step(tx)
    numel = sum(p.numel() for p in tree.leaves(params))
    for k in range(steps):
        grads = _plain(70 + k)
        if k == at:
            leaf, index = where(grads)
            leaf[index] = float("nan") if name.startswith("finite") else 1e3
        updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        params, state = step(params, grads, state)
        assert_close_rounding(
            tree.leaves(params),
            tree.leaves(ref),
            dtype=torch.float32,
            ops=(ELEMENTWISE_OPS + numel + 4) * (k + 1) + 2,
            scale=[p.abs() + 1e-2 for p in tree.leaves(ref)],
        )


@pytest.mark.parametrize(
    "name",
    # (on the CPU's second code path: clip-adamw; the finite check's count is exact, and the
    # other norm is a pass like clip-adamw's, for the suite's time)
    second_path(sorted(_GIVEN_REDUCTIONS), on=["clip-adamw"]),
)
def test_fused_step_steps_large_leaves_directly_given_the_reductions(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transform leafwise given its reductions over all leaves (a global norm, a finite
    check) over a plain tree: the totals come from passes over the large leaves and the staged
    ones, then each large leaf is stepped by itself; four steps (one with a NaN, which
    ``apply_if_finite`` skips) within rounding of the eager update."""
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    tx = _GIVEN_REDUCTIONS[name]()
    assert leafwise(tx, reductions=True) and not leafwise(tx)
    calls = _Calls(monkeypatch)
    _fused_steps_as_eager(tx, name, 4, 2, lambda grads: (grads["w"][0], (1, 1)))
    # per step and large leaf: its step, and each partials pass that is not a norm of the
    # gradients (those are one multi-tensor norm over the large leaves, no compiled call)
    compiled_passes = {"clip-adamw": 0, "finite-clip-adam": 0, "adam-then-clip": 1}[name]
    assert calls.count == 4 * 3 * (1 + compiled_passes)


def test_a_norm_of_the_gradients_is_one_multi_tensor_norm_of_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partials pass that is the sum of squares of each large leaf's gradient as given
    (``clip_by_global_norm`` first) runs as one multi-tensor norm instead of a compiled call
    per leaf: the params come out bit for bit as with the compiled pass (the same step, its
    kernels shared: only the recognition differs). ``TransformOptimizer`` takes the same
    route (its lockstep test, ``clip-adamw``)."""
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    calls = _Calls(monkeypatch)
    tx = _GIVEN_REDUCTIONS["clip-adamw"]()
    step = fo.fused_step(tx)
    runs, counts = [], []
    for recognize in (True, False):
        if not recognize:  # (new params: the step finds what its passes are again)
            monkeypatch.setattr(fo.plain_trees, "gradient_reductions", lambda *args: (1, ()))
        params = _plain(5)
        state = tx.init(params)
        start = calls.count
        for k in range(3):
            params, state = step(params, _plain(70 + k), state)
        counts.append(calls.count - start)
        runs.append([p.clone() for p in tree.leaves(params)])
    assert counts == [3 * 3, 3 * 3 * 2]  # a compiled partials call per leaf only in the second
    assert_bitwise(runs[0], runs[1])


@pytest.mark.parametrize("name", sorted(_GIVEN_REDUCTIONS))
def test_the_small_leaves_partials_of_a_gradient_norm_compile_no_graph(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a totals pass is a reduction of the gradients (a clip's sum of squares, a finite
    check's count), the small leaves' partials (the pure step's staged leaves, the adapter's
    packed params) come from the multi-tensor ops the large leaves' take, not from a compiled
    pass over the packed trees: a first step compiles one graph less. A pass of something
    else (a norm of the moments' output) still runs the compiled pass. Every step within
    rounding of the eager update, pure and adapter."""
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    passes: list[int] = []
    partials = fo.engine.Runner.partials

    def counted(runner: Any, *args: Any) -> Any:
        passes.append(1)
        return partials(runner, *args)

    monkeypatch.setattr(fo.engine.Runner, "partials", counted)
    compiled_passes = {"clip-adamw": 0, "finite-clip-adam": 0, "adam-then-clip": 1}[name]
    tx = _GIVEN_REDUCTIONS[name]()
    # the pure step over a plain tree: "w" and "head" large, "b" staged
    _fused_steps_as_eager(tx, name, 3, 1, lambda grads: (grads["b"][1], (3,)))
    assert len(passes) == 3 * compiled_passes
    # the adapter: two direct params, three packed ones
    del passes[:]
    gen = torch.Generator().manual_seed(8)
    shapes = [(40, 30), (30,), (50, 24), (40,), (7, 3)]
    leaves = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref_leaves = [p.detach().clone() for p in leaves]
    ref_state = tx.init(ref_leaves)
    opt = _direct(lambda ps: TransformOptimizer(ps, _GIVEN_REDUCTIONS[name]()), leaves)
    numel = sum(p.numel() for p in leaves)
    for k in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        if k == 1:
            grads[3][5] = float("nan") if name.startswith("finite") else 1e3
        updates, ref_state = tx.update([g.clone() for g in grads], ref_state, ref_leaves)
        ref_leaves = fo.apply_updates(ref_leaves, updates)
        step_with_grads([(leaves, opt)], grads)
        assert_close_rounding(
            [p.detach() for p in leaves],
            ref_leaves,
            dtype=torch.float32,
            ops=(ELEMENTWISE_OPS + numel + 4) * (k + 1) + 2,
            scale=[p.abs() + 1e-2 for p in ref_leaves],
        )
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine.direct == [0, 2] and engine.rest == [1, 3, 4]
    assert len(passes) == 3 * compiled_passes


def test_adapter_takes_the_finite_check_from_the_clips_squares_when_they_are_finite(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``TransformOptimizer`` stepping ``apply_if_finite(chain(clip_by_global_norm, adam))`` on
    the direct route reads the gradients once for both reductions when the clip's sums of
    squares total a finite value (then no element is NaN or infinite: no second pass for the
    finite check), and counts exactly otherwise: a gradient of finite values whose squares
    overflow float32 is applied, one with a NaN is skipped. Every step within rounding of the
    eager update."""
    from functional_opt import _lists

    passes = []
    finite_flags = _lists._finite_flags

    def counted(xs: Any) -> Tensor:
        passes.append(len(xs))
        return finite_flags(xs)

    monkeypatch.setattr(_lists, "_finite_flags", counted)
    tx = _GIVEN_REDUCTIONS["finite-clip-adam"]()
    gen = torch.Generator().manual_seed(3)
    shapes = [(40, 30), (500,), (20, 25)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [p.detach().clone() for p in params]
    ref_state = tx.init(ref)
    opt = TransformOptimizer(params, tx)
    opt.fused_min_numel, opt.direct_min_numel = 0, 100  # type: ignore[attr-defined]
    numel = sum(p.numel() for p in params)
    for k, fault in enumerate([None, "overflow", None, "nan", None]):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        if fault == "overflow":
            grads[0][3, 4] = 1e30  # (finite; its square is not)
        if fault == "nan":
            grads[1][7] = float("nan")
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        before = len(passes)
        opt.step()
        exact = len(passes) > before
        updates, ref_state = tx.update([g.clone() for g in grads], ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        assert opt._layouts[0].engine.direct == [0, 1, 2]  # type: ignore[attr-defined]
        # the exact count (a pass over the gradients) only where the squares are not finite
        if k:  # (the first step finds its route: eager probes of the passes)
            assert exact == (fault is not None), (k, fault)
        assert_close_rounding(
            [p.detach() for p in params],
            ref,
            dtype=torch.float32,
            ops=(ELEMENTWISE_OPS + numel + 4) * (k + 1) + 2,
            scale=[r.abs() + 1e-2 for r in ref],
        )
