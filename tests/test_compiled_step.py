"""``fo.fused_step`` inside a user's ``torch.compile``: over a plain tree the step is one op of
the graph (``functional_opt::fused_step``), which runs the engine's step when the compiled code
runs, so the results are those of the same ``fused_step`` called outside ``torch.compile``, bit
for bit; trees the op cannot take are traced inline."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import assert_close_rounding
from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs

import functional_opt as fo
from functional_opt import plain_trees, tree

OP = torch.ops.functional_opt.fused_step


def _dict(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"enc.weight": (40, 30), "enc.bias": (40,), "head.weight": (5, 40), "head.bias": (5,)}
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def _list(seed: int) -> list[torch.Tensor]:
    return list(_dict(seed).values())


def _matrices(params: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: "adam" if v.ndim > 1 else "sgd" for k, v in params.items()}


TRANSFORMS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=2),
    # (a reduction across leaves, and a hyperparameter changed between steps)
    "clip-injected-adamw": lambda: fo.chain(
        fo.clip_by_global_norm(1.0), fo.inject_hyperparams(fo.adamw)(learning_rate=1e-2)
    ),
    "partition": lambda: fo.partition(
        {"adam": fo.adam(1e-2), "sgd": fo.sgd(1e-2, momentum=0.9)}, _matrices
    ),
}


def _ops(graphs: list[torch.fx.GraphModule]) -> list[Any]:
    return [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    ("name", "container", "backend"),
    [
        ("dreamerv3", _dict, "inductor"),
        ("clip-injected-adamw", _list, "aot_eager"),
        ("partition", _dict, "aot_eager"),
    ],
)
def test_a_compiled_fused_step_is_one_op_and_steps_as_outside_compile(
    name: str,
    container: Callable[[int], Any],
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four steps of ``torch.compile(fullgraph=True)`` of a step that calls ``fused_step``
    (the first leaf takes the direct route, the others are staged, all of them for the
    clip): one graph with the op and
    none of the update's math, compiled once (the injected lr changed in place on the third
    step), the params stepped in their own storage, the gradients unchanged, and params and
    state bit for bit those of the same transform's ``fused_step`` outside ``torch.compile``."""
    # enc.weight (1200 elements) takes the direct route, except where the reduction's passes
    # would compile four graphs for what the op does not change (every leaf staged: one)
    big = 10**6 if name == "clip-injected-adamw" else 1000
    monkeypatch.setattr(plain_trees, "LEAF_MIN", big)
    torch._dynamo.reset()
    tx = TRANSFORMS[name]()
    step, eager_step = fo.fused_step(tx), fo.fused_step(tx)
    recorded = EagerAndRecordGraphs()
    counted = CompileCounterWithBackend(backend)

    def train_step(params: Any, grads: Any, state: Any) -> Any:
        return step(params, grads, state)

    traced = torch.compile(train_step, backend=recorded, fullgraph=True)
    compiled = torch.compile(train_step, backend=counted, fullgraph=True)
    params, ref = container(0), container(0)
    state, ref_state = tx.init(params), tx.init(ref)
    ptrs = [p.data_ptr() for p in tree.leaves(params)]
    traced(copy.deepcopy(params), container(9), copy.deepcopy(state))
    assert OP in _ops(recorded.graphs)
    assert all(t is OP or "aten" not in str(t) for t in _ops(recorded.graphs))
    for k in range(4):
        if k == 2 and name == "clip-injected-adamw":
            for s in (state, ref_state):
                s[1].hyperparams["learning_rate"].fill_(3e-3)
        grads = container(10 + k)
        out, state = compiled(params, grads, state)
        assert out is params
        assert all(  # (read, never written)
            torch.equal(a, b)
            for a, b in zip(tree.leaves(grads), tree.leaves(container(10 + k)), strict=True)
        )
        ref, ref_state = eager_step(ref, container(10 + k), ref_state)
        got, want = tree.leaves((params, state)), tree.leaves((ref, ref_state))
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert counted.frame_count == 1
    assert [p.data_ptr() for p in tree.leaves(params)] == ptrs


@pytest.mark.parametrize("case", ["nested", "tracked"])
def test_a_compiled_fused_step_the_op_cannot_take_is_traced_inline(case: str) -> None:
    """Params in a nested tree, or params autograd records: the step is traced inline (no op
    in the graph) and agrees with the eager update within rounding."""
    torch._dynamo.reset()
    tx = fo.adam(1e-2)
    step = fo.fused_step(tx)
    recorded = EagerAndRecordGraphs()
    compiled = torch.compile(step, backend=recorded, fullgraph=True)
    if case == "nested":
        params: Any = {"enc": _dict(0), "head": _list(1)}
        grads: Any = {"enc": _dict(2), "head": _list(3)}
    else:
        params = {k: v.requires_grad_() for k, v in _dict(0).items()}
        grads = _dict(2)
    ref = {k: v.detach().clone() for k, v in params.items()} if case == "tracked" else None
    ref = copy.deepcopy(params) if ref is None else ref
    state, ref_state = tx.init(params), tx.init(ref)
    updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref)
    ref = fo.apply_updates(ref, updates)
    out, state = compiled(params, grads, state)
    assert OP not in _ops(recorded.graphs)
    assert_close_rounding(
        [x.detach() for x in tree.leaves(out)], tree.leaves(ref), dtype=torch.float32, ops=12
    )


