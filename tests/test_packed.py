"""Packed trees: ``fo.pack`` round trips, transforms see the same leaves, and the fast paths over
the buffers (dreamerv3's update, ``apply_updates``) equal the per-leaf paths."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    MagnitudeRun,
    assert_bitwise,
    assert_close_rounding,
    dreamerv3_leaf_ops,
    dreamerv3_ops,
)

import functional_opt as fo
import functional_opt.packed as packed_module
from functional_opt.packed import ALIGN, Layout, Packed
from functional_opt.plain_trees import LEAF_MIN as KERNEL_MIN

RUN_MIN = 4  # (a run of small leaves of one shape)

Make = Callable[[torch.Generator, torch.dtype], dict[str, Any]]


def _leaf(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3).to(dtype)


def _rows(gen: torch.Generator, dtype: torch.dtype) -> dict[str, Any]:
    # many small leaves of one size (one run, as in W2) and a shorter run of another
    return {
        "w": [_leaf(gen, dtype, 10, 3) for _ in range(3 * RUN_MIN)],
        "b": [_leaf(gen, dtype, 5) for _ in range(RUN_MIN)],
    }


def _big(gen: torch.Generator, dtype: torch.dtype) -> dict[str, Any]:
    # leaves large enough for a kernel call each, one of a size that is no multiple of ALIGN
    return {
        "w": _leaf(gen, dtype, KERNEL_MIN // 64, 64),
        "v": _leaf(gen, dtype, KERNEL_MIN + 5),
        "u": _leaf(gen, dtype, KERNEL_MIN + 3),
    }


def _big_rows(gen: torch.Generator, dtype: torch.dtype) -> dict[str, Any]:
    # large leaves of one size, apart in the tree: consecutive in the buffer, one kernel call as
    # the rows of a matrix (per leaf in the unpacked path)
    return {
        "a": _leaf(gen, dtype, KERNEL_MIN + 8),
        "b": _leaf(gen, dtype, 2 * KERNEL_MIN),
        "c": [_leaf(gen, dtype, KERNEL_MIN + 8) for _ in range(2)],
        "d": _leaf(gen, dtype, 3),
    }


def _mixed(gen: torch.Generator, dtype: torch.dtype) -> dict[str, Any]:
    # every route at once: a large leaf, a run, small leaves of odd sizes, 0-d and empty
    # leaves, a second buffer in float64, and same-shape leaves that are not consecutive
    return {
        "big": _leaf(gen, dtype, KERNEL_MIN + 7),
        "run": [_leaf(gen, dtype, 6) for _ in range(RUN_MIN + 1)],
        "odd": [_leaf(gen, dtype, 3, 3), _leaf(gen, dtype, 2), _leaf(gen, dtype)],
        "empty": _leaf(gen, dtype, 0, 4),
        "wide": [_leaf(gen, torch.float64, 4) for _ in range(RUN_MIN)],
        "apart": [_leaf(gen, dtype, 7), _leaf(gen, dtype, 2), _leaf(gen, dtype, 7)],
    }


def _tensors(tree: object) -> list[torch.Tensor]:
    return [x for x in fo.tree.leaves(tree) if isinstance(x, torch.Tensor)]


def _unpacked(tree: object) -> object:
    """``tree`` with every packed node replaced by its tree of (separate) tensors."""
    return fo.tree.map_params(lambda x: x.clone(), _plain(tree))


def _plain(tree: object) -> object:
    if isinstance(tree, Packed):
        return tree.tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_plain(x) for x in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(x) for x in tree)
    return tree


# ------------------------------------------------------------------------------ pack itself
def _mixed_tree(gen: torch.Generator) -> list[Any]:
    return [
        _leaf(gen, torch.float32, 3, 4),
        None,
        _leaf(gen, torch.bfloat16, 40),
        _leaf(gen, torch.float32),
        _leaf(gen, torch.float32, 0, 2),
        [_leaf(gen, torch.float32, 17) for _ in range(3)],
        _leaf(gen, torch.float64, 33),
    ]


def _round_trips(tree: list[Any], kept: list[Any], packed: Packed) -> None:
    views, spec = fo.tree.flatten(packed.tree)
    assert spec == fo.tree.flatten(tree)[1]
    for got, want, slot in zip(views, fo.tree.leaves(kept), packed.layout.slots, strict=True):
        if want is None:
            assert got is None and slot is None
            continue
        assert slot is not None and torch.equal(got, want) and got.dtype == want.dtype
        buffer = packed.buffers[slot[0]]
        if want.numel():  # (an empty view has no address)
            assert got.data_ptr() == buffer.data_ptr() + slot[1] * buffer.element_size()
    assert all(torch.equal(a, b) for a, b in zip(_tensors(tree), _tensors(kept), strict=True))


def test_pack_round_trips_into_one_buffer_per_dtype_and_size() -> None:
    tree = _mixed_tree(torch.Generator().manual_seed(0))
    kept = fo.tree.map_params(lambda x: x.clone(), tree)
    packed = fo.pack(tree)
    assert packed.buffers is not None
    # by dtype in order of first use, then by size, largest first: each a dense run of rows
    f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
    assert [(b.dtype, b.numel()) for b in packed.buffers] == [
        (f32, 3 * 17),
        (f32, 12),
        (f32, 1),
        (f32, 0),
        (bf16, 40),
        (f64, 33),
    ]
    assert packed.layout.members(0) == [5, 6, 7]  # flat indices, by offset
    assert [packed.layout.slots[i] for i in (5, 6, 7, 0)] == [(0, 0), (0, 17), (0, 34), (1, 0)]
    _round_trips(tree, kept, packed)


def test_pack_past_max_runs_puts_a_dtype_in_one_aligned_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packed_module, "MAX_RUNS", 3)  # float32 has 4 sizes here
    tree = _mixed_tree(torch.Generator().manual_seed(0))
    kept = fo.tree.map_params(lambda x: x.clone(), tree)
    packed = fo.pack(tree)
    assert packed.buffers is not None and len(packed.buffers) == 3
    assert [b.dtype for b in packed.buffers] == [torch.float32, torch.bfloat16, torch.float64]
    # large leaves start aligned; a run of one size stays dense (rows of a matrix)
    # by size, largest first: the run of 17 (aligned, then dense rows), then the small leaves
    starts = [s[1] for s in packed.layout.slots if s is not None and s[0] == 0]
    assert starts == [51, 63, 64, 0, 17, 34] and ALIGN == 16
    assert packed.layout.members(0) == [5, 6, 7, 0, 3, 4]  # flat indices, by offset
    _round_trips(tree, kept, packed)


def test_pack_rejects_what_is_not_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"\['b'\]\[1\].*int"):
        fo.pack({"a": torch.ones(2), "b": [torch.ones(1), 3]})
    layout = fo.pack([torch.ones(3)]).layout
    with pytest.raises(ValueError, match="exactly one"):
        Packed(layout)
    with pytest.raises(ValueError, match="needs a Layout"):
        Packed(layout.structure, buffers=[torch.ones(3)])
    with pytest.raises(ValueError, match=r"shape \(3,\), got \(4,\)"):
        Packed(layout, buffers=[torch.ones(4)])
    with pytest.raises(ValueError, match=r"shape \(3,\), got \(2, 3\)"):
        Packed(layout, buffers=[torch.ones(2, 3)])  # batched buffers need a batched layout
    with pytest.raises(ValueError, match="1 buffers"):
        Packed(layout, buffers=[torch.ones(3), torch.ones(3)])


def test_layouts_compare_by_value_and_structure_ignores_dtypes() -> None:
    a = fo.pack({"x": torch.ones(3, 2), "y": [torch.ones(6)] * 5})  # one size: one buffer
    b = fo.pack({"x": torch.zeros(3, 2, dtype=torch.float64), "y": [torch.zeros(6)] * 5})
    c = fo.pack({"x": torch.ones(2, 3), "y": [torch.ones(6)] * 5})
    d = fo.pack({"x": torch.zeros(3, 2, dtype=torch.float64), "y": [torch.zeros(6)] * 5})
    assert isinstance(a.layout, Layout) and isinstance(b.layout, Layout)
    assert b.layout is not d.layout and b.layout == d.layout and hash(b.layout) == hash(d.layout)
    assert a.layout != b.layout  # two buffers in b
    assert a.structure == b.structure and hash(a.structure) == hash(b.structure)
    assert a.structure != c.structure


def test_repack_copies_loose_trees_into_buffers() -> None:
    packed = fo.pack({"x": torch.arange(20.0), "y": torch.ones(20)})  # one run: one buffer
    loose = Packed(packed.structure, tree={"x": torch.arange(20.0) * 2, "y": torch.zeros(20)})
    assert loose.buffers is None and loose.layout is None and packed.repack() is packed
    again = loose.repack()
    assert again.layout == packed.layout and again.buffers is not None
    assert torch.equal(again.tree["x"], torch.arange(20.0) * 2)
    from_layout = Packed(packed.layout, tree={"x": torch.ones(20), "y": torch.ones(20)})
    assert from_layout.layout is None and from_layout.structure == packed.structure  # loose
    mixed = Packed(packed.structure, tree={"x": torch.ones(20), "y": torch.ones(20).double()})
    assert mixed.repack().layout != packed.layout  # two buffers now
    assert mixed.repack().structure == packed.structure


# ------------------------------------------------------------------------ generic transforms
_CLIPS = fo.chain(fo.clip_by_global_norm(0.5), fo.clip_by_agc(0.1), fo.scale(-0.1))


@pytest.mark.numerics
@pytest.mark.parametrize(
    "tx",
    [
        fo.adam(1e-2),
        _CLIPS,
        fo.dreamerv3(lr=1e-2, warmup=0, nesterov=True),  # over packed trees: the engine
    ],
    ids=["adam", "clips", "dreamerv3-nesterov"],
)
def test_transforms_see_the_leaves_of_the_packed_tree(tx: fo.GradientTransformation) -> None:
    """A transform over a packed tree computes what it computes over the tree's leaves: bit for
    bit where the math is elementwise (run over whole buffers: the same ops per element), and
    within rounding where it takes norms, which the packed path sums per run of leaves (rows of
    a matrix) and the per-leaf path per leaf, in another order, or where the engine compiles it
    (dreamerv3 over packed trees). Both take each step from the same params."""
    gen = torch.Generator().manual_seed(1)
    params, grads = _mixed(gen, torch.float32), _mixed(gen, torch.float32)
    state, state_p = tx.init(params), tx.init(fo.pack(params))
    magnitudes = MagnitudeRun(tx, params)
    assert fo.state_to_dict(state).keys() == fo.state_to_dict(state_p).keys()
    sizes = [x.numel() for x in fo.tree.leaves(params)]
    # clips: the global norm sums all N elements (N roundings), then sqrt, the division and
    # the product (3); clip_by_agc sums n_i squares of the update and of the param (2 n_i,
    # bounded by the largest leaf) with a sqrt each, then its clamp, product, ratio and the
    # product with the update (6); scale (1): N + 2 max(n_i) + 11, relative to each update.
    ops = sum(sizes) + 2 * max(sizes) + 11
    for step in range(3):
        packed_params = fo.pack(params)
        scale = _tensors(magnitudes.update(grads, params))
        u, state = tx.update(grads, state, params)
        u_p, state_p = tx.update(fo.pack(grads), state_p, packed_params)
        assert isinstance(u_p, Packed) and u_p.structure == packed_params.structure
        if tx is _CLIPS:
            assert_close_rounding(_tensors(u_p), _tensors(u), dtype=torch.float32, ops=ops)
        elif isinstance(state, tuple) and len(state) == 5:  # dreamerv3's: the engine's rounding
            got, want = _tensors((_plain(u_p), _plain(state_p))), _tensors((u, state))
            leaf_ops = dreamerv3_leaf_ops(torch.float32, steps=step + 1)
            assert_close_rounding(got, want, dtype=torch.float32, ops=leaf_ops, scale=scale)
        else:
            assert_bitwise(_tensors((u_p, state_p)), _tensors((u, state)))
        params = fo.apply_updates(params, u)
        grads = _mixed(gen, torch.float32)


def test_mismatched_packed_trees_name_the_first_difference() -> None:
    tx = fo.dreamerv3(warmup=0)
    params = fo.pack({"a": torch.ones(3), "b": torch.ones(2)})
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        tx.update(fo.pack({"a": torch.ones(3), "c": torch.ones(2)}), state, params)
    with pytest.raises(ValueError, match="structure"):
        tx.update({"a": torch.ones(3), "b": torch.ones(2)}, state, params)


# ----------------------------------------------------------------- dreamerv3's packed path
def _check_packed_update(
    make: Make, options: dict[str, Any], flags: tuple[str | bool | None, ...] = (True,)
) -> None:
    """Five updates over packed trees (the chain compiled by the engine) equal the per-leaf
    fused path on the same values within rounding, for each of ``flags``: pure (``None``),
    ``donate="state"``, ``donate=True``; the pure one leaves its inputs untouched; donation
    writes in place."""
    tx = fo.dreamerv3(lr=1e-2, warmup=1, **options)
    gen = torch.Generator().manual_seed(3)
    params = make(gen, torch.float32)
    packed_params = fo.pack(params)
    ref_state = tx.init(params)
    states = [tx.init(packed_params) for _ in flags]
    magnitudes = MagnitudeRun(tx, params)
    for step in range(5):
        grads = make(gen, torch.float32)
        u_ref, ref_state = tx.update(fo.tree.map_params(torch.clone, grads), ref_state, params)
        want = _tensors((u_ref, ref_state))
        scale = _tensors(magnitudes.update(grads, params))
        for k, flag in enumerate(flags):
            g = fo.pack(grads)
            inputs = _tensors((g, states[k], packed_params))
            kept = [x.clone() for x in inputs]
            old = states[k]
            extra = {} if flag is None else {"donate": flag}
            u, states[k] = tx.update(g, states[k], packed_params, **extra)
            assert isinstance(u, Packed) and u.buffers is not None  # the fast path
            nu = states[k][1].nu
            assert isinstance(nu, Packed) and nu.buffers is not None
            if flag is None:
                assert_bitwise(inputs, kept)
            if flag is True:
                assert u.buffers[0].data_ptr() == g.buffers[0].data_ptr()  # type: ignore[index]
            if flag is not None and old[1].nu.buffers is not None:
                assert nu.buffers[0].data_ptr() == old[1].nu.buffers[0].data_ptr()
            got = _tensors((_plain(u), _plain(states[k])))
            # compiled over buffers, per-leaf kernels over leaves: each carries its own state
            ops = dreamerv3_leaf_ops(torch.float32, steps=step + 1)
            assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        params = fo.apply_updates(params, u_ref)
        packed_params = fo.pack(params)


OPTIONS = [{}, {"weight_decay": 0.1}, {"agc": 0.0}, {"agc": 0.02, "pmin": 0.5}]


@pytest.mark.numerics
def test_packed_update_equals_the_per_leaf_path_pure_and_donated() -> None:
    _check_packed_update(_rows, {}, flags=(None, "state", True))


@pytest.mark.parametrize(
    "options",
    # (the second CPU code path: the first; each compiles dreamerv3 again there)
    [
        pytest.param(o, marks=[pytest.mark.numerics] if k == 0 else [])
        for k, o in enumerate(OPTIONS[1:])
    ],
)
def test_packed_update_with_options_equals_the_per_leaf_path(options: dict[str, Any]) -> None:
    _check_packed_update(_rows, options)


@pytest.mark.parametrize(
    "make",
    # (the second CPU code path: the mixed layout, large leaves beside rows of small ones)
    [
        pytest.param(_big, id="large-leaves"),
        pytest.param(_big_rows, id="large-rows"),
        pytest.param(_mixed, id="mixed", marks=pytest.mark.numerics),
    ],
)
def test_packed_update_of_every_layout_equals_the_per_leaf_path(make: Make) -> None:
    # "mixed": leaves of one shape that are not consecutive in the tree, several sizes, a
    # float64 leaf
    _check_packed_update(make, {"weight_decay": 0.1})


@pytest.mark.numerics
def test_packed_update_equals_the_chain() -> None:
    gen = torch.Generator().manual_seed(5)
    fused, chain = fo.dreamerv3(lr=1e-2, warmup=0), fo.dreamerv3(lr=1e-2, warmup=0, _fused=False)
    params = _mixed(gen, torch.float32)
    packed = fo.pack(params)
    s, s_chain = fused.init(packed), chain.init(params)
    magnitudes = MagnitudeRun(chain, params)
    for step in range(4):
        grads = _mixed(gen, torch.float32)
        u, s = fused.update(fo.pack(grads), s, packed, donate=True)
        u_chain, s_chain = chain.update(grads, s_chain, params)
        scale, _ = magnitudes.update(grads, params)
        assert_close_rounding(
            _tensors(_plain(u)),
            _tensors(u_chain),
            dtype=torch.float32,
            ops=dreamerv3_leaf_ops(torch.float32, steps=step + 1),
            scale=_tensors(scale),
        )
        # the same updates for both: errors in the params would otherwise add up too
        packed = fo.apply_updates(packed, fo.pack(u_chain), donate=True)
        params = fo.apply_updates(params, u_chain)
    assert isinstance(packed, Packed) and packed.buffers is not None


def test_loose_state_is_repacked_by_the_first_update() -> None:
    gen = torch.Generator().manual_seed(6)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    params = fo.pack(_rows(gen, torch.float32))
    grads = [fo.pack(_rows(gen, torch.float32)) for _ in range(3)]
    state = tx.init(params)
    _, state = tx.update(grads[0], state, params)
    restored = fo.state_from_dict(state, fo.state_to_dict(state))
    assert restored[1].nu.buffers is None  # loose: separate tensors from the checkpoint
    for g in grads[1:]:
        u_a, state = tx.update(g, state, params)
        u_b, restored = tx.update(g, restored, params, donate="state")
        assert restored[1].nu.buffers is not None
        assert_bitwise(_tensors((u_b, restored)), _tensors((u_a, state)))


@pytest.mark.numerics
def test_16bit_packed_gradients_take_the_engine() -> None:
    gen = torch.Generator().manual_seed(7)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    params = _big(gen, torch.bfloat16)
    grads = _big(gen, torch.bfloat16)
    packed = fo.pack(params)
    scale = _tensors(MagnitudeRun(tx, params).update(grads, params))
    u_p, s_p = tx.update(fo.pack(grads), tx.init(packed), packed, donate=True)
    u, s = tx.update(grads, tx.init(params), params)
    assert isinstance(u_p, Packed) and u_p.buffers is not None  # compiled over the buffers
    got, want = _tensors((_plain(u_p), _plain(s_p))), _tensors((u, s))
    ops = dreamerv3_leaf_ops(torch.bfloat16)
    assert_close_rounding(got, want, dtype=torch.bfloat16, ops=ops, scale=scale)


def test_autograd_through_packed_trees_takes_the_chain() -> None:
    gen = torch.Generator().manual_seed(8)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    params = fo.pack(_rows(gen, torch.float32))
    g = fo.pack(_rows(gen, torch.float32))
    assert g.buffers is not None
    g.buffers[0].requires_grad_(True)
    u, _ = tx.update(g, tx.init(params), params, donate=True)
    # not the in-place fast path: the chain, run over the buffers, recorded by autograd
    assert isinstance(u, Packed) and u.buffers is not None
    assert all(b.grad_fn is not None for b in u.buffers)
    loss = sum(x.sum() for x in _tensors(_plain(u)))
    (grad,) = torch.autograd.grad(loss, g.buffers[0])
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


# ------------------------------------------------------------------------- apply_updates
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("half", [torch.float32, torch.bfloat16])
def test_apply_updates_adds_buffer_by_buffer(donate: bool, half: torch.dtype) -> None:
    # with a bfloat16 leaf the params have two buffers and the updates one: leaf by leaf
    gen = torch.Generator().manual_seed(9)
    params = {"w": _leaf(gen, half, 50), "v": _leaf(gen, torch.float32, 3, 3)}
    updates = {"w": _leaf(gen, torch.float32, 50), "v": _leaf(gen, torch.float32, 3, 3)}
    want = fo.apply_updates(params, updates)
    packed, packed_u = fo.pack(params), fo.pack(updates)
    kept = [x.clone() for x in _tensors((packed, packed_u))]
    out = fo.apply_updates(packed, packed_u, donate=donate)
    assert isinstance(out, Packed) and out.structure == packed.structure
    # (a float32 update is not added into a bfloat16 param in place, with or without packing)
    assert (out.buffers is not None) == (half == torch.float32)
    assert (out is packed) == (donate and half == torch.float32)
    assert_bitwise(_tensors(out), _tensors(want))
    if not donate:
        assert_bitwise(_tensors((packed, packed_u)), kept)


def test_apply_updates_mixing_packed_and_plain_trees_is_an_error() -> None:
    packed = fo.pack({"a": torch.ones(2)})
    with pytest.raises(ValueError, match="structure"):
        fo.apply_updates(packed, {"a": torch.ones(2)})


# ------------------------------------------------------------------------------ torch.func
def test_grad_of_packed_params_is_packed_with_their_layout() -> None:
    gen = torch.Generator().manual_seed(10)
    params = {"a": _leaf(gen, torch.float32, 3, 4), "b": [_leaf(gen, torch.float32, 4)] * 2}
    x = _leaf(gen, torch.float32, 2, 3)

    def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["a"] + p["b"][0]).sum() + p["b"][1].pow(2).sum()

    packed = fo.pack(params)
    grads = torch.func.grad(lambda p, x: loss(p.tree, x))(packed, x)
    want = torch.func.grad(loss)(params, x)
    assert isinstance(grads, Packed) and grads.layout == packed.layout
    assert grads.buffers is not None
    assert_bitwise(_tensors(grads), _tensors(want))  # the same ops on the same values


@pytest.mark.numerics
def test_compiled_step_over_packed_trees_matches_eager() -> None:
    # keys inserted out of sorted order (compiled pytree code may visit them in another order:
    # leaves are placed by index, not by visiting order)
    gen = torch.Generator().manual_seed(11)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)

    def make() -> dict[str, Any]:
        return {"w": _leaf(gen, torch.float32, 3, 4), "b": [_leaf(gen, torch.float32, 4)] * 2}

    params, grads = fo.pack(make()), fo.pack(make())

    def step(g: Packed, s: Any, p: Packed) -> tuple[Any, Any]:
        u, s = tx.update(g, s, p)
        return fo.apply_updates(p, u), s

    state = tx.init(params)
    got = torch.compile(step, fullgraph=True)(grads, state, params)
    want = step(grads, state, params)
    assert isinstance(got[0], Packed) and got[0].tree["w"].shape == (3, 4)
    assert torch.compile(lambda g: g.tree["w"] + 0, fullgraph=True)(grads).shape == (3, 4)
    # compiled vs eager: one dreamerv3 step and the add (one more rounding); a first step from
    # zero moments has no cancelling terms but p + u, whose terms are |p| + |u|
    new_params, new_state = _tensors(want[0]), _tensors(want[1])
    old = _tensors(params)
    scale = [p.abs() + (n - p).abs() for p, n in zip(old, new_params, strict=True)]
    scale += [x.abs() if x.is_floating_point() else x for x in new_state]
    ops = lambda leaf: dreamerv3_ops(torch.float32, numel=leaf.numel(), steps=1)  # noqa: E731
    assert_close_rounding(
        _tensors(got), [*new_params, *new_state], dtype=torch.float32, ops=ops, scale=scale
    )
    with pytest.raises(RuntimeError, match=r"pack cannot run under torch\.compile"):
        torch.compile(fo.pack, fullgraph=True)({"a": torch.ones(2)})


def test_a_compiled_step_over_packed_trees_compiles_once() -> None:
    """``pack`` makes its layout's plans: a compiled step that made them while tracing found
    them made on its second call and compiled again (5 s on W1)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    leaves = lambda: {"w": _leaf(gen, torch.float32, 3, 4), "b": _leaf(gen, torch.float32, 4)}  # noqa: E731
    params, grads = fo.pack(leaves()), fo.pack(leaves())  # (one gradient buffer, kept)
    state = tx.init(params)
    counter = CompileCounter()
    step = torch.compile(fo.fused_step(tx), backend=counter, fullgraph=True)
    for _ in range(3):
        params, state = step(params, grads, state)
    assert counter.frame_count == 1


