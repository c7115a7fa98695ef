"""The engine: elementwise transforms over packed buffers, compiled by ``fo.fused`` and run by
``TransformOptimizer`` on flat gradient and state buffers.

Compiled code and eager code compute the same math with other roundings (inductor fuses the
ops of a chain into one loop and may contract ``a * b + c``), so the comparisons are rule 2 of
tests/README.md: ``ELEMENTWISE_OPS`` per update and step (errors carried in state add up),
plus the summed squares of a global norm, relative to the terms (``MagnitudeRun``)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    DREAMERV3_ELEMENTWISE_OPS,
    ELEMENTWISE_OPS,
    MagnitudeRun,
    assert_bitwise,
    assert_close_rounding,
    second_path,
)

import functional_opt as fo
from functional_opt.adapters import TransformOptimizer
from functional_opt.base import fusable

CHAINS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "adam": lambda: fo.adam(1e-2),
    "adamw": lambda: fo.adamw(1e-2, weight_decay=0.1),
    "sgd-nesterov": lambda: fo.sgd(1e-2, 0.9, nesterov=True),
    "clip-adamw": lambda: fo.chain(fo.clip_by_global_norm(0.05), fo.adamw(1e-2, weight_decay=0.1)),
    # weight decay on some leaves only (a mask tree, and a function of the packed params)
    "adamw-masked": lambda: fo.adamw(
        1e-2,
        weight_decay=0.1,
        mask={
            "w": True,
            "run": [True, False, False, True, True],
            "s": False,
            "e": True,
            "d": False,
        },
    ),
    "adamw-mask-fn": lambda: fo.adamw(
        1e-2, weight_decay=0.1, mask=lambda p: fo.tree_map(lambda x: x.ndim > 1, p)
    ),
    "guarded-injected": lambda: fo.apply_if_finite(
        fo.inject_hyperparams(fo.adam)(learning_rate=1e-2, b1=0.8), 2
    ),
    # per-leaf clipping: each leaf a row of its size's buffer, the factor broadcast per row
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=0, weight_decay=0.1),
}


def _tree(gen: torch.Generator, scale: float = 1.0) -> dict[str, Any]:
    # leaves of several sizes (runs of equal ones, a 0-d and an empty one) and a float64 buffer
    return {
        "w": torch.randn(33, 17, generator=gen) * scale,
        "run": [torch.randn(6, generator=gen) * scale for _ in range(5)],
        "s": torch.randn((), generator=gen) * scale,
        "e": torch.zeros(0, 3),
        "d": (torch.randn(9, generator=gen) * scale).double(),
    }


def _ops(name: str, params: Any, step: int) -> float:
    numel = sum(x.numel() for x in fo.tree.leaves(params))
    # a global norm sums every square (numel roundings) and its factor takes a sqrt, a
    # division and the product: numel + 3 per step
    extra = numel + 3 if name == "clip-adamw" else 0
    if name == "dreamerv3":  # its clip's two norms over a leaf (at most numel squares), a sqrt
        return (DREAMERV3_ELEMENTWISE_OPS + numel + 2) * (step + 1)
    return (ELEMENTWISE_OPS + extra) * (step + 1)


# (the second CPU code path: a global norm, a guard with injected hyperparameters, dreamerv3)
@pytest.mark.parametrize(
    "name", second_path(list(CHAINS), on=["clip-adamw", "guarded-injected", "dreamerv3"])
)
def test_fused_update_over_packed_buffers_equals_the_chain(name: str) -> None:
    """``fused(tx)`` over packed trees, donated, computes ``tx``'s updates leaf by leaf within
    rounding, compiles (no fallback warning), and writes the updates into the gradients'
    buffers and the moments into their own."""
    tx = CHAINS[name]()
    assert fusable(tx)
    fast = fo.fused(tx)
    gen = torch.Generator().manual_seed(0)
    params = _tree(gen)
    state, fast_state = tx.init(params), fast.init(fo.pack(params))
    magnitudes = MagnitudeRun(tx, params)
    for step in range(3):
        grads = _tree(gen, 0.1)
        packed_grads = fo.pack(grads)
        assert packed_grads.buffers is not None
        ptrs = [b.data_ptr() for b in packed_grads.buffers]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            u_fast, fast_state = fast.update(packed_grads, fast_state, fo.pack(params), donate=True)
        assert not [w for w in caught if str(w.message).startswith("fused:")]
        u, state = tx.update(grads, state, params)
        scale, _ = magnitudes.update(grads, params)
        assert isinstance(u_fast, fo.Packed) and u_fast.buffers is not None
        assert [b.data_ptr() for b in u_fast.buffers] == ptrs  # into the donated gradients
        assert_close_rounding(
            u_fast.tree,
            u,
            dtype=torch.float32,
            ops=_ops(name, params, step),
            scale=scale,
            msg=f"{name}, step {step}",
        )
        params = fo.apply_updates(params, u)


def test_changing_an_injected_hyperparameter_does_not_recompile() -> None:
    counters = torch._dynamo.utils.counters
    tx = fo.fused(fo.inject_hyperparams(fo.adamw)(learning_rate=1e-2, weight_decay=0.1))
    params = fo.pack({"w": torch.randn(40), "b": torch.randn(3)})
    state = tx.init(params)
    grads = fo.pack({"w": torch.randn(40), "b": torch.randn(3)})
    _, state = tx.update(grads, state, params, donate="state")
    before = dict(counters["stats"])
    for lr in (3e-3, 1e-3, 0.0):
        state.hyperparams["learning_rate"].fill_(lr)
        _, state = tx.update(grads, state, params, donate="state")
    assert dict(counters["stats"]).get("unique_graphs") == before.get("unique_graphs")


@pytest.mark.numerics
def test_a_freshly_packed_tree_of_an_equal_layout_reuses_the_graph() -> None:
    """Compiled code compares layouts and structures by their digests (two ints per tree, which
    dynamo then checks on every call, instead of every leaf's slot and shape): packing the
    gradients afresh every step reuses the graph; a tree of another layout still takes (and
    compiles) its own."""
    counters = torch._dynamo.utils.counters
    tx = fo.fused(fo.adam(1e-2))
    values = {"w": [torch.randn(7) for _ in range(300)], "b": [torch.randn(3) for _ in range(9)]}
    params = fo.pack(values)
    state = tx.init(params)
    a, b = fo.pack(values).layout, fo.pack(values).layout
    assert a is not b and a == b and a._digest == b._digest != 0
    assert a.structure._digest == b.structure._digest != 0
    other = fo.pack({**values, "b": [torch.randn(3) for _ in range(8)]})
    assert other.layout._digest != a._digest and other.structure._digest != a.structure._digest
    ref = fo.adam(1e-2)  # eager, over the same buffers
    ref_state = ref.init(params)
    before: dict[str, int] = {}
    for step in range(4):
        grads = fo.pack({k: [torch.randn_like(x) for x in v] for k, v in values.items()})
        want, ref_state = ref.update(grads, ref_state, params)
        u, state = tx.update(grads, state, params, donate="state")
        assert_close_rounding(
            u.tree, want.tree, dtype=torch.float32, ops=ELEMENTWISE_OPS * (step + 1)
        )
        if step == 0:
            before = dict(counters["stats"])
    assert dict(counters["stats"]).get("unique_graphs") == before.get("unique_graphs")


def test_user_transform_declared_elementwise_is_fused() -> None:
    """The transform of docs/concepts.md, written with the tree helpers: fusable, and the same
    numbers fused over packed buffers as leaf by leaf."""
    sign = fo.stateless_with_tree_map(lambda u, p: torch.sign(u), elementwise=True)
    tx = fo.chain(sign, fo.trace(0.9), fo.scale(-0.1))
    assert fusable(tx)
    assert not fusable(fo.chain(fo.stateless_with_tree_map(lambda u, p: torch.sign(u)), tx))
    gen = torch.Generator().manual_seed(1)
    params = _tree(gen)
    fast = fo.fused(tx)
    state, fast_state = tx.init(params), fast.init(fo.pack(params))
    for _ in range(3):
        grads = _tree(gen)
        u, state = tx.update(grads, state, params)
        u_fast, fast_state = fast.update(fo.pack(grads), fast_state, fo.pack(params))
        # sign, a momentum (product and sum) and the scale: the same ops, compiled: 3 per step
        assert_close_rounding(u_fast.tree, u, dtype=torch.float32, ops=9)


def test_an_update_autograd_records_runs_the_transform_itself() -> None:
    """Gradients that require grad, in grad mode: the transform's own ops (which autograd
    differentiates), equal to the unfused update, with no compile and no fallback warning."""
    tx, fast = fo.clip_by_global_norm(0.5), fo.fused(fo.clip_by_global_norm(0.5))
    values = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = fo.pack(values)
    assert grads.buffers is not None
    for b in grads.buffers:
        b.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        u, _ = fast.update(grads, fast.init(grads), None)
    want, _ = tx.update(grads, tx.init(grads), None)
    assert isinstance(u, fo.Packed) and u.buffers is not None
    assert all(b.grad_fn is not None for b in u.buffers)
    assert_bitwise(list(u.buffers), list(want.buffers))  # the same ops, eager


def test_not_packed_or_not_fusable_runs_the_transform_itself() -> None:
    tx = fo.fused(fo.adaptive_grad_clip(0.1))
    params = {"w": torch.randn(4, 3)}
    grads = {"w": torch.randn(4, 3)}
    u, _ = tx.update(grads, tx.init(params), params)
    want, _ = fo.adaptive_grad_clip(0.1).update(grads, fo.EmptyState(), params)
    assert_bitwise(u, want)
    with pytest.raises(TypeError, match="GradientTransformation"):
        fo.fused(lambda: None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- adapter
class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(12, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _engine_opt(params: Any, make: Callable[[Any], TransformOptimizer]) -> TransformOptimizer:
    opt = make(params)
    opt.fused_min_numel = 0
    return opt


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: TransformOptimizer(
            ps, fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(1e-2, weight_decay=0.1))
        ),
        lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-2),
        lambda ps: TransformOptimizer(
            ps, fo.adamw, lr=1e-2, weight_decay=0.1, mask=lambda ps: [p.ndim > 1 for p in ps]
        ),
        lambda ps: TransformOptimizer(
            ps, fo.adamw(1e-2, weight_decay=0.1, mask=lambda ps: [p.ndim > 1 for p in ps])
        ),
        lambda ps: TransformOptimizer(ps, fo.dreamerv3, lr=1e-2, warmup=0),
    ],
    ids=["ready-made-chain", "factory", "masked-weight-decay", "ready-made-list-mask", "dreamerv3"],
)
def test_optimizer_steps_on_the_engine_like_the_per_tensor_path(
    make: Callable[[Any], TransformOptimizer],
) -> None:
    """Lockstep: both optimizers step from the same params on the same batch (the engine's
    params are then reset to the reference's), so each step's update is compared alone; the
    params keep their storage, the state entries are views of the engine's buffers, and an
    LR scheduler's lr drives the engine (0 freezes)."""
    torch.manual_seed(0)
    model = _Model()
    ref_model = copy.deepcopy(model)
    opt = _engine_opt(model.parameters(), make)
    ref = make(ref_model.parameters())
    ref.fused_steps = False
    ptrs = [p.data_ptr() for p in model.parameters()]
    numel = sum(p.numel() for p in model.parameters())
    for step in range(4):
        x = torch.randn(8, 12)
        before = [p.detach().clone() for p in ref_model.parameters()]
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        got = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
        want = [p.detach() - b for p, b in zip(ref_model.parameters(), before, strict=True)]
        # the update (its own roundings plus the clip's global norm: numel + 3, and the state's
        # carried errors: per step), then p + u - p (two roundings relative to |p|)
        ops = (ELEMENTWISE_OPS + numel + 3) * (step + 1) + 2
        scale = [b.abs() + 1e-2 for b in before]
        assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                p.copy_(q)
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine not in (None, False)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    for p in model.parameters():
        for value in opt.state[p].values():
            assert any(
                value.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                for bs in engine.state.values()
                for b in bs
            )
    frozen = [p.detach().clone() for p in model.parameters()]
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.zero_grad()
    model(torch.randn(8, 12)).pow(2).mean().backward()
    opt.step()
    assert_bitwise([p.detach() for p in model.parameters()], frozen)


def test_engine_checkpoints_round_trip_and_loaded_state_is_adopted() -> None:
    """state_dict() of an engine-stepped optimizer loads into a fresh one (weights_only), whose
    next steps give the same params bit for bit (the same compiled kernels on the same values)."""
    torch.manual_seed(1)
    model = _Model()

    def make(ps: Any) -> TransformOptimizer:
        return _engine_opt(ps, lambda q: TransformOptimizer(q, fo.adam, lr=1e-2))

    opt = make(model.parameters())
    batches = [torch.randn(8, 12) for _ in range(4)]

    def run(m: torch.nn.Module, o: TransformOptimizer, xs: list[torch.Tensor]) -> None:
        for x in xs:
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()

    run(model, opt, batches[:2])
    import io

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run(model, opt, batches[2:])
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    other = _Model()
    other.load_state_dict(saved["model"])
    other_opt = make(other.parameters())
    other_opt.load_state_dict(saved["opt"])
    run(other, other_opt, batches[2:])
    assert_bitwise(
        [p.detach() for p in other.parameters()], [p.detach() for p in model.parameters()]
    )


def test_groups_that_cannot_use_the_engine_step_per_tensor() -> None:
    model = _Model()
    masked = TransformOptimizer(  # adaptive_grad_clip works leaf by leaf: not fusable
        model.parameters(), fo.chain(fo.adaptive_grad_clip(0.1), fo.adam(1e-2))
    )
    masked.fused_min_numel = 0
    other = _Model()
    small = TransformOptimizer(other.parameters(), fo.adam(1e-2))  # below fused_min_numel
    for opt, m in ((masked, model), (small, other)):
        opt.zero_grad()
        m(torch.randn(4, 12)).sum().backward()
        opt.step()
    assert masked._layouts[0].engine is None  # type: ignore[union-attr]  (not fusable)
    assert small._layouts[0].engine is None  # type: ignore[union-attr]


def test_a_transform_written_with_tree_map_runs_in_every_tree_the_library_uses() -> None:
    """docs/concepts.md's signSGD with ``fo.tree_map``: under ``TransformOptimizer`` (param
    slots), on packed trees and plain ones, the same updates (``optree.tree_map`` without the
    library's namespace sees a ``ParamSlots`` or a ``Packed`` as one leaf and fails)."""
    for elementwise in (False, True):
        sign = fo.stateless_with_tree_map(lambda u, p: torch.sign(u), elementwise=elementwise)
        tx = fo.chain(sign, fo.scale(-0.5))
        model = _Model()
        before = [p.detach().clone() for p in model.parameters()]
        opt = TransformOptimizer(model.parameters(), tx)
        model(torch.randn(4, 12)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
        want = [b - 0.5 * torch.sign(g) for b, g in zip(before, grads, strict=True)]
        assert_bitwise([p.detach() for p in model.parameters()], want)
        packed_u, _ = tx.update(fo.pack(grads), tx.init(fo.pack(before)), fo.pack(before))
        assert_bitwise(list(packed_u.tree), [-0.5 * torch.sign(g) for g in grads])


@pytest.mark.parametrize("name", ["adam", "clip-adamw", "dreamerv3"])
def test_fused_step_adds_the_update_in_the_same_graph(name: str) -> None:
    """``fo.fused_step(tx)(params, grads, state)``: the params' buffers take ``p + u`` in
    place, equal to ``tx.update`` then ``apply_updates`` within rounding (each step from the
    same params: the update's count, and one more rounding for the sum relative to |p|)."""
    tx = CHAINS[name]()
    step = fo.fused_step(tx)
    gen = torch.Generator().manual_seed(2)
    params = _tree(gen)
    state, fast_state = tx.init(params), tx.init(fo.pack(params))
    magnitudes = MagnitudeRun(tx, params)
    for i in range(3):
        grads = _tree(gen, 0.1)
        packed = fo.pack(params)
        assert packed.buffers is not None
        ptrs = [b.data_ptr() for b in packed.buffers]
        new_packed, fast_state = step(packed, fo.pack(grads), fast_state)
        assert new_packed is packed and [b.data_ptr() for b in packed.buffers] == ptrs
        u, state = tx.update(grads, state, params)
        scale, _ = magnitudes.update(grads, params)
        want = fo.apply_updates(params, u)
        bound = fo.tree_map(lambda s, p: s + p.abs(), scale, params)
        assert_close_rounding(
            new_packed.tree, want, dtype=torch.float32, ops=_ops(name, params, i) + 1, scale=bound
        )
        params = want


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(12, 32)
        self.c = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x)))


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_a_group_of_few_params_adds_its_update_inside_the_graph(name: str) -> None:
    """Four params: the engine adds the update into the params in the compiled graph, and a
    transform that reads the params (``adamw``'s weight decay) reads them there too, without a
    copy into a buffer first; the same updates as the per-tensor path (lockstep, derived
    bound), params keep their storage."""
    torch.manual_seed(3)
    model = _Small()
    ref_model = copy.deepcopy(model)

    def make(ps: Any) -> TransformOptimizer:
        if name == "adamw":
            return TransformOptimizer(ps, fo.adamw, lr=1e-2, weight_decay=0.1)
        return TransformOptimizer(ps, fo.adam, lr=1e-2)

    opt = _engine_opt(model.parameters(), make)
    ref = make(ref_model.parameters())
    ref.fused_steps = False
    ptrs = [p.data_ptr() for p in model.parameters()]
    for step in range(3):
        x = torch.randn(8, 12)
        before = [p.detach().clone() for p in ref_model.parameters()]
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        got = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
        want = [p.detach() - b for p, b in zip(ref_model.parameters(), before, strict=True)]
        scale = [b.abs() + 1e-2 for b in before]
        ops = ELEMENTWISE_OPS * (step + 1) + 2
        assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                p.copy_(q)
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine and engine.apply_inside
    assert engine.params is None  # no buffer of the params' values: the graph reads them
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_gradients_that_are_views_of_the_engine_buffer_are_never_written() -> None:
    """Bucket views: the params' gradients set to views of the group's flat gradient buffer are
    read in place, not copied, and still hold the gradients after the step; the step equals
    the one with separate gradients bit for bit (the same kernels on the same values)."""
    torch.manual_seed(4)
    model = _Model()
    twin = copy.deepcopy(model)

    def make(ps: Any) -> TransformOptimizer:
        return _engine_opt(ps, lambda q: TransformOptimizer(q, fo.adam, lr=1e-2))

    opt, twin_opt = make(model.parameters()), make(twin.parameters())
    x = torch.randn(8, 12)
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
    for p, view in zip(model.parameters(), engine.grad_views, strict=True):
        assert p.grad is not None
        view.copy_(p.grad)
        p.grad = view
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    opt.step()
    twin_opt.step()
    assert_bitwise([p.grad for p in model.parameters()], grads)
    assert_bitwise(
        [p.detach() for p in model.parameters()], [p.detach() for p in twin.parameters()]
    )


