"""A mask on the engine's per-leaf routes: ``masked`` (``adamw(mask=...)``'s weight decay) reads
each leaf's flag off the whole tree once (its *label*), so the engine steps large leaves alone
(in their own storage) and packs the others, each given the flags it has in the whole tree."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import (
    ELEMENTWISE_OPS,
    assert_bitwise,
    assert_close_rounding,
    assert_same_steps_then_sync,
    step_with_grads,
)

import functional_opt as fo
from functional_opt import tree
from functional_opt.adapters import TransformOptimizer
from functional_opt.base import (
    fusable,
    has_leaf_labels,
    leaf_labels,
    leafwise,
    part_labels,
    pinned,
    staged,
)
from functional_opt.transforms.combinators import MaskedState


def _every_other(ps: Any) -> list[bool]:
    """A mask by position: a leaf alone cannot tell its flag (alone it is always position 0)."""
    return [i % 2 == 0 for i in range(len(tree.leaves(ps)))]


def _leaves(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(5, 4), (7,), (3, 2)]]


@pytest.mark.parametrize("mask", ["tree", "function"])
def test_a_masked_leaf_updates_alone_given_its_label_as_in_the_tree(mask: str) -> None:
    """The labels' promise: over three steps, each leaf's update under its label equals bit for
    bit its update in the whole tree (a mask given as a tree or as a function of it)."""
    given = [True, False, True] if mask == "tree" else _every_other
    tx = fo.adamw(1e-2, weight_decay=0.3, mask=given)
    assert leafwise(tx) and has_leaf_labels(tx)
    params = _leaves(0)
    labels = leaf_labels(tx, params)
    assert labels is not None
    assert [dict(label).popitem()[1] for label in labels] == [True, False, True]
    state = tx.init(params)
    alone = []
    for p, label in zip(params, labels, strict=True):
        with staged(label):
            alone.append(tx.init([p]))
    for step in range(3):
        grads = _leaves(10 + step)
        updates, state = tx.update(grads, state, params)
        for i, (g, p) in enumerate(zip(grads, params, strict=True)):
            with staged(labels[i]):
                u, alone[i] = tx.update([g], alone[i], [p])
            assert_bitwise(u[0], updates[i])
        params = [p + u for p, u in zip(params, updates, strict=True)]
    # a part of the tree, given its leaves' flags in order
    part = part_labels(labels, [1, 2])
    with staged(part):
        u, _ = fo.adamw(1e-2, weight_decay=0.3, mask=given).update(
            [grads[1], grads[2]], tx.init(params[1:]), params[1:]
        )
    want, _ = tx.update(grads, tx.init(params), params)
    assert_bitwise(u, want[1:])


def test_a_mask_over_a_stateful_transform_is_leafwise_only_on_a_part_of_one_flag() -> None:
    """A masked transform that keeps state (over the masked leaves only) is neither leafwise
    nor fusable over a whole tree (its params' states differ in structure), but it gives its
    flags as labels, and on a part of the tree whose leaves share a flag (what
    ``TransformOptimizer`` steps: see ``label_parts``) it is both: flag true, the inner over
    the part as is (the same bits as the whole tree's update of those leaves); flag false,
    the updates and the state passed through untouched."""
    tx = fo.masked(fo.scale_by_adam(), _every_other)
    assert not leafwise(tx, reductions=True) and not fusable(tx)
    leaves = _leaves(0)
    labels = leaf_labels(tx, leaves)
    assert labels is not None and [dict(mine) for mine in labels] == [
        {labels[0][0][0]: i % 2 == 0} for i in range(len(leaves))
    ]
    masked_in, left_out = [0, 2], [1]
    grads = [torch.randn_like(x) for x in leaves]
    whole_u, whole_state = tx.update(grads, tx.init(leaves), leaves)
    inner = fo.scale_by_adam()
    with pinned(part_labels(labels, masked_in)):
        assert leafwise(tx) and fusable(tx)
        mine = [leaves[i] for i in masked_in]
        u, state = tx.update([grads[i] for i in masked_in], MaskedState(inner.init(mine)), mine)
    assert_bitwise(u, [whole_u[i] for i in masked_in])
    assert_bitwise(
        [state.inner_state.mu, state.inner_state.nu],
        [
            [whole_state.inner_state.mu[i] for i in masked_in],
            [whole_state.inner_state.nu[i] for i in masked_in],
        ],
    )
    with pinned(part_labels(labels, left_out)):
        assert leafwise(tx) and fusable(tx)
        other = [grads[i] for i in left_out]
        untouched = MaskedState(inner.init([leaves[i] for i in left_out]))
        u, state = tx.update(other, untouched, [leaves[i] for i in left_out])
    assert u is other and state is untouched


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(48, 40), (40,), (40, 30), (30,), (30, 36), (36,), (20,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


CHAINS: dict[str, tuple[Any, int]] = {
    # the factory form: inject_hyperparams makes a new masked transform each step (the flags
    # are keyed by the mask itself)
    "factory-adamw": (
        lambda ps: TransformOptimizer(ps, fo.adamw, lr=1e-2, weight_decay=0.3, mask=_every_other),
        0,
    ),
    # leafwise given the global norm: the direct params' totals first
    "clip-adamw": (
        lambda ps: TransformOptimizer(
            ps,
            fo.chain(
                fo.clip_by_global_norm(0.05),
                fo.adamw(1e-2, weight_decay=0.3, mask=_every_other),
            ),
        ),
        48 * 40 + 40 * 30 + 30 * 36 + 200,
    ),
}


# (a ready-made adamw with a mask takes the factory's route; the clip chain is ready-made)
@pytest.mark.parametrize(
    ("chain", "rest_max"),
    [
        pytest.param(
            chain,
            rest_max,
            id=f"{route}-{chain}",
            # (the second CPU code path: the global norm's totals beside the large direct steps)
            marks=[pytest.mark.numerics] if (chain, rest_max) == ("clip-adamw", 0) else [],
        )
        for rest_max, route in ((0, "large-direct"), (8, "all-direct"))
        for chain in CHAINS
    ],
)
def test_a_masked_chain_steps_on_the_direct_route_like_the_per_tensor_path(
    chain: str, rest_max: int
) -> None:
    """``TransformOptimizer`` of a chain with a mask by position: the large params stepped
    alone, each with its own flag; the small ones packed (``direct_rest_max = 0``), given their
    flags in the whole group, or stepped alone too (the default); lockstep with the per-tensor
    path over three steps. (With the flags read off one leaf or off the packed ones alone, the
    decay would land on other params.)"""
    make, extra = CHAINS[chain]
    params, ref_params = _params(0), _params(0)
    opt = make(params)
    opt.fused_min_numel, opt.direct_min_numel, opt.direct_rest_max = 0, 1000, rest_max
    ref = make(ref_params)
    ref.fused_steps = False
    for step in range(3):
        gen = torch.Generator().manual_seed(30 + step)
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        before = [p.detach().clone() for p in ref_params]
        step_with_grads([(params, opt), (ref_params, ref)], grads)
        ops = (ELEMENTWISE_OPS + extra) * (step + 1) + 2
        assert_same_steps_then_sync(list(params), list(ref_params), before, ops)
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert [dict(label).popitem()[1] for label in engine.labels] == [i % 2 == 0 for i in range(7)]
    if rest_max == 0:
        assert engine.direct == [0, 2, 4] and engine.rest == [1, 3, 5, 6]
        assert [flags for _, flags in engine.rest_labels] == [(False, False, False, True)]
    else:
        assert engine.direct == list(range(7)) and not engine.rest
    # one compiled step per flag, whatever the sizes
    assert {key[1] for key in engine.leaf_steps if key[1]} == {
        engine.labels[i] for i in engine.direct
    }


def _tree(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "b": [torch.randn(s, generator=gen) for s in [(30,), (40,)]],
        "head": torch.randn(50, 24, generator=gen),
        "w": [torch.randn(s, generator=gen) for s in [(40, 30), (30, 40)]],
    }


def _by_key(ps: dict[str, Any]) -> dict[str, Any]:
    """Flags by name: a function of the dict, which a leaf or a list of some leaves is not."""
    return {"b": [True, False], "head": True, "w": [False, True]}


@pytest.mark.numerics
def test_fused_step_of_a_masked_chain_over_a_dict_steps_its_large_leaves_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fo.fused_step`` over a plain dict with a mask given as a function of its keys: the
    large leaves (``head``, ``w``) stepped alone with their flags, the small ones (``b``)
    staged with theirs; three steps within rounding of ``update`` + ``apply_updates``."""
    monkeypatch.setattr(fo.plain_trees, "LEAF_MIN", 1000)
    calls = []
    original = fo.engine._kernels.Kernel.kept_call

    def spy(kernel: Any, kept: Any, key: Any, args: Any) -> Any:
        calls.append(key)
        return original(kernel, kept, key, args)

    monkeypatch.setattr(fo.engine._kernels.Kernel, "kept_call", spy)
    tx = fo.adamw(1e-2, weight_decay=0.3, mask=_by_key)
    params, ref = _tree(1), _tree(1)
    state, ref_state = tx.init(params), tx.init(ref)
    step = fo.fused_step(tx)
    for k in range(3):
        grads = _tree(20 + k)
        updates, ref_state = tx.update(copy.deepcopy(grads), ref_state, ref)
        ref = fo.apply_updates(ref, updates)
        params, state = step(params, grads, state)
        assert_close_rounding(
            tree.leaves(params),
            tree.leaves(ref),
            dtype=torch.float32,
            ops=ELEMENTWISE_OPS * (k + 1) + 2,
            scale=[p.abs() + 1e-2 for p in tree.leaves(ref)],
        )
    assert len(calls) == 3 * 3  # head and the two w's, each step
    assert {dict(key[2]).popitem()[1] for key in calls} == {True, False}