@pytest.mark.parametrize("donate", [False, True])
def test_loose_gradients_from_an_earlier_transform_are_repacked(donate: bool) -> None:
    # chain(clip, dreamerv3): dreamerv3 gets the clip's loose output, copies it into buffers
    # and runs over them; the caller's gradients are never written
    gen = torch.Generator().manual_seed(12)
    inner = {"lr": 1e-2, "warmup": 0}
    tx = fo.chain(fo.clip_by_global_norm(0.1), fo.dreamerv3(**inner))
    ref = fo.chain(fo.clip_by_global_norm(0.1), fo.dreamerv3(**inner, _fused=False))
    params = _rows(gen, torch.float32)
    packed = fo.pack(params)
    state, ref_state = tx.init(packed), ref.init(params)
    magnitudes = MagnitudeRun(ref, params)
    total = sum(x.numel() for x in _tensors(params))
    for step in range(3):
        grads = _rows(gen, torch.float32)
        g = fo.pack(grads)
        kept = [x.clone() for x in _tensors(g)]
        u, state = tx.update(g, state, packed, donate=donate)
        u_ref, ref_state = ref.update(grads, ref_state, params)
        scale = _tensors(magnitudes.update(grads, params))
        assert isinstance(u, Packed) and u.buffers is not None  # the fast path
        assert_bitwise(_tensors(g), kept)

        def ops(leaf: torch.Tensor, steps: int = step + 1) -> Any:
            # dreamerv3's count, its clip over the leaf, plus the global norm's sum over all
            return dreamerv3_ops(torch.float32, numel=leaf.numel() + total + 2, steps=steps)

        got, want = _tensors(_plain((u, state))), _tensors((u_ref, ref_state))
        assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        # the same updates for both: errors in the params would otherwise add up too
        packed = fo.apply_updates(packed, fo.pack(u_ref), donate=donate)
        params = fo.apply_updates(params, u_ref)


