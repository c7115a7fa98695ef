"""The engine's piecewise route: with a transform that treats every leaf on its own without
reductions, ``TransformOptimizer`` steps its packed params in pieces of rows of the packed
buffers (``PackedGroup.pieces``): each piece's gradients copied in, one compiled call of the
transform vmapped over its rows (``leaf_step.rows_step``), its update added into its params,
while the piece is in cache.

Steps are compared with the per-tensor path by rule 2 of tests/README.md (compiled and eager
code round the same math differently); the rows step itself is compared with the transform's
eager update over a packed tree."""

from __future__ import annotations

import copy
from collections.abc import Callable

import optree
import pytest
import torch
from conftest import (
    DREAMERV3_ELEMENTWISE_OPS,
    ELEMENTWISE_OPS,
    assert_bitwise,
    assert_close_rounding,
    assert_same_steps_then_sync,
    step_with_grads,
)

import functional_opt as fo
from functional_opt import _kernels, tree
from functional_opt.adapters import TransformOptimizer, packed_group
from functional_opt.leaf_step import GIVEN, GivenPack, rows_step

# shapes of one size in one run, some of other shapes of that size (copied in one by one), an
# odd size (rows that start at unaligned addresses), a few larger ones
SHAPES = [(6, 7), (42,), (7, 6), (42,), (42,), (3, 14), (13,), (13,), (13,), (13,), (13,)]
SHAPES += [(42,)] * 9 + [(9, 11)] * 3

MAKERS: dict[str, tuple[Callable[[list[torch.Tensor]], TransformOptimizer], int]] = {
    # (the maker, roundings per element of one update beyond ELEMENTWISE_OPS)
    "adam": (lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-2), 0),
    "adamw": (lambda ps: TransformOptimizer(ps, fo.adamw(1e-2, weight_decay=0.1)), 0),
    # reads the params (clip by their norms, weight decay); the norms of the largest leaf
    "dreamerv3": (
        lambda ps: TransformOptimizer(ps, fo.dreamerv3, lr=1e-2, warmup=2),
        DREAMERV3_ELEMENTWISE_OPS + 99 + 2,
    ),
    # stages: a mini-step only accumulates (no param written), every second step emits
    "multi-steps": (
        lambda ps: TransformOptimizer(
            ps, fo.MultiSteps(fo.adamw(1e-2, weight_decay=0.1), 2).gradient_transformation()
        ),
        0,
    ),
    # a global norm over all params (a total the pieces take from the gradients first)
    "clip-chain": (
        lambda ps: TransformOptimizer(
            ps, fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(1e-2, weight_decay=0.1))
        ),
        4,
    ),
    # a finite check and a global norm (two totals)
    "apply-if-finite": (
        lambda ps: TransformOptimizer(
            ps,
            fo.apply_if_finite(
                fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(1e-2, weight_decay=0.1)), 2
            ),
        ),
        4,
    ),
    # a global norm of adam's output: not a reduction of the gradients, so the group takes
    # the whole-buffer route (its totals from a compiled pass over the packed params)
    "adam-then-clip": (
        lambda ps: TransformOptimizer(
            ps, lambda lr: fo.chain(fo.adam(lr), fo.clip_by_global_norm(0.05)), lr=1e-2
        ),
        4,
    ),
}


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 0.1 for s in SHAPES]


