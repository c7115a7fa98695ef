"""Donation mode: ``update(..., donate=True)`` gives the same results (bit for bit: the same
kernels on the same inputs) and reuses the buffers of the state and the incoming updates, never
the params' (never donated to ``update``); ``apply_updates(..., donate=True)`` adds in place,
and without donation leaves the params as they were."""

from __future__ import annotations

import pytest
import torch
from conftest import MagnitudeRun, assert_bitwise, assert_close_rounding, dreamerv3_ops

import functional_opt as fo
from functional_opt.plain_trees import TREE_MIN
from functional_opt.testing import check_donation


def _tree(seed: int, dtype: torch.dtype = torch.float32, big: bool = False) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    # ``big``: a tree large enough for dreamerv3's eager update on the engine
    rows = TREE_MIN // 3 + 1 if big else 4
    return {
        "w": torch.randn(rows, 3, generator=g).to(dtype),
        "b": [torch.randn(3, generator=g).to(dtype)],
    }


numerics = pytest.mark.numerics

TRANSFORMS = {
    "scale_by_rms": lambda: fo.scale_by_rms(0.9, 1e-8, bias_correction=True),
    "scale_by_adam": lambda: fo.scale_by_adam(nesterov=True),
    "trace": lambda: fo.trace(0.9, nesterov=True),
    "ema": lambda: fo.ema(0.8),
    "adamw": lambda: fo.adamw(1e-2),
    "sgd": lambda: fo.sgd(1e-2, momentum=0.9),
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=2),
    "dreamerv3_nesterov": lambda: fo.dreamerv3(1e-2, warmup=0, nesterov=True),
    "multi_steps": lambda: fo.multi_steps(fo.adam(1e-2), 2),
    "apply_if_finite": lambda: fo.apply_if_finite(fo.adam(1e-2), 1),
    "inject": lambda: fo.inject_hyperparams(fo.adam)(learning_rate=1e-2),
    "masked": lambda: fo.masked(fo.adam(1e-2), {"w": True, "b": [False]}),
}


def _leaves(tree: object) -> list[torch.Tensor]:
    return [x for x in fo.tree.leaves(tree) if isinstance(x, torch.Tensor)]


TRANSFORMS["chain_clip_dreamerv3"] = lambda: fo.chain(
    fo.clip_by_global_norm(0.5), fo.dreamerv3(1e-2, warmup=0)
)
TRANSFORMS["multi_steps_dreamerv3"] = lambda: fo.multi_steps(fo.dreamerv3(1e-2, warmup=0), 2)


# dreamerv3 runs a large tree on the engine (its chain compiled): it runs small and big.
CASES = [(name, False) for name in sorted(TRANSFORMS)]
CASES += [("dreamerv3", True)]