@pytest.mark.numerics
def test_injected_hyperparameters_run_the_chain_over_the_buffers() -> None:
    # (a new dreamerv3 is built on every update: it runs its chain, never compiling per step)
    gen = torch.Generator().manual_seed(13)
    tx = fo.inject_hyperparams(fo.dreamerv3)(lr=1e-2, warmup=0)
    plain = _rows(gen, torch.float32)
    params = fo.pack(plain)
    grads = _rows(gen, torch.float32)
    scale, _ = MagnitudeRun(tx, plain).update(grads, plain)
    u, state = tx.update(fo.pack(grads), tx.init(params), params)
    want, _ = tx.update(grads, tx.init(plain), plain)  # the per-leaf path
    assert isinstance(u, Packed) and u.buffers is not None
    ops = dreamerv3_leaf_ops(torch.float32)
    assert_close_rounding(
        _tensors(u), _tensors(want), dtype=torch.float32, ops=ops, scale=_tensors(scale)
    )
    state.hyperparams["lr"] = torch.tensor(0.5)  # a new value: the same path, no recompile
    u2, _ = tx.update(fo.pack(grads), state, params)
    assert isinstance(u2, Packed) and u2.buffers is not None


# ------------------------------------------------------------ batch dimensions and vmap
def _stacked(gen: torch.Generator, members: int) -> dict[str, Any]:
    # an ensemble's params: every leaf has the members first
    return {
        "w": _leaf(gen, torch.float32, members, 6, 4),
        "b": [_leaf(gen, torch.float32, members, 6), None, _leaf(gen, torch.float32, members)],
        "h": _leaf(gen, torch.float64, members, 3),
    }