def _engine(opt: TransformOptimizer) -> packed_group.PackedGroup:
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert isinstance(engine, packed_group.PackedGroup)
    return engine


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of at most 200 elements, so that runs are cut into several."""
    monkeypatch.setattr(packed_group, "PIECE", 200)


# (each case compiles its kernels: a few transforms, each with one kind of gradients, adam in
# the model test below; the
# second CPU code path reruns the one whose kernel reduces, DreamerV3's norms)
CASES = [
    pytest.param("adamw", True, id="adamw-persisting"),
    pytest.param("dreamerv3", False, id="dreamerv3-fresh", marks=pytest.mark.numerics),
    pytest.param("multi-steps", True, id="multi-steps-persisting"),
]


@pytest.mark.parametrize(("name", "persisting"), CASES)
def test_packed_params_step_piece_by_piece_like_the_per_tensor_path(
    name: str, persisting: bool, small_pieces: None
) -> None:
    """Lockstep with the per-tensor path over 5 steps (the lr changed on the fourth): every
    param packed, in pieces of a few rows; the params keep their storage, the gradients are
    never written (with persisting gradients they become the buffer's views, still read
    only), and the state entries are views of the engine's buffers."""
    make, extra = MAKERS[name]
    params, ref_params = _params(0), _params(0)
    opt, ref = make(params), make(ref_params)
    opt.fused_min_numel = 0
    opt.direct_min_numel = 2**40  # (every param packed)
    ref.fused_steps = False
    ptrs = [p.data_ptr() for p in params]
    grads = _grads(1)
    for step in range(5):
        if step == 3:
            for o in (opt, ref):
                o.param_groups[0]["lr"] = 5e-3
        if not persisting:
            grads = _grads(10 + step)
        before = [p.detach().clone() for p in ref_params]
        for ps in (params, ref_params):
            for p, g in zip(ps, grads, strict=True):
                if persisting and p.grad is not None:
                    p.grad.copy_(g)
                else:
                    p.grad = g.clone()
        held = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        opt.step()
        ref.step()
        assert_bitwise([p.grad for p in params], held)
        ops = (ELEMENTWISE_OPS + extra) * (step + 1) + 2
        assert_same_steps_then_sync(list(params), list(ref_params), before, ops)
    engine = _engine(opt)
    assert engine.direct == [] and len(engine.rest) == len(SHAPES)
    assert [(piece.rows, piece.size) for piece in engine.pieces] == [
        *[(2, 99), (1, 99)],
        *[(4, 42), (4, 42), (4, 42), (3, 42)],
        (5, 13),
    ]
    # (leaves of one size but several shapes are copied in one by one)
    nine, six = torch.Size([9, 11]), torch.Size([42])
    assert [piece.shape for piece in engine.pieces] == [nine, nine, None, None, six, six, (13,)]
    assert engine.piece_kernels  # compiled calls, kept
    assert [p.data_ptr() for p in params] == ptrs
    if persisting:
        assert all(p.grad is v for p, v in zip(params, engine.rest_views, strict=True))
    for p in params:  # each state entry a view of the engine's buffers
        for name_, entry in opt.state[p].items():
            buffers = engine.state.get(name_)
            if buffers is not None:
                assert any(entry.untyped_storage().data_ptr() == b.data_ptr() for b in buffers)
    reads = name != "adam"  # (weight decay, dreamerv3's clip)
    assert set(engine.reads_params.values()) == (
        {False, True} if name == "multi-steps" else {reads}
    )


@pytest.mark.parametrize(
    "case",
    ["clip-chain", "decay-mask", "tied", "few"],
)
def test_groups_the_piecewise_route_cannot_take_step_over_the_whole_buffers(case: str) -> None:
    """A reduction across leaves (a global-norm clip), leaf labels (a decay mask), params that
    share memory (tied weights) and a group of few packed params keep the whole-buffer route."""
    params = _params(0)
    if case == "tied":
        params.append(torch.nn.Parameter(params[1].data))  # the same storage as params[1]
    if case == "few":
        params = params[:4]
    tx: fo.GradientTransformation = fo.adam(1e-2)
    if case == "clip-chain":
        tx = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2))
    if case == "decay-mask":
        tx = fo.adamw(1e-2, weight_decay=0.1, mask=[p.dim() > 1 for p in params])
    opt = TransformOptimizer(params, tx)
    opt.fused_min_numel = 0
    opt.direct_min_numel = 2**40
    for p, g in zip(params, _grads(1), strict=False):
        p.grad = g
    if case == "tied":
        params[-1].grad = torch.ones_like(params[-1])
    opt.step()
    engine = _engine(opt)
    assert engine.steps == 1 and engine.pieces == []


