"""``partition`` (and ``masked`` around a transform that keeps state) on ``TransformOptimizer``'s
engine: the group split into one packed part per label (``adapters/label_parts.py``), each
stepped with its labels pinned, so that each label's state, counters included, is written by
its own part only.

Steps are compared with the per-tensor path by rule 2 of tests/README.md (compiled and eager
code round the same math differently); counters and state structure must be equal."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import (
    ELEMENTWISE_OPS,
    assert_close_rounding,
    assert_same_steps_then_sync,
    step_with_grads,
)

import functional_opt as fo
from functional_opt import plain_trees, tree
from functional_opt.adapters import TransformOptimizer
from functional_opt.adapters.label_parts import LabelParts

# matrices (adam's label) and vectors (sgd's), a few of each large enough to be stepped alone
SHAPES = [(40, 30), (30,), (6, 5), (5,), (6, 5), (5,), (3, 4), (7,), (20, 12), (300,), (4,)]
SHAPES += [(9,)] * 6 + [(2, 3)] * 6


def by_rank(params: Any) -> Any:
    return fo.tree_map(lambda p: "adam" if p.ndim > 1 else "sgd", params)


def aliases(learning_rate: float) -> fo.GradientTransformation:
    """A factory: each label an alias with its own scale (adam's with its bias-correction
    counter), under ``inject_hyperparams``' own step counter, which every part advances."""
    return fo.partition(
        {"adam": fo.adam(learning_rate), "sgd": fo.sgd(learning_rate, momentum=0.9)}, by_rank
    )


def matrices(params: Any) -> Any:
    return fo.tree_map(lambda p: p.ndim > 1, params)


def masked_adam(learning_rate: float) -> fo.GradientTransformation:
    """Adam on the matrices; the vectors' updates pass through the mask (p += g). (The mask is
    one object for every instance the factory makes, so its flags are the same labels.)"""
    return fo.masked(fo.adam(learning_rate), matrices)


MAKERS: dict[str, Callable[[list[torch.nn.Parameter]], TransformOptimizer]] = {
    "partition-of-aliases": lambda ps: TransformOptimizer(ps, aliases, lr=1e-2),
    "masked-adam": lambda ps: TransformOptimizer(ps, masked_adam, lr=1e-2),
    # ready-made (the bench's chain; in the checkpoint test)
    "chain-of-partition": lambda ps: TransformOptimizer(
        ps,
        fo.chain(
            fo.partition({"adam": fo.scale_by_adam(), "sgd": fo.trace(0.9)}, by_rank),
            fo.scale_by_learning_rate(1e-2),
        ),
    ),
}


def _params(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 0.1 for s in shapes]


def _lockstep(
    make: Callable[[list[torch.nn.Parameter]], TransformOptimizer],
    shapes: list[tuple[int, ...]],
    steps: int = 5,
) -> tuple[TransformOptimizer, TransformOptimizer, list[torch.nn.Parameter]]:
    """``steps`` steps of the engine and of the per-tensor path on the same gradients (the lr
    changed on the fourth), compared step by step; the params keep their storage."""
    params, ref_params = _params(0, shapes), _params(0, shapes)
    opt, ref = make(params), make(ref_params)
    opt.fused_min_numel = 0
    opt.direct_min_numel = 250  # (the largest params stepped alone, the others packed)
    ref.fused_steps = False
    ptrs = [p.data_ptr() for p in params]
    for step in range(steps):
        if step == 3:
            for o in (opt, ref):
                o.param_groups[0]["lr"] = 5e-3
        grads = _grads(10 + step, shapes)
        before = [p.detach().clone() for p in ref_params]
        step_with_grads([(params, opt), (ref_params, ref)], grads)
        ops = ELEMENTWISE_OPS * (step + 1) + 2
        assert_same_steps_then_sync(list(params), list(ref_params), before, ops)
    assert [p.data_ptr() for p in params] == ptrs
    return opt, ref, params


def _parts(opt: TransformOptimizer) -> LabelParts:
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert isinstance(engine, LabelParts)
    return engine