def test_pack_with_batch_dims_keeps_the_members_first() -> None:
    gen = torch.Generator().manual_seed(20)
    values = _stacked(gen, 3)
    packed = fo.pack(values, batch_dims=1)
    assert packed.structure.batch == torch.Size([3]) and packed.buffers is not None
    assert [tuple(b.shape) for b in packed.buffers] == [(3, 24), (3, 6), (3, 1), (3, 3)]
    # shapes without the batch, in flattening order: b[0], b[1] (None), b[2], h, w
    assert packed.structure.shapes == ((6,), None, (), (3,), (6, 4))
    for a, b in zip(_tensors(packed), _tensors(values), strict=True):
        assert torch.equal(a, b)
    w = packed.tree["w"]
    assert w.untyped_storage().data_ptr() == packed.buffers[0].untyped_storage().data_ptr()
    w.add_(1.0)  # a view: writes reach the buffer
    assert torch.equal(packed.buffers[0][:, :24], (values["w"] + 1).reshape(3, 24))
    assert packed.structure != fo.pack(values["w"][0]).structure  # the batch is structure
    two = fo.pack({"x": torch.zeros(2, 5, 7)}, batch_dims=2)
    assert two.structure.batch == torch.Size([2, 5]) and two.tree["x"].shape == (2, 5, 7)
    assert two.structure == fo.pack({"x": torch.ones(2, 5, 7)}, batch_dims=2).structure


