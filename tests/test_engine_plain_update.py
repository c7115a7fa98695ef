"""The pure API's update on the engine over plain trees: ``fo.fused(tx).update(g, s, p)`` (and
``dreamerv3()``'s own eager update) steps a fusable transform as ``fused_step`` does (large
leaves one compiled call each in their own storage, the others staged through packed buffers),
with the update written into the gradients instead of added into the params
(:meth:`functional_opt.plain_trees.PlainTreeStep.update`).

Compared with ``tx.update`` run op by op by rule 2 of tests/README.md (compiled code may fuse
``a * b + c``); the three donation modes give the same bits, and what a mode does not donate
is never written."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import DREAMERV3_ELEMENTWISE_OPS, ELEMENTWISE_OPS, assert_bitwise
from conftest import assert_close_rounding as close
from test_engine_direct import _plain, close_after_steps
from torch import Tensor

import functional_opt as fo
from functional_opt import tree
from functional_opt.plain_trees import PlainTreeStep

CHAINS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "adam": lambda: fo.adam(1e-2),
    "clip-adamw": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2, weight_decay=0.1)),
    "apply-if-finite": lambda: fo.apply_if_finite(
        fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2)), 3
    ),
    "multi-steps": lambda: fo.MultiSteps(fo.adamw(1e-2), 2).gradient_transformation(),
    "injected-adam": lambda: fo.inject_hyperparams(fo.adam)(learning_rate=1e-2),
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=2, _fused=False),
}


def _tensors(x: Any) -> list[Tensor]:
    return [t for t in tree.leaves(x) if isinstance(t, Tensor)]


class _Routes:
    """Whether each update took the engine's plain-tree route."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken: list[bool] = []
        real = PlainTreeStep.update

        def spy(step: PlainTreeStep, *args: Any, **kwargs: Any) -> Any:
            out = real(step, *args, **kwargs)
            self.taken.append(out is not None)
            return out

        monkeypatch.setattr(PlainTreeStep, "update", spy)


# (large leaves: the direct route and the staged one; all staged: the staged one alone, for
# transforms whose update looks across leaves or skips; adamw and sgd take adam's routes.)
CASES = [
    (name, True)
    for name in ("adam", "clip-adamw", "apply-if-finite", "multi-steps", "injected-adam")
] + [("dreamerv3", True), ("clip-adamw", False), ("multi-steps", False)]


# (the second code path of the CPU runs two cases: dreamerv3's, the longest elementwise chain,
# and a staged global norm; each case compiles its transform)
NUMERICS = {("dreamerv3", True), ("clip-adamw", False)}