def test_the_rows_step_is_the_transform_over_a_packed_tree_row_by_row() -> None:
    """``rows_step`` of ``dreamerv3`` on a ``[rows, size]`` piece gives each row the update of
    that leaf in a packed tree (the eager update, bit for bit where the compiled kernel rounds
    as eager does: within float32 rounding per element), writes the new moments in place and
    the counters' new values into its outputs, and leaves the gradient and params alone."""
    tx = fo.dreamerv3(1e-2, warmup=2, _fused=False)
    gen = torch.Generator().manual_seed(0)
    rows, size = 5, 37
    g = torch.randn(rows, size, generator=gen) * 0.1
    p = torch.randn(rows, size, generator=gen)
    state = tx.init(fo.pack(list(p)))
    # one step first, so that the moments and counters are not zeros
    state = tx.update(fo.pack(list(g * 0.5)), state, fo.pack(list(p)))[1]
    want_u, want_state = tx.update(fo.pack(list(g)), state, fo.pack(list(p)))

    leaves, spec = optree.tree_flatten(
        state,
        is_leaf=lambda x: isinstance(x, fo.Packed),
        none_is_leaf=True,
        namespace=tree.NAMESPACE,
    )
    kinds = [
        "param" if isinstance(x, fo.Packed) else "none" if x is None else "group" for x in leaves
    ]
    outline = optree.tree_unflatten(spec, kinds)
    given = [x for x, k in zip(leaves, kinds, strict=True) if k in GIVEN]
    pack = GivenPack(given)
    step = rows_step(tx, outline, kinds, True, pack)
    assert step is not None
    moments = [x.buffers[0].view(rows, size).clone() for x in leaves if isinstance(x, fo.Packed)]
    outs = pack.empty()
    u = torch.empty(rows, size)
    g_in, p_in = g.clone(), p.clone()
    _kernels.Kernel(step)(g_in, p_in, u, *moments, *pack.pack(given), *outs)
    assert_bitwise([g_in, p_in], [g, p])
    assert_close_rounding(
        [u],
        [want_u.buffers[0].view(rows, size)],
        dtype=torch.float32,  # type: ignore[union-attr]
        ops=DREAMERV3_ELEMENTWISE_OPS + size,
    )
    new_leaves = optree.tree_leaves(
        want_state,
        is_leaf=lambda x: isinstance(x, fo.Packed),
        none_is_leaf=True,
        namespace=tree.NAMESPACE,
    )
    want_moments = [x.buffers[0].view(rows, size) for x in new_leaves if isinstance(x, fo.Packed)]
    assert_close_rounding(moments, want_moments, dtype=torch.float32, ops=DREAMERV3_ELEMENTWISE_OPS)
    want_given = [x for x in new_leaves if isinstance(x, torch.Tensor) and x.dim() == 0]
    assert_bitwise(pack.unpack(outs), want_given)