def test_pack_with_batch_dims_rejects_leaves_that_do_not_share_them() -> None:
    with pytest.raises(ValueError, match=r"\['b'\] has batch shape \(2,\), .* \(3,\)"):
        fo.pack({"a": torch.ones(3, 4), "b": torch.ones(2, 4)}, batch_dims=1)
    with pytest.raises(ValueError, match=r"\['s'\] has 0 dimensions, fewer than batch_dims=1"):
        fo.pack({"a": torch.ones(3, 4), "s": torch.tensor(1.0)}, batch_dims=1)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="batch_dims must be an int"):
            fo.pack({"a": torch.ones(3)}, batch_dims=bad)  # type: ignore[arg-type]


def test_loose_batched_trees_repack_with_their_batch() -> None:
    gen = torch.Generator().manual_seed(21)
    packed = fo.pack(_stacked(gen, 2), batch_dims=1)
    loose = fo.tree.map_params(lambda x: x * 2, packed)
    assert isinstance(loose, Packed) and loose.buffers is None
    assert loose.structure == packed.structure
    again = loose.repack()
    assert again.layout == packed.layout and again.structure.batch == torch.Size([2])
    for a, b in zip(_tensors(again), _tensors(packed), strict=True):
        assert torch.equal(a, 2 * b)