def _assert_same_state(opt: TransformOptimizer, ref: TransformOptimizer, steps: int) -> None:
    """The same state entries for each param and the same counters; the moments within the
    rounding of ``steps`` updates."""
    got, want = opt.state_dict(), ref.state_dict()
    assert got["param_groups"] == want["param_groups"]  # (the counters, with the options)
    assert got["state"].keys() == want["state"].keys()
    for i, entries in want["state"].items():
        assert got["state"][i].keys() == entries.keys()
        for name, value in entries.items():
            assert_close_rounding(
                got["state"][i][name],
                value,
                dtype=torch.float32,
                ops=ELEMENTWISE_OPS * steps,
                scale=value.abs() + 1e-3,
            )


@pytest.mark.parametrize("name", ["partition-of-aliases", "masked-adam"])
def test_each_label_steps_as_a_part_of_its_own_like_the_per_tensor_path(name: str) -> None:
    """Lockstep with the per-tensor path: the group is stepped as two parts (matrices,
    vectors), each on the engine (its large params alone, the others packed), with each
    label's state on its own params only and each counter advanced once per step."""
    opt, ref, params = _lockstep(MAKERS[name], SHAPES)
    parts = _parts(opt)
    matrices = [i for i, s in enumerate(SHAPES) if len(s) > 1]
    vectors = [i for i, s in enumerate(SHAPES) if len(s) == 1]
    assert sorted(part.members for part in parts.parts) == [matrices, vectors]
    assert parts.orphans is None and parts.steps == 5
    for part in parts.parts:
        assert part.group.rest and (part.group.direct or part.members == vectors)
    _assert_same_state(opt, ref, 5)
    for i in matrices:  # each label's state on its params only: adam's moments ...
        assert set(opt.state[params[i]]) <= {"mu", "nu"}
    if name != "masked-adam":  # ... the momentum of sgd
        for i in vectors:
            assert set(opt.state[params[i]]) == {"trace"}


def test_a_label_no_param_has_still_counts_its_steps() -> None:
    """Vectors only: adam's part has no param, but the whole group's update advances its
    counter over no leaf, so the engine's step does too (an update of no param, under adam's
    flag alone), and the checkpoints are the same."""
    shapes = [(9,)] * 8 + [(300,)]
    opt, ref, _ = _lockstep(MAKERS["partition-of-aliases"], shapes, steps=3)
    parts = _parts(opt)
    assert len(parts.parts) == 1 and parts.orphans is not None
    _assert_same_state(opt, ref, 3)
    assert int(opt.param_groups[0]["transform_state"]["count"]) == 3


def test_a_checkpoint_of_the_parts_loads_into_the_per_tensor_path_and_back() -> None:
    """A checkpoint taken on the engine continues on the per-tensor path (and the other way)
    with the same steps, the lr then changed: the state in torch's layout, each param with its
    label's entries."""
    opt, ref, params = _lockstep(MAKERS["chain-of-partition"], SHAPES, steps=2)
    assert sorted(len(part.members) for part in _parts(opt).parts) == [11, 12]
    ref.load_state_dict(opt.state_dict())  # (the per-tensor path takes the engine's state)
    opt.load_state_dict(ref.state_dict())  # (and the engine adopts it into its buffers)
    ref_params = [p for p in ref.param_groups[0]["params"]]
    with torch.no_grad():
        for p, q in zip(ref_params, params, strict=True):
            p.copy_(q)
    for o in (opt, ref):  # (the ready-made chain's lr as a ratio to the one it was built with)
        o.param_groups[0]["lr"] = 5e-3
    before = [p.detach().clone() for p in params]
    grads = _grads(99, SHAPES)
    step_with_grads([(params, opt), (ref_params, ref)], grads)
    assert_same_steps_then_sync(list(params), ref_params, before, ELEMENTWISE_OPS * 3 + 2)
    _assert_same_state(opt, ref, 3)


def clip_then_partition(learning_rate: float) -> fo.GradientTransformation:
    """A global norm over all leaves: a part would take it over its own leaves."""
    return fo.chain(
        fo.clip_by_global_norm(1.0),
        fo.partition({"adam": fo.adam(learning_rate), "sgd": fo.sgd(learning_rate)}, by_rank),
    )


def clip_inside_a_label(learning_rate: float) -> fo.GradientTransformation:
    """A reduction within a label (over its leaves): not split either (not leafwise)."""
    return fo.partition(
        {
            "adam": fo.chain(fo.clip_by_global_norm(1.0), fo.adam(learning_rate)),
            "sgd": fo.sgd(learning_rate),
        },
        by_rank,
    )