def test_a_model_steps_the_same_with_and_without_pieces() -> None:
    """A model through ``zero_grad`` and backward: the piecewise route (its default pieces)
    and the whole-buffer route give the same params within rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(30, 30) for _ in range(6)])
    twin = copy.deepcopy(model)
    opts = []
    for m in (model, twin):
        o = TransformOptimizer(m.parameters(), fo.adam, lr=1e-2)
        o.fused_min_numel = 0
        o.direct_min_numel = 2**40
        opts.append(o)
    for step in range(3):
        x = torch.randn(4, 30)
        before = [p.detach().clone() for p in twin.parameters()]
        for i, (m, o) in enumerate(zip((model, twin), opts, strict=True)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            if i == 1 and step == 0:
                with pytest.MonkeyPatch.context() as patch:  # (the whole-buffer route)
                    patch.setattr(packed_group.PackedGroup, "_pieces", lambda self, ps: [])
                    o.step()
            else:
                o.step()
        assert_same_steps_then_sync(
            list(model.parameters()), list(twin.parameters()), before, ELEMENTWISE_OPS * 2
        )
    assert _engine(opts[0]).pieces and not _engine(opts[1]).pieces


def test_dreamerv3_optimizer_on_16_bit_params_steps_in_pieces_like_the_per_tensor_path() -> None:
    """``DreamerV3Optimizer`` on the engine with bfloat16 params: the gradients copied into the
    float32 buffer piece by piece (never bucket views), the params' 16-bit values read, the
    float32 update added into them rounded once, as on the per-tensor path."""
    from functional_opt.adapters import DreamerV3Optimizer

    shapes = [(300,)] * 12 + [(50, 6)] * 6 + [(17,)] * 8

    def make() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]

    params, ref_params = make(), make()
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0)
    ref = DreamerV3Optimizer(ref_params, lr=1e-2, warmup_steps=0)
    opt.flat_step = ref.flat_step = False
    opt.fused_min_numel, opt.direct_min_numel = 0, 2**40
    ref.fused_steps = False
    for step in range(3):
        gen = torch.Generator().manual_seed(10 + step)
        grads = [torch.randn(s, generator=gen).bfloat16() * 0.1 for s in shapes]
        before = [p.detach().float() for p in ref_params]
        step_with_grads([(params, opt), (ref_params, ref)], grads)
        # one bfloat16 rounding of p + u apart at most (the float32 updates agree to rounding)
        assert_close_rounding(
            [p.detach().float() for p in params],
            [p.detach().float() for p in ref_params],
            dtype=torch.bfloat16,
            ops=1,
            scale=[b.abs() + 1e-2 for b in before],
        )
        with torch.no_grad():
            for p, q in zip(params, ref_params, strict=True):
                p.copy_(q)
    engine = _engine(opt)
    assert engine.upcast and len(engine.pieces) == 2
    assert all(g.dtype == torch.float32 for g in engine.grads)
    assert all(p.grad is not v for p, v in zip(params, engine.rest_views, strict=True))


def test_a_usual_step_after_an_in_place_transpose_adds_the_update_where_it_belongs() -> None:
    """A square param transposed in place keeps its address, so the next step is a usual one
    (bucket-view gradients, nothing moved): its params' contiguity, read with their addresses,
    sends the update through the strided add, not the fused one that would add it over the
    storage in the old order. Lockstep with the per-tensor path before and after."""
    shapes = [(6, 6)] * 3 + [(36,)] * 3

    def params_of(seed: int) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]

    params, ref_params = params_of(0), params_of(0)
    opt = TransformOptimizer(params, fo.adam, lr=1e-2)
    ref = TransformOptimizer(ref_params, fo.adam, lr=1e-2)
    opt.fused_min_numel = 0
    opt.direct_min_numel = 2**40  # (every param packed, in pieces)
    ref.fused_steps = False
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                for p in (params[1], ref_params[1]):
                    p.t_()
        grads = [torch.randn(p.shape, generator=gen) * 0.1 for p in params]
        before = [p.detach().clone() for p in ref_params]
        for ps in (params, ref_params):
            for p, g in zip(ps, grads, strict=True):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        usual = _engine(opt).usual_grads(params, opt.state) if step else None
        opt.step()
        ref.step()
        if step >= 2:  # (the gradients are bucket views after the second step: usual steps)
            assert usual is not None
        assert_same_steps_then_sync(list(params), list(ref_params), before, ELEMENTWISE_OPS + 2)
    assert _engine(opt).pieces
    assert not params[1].is_contiguous()


# large matrices beside the small params: stepped directly (``direct_min_numel`` below)
LARGE = [(30, 40), (40, 30), (20, 60)]


@pytest.mark.parametrize(
    ("name", "graphs"),
    [
        pytest.param("adam", 1, id="adam"),
        pytest.param("adamw", 1, id="adamw"),
        # a mini-step and an emitting step: a graph each
        pytest.param("multi-steps", 2, id="multi-steps"),
        pytest.param("clip-chain", 1, id="clip-chain"),
        pytest.param("apply-if-finite", 1, id="apply-if-finite"),
        # the direct params' partials pass and step, the packed params' partials pass and
        # update
        pytest.param("adam-then-clip", 4, id="adam-then-clip"),
        # per-leaf norms: the pieces keep the rows step, a graph of its own
        pytest.param("dreamerv3", 2, id="dreamerv3", marks=pytest.mark.numerics),
    ],
)
def test_beside_direct_params_the_pieces_take_the_direct_params_step(
    name: str, graphs: int
) -> None:
    """In a group with direct params, a transform whose one-param step treats each element on
    its own steps its pieces with that same compiled step (each piece a ``[rows, size]``
    matrix, as the direct matrices are): with the compiler's caches off (a first run), one graph
    per stage of the transform goes through AOT autograd, not one for the direct params and
    another for the pieces. Lockstep with the per-tensor path over 4 steps (the lr changed on
    the third); the params keep their storage and the gradients are never written. DreamerV3
    (each leaf's norms) is not elementwise: its pieces keep the rows step. A transform with
    reductions over all params (a clip, a finite check) first takes their totals from the
    gradients, then steps the pieces given them; one whose reduction is of something else (a
    clip after adam) steps over the whole buffers as before."""
    from torch._dynamo.utils import counters

    make, extra = MAKERS[name]
    shapes = SHAPES + LARGE

    def params_(seed: int) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]

    params, ref_params = params_(0), params_(0)
    opt, ref = make(params), make(ref_params)
    opt.fused_min_numel = 0
    opt.direct_min_numel = 1000
    ref.fused_steps = False
    ptrs = [p.data_ptr() for p in params]
    counters.clear()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        for step in range(4):
            if step == 2:
                for o in (opt, ref):
                    o.param_groups[0]["lr"] = 5e-3
            gen = torch.Generator().manual_seed(20 + step)
            grads = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
            before = [p.detach().clone() for p in ref_params]
            step_with_grads([(params, opt), (ref_params, ref)], grads)
            assert_bitwise([p.grad for p in params], grads)
            ops = (ELEMENTWISE_OPS + extra) * (step + 1) + 2
            assert_same_steps_then_sync(list(params), list(ref_params), before, ops)
    compiled = dict(counters["aot_autograd"])
    assert compiled.get("ok") == graphs, compiled
    if name != "adam-then-clip":  # (two of its graphs are traced twice: not this route's)
        assert compiled.get("total") == graphs, compiled
    engine = _engine(opt)
    assert len(engine.direct) == len(LARGE)
    if name == "adam-then-clip":
        assert not engine.pieces  # (dropped on the first step)
    else:
        assert engine.pieces
        assert set(engine.elementwise.values()) == {name != "dreamerv3"}
    assert [p.data_ptr() for p in params] == ptrs


def _clip_each_leaf(updates: object, params: object) -> object:
    """Each leaf scaled to a norm of at most 1e6 (never reached here: the factor is 1 for these
    gradients, so only the structure of the step shows the per-leaf reduction)."""
    del params
    g, at = tree.split(updates, elementwise=True)
    factors = 1e6 / torch.clamp(at.norm_vector(g), min=1e6)
    return at.updates(at.scale_leaves(g, factors))


def _by_size(updates: object, params: object) -> object:
    """Each leaf divided by the square root of its size (a number of the leaf's size, not of
    its elements)."""
    del params
    g, at = tree.split(updates, elementwise=True)
    return at.updates([x / x.numel() ** 0.5 for x in g])


def _halved(updates: object, params: object) -> object:
    del params
    g, at = tree.split(updates, elementwise=True)
    return at.updates([x * 0.5 for x in g])


@pytest.mark.parametrize(
    ("fn", "elementwise"),
    [(_clip_each_leaf, False), (_by_size, False), (_halved, True)],
    ids=["a-norm-per-leaf", "a-number-of-the-leaf-size", "elementwise"],
)
def test_only_a_step_that_treats_each_element_alone_takes_the_direct_step_for_pieces(
    fn: Callable[[object, object], object], elementwise: bool
) -> None:
    """A user's transform (declared fusable and leafwise) before ``sgd``: the pieces take the
    direct params' step only when that step treats each element on its own, found from the
    ops it makes, not from the values it gives (the per-leaf clip changes nothing here, yet a
    piece stepped as one leaf would be clipped by the piece's norm). Each case steps like the
    per-tensor path."""
    # (plain sgd: inductor 2.13 fails to compile the rows step of such a clip before a
    # transform with moments, "KeyError: 'buf3'" in its C++ outer loop fusion, and runs it
    # eagerly with a warning)
    tx = fo.chain(fo.stateless(fn, elementwise=True, leafwise=True), fo.sgd(1e-2))
    shapes = SHAPES + LARGE
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = TransformOptimizer(params, tx), TransformOptimizer(ref_params, tx)
    opt.fused_min_numel = 0
    opt.direct_min_numel = 1000
    ref.fused_steps = False
    for step in range(2):
        grads = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
        before = [p.detach().clone() for p in ref_params]
        step_with_grads([(params, opt), (ref_params, ref)], grads)
        assert_same_steps_then_sync(list(params), list(ref_params), before, 4 * (step + 1) + 2)
    engine = _engine(opt)
    assert len(engine.direct) == len(LARGE) and engine.pieces
    assert engine.elementwise == {(): elementwise}