def test_torch_pytree_utilities_can_rebuild_a_packed_spec_around_other_values() -> None:
    # torch's pytree contract: unflatten takes any leaves (vmap's in_dims, tree_map)
    import torch.utils._pytree as torch_pytree

    packed = fo.pack({"a": torch.ones(3), "h": torch.ones(2, dtype=torch.float64)})
    leaves, spec = torch_pytree.tree_flatten(packed)
    assert len(leaves) == 2
    holder = torch_pytree.tree_unflatten([0, None], spec)
    assert isinstance(holder, Packed) and torch_pytree.tree_flatten(holder)[0] == [0, None]
    assert torch_pytree.tree_map(lambda b: b.dtype, packed) is not None
    with pytest.raises(TypeError, match="holds NoneType, int values in place of its buffers"):
        _ = holder.tree


def test_vmap_over_data_shares_packed_params_and_stacks_per_sample_gradients() -> None:
    gen = torch.Generator().manual_seed(22)
    params = {"w": _leaf(gen, torch.float32, 3, 2), "b": _leaf(gen, torch.float32, 2)}
    x, y = _leaf(gen, torch.float32, 5, 3), _leaf(gen, torch.float32, 5, 2)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((torch.tanh(x @ p["w"] + p["b"]) - y) ** 2).sum()

    packed = fo.pack(params)
    per_sample = torch.vmap(torch.func.grad(lambda p, x, y: loss(p.tree, x, y)), (None, 0, 0))
    grads = per_sample(packed, x, y)
    want = torch.vmap(torch.func.grad(loss), (None, 0, 0))(params, x, y)
    assert isinstance(grads, Packed) and grads.structure.batch == torch.Size([5])
    assert grads.layout == packed.layout.batched(torch.Size([5]))
    assert all(a.shape[0] == 5 for a in _tensors(grads))
    assert_bitwise(_tensors(grads), _tensors(want))  # the same ops on the same values


