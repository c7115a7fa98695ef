"""The engine and the wrappers: ``MultiSteps``, ``apply_if_finite``, ``inject_hyperparams``,
``masked``/``partition`` over packed trees, eager, donated, compiled (``fo.fused``,
``fo.fused_step``) and under ``TransformOptimizer``.

Compiled and eager code compute the same math with other roundings, so those comparisons are
rule 2 of tests/README.md (counted below, errors carried in state adding up per step); the
same ops on the same values (a skipped step's negative zeros, the counters, a per-leaf path
against the plain tree) are compared bit for bit."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from conftest import ELEMENTWISE_OPS, MagnitudeRun, assert_bitwise, assert_close_rounding
from test_engine import _Model

import functional_opt as fo
from functional_opt.adapters import TransformOptimizer
from functional_opt.base import fusable, staged, stages

K = 3  # mini-steps per window
# A mini-step's accumulation, (g - acc) / n + acc, rounds 3 times; a window of K of them is
# what the inner transform gets.
WINDOW_OPS = 3 * K


def _tree(gen: torch.Generator, scale: float = 1.0) -> dict[str, Any]:
    # leaves of several sizes (a run of equal ones, a 0-d one) and a float64 buffer
    return {
        "w": torch.randn(33, 17, generator=gen) * scale,
        "run": [torch.randn(6, generator=gen) * scale for _ in range(4)],
        "s": torch.randn((), generator=gen) * scale,
        "d": (torch.randn(9, generator=gen) * scale).double(),
    }


def _no_fallback(caught: list[warnings.WarningMessage]) -> None:
    assert not [w for w in caught if str(w.message).startswith("fused:")]


# ------------------------------------------------------------------------------ MultiSteps
@pytest.mark.numerics
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_multi_steps_is_fused_and_equals_the_unfused_one(mean: bool) -> None:
    """``fused(MultiSteps(adam, K))`` over packed trees, donated: fusable, accumulators held in
    buffers of the params' layout (updated in place), the counters bit for bit, the emitted
    updates within rounding of the eager transform on the plain tree, and the mini-steps'
    updates negative zeros bit for bit."""
    tx = fo.MultiSteps(fo.adam(1e-2), K, use_grad_mean=mean).gradient_transformation()
    assert fusable(tx)
    fast = fo.fused(tx)
    gen = torch.Generator().manual_seed(0)
    params = _tree(gen)
    packed_params = fo.pack(params)
    state, fast_state = tx.init(params), fast.init(packed_params)
    assert fast_state.acc_grads.buffers is not None
    acc_ptrs = [b.data_ptr() for b in fast_state.acc_grads.buffers]
    magnitudes = MagnitudeRun(tx, params)
    for step in range(2 * K + 1):
        grads = _tree(gen, 0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            u_fast, fast_state = fast.update(fo.pack(grads), fast_state, packed_params, donate=True)
        _no_fallback(caught)
        u, state = tx.update(grads, state, params)
        scale, _ = magnitudes.update(grads, params)
        assert_bitwise(
            [fast_state.mini_step, fast_state.gradient_step],
            [state.mini_step, state.gradient_step],
        )
        assert [b.data_ptr() for b in fast_state.acc_grads.buffers] == acc_ptrs
        if (step + 1) % K:
            assert_bitwise(u_fast.tree, u)  # negative zeros
            continue
        window = (step + 1) // K
        assert_close_rounding(
            u_fast.tree,
            u,
            dtype=torch.float32,
            ops=(WINDOW_OPS + ELEMENTWISE_OPS) * window,
            scale=scale,
            msg=f"step {step}",
        )
        assert_close_rounding(
            fast_state.inner_opt_state[0].mu.tree,
            state.inner_opt_state[0].mu,
            dtype=torch.float32,
            ops=(WINDOW_OPS + ELEMENTWISE_OPS) * window,
        )


@pytest.mark.numerics
def test_multi_steps_fused_step_leaves_params_alone_on_mini_steps() -> None:
    """``fused_step`` of ``MultiSteps``: the params' buffers are unchanged bit for bit on a
    mini-step, and take ``p + u`` on the emitting one (the update's count, one more rounding
    for the sum)."""
    tx = fo.MultiSteps(fo.adam(1e-2), K).gradient_transformation()
    step_fn = fo.fused_step(tx)
    gen = torch.Generator().manual_seed(1)
    params = _tree(gen)
    packed = fo.pack(params)
    state, fast_state = tx.init(params), tx.init(packed)
    magnitudes = MagnitudeRun(tx, params)
    for i in range(2 * K):
        grads = _tree(gen, 0.1)
        before = [b.clone() for b in packed.buffers]
        packed, fast_state = step_fn(packed, fo.pack(grads), fast_state)
        u, state = tx.update(grads, state, params)
        scale, _ = magnitudes.update(grads, params)
        want = fo.apply_updates(params, u)
        if (i + 1) % K:
            assert_bitwise(list(packed.buffers), before)
        else:
            bound = fo.tree_map(lambda s, p: s + p.abs(), scale, params)
            ops = (WINDOW_OPS + ELEMENTWISE_OPS) * ((i + 1) // K) + 1
            assert_close_rounding(packed.tree, want, dtype=torch.float32, ops=ops, scale=bound)
        params = want


def _graph_ops(
    tx: fo.GradientTransformation, state: Any, grads: Any, params: Any, stage: bool = True
) -> set[str]:
    """The functions of the graph dynamo captures for ``tx.update`` under the stages read
    from ``state`` (as the engine traces it), or under none."""
    seen: list[set[str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        del example_inputs
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    def update(u: Any, s: Any, p: Any) -> Any:
        return tx.update(u, s, p)

    compiled = torch.compile(update, backend=backend, fullgraph=True, dynamic=False)
    with staged(stages(tx, state) if stage else ()):
        compiled(grads, state, params)
    torch._dynamo.reset()
    assert len(seen) == 1
    return seen[0]


def test_a_staged_mini_step_compiles_the_accumulation_alone() -> None:
    """The stages protocol the engine compiles by: on a CPU counter in eager mode ``MultiSteps``
    says whether the next mini-step emits, and traced under that stage a mini-step's graph is
    the accumulation alone (no square root: Adam does not run), while the emitting one runs
    Adam; without a stage (plain ``torch.compile``) both outcomes are computed and selected."""
    ms = fo.MultiSteps(fo.adam(1e-2), 2)
    tx = ms.gradient_transformation()
    gen = torch.Generator().manual_seed(2)
    params = fo.pack(_tree(gen))
    state = tx.init(params)
    grads = fo.pack(_tree(gen))
    assert stages(tx, state) == ((id(ms), False),)
    assert stages(fo.chain(fo.scale(1.0), tx), (fo.EmptyState(), state)) == ((id(ms), False),)
    guarded = fo.apply_if_finite(tx, 3)
    assert stages(guarded, guarded.init(params)) == ((id(ms), False),)
    assert not any("sqrt" in op for op in _graph_ops(guarded, guarded.init(params), grads, params))
    mini = _graph_ops(tx, state, grads, params)
    assert not any("sqrt" in op for op in mini)
    _, after = tx.update(grads, state, params)
    assert stages(tx, after) == ((id(ms), True),)
    assert any("sqrt" in op for op in _graph_ops(tx, after, grads, params))
    # not staged: the where-selection computes Adam on every mini-step
    assert any("sqrt" in op for op in _graph_ops(tx, state, grads, params, stage=False))
    # a counter that is not on the CPU (reading it would sync), or a should-skip function: no
    # stage
    elsewhere = state._replace(mini_step=torch.zeros((), dtype=torch.int32, device="meta"))
    assert stages(tx, elsewhere) == ()
    skipping = fo.multi_steps(fo.adam(1e-2), 2, should_skip_update_fn=fo.skip_not_finite)
    assert not fusable(skipping)
    assert stages(skipping, skipping.init(params)) == ()


@pytest.mark.numerics
def test_multi_steps_under_the_optimizer_steps_on_the_engine() -> None:
    """``TransformOptimizer`` with ``apply_if_finite(MultiSteps(adam, 2))``: the group steps on
    the engine (it did not: ``MultiSteps`` was not fusable), with the per-tensor path's
    updates (lockstep: each step from the same params, compared within rounding)."""
    torch.manual_seed(0)
    model = _Model()
    ref_model = copy.deepcopy(model)

    def make(ps: Any) -> TransformOptimizer:
        inner = fo.MultiSteps(fo.adam(1e-2), 2).gradient_transformation()
        return TransformOptimizer(ps, fo.apply_if_finite(inner, 2))

    opt, ref = make(model.parameters()), make(ref_model.parameters())
    opt.fused_min_numel = 0
    ref.fused_steps = False
    for step in range(4):
        x = torch.randn(8, 12)
        before = [p.detach().clone() for p in ref_model.parameters()]
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        got = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
        want = [p.detach() - b for p, b in zip(ref_model.parameters(), before, strict=True)]
        if step % 2 == 0:
            assert_bitwise(got, want)  # a mini-step: zeros
        else:  # the window's accumulation and Adam (carried per window), p + u - p: 2
            ops = (3 * 2 + ELEMENTWISE_OPS) * (step // 2 + 1) + 2
            scale = [b.abs() + 1e-2 for b in before]
            assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                p.copy_(q)
    assert opt._layouts[0].engine not in (None, False)  # type: ignore[union-attr]


# ------------------------------------------------------------------------ apply_if_finite
def _faulty(gen: torch.Generator, step: int) -> dict[str, Any]:
    grads = _tree(gen, 0.1)
    if step == 1:
        grads["w"][3, 4] = float("nan")
    elif step == 3:
        grads["run"][2][1] = float("inf")
    elif step == 4:
        grads["d"][0] = -float("inf")  # the float64 buffer
    return grads


@pytest.mark.numerics
def test_fused_apply_if_finite_over_a_stream_with_faults() -> None:
    """``fused(apply_if_finite(chain(clip, adam), 2))`` over packed trees, donated, on a stream
    with NaN and infinities: the counters and the skipped steps' negative zeros bit for bit
    as eager, the inner state kept bit for bit on a skipped step, the applied updates within
    rounding; and the state stays in its buffers (the selected state is written into the
    donated one: a fresh buffer per step cost W1 4.6x fused Adam in page faults)."""
    tx = fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)), 2)
    fast = fo.fused(tx)
    gen = torch.Generator().manual_seed(3)
    params = _tree(gen)
    packed_params = fo.pack(params)
    state, fast_state = tx.init(params), fast.init(packed_params)
    numel = sum(x.numel() for x in fo.tree.leaves(params))
    applied = 0
    for step in range(6):
        grads = _faulty(gen, step)
        mu_ptrs = [b.data_ptr() for b in fast_state.inner_state[1][0].mu.buffers]
        kept = [b.clone() for b in fast_state.inner_state[1][0].mu.buffers]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            u_fast, fast_state = fast.update(fo.pack(grads), fast_state, packed_params, donate=True)
        _no_fallback(caught)
        u, state = tx.update(grads, state, params)
        counters = [state.notfinite_count, state.last_finite, state.total_notfinite]
        assert_bitwise(
            [fast_state.notfinite_count, fast_state.last_finite, fast_state.total_notfinite],
            counters,
        )
        mu = fast_state.inner_state[1][0].mu
        assert [b.data_ptr() for b in mu.buffers] == mu_ptrs
        if not bool(state.last_finite):
            assert_bitwise(u_fast.tree, u)
            assert_bitwise(list(mu.buffers), kept)
            continue
        applied += 1
        # the global norm's squares and its factor (numel + 3) and Adam's, per applied step
        ops = (ELEMENTWISE_OPS + numel + 3) * applied
        assert_close_rounding(u_fast.tree, u, dtype=torch.float32, ops=ops, msg=f"step {step}")
    assert int(state.total_notfinite) == 3


@pytest.mark.numerics
def test_fused_step_of_apply_if_finite_keeps_params_on_a_bad_step() -> None:
    """``fused_step(apply_if_finite(adam, 1))``: a bad step leaves the params bit for bit, and
    the moments stay in their buffers on every step (written in place, never fresh ones)."""
    tx = fo.apply_if_finite(fo.adam(1e-2), 1)
    step_fn = fo.fused_step(tx)
    gen = torch.Generator().manual_seed(4)
    packed = fo.pack(_tree(gen))
    state = tx.init(packed)
    ptrs = [
        b.data_ptr() for b in (*state.inner_state[0].mu.buffers, *state.inner_state[0].nu.buffers)
    ]
    for step in range(3):
        before = [b.clone() for b in packed.buffers]
        packed, state = step_fn(packed, fo.pack(_faulty(gen, step)), state)
        same = all(torch.equal(a, b) for a, b in zip(packed.buffers, before, strict=True))
        assert same == (step == 1)  # the NaN step: bit for bit the old params
        moments = (*state.inner_state[0].mu.buffers, *state.inner_state[0].nu.buffers)
        assert [b.data_ptr() for b in moments] == ptrs
    assert int(state.total_notfinite) == 1


# --------------------------------------------------------------------- inject_hyperparams
@pytest.mark.numerics
def test_fused_step_with_injected_hyperparameters_never_recompiles() -> None:
    """``fused_step(chain(clip, inject_hyperparams(adamw)))``: changing ``learning_rate`` and
    ``b1`` in the state between steps compiles nothing new, and every step equals the eager
    chain with the same values within rounding."""
    counters = torch._dynamo.utils.counters
    make = fo.inject_hyperparams(fo.adamw)
    tx = fo.chain(fo.clip_by_global_norm(1.0), make(learning_rate=1e-2, b1=0.9, weight_decay=0.1))
    step_fn = fo.fused_step(tx)
    gen = torch.Generator().manual_seed(5)
    params = _tree(gen)
    packed = fo.pack(params)
    state, fast_state = tx.init(params), tx.init(packed)
    numel = sum(x.numel() for x in fo.tree.leaves(params))
    magnitudes = MagnitudeRun(tx, params)
    graphs = None
    for i, (lr, b1) in enumerate([(1e-2, 0.9), (3e-3, 0.8), (1e-3, 0.5), (0.0, 0.9)]):
        for s in (state, fast_state):
            s[1].hyperparams["learning_rate"].fill_(lr)
            s[1].hyperparams["b1"].fill_(b1)
        grads = _tree(gen, 0.1)
        packed, fast_state = step_fn(packed, fo.pack(grads), fast_state)
        if graphs is None:
            graphs = counters["stats"].get("unique_graphs")
        assert counters["stats"].get("unique_graphs") == graphs, f"recompiled at step {i}"
        u, state = tx.update(grads, state, params)
        scale, _ = magnitudes.update(grads, params)
        want = fo.apply_updates(params, u)
        bound = fo.tree_map(lambda s, p: s + p.abs(), scale, params)
        # the global norm (numel + 3) and the chain's ops, carried per step; the sum: 1
        ops = (ELEMENTWISE_OPS + numel + 3) * (i + 1) + 1
        assert_close_rounding(packed.tree, want, dtype=torch.float32, ops=ops, scale=bound)
        params = want


# ------------------------------------------------------------------- masked / partition
MASK = {"w": True, "run": [True, False, True, False], "s": False, "d": True}


@pytest.mark.parametrize(
    "make",
    [
        lambda: fo.masked(fo.adam(1e-2), MASK),
        lambda: fo.masked(fo.adam(1e-2), lambda params: MASK),
        lambda: fo.partition(
            {"a": fo.adam(1e-2), "s": fo.sgd(0.1)},
            {"w": "a", "run": ["a", "s", "a", "s"], "s": "s", "d": "a"},
        ),
    ],
    ids=["tree-mask", "callable-tree-mask", "partition"],
)
def test_tree_masks_and_labels_apply_to_packed_trees(make: Any) -> None:
    """A mask (or labels) written for the params' tree applies to the same params packed (it
    raised a ``ValueError``: the ``Packed`` node was not in the mask): the updates and state
    of the packed run equal the plain run's bit for bit (a stateful inner runs leaf by leaf:
    the same per-leaf ops)."""
    tx = make()
    gen = torch.Generator().manual_seed(6)
    params = _tree(gen)
    packed_params = fo.pack(params)
    state, packed_state = tx.init(params), tx.init(packed_params)
    for _ in range(3):
        grads = _tree(gen, 0.1)
        u, state = tx.update(grads, state, params)
        u_packed, packed_state = tx.update(fo.pack(grads), packed_state, packed_params)
        assert_bitwise(u_packed.tree, u)
    assert_bitwise(fo.state_to_dict(packed_state), fo.state_to_dict(state))


@pytest.mark.numerics
def test_a_masked_stateless_inner_runs_over_the_buffers() -> None:
    """``masked(add_decayed_weights)`` on a packed tree runs over the whole buffers and returns
    buffers (so the ``adam`` after it runs over them too): the leaves outside the mask keep
    their updates bit for bit, the others get the decay within rounding (vectorized adds may
    round ``u + wd p`` once), and the chain is fusable."""
    decay = fo.masked(fo.add_decayed_weights(0.1), MASK)
    tx = fo.chain(decay, fo.adam(1e-2))
    assert fusable(tx) and not fusable(fo.masked(fo.adam(1e-2), MASK))
    gen = torch.Generator().manual_seed(6)
    params = _tree(gen)
    packed_params = fo.pack(params)
    grads = _tree(gen, 0.1)
    u, _ = decay.update(fo.pack(grads), decay.init(packed_params), packed_params)
    assert isinstance(u, fo.Packed) and u.buffers is not None
    plain, _ = decay.update(grads, decay.init(params), params)
    assert_bitwise(
        [u.tree["run"][1], u.tree["run"][3], u.tree["s"]],
        [grads["run"][1], grads["run"][3], grads["s"]],
    )
    scale = fo.tree_map(lambda g, p: g.abs() + 0.1 * p.abs(), grads, params)
    assert_close_rounding(u.tree, plain, dtype=torch.float32, ops=2, scale=scale)
    state, packed_state = tx.init(params), tx.init(packed_params)
    magnitudes = MagnitudeRun(tx, params)
    for step in range(3):
        grads = _tree(gen, 0.1)
        u, state = tx.update(grads, state, params)
        u_packed, packed_state = tx.update(fo.pack(grads), packed_state, packed_params)
        bound, _ = magnitudes.update(grads, params)
        ops = ELEMENTWISE_OPS * (step + 1)
        assert_close_rounding(u_packed.tree, u, dtype=torch.float32, ops=ops, scale=bound)
    nothing = fo.masked(fo.add_decayed_weights(0.1), lambda p: fo.tree_map(lambda _: False, p))
    grads = fo.pack(_tree(gen, 0.1))
    same, _ = nothing.update(grads, nothing.init(packed_params), packed_params)
    assert same is grads  # no leaf masked: nothing computed


# ------------------------------------------------------------------------------ not fusable
def test_fused_step_of_a_leaf_by_leaf_transform_runs_its_own_update() -> None:
    """``fused_step`` of a transform that is not fusable (``adaptive_grad_clip`` needs each
    leaf's shape) runs its update leaf by leaf and adds it into the params' buffers: the same
    ops as ``update`` + ``apply_updates``, so the same bits (it raised a TypeError on the loose
    result)."""
    tx = fo.chain(fo.adaptive_grad_clip(0.1), fo.adam(1e-2))
    assert not fusable(tx)
    step_fn = fo.fused_step(tx)
    gen = torch.Generator().manual_seed(3)
    params = _tree(gen)
    packed = fo.pack(copy.deepcopy(params))
    state, fast_state = tx.init(params), tx.init(packed)
    for _ in range(3):
        grads = _tree(gen, 0.1)
        packed, fast_state = step_fn(packed, fo.pack(grads), fast_state)
        u, state = tx.update(grads, state, params)
        params = fo.apply_updates(params, u)
        assert_bitwise(packed.tree, params)


class _Pair(tuple):  # type: ignore[type-arg]
    """A tuple subclass that is not a named tuple: left to the general path."""


def _state_like(gen: torch.Generator) -> Any:
    """A state of the containers states are made of, with leaves of every kind."""
    return (
        fo.transforms.finite.ApplyIfFiniteState(
            torch.zeros((), dtype=torch.int32),
            torch.ones((), dtype=torch.bool),
            torch.zeros((), dtype=torch.int32),
            (None, [torch.randn(3, generator=gen), torch.randn(2, 2, generator=gen)]),
        ),
        {"b": torch.randn(4, generator=gen), "a": 3, "c": fo.pack([torch.randn(5, generator=gen)])},
        (),
    )


@pytest.mark.parametrize("take", [True, False])
def test_select_tree_walks_plain_containers_as_the_general_path_does(
    take: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``select_tree`` over tuples, named tuples, lists and dicts walks them in plain Python
    (no ``optree`` flatten, which dynamo traces as Python stand-ins: ``apply_if_finite``'s
    state doubled what was traced of a step) and gives what the general path gives, bit for
    bit, dict order and non-tensor leaves included, donated (``into``) or not; other trees
    (a tuple subclass, structures that differ) still take the general path."""
    from functional_opt.transforms import finite

    gen = torch.Generator().manual_seed(0)
    a, b = _state_like(gen), _state_like(gen)
    cond = torch.tensor(take)
    flatten = fo.tree.flatten_buffered
    calls: list[int] = []

    def counted(x: Any) -> Any:
        calls.append(1)
        return flatten(x)

    monkeypatch.setattr(fo.tree, "flatten_buffered", counted)
    for into in (False, True):
        got = finite.select_tree(cond, a, copy.deepcopy(b), into=into)
        assert not calls
        with monkeypatch.context() as patch:
            patch.setattr(finite, "_plain_pairs", lambda *args: False)
            want = finite.select_tree(cond, a, copy.deepcopy(b), into=into)
        assert calls
        calls.clear()
        assert fo.tree.difference(got, want) is None
        assert list(got[1]) == ["b", "a", "c"]
        assert_bitwise(
            [x for x in fo.tree.leaves(got) if isinstance(x, torch.Tensor)],
            [x for x in fo.tree.leaves(want) if isinstance(x, torch.Tensor)],
        )
        assert got[1]["a"] == 3
    finite.select_tree(cond, _Pair((torch.ones(2),)), _Pair((torch.zeros(2),)))
    assert calls  # (the general path)
    calls.clear()
    with pytest.raises((ValueError, TypeError)):
        finite.select_tree(cond, ([torch.ones(2)],), ((torch.ones(2),),))
    # structures that differ after a leaf that pairs up: nothing written into the donated tree
    # before the error
    donated = (torch.zeros(2), (torch.zeros(2),))
    with pytest.raises((ValueError, TypeError)):
        finite.select_tree(torch.tensor(True), (torch.ones(2), [torch.ones(2)]), donated, into=True)
    assert_bitwise(list(donated[:1]), [torch.zeros(2)])