@pytest.mark.parametrize("factory", [clip_then_partition, clip_inside_a_label])
def test_groups_the_parts_would_step_otherwise_stay_per_tensor(factory: Any) -> None:
    """Where the parts' updates might not be the whole group's (a reduction over leaves), the
    group keeps the per-tensor path, with its usual results."""
    params, ref_params = _params(0, SHAPES), _params(0, SHAPES)
    opt = TransformOptimizer(params, factory, lr=1e-2)
    ref = TransformOptimizer(ref_params, factory, lr=1e-2)
    opt.fused_min_numel = 0
    ref.fused_steps = False
    for step in range(2):
        grads = _grads(step, SHAPES)
        step_with_grads([(params, opt), (ref_params, ref)], grads)
    assert opt._layouts[0].engine is False  # type: ignore[union-attr]
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------- pure API
PURE: dict[str, Callable[[], fo.GradientTransformation]] = {
    "partition": lambda: fo.chain(
        fo.partition({"adam": fo.scale_by_adam(), "sgd": fo.trace(0.9)}, by_rank),
        fo.scale_by_learning_rate(1e-2),
    ),
    # inject_hyperparams' step count, which every part advances
    "injected-aliases": lambda: fo.inject_hyperparams(aliases)(learning_rate=1e-2),
    "masked-adam": lambda: masked_adam(1e-2),
}