@pytest.mark.parametrize("wrong", ["another-transform", "other-shapes"])
def test_a_compiled_fused_step_given_a_state_of_another_structure_raises(wrong: str) -> None:
    """The op rebuilds the state's structure from ``tx.init`` of the params; a state of another
    transform, or one of as many leaves of other shapes (the params' order reversed), is a
    ``RuntimeError`` saying so, and nothing is written."""
    torch._dynamo.reset()
    tx = fo.adam(1e-2)
    compiled = torch.compile(fo.fused_step(tx), backend="aot_eager", fullgraph=True)
    params = _list(0)
    before = copy.deepcopy(params)
    if wrong == "another-transform":
        state = fo.sgd(1e-2, momentum=0.9).init(params)
    else:
        state = tx.init(params[::-1])
    with pytest.raises(RuntimeError, match=r"structure of tx\.init"):
        compiled(params, _list(1), state)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


def test_a_compiled_fused_step_whose_init_reads_values_rebuilds_its_state_from_the_params() -> None:
    """The op rebuilds the state's structure from ``tx.init`` on the ``meta`` device; an init
    that cannot run there (it reads values) runs on the params instead, and the steps agree
    with the eager ``fused_step``."""
    torch._dynamo.reset()
    adam = fo.adam(1e-2)

    def init(params: Any) -> Any:
        if any(p.is_meta for p in tree.leaves(params)):
            raise NotImplementedError("reads values")
        return adam.init(params)

    tx = fo.GradientTransformation(init, adam.update)
    compiled = torch.compile(fo.fused_step(tx), backend="aot_eager", fullgraph=True)
    eager = fo.fused_step(tx)
    params, ref = _list(0), _list(0)
    state, ref_state = tx.init(params), tx.init(ref)
    for k in range(2):
        params, state = compiled(params, _list(1 + k), state)
        ref, ref_state = eager(ref, _list(1 + k), ref_state)
    assert all(torch.equal(a, b) for a, b in zip(params, ref, strict=True))


def test_one_fused_step_called_compiled_and_eagerly_in_turn_steps_as_eagerly() -> None:
    """A training step compiled whole (the gradients from ``torch.func.grad`` inside the graph,
    then ``fused_step``) and the same ``fused_step`` called eagerly, in turn, on two copies of
    the params: each agrees bit for bit with a ``fused_step`` only ever called eagerly. (The
    op's plain-tree step is its own: it reuses its staging buffers every step, which must not
    be the buffers the eager calls' returned state views.)"""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Tanh(), torch.nn.Linear(30, 2))
    tx = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=1e-2))
    step, reference = fo.fused_step(tx), fo.fused_step(tx)

    def loss(params: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().mean()

    def train_step(params: Any, state: Any, x: torch.Tensor) -> Any:
        return step(params, torch.func.grad(loss)(params, x), state)

    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    recorded = EagerAndRecordGraphs()
    torch.compile(train_step, backend=recorded, fullgraph=True)(
        copy.deepcopy(start), tx.init(start), torch.ones(3, 8)
    )
    assert OP in _ops(recorded.graphs)
    compiled = torch.compile(train_step, backend="aot_eager", fullgraph=True)
    a, b, ref_a, ref_b = (copy.deepcopy(start) for _ in range(4))
    sa, sb, ref_sa, ref_sb = (tx.init(start) for _ in range(4))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        a, sa = compiled(a, sa, x)
        b, sb = step(b, torch.func.grad(loss)(b, x), sb)
        ref_a, ref_sa = reference(ref_a, torch.func.grad(loss)(ref_a, x), ref_sa)
        ref_b, ref_sb = reference(ref_b, torch.func.grad(loss)(ref_b, x), ref_sb)
        for got, want in ((a, ref_a), (b, ref_b), (sa, ref_sa), (sb, ref_sb)):
            assert all(
                torch.equal(u, v) for u, v in zip(tree.leaves(got), tree.leaves(want), strict=True)
            )


def test_a_compiled_fused_step_places_the_state_in_optrees_order_whatever_it_is() -> None:
    """The traced code lists the state's leaves itself (dict keys sorted); the op finds, on
    ``tx.init`` of the params, where each of optree's leaves is in that list, so the state is
    rebuilt right even when optree keeps dicts in insertion order (here not the sorted one)."""
    torch._dynamo.reset()
    tx = fo.adam(1e-2)
    with optree.dict_insertion_ordered(True, namespace=tree.NAMESPACE):
        compiled = torch.compile(fo.fused_step(tx), backend="aot_eager", fullgraph=True)
        eager = fo.fused_step(tx)
        params, ref = _dict(0), _dict(0)
        assert list(params) != sorted(params)
        state, ref_state = tx.init(params), tx.init(ref)
        for k in range(2):
            params, state = compiled(params, _dict(1 + k), state)
            ref, ref_state = eager(ref, _dict(1 + k), ref_state)
        got, want = tree.leaves((params, state)), tree.leaves((ref, ref_state))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_op_is_never_captured_in_a_cuda_graph() -> None:
    """The op's body is Python that decides each step what to run (routes, staging, copies):
    inductor's CUDA graphs (``mode="reduce-overhead"``) must leave it out of a capture."""
    assert torch.Tag.cudagraph_unsafe in OP.default.tags


def test_the_engine_inside_the_op_compiles_once() -> None:
    """Compiled by inductor, the graph's first call runs the op through its in-place kernel and
    later calls reach it directly, with the dispatch keys that the engine's own compiled
    kernels guard on set otherwise: the second call compiled the engine's kernels again. The
    op now runs the engine as eager code does, every call."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    tx = fo.dreamerv3(lr=1e-3, warmup=0)
    compiled = torch.compile(fo.fused_step(tx), fullgraph=True)
    params = _dict(0)
    state = tx.init(params)
    params, state = compiled(params, _dict(1), state)
    before = dict(counters["stats"])
    for k in range(2, 4):
        params, state = compiled(params, _dict(k), state)
    assert dict(counters["stats"]).get("unique_graphs") == before.get("unique_graphs")