def test_fused_under_a_dispatch_mode_runs_the_update_eagerly() -> None:
    """Under a user's ``TorchDispatchMode`` (a profiler, a collective counter) ``torch.compile``
    runs no compiled code, and with ``fullgraph`` it raised: ``fo.fused`` and ``fo.fused_step``
    run the same update eagerly there, with the eager update's bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.calls += 1
            return func(*args, **(kwargs or {}))

    tx = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2))
    gen = torch.Generator().manual_seed(7)
    values = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    grads = [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]
    params = fo.pack(values)
    # the eager update over the same packed trees (its norms summed per run of leaves)
    want, _ = tx.update(fo.pack(grads), tx.init(params), params)
    mode = Counting()
    with mode:
        updates, _ = fo.fused(tx).update(fo.pack(grads), tx.init(params), params)
    assert mode.calls > 0  # the update's ops ran under the mode: eagerly
    assert_bitwise(updates.tree, want.tree)
    expected = fo.apply_updates(copy.deepcopy(values), want.tree)
    with mode:
        stepped, _ = fo.fused_step(tx)(params, fo.pack(grads), tx.init(params))
    assert_bitwise(stepped.tree, expected)


def test_compiled_norms_of_16bit_buffers_copy_nothing() -> None:
    """A compiled ``clip_by_global_norm`` over a bfloat16 buffer reads the 16-bit values in
    its norm's pass (``torch._foreach_norm`` with a float32 dtype, which the graph ran as
    torch's kernel, first copied the whole buffer to float32: half of the step's time). The
    donated step allocates under 1 MB where that copy took 4 MB."""
    from torch.profiler import ProfilerActivity, profile

    fast = fo.fused(fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1)))
    gen = torch.Generator().manual_seed(0)
    values = {"w": torch.randn(1 << 20, generator=gen).bfloat16()}
    params = fo.pack(values)
    state = fast.init(params)
    for _ in range(2):  # the first call compiles; the second is measured
        grads = fo.pack({"w": torch.randn(1 << 20, generator=gen).bfloat16()})
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _, state = fast.update(grads, state, params, donate=True)
    # each allocation at its event's start, each free at its end (never below the true peak)
    changes = [
        (
            e.time_range.end if e.self_cpu_memory_usage < 0 else e.time_range.start,
            e.self_cpu_memory_usage,
        )
        for e in prof.events()
        if e.self_cpu_memory_usage
    ]
    peak = running = 0
    for _, change in sorted(changes):
        running += change
        peak = max(peak, running)
    assert peak < 1 << 20, f"the step allocated {peak} bytes"