# (the second CPU code path runs the small trees: a big one compiles dreamerv3's engine again
# there, whose donation modes test_engine_plain_update covers on that path)
@pytest.mark.parametrize(
    ("name", "big"),
    [
        pytest.param(n, b, id=f"{n}-{'big' if b else 'small'}", marks=[] if b else [numerics])
        for n, b in CASES
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flag", [True, "state"])
def test_donated_updates_are_identical(
    name: str, big: bool, dtype: torch.dtype, flag: bool | str
) -> None:
    # functional_opt.testing's check: the same bits as the pure update, params never written,
    # nor the gradients with donate="state" (nor anything by the pure update); six steps, the
    # params moving by the updates
    grads = [_tree(step + 1, dtype, big) for step in range(6)]
    if name == "apply_if_finite":
        grads[2]["w"][0, 0] = float("nan")  # type: ignore[index]
    check_donation(TRANSFORMS[name](), _tree(0, dtype, big), grads, flags=[flag])


@pytest.mark.parametrize("name", ["scale_by_rms", "scale_by_adam", "trace", "ema", "dreamerv3"])
def test_donation_reuses_moment_buffers(name: str) -> None:
    tx = TRANSFORMS[name]()
    params = _tree(0)
    state = tx.init(params)
    kept_params = [x.clone() for x in _leaves(params)]
    # (dreamerv3's engine moves the staged leaves' state into its packed buffers on the first
    # update, and then steps them there: from the second update on, every buffer is reused)
    _, state = tx.update(_tree(2), state, params, donate=True)
    grads = _tree(1)
    big = [x for x in _leaves(state) if x.dim() > 0]
    ptrs = {x.data_ptr() for x in big}
    _, new_state = tx.update(grads, state, params, donate=True)
    assert {x.data_ptr() for x in _leaves(new_state) if x.dim() > 0} == ptrs
    assert_bitwise(_leaves(params), kept_params, "donated update wrote the params")
    # Without donation nothing is written into the old state, nor into the params.
    state = tx.init(params)
    before = [x.clone() for x in _leaves(state)]
    tx.update(grads, state, params)
    assert_bitwise(_leaves(state), before)
    assert_bitwise(_leaves(params), kept_params, "pure update wrote the params")


def test_donate_must_be_a_python_bool_or_state() -> None:
    tx = fo.adam(1e-2)
    params = _tree(0)
    with pytest.raises(TypeError, match="donate"):
        tx.update(_tree(1), tx.init(params), params, donate=torch.tensor(True))
    with pytest.raises(TypeError, match="donate"):
        tx.update(_tree(1), tx.init(params), params, donate="updates")


def test_donated_updates_take_the_new_update_in_place() -> None:
    tx = fo.dreamerv3(1e-2, warmup=0)
    params = _tree(0, big=True)
    state = tx.init(params)
    grads = _tree(1, big=True)
    kept_params = [x.clone() for x in _leaves(params)]
    updates, _ = tx.update(grads, state, params, donate=True)
    assert updates["w"] is grads["w"]  # the large float32 leaf: written into the gradient
    assert_bitwise(_leaves(params), kept_params, "donated update wrote the params")


def test_chain_donates_updates_to_its_first_transform_only() -> None:
    seen: list[object] = []

    def spy(updates: object, state: object, params: object = None, **extra: object) -> object:
        seen.append(extra.get("donate"))
        return updates, state

    probe = fo.GradientTransformation(lambda p: fo.EmptyState(), spy)
    tx = fo.chain(probe, fo.scale(2.0), probe)
    params = _tree(0)
    tx.update(_tree(1), tx.init(params), params, donate=True)
    tx.update(_tree(1), tx.init(params), params, donate="state")
    tx.update(_tree(1), tx.init(params), params)
    assert seen == [True, "state", "state", "state", None, None]


@pytest.mark.numerics
@pytest.mark.parametrize("big", [False, True], ids=["small", "large-leaf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_apply_updates_donated_is_identical_and_in_place(dtype: torch.dtype, big: bool) -> None:
    # large 16-bit leaves take a compiled add: the same sums, rounded once
    params = _tree(0, dtype, big)
    updates = _tree(1, dtype, big)
    kept_params = [x.clone() for x in _leaves(params)]
    kept_updates = [x.clone() for x in _leaves(updates)]
    want = fo.apply_updates(params, updates)
    assert_bitwise(_leaves(params), kept_params, "apply_updates without donation wrote params")
    buffers = [x.data_ptr() for x in _leaves(params)]
    got = fo.apply_updates(params, updates, donate=True)
    assert [x.data_ptr() for x in _leaves(got)] == buffers
    assert_bitwise(_leaves(got), _leaves(want))
    assert_bitwise(_leaves(updates), kept_updates, "apply_updates wrote the updates")


def test_apply_updates_donated_stays_pure_where_in_place_is_unsafe() -> None:
    # autograd-tracked params, a param twice in the tree, a narrower param than its update
    tracked = {"w": torch.ones(3, requires_grad=True)}
    out = fo.apply_updates(tracked, {"w": torch.ones(3)}, donate=True)
    assert out["w"] is not tracked["w"] and torch.equal(tracked["w"].detach(), torch.ones(3))
    shared = torch.ones(2)
    out = fo.apply_updates([shared, shared], [torch.ones(2), torch.ones(2)], donate=True)
    assert torch.equal(shared, torch.ones(2)) and torch.equal(out[0], torch.full((2,), 2.0))
    narrow = {"w": torch.ones(2, dtype=torch.bfloat16)}
    out = fo.apply_updates(narrow, {"w": torch.full((2,), 1e-3)}, donate=True)
    assert torch.equal(narrow["w"], torch.ones(2, dtype=torch.bfloat16))
    assert out["w"].dtype == torch.bfloat16
    with pytest.raises(TypeError, match="donate"):
        fo.apply_updates(narrow, narrow, donate="yes")  # type: ignore[arg-type]


@pytest.mark.numerics
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dreamerv3_runs_use_flat_params_and_gradients_in_place(
    dtype: torch.dtype, weight_decay: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Params and gradients kept as the rows of one buffer each (as a flat-buffer training loop
    # keeps them): the engine reads them where they are, and a donated gradient buffer
    # takes the update. The same bits as separate tensors, and as the unfused chain to rounding.
    monkeypatch.setattr(fo.plain_trees, "TREE_MIN", 1)  # (the engine for this small tree)
    tx = fo.dreamerv3(1e-2, warmup=1, weight_decay=weight_decay)
    chain = fo.dreamerv3(1e-2, warmup=1, weight_decay=weight_decay, _fused=False)
    gen = torch.Generator().manual_seed(3)
    flat_p = (torch.randn(6, 40, generator=gen) * 0.3).to(dtype)
    params = list(flat_p.unbind(0))
    s_flat, s_sep, s_chain = tx.init(params), tx.init(params), chain.init(params)
    magnitudes = MagnitudeRun(chain, params)
    for step in range(3):
        flat_g = torch.randn(6, 40, generator=gen).to(dtype)
        grads = list(flat_g.unbind(0))
        separate = [g.clone() for g in grads]
        kept, kept_params = flat_g.clone(), flat_p.clone()
        u_pure, _ = tx.update(grads, s_flat, params)
        assert_bitwise(flat_g, kept)  # not donated: the gradients stay as they were
        u_chain, s_chain = chain.update(separate, s_chain, params)
        u_mag, _ = magnitudes.update(separate, params)
        u_sep, s_sep = tx.update([g.clone() for g in grads], s_sep, params, donate=True)
        u_flat, s_flat = tx.update(grads, s_flat, params, donate=True)
        assert_bitwise(flat_p, kept_params)  # params are never donated to update
        if dtype == torch.float32:  # the update written into the donated gradient buffer
            assert all(u is g for u, g in zip(u_flat, grads, strict=True))
        assert_bitwise(_leaves((u_flat, s_flat)), _leaves((u_sep, s_sep)))
        assert_bitwise(u_flat, u_pure)
        # fused run kernel vs the chain's ops: the rule's dreamerv3 count (rows of 40)
        ops = dreamerv3_ops(dtype, numel=40, steps=step + 1)
        assert_close_rounding(u_flat, u_chain, dtype=dtype, ops=ops, scale=u_mag)
        params = fo.apply_updates(params, u_chain, donate=True)  # still the rows of flat_p
        assert all(p._base is flat_p for p in params)


@pytest.mark.numerics
def test_dreamerv3_leaves_flat_gradients_that_autograd_tracks() -> None:
    # rows of a buffer autograd tracks cannot take the update in place: an update autograd
    # records runs the chain, and the buffer keeps its values
    tx = fo.dreamerv3(1e-2, warmup=0)
    params = list(torch.randn(6, 40).unbind(0))
    flat_g = torch.randn(6, 40, requires_grad=True)
    grads = list(flat_g.unbind(0))
    kept = flat_g.detach().clone()
    kept_params = [p.clone() for p in params]
    updates, _ = tx.update(grads, tx.init(params), params, donate=True)
    want, _ = tx.update([g.detach().clone() for g in grads], tx.init(params), params)
    magnitudes, _ = MagnitudeRun(tx, params).update(grads, params)
    assert_bitwise(flat_g.detach(), kept)
    assert_bitwise(params, kept_params)
    assert all(a.requires_grad for a in updates)
    # the chain (recorded) vs the fused run kernel: one step, rows of 40
    assert_close_rounding(
        [a.detach() for a in updates],
        want,
        dtype=torch.float32,
        ops=dreamerv3_ops(torch.float32, numel=40),
        scale=magnitudes,
    )