def _pure_lockstep(
    tx: fo.GradientTransformation,
    shapes: list[tuple[int, ...]],
    steps: int,
    adapt: Callable[[list[torch.Tensor]], list[torch.Tensor]],
) -> tuple[Any, Any]:
    """``steps`` steps of ``fo.fused_step(tx)`` over a plain list (its gradients ``adapt``-ed)
    and of ``update`` + ``apply_updates`` on the same gradients, compared step by step; the
    two final states."""
    step = fo.fused_step(tx)
    params = [p.detach() for p in _params(0, shapes)]
    ref = [p.clone() for p in params]
    state, ref_state = tx.init(params), tx.init(ref)
    for t in range(steps):
        grads = _grads(20 + t, shapes)
        before = [p.clone() for p in ref]
        params, state = step(params, adapt([g.clone() for g in grads]), state)
        updates, ref_state = tx.update(grads, ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        assert_same_steps_then_sync(params, ref, before, ELEMENTWISE_OPS * (t + 1) + 2)
    return state, ref_state


def _outcomes(monkeypatch: pytest.MonkeyPatch, method: str) -> list[bool]:
    """Whether each call of a plain-tree step's ``method`` took its tree (``False``: it
    refused), recorded from now on."""
    calls: list[bool] = []
    original = getattr(plain_trees.PlainTreeStep, method)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(plain_trees.PlainTreeStep, method, counted)
    return calls


@pytest.fixture
def plain_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of a plain-tree step stepped its tree (``False``: it refused)."""
    return _outcomes(monkeypatch, "__call__")


@pytest.fixture
def plain_updates(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of a plain-tree step's ``update`` updated its tree (``False``: it
    refused)."""
    return _outcomes(monkeypatch, "update")


def _assert_same_pure_state(state: Any, ref_state: Any, steps: int) -> None:
    """The same entries; counters equal, the rest within rounding (rule 2 of tests/README.md)."""
    got, want = fo.state_to_dict(state), fo.state_to_dict(ref_state)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if value.dtype in (torch.int32, torch.int64):
            assert torch.equal(got[key], value), key
        else:
            assert_close_rounding(
                got[key],
                value,
                dtype=torch.float32,
                ops=ELEMENTWISE_OPS * steps,
                scale=value.abs() + 1e-3,
            )


@pytest.mark.parametrize(
    ("name", "shapes"),
    [
        ("partition", [*SHAPES, (300, 120)]),  # (the last one large: stepped alone)
        ("injected-aliases", SHAPES),
        ("masked-adam", SHAPES),
        ("injected-aliases", [(9,)] * 8),  # (no matrix: adam's counter by an update of no leaf)
    ],
    ids=["partition", "injected-aliases", "masked-adam", "vectors-only"],
)
def test_fused_step_over_a_plain_tree_steps_each_label_as_a_part(
    name: str, shapes: list[tuple[int, ...]], plain_calls: list[bool]
) -> None:
    """``fo.fused_step`` of such a transform over a plain list: one plain-tree step per set of
    labels (compiled, in place) instead of the transform's own eager update; 4 steps equal to
    ``update`` + ``apply_updates`` within rounding, the state of the same structure (each
    label's entries at its leaves, ``None`` elsewhere) and the same counters."""
    state, ref_state = _pure_lockstep(PURE[name](), shapes, 4, lambda grads: grads)
    parts = 1 if len(shapes) == 8 else 2  # (matrices and vectors, or vectors only)
    assert plain_calls == [True] * 4 * parts  # (each part's plain-tree step, none refused)
    _assert_same_pure_state(state, ref_state, 4)


def test_a_part_the_plain_tree_step_refuses_runs_its_own_update(plain_calls: list[bool]) -> None:
    """A part refused after another was stepped (here: a large vector whose gradient is not
    contiguous, which the plain-tree step does not read in place) runs the transform's eager
    update under its flags: the same steps as ``update`` + ``apply_updates``."""
    shapes = [(40, 30), (30,), (6, 5), (40000,)]

    def strided(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        grads[3] = torch.stack([grads[3], grads[3]], dim=1)[:, 0]  # (a strided view)
        assert not grads[3].is_contiguous()
        return grads

    state, ref_state = _pure_lockstep(PURE["injected-aliases"](), shapes, 2, strided)
    assert plain_calls == [True, False] * 2  # (the matrices stepped, the vectors refused)
    assert torch.equal(fo.state_to_dict(state)["count"], fo.state_to_dict(ref_state)["count"])


def test_new_params_of_one_structure_are_labelled_afresh() -> None:
    """The parts are found for the params given: another list of the same length whose leaves
    are labelled otherwise (a matrix where a vector was) is split by its own labels, not by
    those of the list stepped before."""
    tx = PURE["partition"]()
    step = fo.fused_step(tx)
    for shapes in ([(40, 30), (30,), (6, 5), (5,)], [(30,), (40, 30), (5,), (6, 5)]):
        params = [p.detach() for p in _params(0, shapes)]
        ref = [p.clone() for p in params]
        state, ref_state = tx.init(params), tx.init(ref)
        grads = _grads(40, shapes)
        params, state = step(params, [g.clone() for g in grads], state)
        updates, ref_state = tx.update(grads, ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        assert_same_steps_then_sync(params, ref, [p.detach() for p in _params(0, shapes)], 4)


@pytest.mark.parametrize("donate", [True, "state", False])
@pytest.mark.parametrize("name", ["partition", "injected-aliases", "masked-adam"])
def test_fused_update_over_a_plain_tree_updates_each_label_as_a_part(
    name: str, donate: bool | str, plain_updates: list[bool]
) -> None:
    """``fo.fused(tx).update`` of such a transform over a plain list, as in a pure training
    loop of ``update`` + ``apply_updates``: one plain-tree update per set of labels (compiled)
    instead of the transform's own eager update, with each donation mode's contract: donated
    gradients hold the updates, gradients not donated are left as they were, and a state not
    donated too; 3 steps equal to the transform's own update within rounding."""
    shapes = [*SHAPES, (300, 120), (40000,)]  # (two large leaves: stepped alone)
    tx = PURE[name]()
    fast = fo.fused(tx)
    params = [p.detach() for p in _params(0, shapes)]
    ref = [p.clone() for p in params]
    state, ref_state = tx.init(params), tx.init(ref)
    for t in range(3):
        grads = _grads(50 + t, shapes)
        given = [g.clone() for g in grads]
        held = [x.clone() for x in fo.state_to_dict(state).values()]
        updates, state_after = fast.update(given, state, params, donate=donate)
        want, ref_state = tx.update(grads, ref_state, ref)
        if donate is True:
            assert all(u is g for u, g in zip(updates, given, strict=True))
        else:
            assert all(torch.equal(g, h) for g, h in zip(given, grads, strict=True))
        if donate is False:  # (the state given is as it was)
            for x, h in zip(fo.state_to_dict(state).values(), held, strict=True):
                assert torch.equal(x, h)
        for u, w in zip(updates, want, strict=True):
            assert_close_rounding(u, w, dtype=torch.float32, ops=ELEMENTWISE_OPS * (t + 1))
        state = state_after
        before = [p.clone() for p in ref]
        params = fo.apply_updates(params, updates)
        ref = fo.apply_updates(ref, want)
        assert_same_steps_then_sync(params, ref, before, ELEMENTWISE_OPS * (t + 1) + 2)
    assert plain_updates == [True] * 3 * 2  # (matrices and vectors, none refused)
    _assert_same_pure_state(state, ref_state, 3)


def _node_types(state: Any) -> list[type]:
    """The state's leaves' types, with packed trees taken as leaves."""
    return [
        type(x)
        for x in optree.tree_leaves(
            state,
            is_leaf=lambda x: isinstance(x, fo.Packed),
            none_is_leaf=True,
            namespace=tree.NAMESPACE,
        )
    ]


@pytest.mark.parametrize("name", ["partition", "injected-aliases", "masked-adam"])
def test_packed_trees_step_each_label_as_a_part(
    name: str, plain_calls: list[bool], plain_updates: list[bool]
) -> None:
    """Over packed trees (``fo.pack``) too: ``fo.fused_step`` and the donated
    ``fo.fused(tx).update`` step the packed leaves (views of the buffers) per set of labels,
    writing through the views (the params' and gradients' buffers stay the ones given), with
    each label's state packed at the params' structure as ``tx.init`` made it; 3 steps equal
    to the transform's own update over the plain list. (Here a buffer holds matrices and
    vectors of one size, ``(6, 5)`` and ``(30,)``: not the route over whole buffers.)"""
    shapes = [*SHAPES, (300, 120)]
    tx = PURE[name]()
    step, fast = fo.fused_step(tx), fo.fused(tx)
    plain = [p.detach() for p in _params(0, shapes)]
    by_step, by_update = fo.pack([p.clone() for p in plain]), fo.pack([p.clone() for p in plain])
    buffers = [*by_step.buffers, *by_update.buffers]  # type: ignore[misc]
    s_step, s_update, ref_state = tx.init(by_step), tx.init(by_update), tx.init(plain)
    ref = plain
    for t in range(3):
        grads = _grads(60 + t, shapes)
        before = [p.clone() for p in ref]
        by_step, s_step = step(by_step, fo.pack([g.clone() for g in grads]), s_step)
        packed_grads = fo.pack([g.clone() for g in grads])
        updates, s_update = fast.update(packed_grads, s_update, by_update, donate=True)
        assert updates is packed_grads  # (written into the donated gradients' buffers)
        by_update = fo.apply_updates(by_update, updates, donate=True)
        want, ref_state = tx.update(grads, ref_state, ref)
        ref = fo.apply_updates(ref, want)
        for got in (by_step, by_update):
            assert isinstance(got, fo.Packed)
            assert_same_steps_then_sync(list(got.tree), ref, before, ELEMENTWISE_OPS * (t + 1) + 2)
    assert all(map(operator.is_, [*by_step.buffers, *by_update.buffers], buffers))  # type: ignore[misc]
    assert plain_calls == [True] * 3 * 2 and plain_updates == [True] * 3 * 2
    for state in (s_step, s_update):
        assert _node_types(state) == _node_types(tx.init(fo.pack(plain)))
        _assert_same_pure_state(state, ref_state, 3)


# no vector has a matrix's number of elements: each buffer of a packed tree (one per leaf
# size) holds leaves of one label
BY_BUFFER = [(40, 30), (31,), (6, 5), (7,), (6, 5), (7,), (3, 4), (300,), (20, 12)]
BY_BUFFER += [(9,)] * 6 + [(2, 3)] * 6


@pytest.mark.parametrize(
    ("name", "shapes"),
    [
        ("partition", BY_BUFFER),
        ("injected-aliases", BY_BUFFER),
        ("masked-adam", BY_BUFFER),
        ("injected-aliases", [(9,)] * 8),  # (no matrix: adam's counter by an update of no leaf)
    ],
    ids=["partition", "injected-aliases", "masked-adam", "vectors-only"],
)
def test_packed_trees_whose_labels_fill_whole_buffers_step_over_the_buffers(
    name: str,
    shapes: list[tuple[int, ...]],
    plain_calls: list[bool],
    plain_updates: list[bool],
) -> None:
    """Over packed trees whose buffers each hold leaves of one set of labels, ``fo.fused_step``
    and ``fo.fused(tx).update`` (each donation mode) run each set of labels' update compiled
    over its buffers (no plain-tree step, no leaf views); each label's state nodes are packed
    into buffers of their own (``tx.init`` made them loose) and used in place from then on;
    4 steps equal to the transform's own update over the plain list, the same counters."""
    tx = PURE[name]()
    step, fast = fo.fused_step(tx), fo.fused(tx)
    plain = [p.detach() for p in _params(0, shapes)]
    by_step = fo.pack([p.clone() for p in plain])
    by_update = {mode: fo.pack([p.clone() for p in plain]) for mode in ("all", "state", "none")}
    buffers = list(by_step.buffers)  # type: ignore[arg-type]
    s_step = tx.init(by_step)
    s_update = {mode: tx.init(p) for mode, p in by_update.items()}
    ref, ref_state = plain, tx.init(plain)
    donation: dict[str, bool | str] = {"all": True, "state": "state", "none": False}
    for t in range(4):
        grads = _grads(90 + t, shapes)
        before = [p.clone() for p in ref]
        by_step, s_step = step(by_step, fo.pack([g.clone() for g in grads]), s_step)
        want, ref_state = tx.update(grads, ref_state, ref)
        ref = fo.apply_updates(ref, want)
        for mode, params in by_update.items():
            given = fo.pack([g.clone() for g in grads])
            held = [x.clone() for x in fo.state_to_dict(s_update[mode]).values()]
            updates, new_state = fast.update(given, s_update[mode], params, donate=donation[mode])
            assert (updates is given) == (mode == "all")
            if mode != "all":  # (the gradients given are as they were)
                assert all(torch.equal(g, h) for g, h in zip(given.tree, grads, strict=True))
            if mode == "none" and t > 0:  # (so is the state: packed on the first update)
                now = fo.state_to_dict(s_update[mode]).values()
                assert all(torch.equal(x, h) for x, h in zip(now, held, strict=True))
            s_update[mode] = new_state
            by_update[mode] = fo.apply_updates(params, updates, donate=True)
        for got in (by_step, *by_update.values()):
            assert isinstance(got, fo.Packed)
            assert_same_steps_then_sync(list(got.tree), ref, before, ELEMENTWISE_OPS * (t + 1) + 2)
    assert all(map(operator.is_, by_step.buffers, buffers))  # type: ignore[arg-type]
    assert plain_calls == [] and plain_updates == []  # (no plain-tree step: the buffers')
    for state in (s_step, *s_update.values()):
        nodes = [
            x
            for x in optree.tree_leaves(
                state, is_leaf=lambda x: isinstance(x, fo.Packed), namespace=tree.NAMESPACE
            )
            if isinstance(x, fo.Packed)
        ]
        with_leaves = [
            x
            for x in nodes
            if any(
                v is not None
                for v in optree.tree_leaves(x.tree, none_is_leaf=True, namespace=tree.NAMESPACE)
            )
        ]
        assert with_leaves and all(x.buffers is not None for x in with_leaves)
        assert _node_types(state) == _node_types(tx.init(fo.pack(plain)))
        _assert_same_pure_state(state, ref_state, 4)


@pytest.mark.parametrize("donate", [True, "state", False])
def test_a_part_the_plain_tree_update_refuses_runs_its_own_update(
    donate: bool | str, plain_updates: list[bool]
) -> None:
    """``fo.fused(tx).update``: a part refused after another was updated (a large vector whose
    gradient is not contiguous) runs the transform's eager update under its flags, with the
    same donation: the same updates and state as the transform's own update."""
    shapes = [(40, 30), (30,), (6, 5), (40000,)]
    tx = PURE["injected-aliases"]()
    fast = fo.fused(tx)
    params = [p.detach() for p in _params(0, shapes)]
    state, ref_state = tx.init(params), tx.init([p.clone() for p in params])
    for t in range(2):
        grads = _grads(70 + t, shapes)
        given = [g.clone() for g in grads]
        given[3] = torch.stack([given[3], given[3]], dim=1)[:, 0]  # (a strided view)
        assert not given[3].is_contiguous()
        updates, state = fast.update(given, state, params, donate=donate)
        want, ref_state = tx.update(grads, ref_state, params)
        for u, w in zip(updates, want, strict=True):
            assert_close_rounding(u, w, dtype=torch.float32, ops=ELEMENTWISE_OPS * (t + 1))
    assert plain_updates == [True, False] * 2  # (the matrices updated, the vectors refused)
    _assert_same_pure_state(state, ref_state, 2)