def test_vmap_over_a_packed_tree_without_batch_dims_says_what_to_do() -> None:
    packed = fo.pack({"a": torch.ones(3)})
    with pytest.raises(ValueError, match=r"in_dims=None .* batch_dims=1"):
        torch.vmap(lambda p: p.tree["a"] * 2)(packed)


@pytest.mark.parametrize("donate", [False, True])
def test_vmapped_dreamerv3_over_a_packed_ensemble_equals_each_member_alone(donate: bool) -> None:
    gen = torch.Generator().manual_seed(23)
    members = 3
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    plain = _stacked(gen, members)
    params = fo.pack(plain, batch_dims=1)
    state = torch.vmap(tx.init)(params)
    assert isinstance(state[1].nu, Packed) and state[1].nu.structure.batch == (members,)
    solo_states = [tx.init(fo.tree.map_params(lambda x, i=i: x[i], plain)) for i in range(members)]
    magnitudes = [
        MagnitudeRun(tx, fo.tree.map_params(lambda x, i=i: x[i], plain)) for i in range(members)
    ]
    update = torch.vmap(functools.partial(tx.update, donate=donate))
    for step in range(3):
        raw = _stacked(gen, members)
        # each member alone, from the same params (the per-leaf path: other kernels)
        solo = [
            fo.tree.map_params(lambda x, i=i: x[i].clone(), params.tree) for i in range(members)
        ]
        u, state = update(fo.pack(raw, batch_dims=1), state, params)
        assert isinstance(u, Packed) and u.structure.batch == (members,)
        for i in range(members):
            g = fo.tree.map_params(lambda x, i=i: x[i], raw)
            u_i, solo_states[i] = tx.update(g, solo_states[i], solo[i])
            scale = _tensors(magnitudes[i].update(g, solo[i]))
            got = [x[i] for x in _tensors((_plain(u), _plain(state)))]
            want = _tensors((u_i, solo_states[i]))
            ops = dreamerv3_leaf_ops(torch.float32, steps=step + 1)
            assert_close_rounding(got, want, dtype=torch.float32, ops=ops, scale=scale)
        params = fo.apply_updates(params, u, donate=donate)
    assert params.structure.batch == (members,)


def test_dreamerv3_over_batched_packed_trees_without_vmap_treats_each_leaf_whole() -> None:
    # no vmap: a batched leaf is one tensor (its norms span the members), as for the plain
    # stacked tree; the buffers' fast path is for unbatched trees, so this is the per-leaf path
    gen = torch.Generator().manual_seed(24)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    plain = _stacked(gen, 2)
    params = fo.pack(plain, batch_dims=1)
    grads = _stacked(gen, 2)
    u, state = tx.update(fo.pack(grads, batch_dims=1), tx.init(params), params)
    want, want_state = tx.update(grads, tx.init(plain), plain)
    assert isinstance(u, Packed) and u.structure.batch == (2,)
    # (other kernels for some leaves; one step from zero moments without weight decay: no term
    # cancels, so each value is its own magnitude, the rule's default scale per leaf)
    assert_close_rounding(
        _tensors(_plain((u, state))),
        _tensors((want, want_state)),
        dtype=torch.float32,
        ops=dreamerv3_leaf_ops(torch.float32),
    )
    with pytest.raises(ValueError, match="structure"):  # batched and unbatched do not mix
        tx.update(fo.pack(grads, batch_dims=1), tx.init(plain), fo.pack(plain))