@pytest.mark.parametrize(
    ("name", "large"),
    [
        pytest.param(
            n,
            big,
            id=f"{n}-{'large-leaves' if big else 'all-staged'}",
            marks=[pytest.mark.numerics] if (n, big) in NUMERICS else [],
        )
        for n, big in CASES
    ],
)
def test_fused_update_over_a_plain_tree_equals_the_update(
    name: str, large: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four updates, each in the three donation modes (one ``fused`` transform, each mode's
    own state): the same bits, within rounding of ``tx.update`` (updates and state); donated,
    the update is written into the gradients; the params are never written, nor (unless
    donated) the gradients or the state."""
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000 if large else 10**6)
    routes = _Routes(monkeypatch)
    ref_tx = CHAINS[name]()
    params = _plain(0)
    kept_params = [p.clone() for p in tree.leaves(params)]
    fused = fo.fused(CHAINS[name]())
    txs = {flag: fused for flag in (False, "state", True)}
    states = {flag: tx.init(params) for flag, tx in txs.items()}
    ref_state = ref_tx.init(params)
    for k in range(4):
        grads = _plain(10 + k)
        ref_u, ref_state = ref_tx.update(copy.deepcopy(grads), ref_state, params)
        outs = {}
        for flag, tx in txs.items():
            g = copy.deepcopy(grads)
            kept = [x.clone() for x in _tensors((g, states[flag]))]
            inputs = _tensors((g, states[flag]))
            u, states[flag] = tx.update(g, states[flag], params, donate=flag)
            outs[flag] = _tensors((u, states[flag]))
            if flag is True:
                assert u is g  # the update written into the gradients
            elif flag == "state":
                assert_bitwise(_tensors(g), kept[: len(_tensors(g))])
            else:
                assert_bitwise(inputs, kept)
        assert_bitwise(outs["state"], outs[False])
        assert_bitwise(outs[True], outs[False])
        extra = DREAMERV3_ELEMENTWISE_OPS + 40 * 30 + 2 if name == "dreamerv3" else 0
        ops = (ELEMENTWISE_OPS + extra) * (k + 1) + 2
        want = _tensors((ref_u, ref_state))
        scale = [x.abs() + 1e-2 if x.is_floating_point() else x for x in want]
        close(outs[False], want, dtype=torch.float32, ops=ops, scale=scale)
        params = fo.apply_updates(params, ref_u)
        kept_params = [p.clone() for p in tree.leaves(params)]
    assert_bitwise(tree.leaves(params), kept_params)
    assert routes.taken and all(routes.taken)


def test_dreamerv3_eager_update_runs_on_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dreamerv3()``'s eager update over a plain tree of at least ``TREE_MIN`` elements is
    the engine's (its chain compiled), in every donation mode, and a donated state is stepped
    in the buffers it is in; a smaller tree runs the chain op by op."""
    small = fo.dreamerv3(1e-2, warmup=0)  # (built first: its threshold is the default)
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    monkeypatch.setattr(fo.plain_trees, "TREE_MIN", 1000)
    routes = _Routes(monkeypatch)
    tx = fo.dreamerv3(1e-2, warmup=0)
    params = _plain(0)
    state = tx.init(params)
    ptrs: list[int] = []
    for k, flag in enumerate((False, "state", True, True)):
        _, state = tx.update(_plain(3), state, params, donate=flag)
        if k == 3:  # donated again: the state stepped in the buffers it is in
            assert [x.data_ptr() for x in _tensors(state) if x.ndim] == ptrs
        ptrs = [x.data_ptr() for x in _tensors(state) if x.ndim]
    assert routes.taken == [True, True, True, True]
    small.update(_plain(3), small.init(params), params)  # (a tree under TREE_MIN: the chain)
    assert routes.taken == [True, True, True, True, False]


def test_updates_the_engine_cannot_take_run_the_transform() -> None:
    """Where the route does not apply the transform's own update runs, with the same results:
    gradients that share memory (one tensor twice), gradients that overlap a param, no params
    given, an update whose dtype is not its gradient's, ``None`` gradients."""
    tx = fo.adam(1e-2)
    fused = fo.fused(fo.adam(1e-2))
    params = {"a": torch.randn(3000), "b": torch.randn(5)}
    state = tx.init(params)
    shared = torch.randn(3000)
    cases: list[tuple[Any, Any]] = [
        ({"a": shared, "b": shared[:5]}, params),  # (b's span lies inside a's)
        ({"a": params["a"], "b": torch.randn(5)}, params),  # the gradient is the param
        ({"a": torch.randn(3000), "b": torch.randn(5)}, None),
    ]
    for grads, p in cases:
        want, _ = tx.update(copy.deepcopy(grads), state, copy.deepcopy(p))
        got, _ = fused.update(grads, copy.deepcopy(state), p, donate=True)
        assert_bitwise(tree.leaves(got), tree.leaves(want))

    def widen(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return fo.tree_map(lambda u: u.double(), updates), state

    wide = fo.chain(fo.adam(1e-2), fo.GradientTransformation(lambda p: fo.EmptyState(), widen))
    fo.base.declare_fusable(wide.update, True)
    grads = {"a": torch.randn(3000), "b": torch.randn(5)}
    want, _ = wide.update(copy.deepcopy(grads), wide.init(params), params)
    got, _ = fo.fused(wide).update(grads, wide.init(params), params, donate=True)
    assert all(u.dtype == torch.float64 for u in tree.leaves(got))
    assert_bitwise(tree.leaves(got), tree.leaves(want))


def test_rows_of_one_buffer_take_the_update_in_place() -> None:
    """Params and gradients that are the rows of one buffer each (a flat-buffer training
    loop): the params are only read, and each gradient row takes its own update."""
    tx = fo.fused(fo.adam(1e-2))
    flat_p, flat_g = torch.randn(6, 40), torch.randn(6, 40)
    params, grads = list(flat_p.unbind(0)), list(flat_g.unbind(0))
    want, _ = fo.adam(1e-2).update([g.clone() for g in grads], tx.init(params), params)
    got, _ = tx.update(grads, tx.init(params), params, donate=True)
    assert all(u is g for u, g in zip(got, grads, strict=True))
    close(got, want, dtype=torch.float32, ops=ELEMENTWISE_OPS)


def _rows_tree(seed: int) -> dict[str, Any]:
    """Large matrices and small vectors of two sizes, several of each: the staged vectors lie
    in runs of rows of the staging buffers."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": [torch.randn(s, generator=gen) for s in [(40, 30), (30, 40), (50, 24)]],
        "b": [torch.randn(s, generator=gen) for s in [(30,)] * 4 + [(8,)] * 3],
    }


@pytest.mark.parametrize(
    ("name", "graphs"),
    [
        pytest.param("adam", 1, id="adam"),
        pytest.param("clip-adamw", 1, id="clip-adamw"),
        pytest.param("apply-if-finite", 1, id="apply-if-finite"),
        # per-leaf norms: the staged leaves keep the engine's step over the packed buffers
        pytest.param("dreamerv3", 2, id="dreamerv3", marks=pytest.mark.numerics),
    ],
)
@pytest.mark.parametrize("call", ["fused_step", "update"])
def test_staged_rows_take_the_large_leaves_step(
    name: str, graphs: int, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a plain tree with large leaves, a transform whose one-leaf step treats each
    element on its own steps the staged leaves' runs of rows through the large leaves' compiled
    step (``PlainTreeStep._run_staged_rows``): with the compiler's caches off, one graph goes
    through AOT autograd, not a second one for the staged leaves (DreamerV3, with per-leaf
    norms, keeps its second). ``fused_step`` and the donated ``update`` stay within rounding of
    ``tx.update`` run op by op over three steps; the params keep their storage."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    routes = _Routes(monkeypatch)
    ref_tx, tx = CHAINS[name](), CHAINS[name]()
    params, ref = _rows_tree(0), _rows_tree(0)
    state, ref_state = tx.init(params), ref_tx.init(ref)
    ptrs = [p.data_ptr() for p in tree.leaves(params)]
    step, fused = fo.fused_step(tx), fo.fused(tx)
    counters.clear()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        for k in range(3):
            grads = _rows_tree(10 + k)
            ref_u, ref_state = ref_tx.update(copy.deepcopy(grads), ref_state, ref)
            ref = fo.apply_updates(ref, ref_u)
            if call == "fused_step":
                params, state = step(params, grads, state)
            else:
                u, state = fused.update(grads, state, params, donate=True)
                params = fo.apply_updates(params, u, donate=True)
            extra = DREAMERV3_ELEMENTWISE_OPS + 40 * 30 + 2 if name == "dreamerv3" else 4
            close_after_steps(params, ref, extra, k + 1)
    compiled = dict(counters["aot_autograd"])
    assert compiled.get("total") == compiled.get("ok") == graphs, compiled
    assert [p.data_ptr() for p in tree.leaves(params)] == ptrs
    if call == "update":
        assert routes.taken and all(routes.taken)