def test_compiled_vmap_over_a_packed_ensemble_matches_eager() -> None:
    gen = torch.Generator().manual_seed(25)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    params = fo.pack(_stacked(gen, 3), batch_dims=1)
    grads = fo.pack(_stacked(gen, 3), batch_dims=1)
    state = torch.vmap(tx.init)(params)
    got = torch.compile(torch.vmap(tx.update), fullgraph=True)(grads, state, params)
    want = torch.vmap(tx.update)(grads, state, params)
    assert isinstance(got[0], Packed) and got[0].layout == want[0].layout
    # compiled vs eager, one step from zero moments without weight decay: no term cancels, so
    # each value is its own magnitude (the rule's default scale, per leaf)
    assert_close_rounding(
        _tensors(_plain(got)),
        _tensors(_plain(want)),
        dtype=torch.float32,
        ops=dreamerv3_leaf_ops(torch.float32),
    )


def test_checkpoints_of_a_packed_ensemble_state_match_the_plain_stacked_state() -> None:
    gen = torch.Generator().manual_seed(26)
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    plain = _stacked(gen, 3)
    params = fo.pack(plain, batch_dims=1)
    update = torch.vmap(tx.update)
    grads = fo.pack(_stacked(gen, 3), batch_dims=1)
    _, state = update(grads, torch.vmap(tx.init)(params), params)
    flat = fo.state_to_dict(state)
    assert sorted(flat) == sorted(fo.state_to_dict(tx.init(plain)))  # the same names
    restored = fo.state_from_dict(torch.vmap(tx.init)(params), flat)
    assert restored[1].nu.buffers is None and restored[1].nu.structure.batch == (3,)
    got, want = update(grads, restored, params), update(grads, state, params)
    assert_bitwise(_tensors(_plain(got)), _tensors(_plain(want)))


@pytest.mark.parametrize("donate", [False, True])
def test_a_compiled_update_and_apply_over_packed_trees_is_one_graph_of_buffer_ops(
    donate: bool,
) -> None:
    """``tx.update`` and ``apply_updates`` compiled together over packed trees: one compile for
    three steps, and a graph whose size does not grow with the number of leaves (the add runs
    over the buffers, as it does eagerly; leaf by leaf it was one add per leaf, W1's first call
    took 22 s and compiled again on the second, and W2's 2000 leaves did not compile in 10
    minutes). SGD with momentum and halving factors rounds once per sum whatever fuses, so
    the compiled steps equal the eager ones bit for bit."""
    from torch._dynamo.testing import CompileCounter

    tx = fo.sgd(0.5, momentum=0.5)

    def step(g: Packed, s: Any, p: Packed) -> tuple[Any, Any]:
        u, s = tx.update(g, s, p, donate=donate)
        return fo.apply_updates(p, u, donate=donate), s

    ops = []
    for leaves in (4, 40):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(leaves)
        params = fo.pack([_leaf(gen, torch.float32, 8) for _ in range(leaves)])
        grads = [[_leaf(gen, torch.float32, 8) for _ in range(leaves)] for _ in range(3)]
        state = tx.init(params)
        eager_p, eager_s = fo.pack([x.clone() for x in _tensors(params)]), tx.init(params)
        counter = CompileCounter()
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        for g in grads:
            params, state = compiled(fo.pack(g), state, params)
            eager_p, eager_s = step(fo.pack(g), eager_s, eager_p)
        assert counter.frame_count == 1
        ops.append(counter.op_count)
        assert isinstance(params, Packed) and params.buffers is not None
        assert_bitwise(_tensors(params), _tensors(eager_p))
        assert_bitwise(_tensors(state), _tensors(eager_s))
    assert ops[0] == ops[1]


def test_a_compiled_fused_step_of_a_partition_over_packed_trees() -> None:
    """``fused_step(partition(...))`` inside ``torch.compile`` over packed trees: the per-label
    routes, which run compiled code of their own, step aside while dynamo traces, and the
    partition is traced over the trees (before, its update by label parts ran under dynamo and
    failed). Given new gradients every step, nothing compiles after the second step (the
    second compiles once more: the state the first returns holds its per-label trees in
    layouts made in the graph, not the one ``init`` shared with the params, and dynamo guards
    on that sharing); the results equal the eager steps' bit for bit (halving factors: one
    rounding per sum). The eager step ran the stateless label's mask with one flag per leaf of
    its part over a tree that also holds the other labels' leaves, and raised."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    labels = lambda p: ["m" if x.ndim == 2 else "v" for x in p]  # noqa: E731
    tx = fo.partition({"m": fo.sgd(0.5), "v": fo.sgd(0.5, momentum=0.5)}, labels)
    step = fo.fused_step(tx)
    gen = torch.Generator().manual_seed(21)
    make = lambda: [_leaf(gen, torch.float32, 4, 3), _leaf(gen, torch.float32, 5)]  # noqa: E731
    params = fo.pack(make())
    eager_p = fo.pack([x.clone() for x in _tensors(params)])
    state, eager_s = tx.init(params), tx.init(eager_p)
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    counts = []
    for _ in range(4):
        grads = make()
        params, state = compiled(params, fo.pack([g.clone() for g in grads]), state)
        eager_p, eager_s = step(eager_p, fo.pack(grads), eager_s)
        counts.append(counter.frame_count)
    assert counts[1] == counts[-1] <= 2, counts
    assert_bitwise(_tensors(params), _tensors(eager_p))
