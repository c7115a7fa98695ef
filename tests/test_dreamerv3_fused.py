"""dreamerv3's eager update over plain trees, which the engine runs (its chain compiled:
:meth:`functional_opt.plain_trees.PlainTreeStep.update`), equals its reference chain run op
by op, to the rounding bound of ``tests/conftest.py`` (compiled code may fuse ``a * b + c``),
and gives the same bits whatever is donated."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import MagnitudeRun, assert_bitwise, assert_close_rounding, dreamerv3_leaf_ops

import functional_opt as fo
from functional_opt.plain_trees import LEAF_MIN

OPTIONS = [
    {},
    {"nesterov": True},
    {"momentum": False},
    {"agc": 0.0},
    {"agc": 0.05, "pmin": 0.5},
    {"weight_decay": 0.1, "schedule": "cosine", "anneal": 9, "warmup": 3},
    {"schedule": "linear", "anneal": 7, "warmup": 2, "eps": 1e-8},
]


def _tree(gen: torch.Generator, dtype: torch.dtype, drop: bool) -> dict[str, object]:
    return {
        "a": torch.randn(5, 3, generator=gen).to(dtype),
        "b": [
            None if drop else torch.randn(4, generator=gen).to(dtype),
            torch.randn((), generator=gen).to(dtype),
        ],
    }


@pytest.mark.numerics
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("donate", [False, True])
def test_fused_equals_chain(options: dict[str, object], dtype: torch.dtype, donate: bool) -> None:
    kwargs = {"lr": 1e-2, "warmup": 0, **options}
    fused = fo.dreamerv3(**kwargs)  # type: ignore[arg-type]
    chain = fo.dreamerv3(**kwargs, _fused=False)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    params = _tree(gen, dtype, drop=False)
    s_fused, s_chain = fused.init(params), chain.init(params)
    magnitudes = MagnitudeRun(chain, params)
    extra = {"donate": True} if donate else {}
    for step in range(10):
        grads = _tree(gen, dtype, drop=step % 3 == 1)
        u_chain, s_chain = chain.update(grads, s_chain, params)
        mags = magnitudes.update(grads, params)
        u_fused, s_fused = fused.update(grads, s_fused, params, **extra)
        got = [x for x in fo.tree.leaves((u_fused, s_fused)) if x is not None]
        want = [x for x in fo.tree.leaves((u_chain, s_chain)) if x is not None]
        ops = dreamerv3_leaf_ops(dtype, steps=step + 1)
        scale = [x for x in fo.tree.leaves(mags) if x is not None]
        assert_close_rounding(got, want, dtype=dtype, ops=ops, scale=scale)
        assert u_fused["b"][0] is None if step % 3 == 1 else True
        params = fo.apply_updates(params, u_chain)


# Large leaves take the engine's direct route (one compiled call each), the others its staged
# one: equal to the chain to float rounding, and the same bits whether or not state and
# updates are donated.
KERNEL_OPTIONS = [
    {},
    {"agc": 0.05, "pmin": 0.5, "weight_decay": 0.1},
    {"schedule": "cosine", "anneal": 9, "agc": 0.0},
    {"weight_decay": torch.tensor(0.05), "agc": 0.0},  # (tensor hyperparameters: the chain)
]


def _tensors(tree: object) -> list[torch.Tensor]:
    return [x for x in fo.tree.leaves(tree) if isinstance(x, torch.Tensor)]


def _check_kernel_paths(
    options: dict[str, object],
    dtype: torch.dtype,
    make: Callable[[torch.Generator, torch.dtype, int], dict[str, object]],
) -> None:
    """Six updates of ``make``'s trees: pure, ``donate="state"`` and ``donate=True`` give the
    same bits, the pure update never writes its inputs, and all equal the chain to float
    rounding."""
    kwargs = {"lr": 1e-2, "warmup": 1, **options}
    fused = fo.dreamerv3(**kwargs)  # type: ignore[arg-type]
    chain = fo.dreamerv3(**kwargs, _fused=False)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(4)
    params = make(gen, dtype, 0)
    states = [fused.init(params), fused.init(params), fused.init(params), chain.init(params)]
    magnitudes = MagnitudeRun(chain, params)
    for step in range(6):
        grads = make(gen, dtype, step)
        outs = []
        for k, flag in enumerate((None, "state", True)):
            g = fo.tree.map_params(lambda x: x.clone(), grads)
            extra = {} if flag is None else {"donate": flag}
            kept = [x.clone() for x in _tensors((g, states[k]))]
            inputs = _tensors((g, states[k]))
            u, states[k] = fused.update(g, states[k], params, **extra)
            outs.append(_tensors((u, states[k])))
            if flag is None:
                assert_bitwise(inputs, kept)
        u_chain, states[3] = chain.update(grads, states[3], params)
        scale = _tensors(magnitudes.update(grads, params))
        for other in outs[1:]:
            assert_bitwise(other, outs[0])
        ops = dreamerv3_leaf_ops(dtype, steps=step + 1)
        want = _tensors((u_chain, states[3]))
        assert_close_rounding(outs[0], want, dtype=dtype, ops=ops, scale=scale)
        params = fo.apply_updates(params, u_chain)


def _big(gen: torch.Generator, dtype: torch.dtype, step: int = 0) -> dict[str, object]:
    # two leaves large enough for a kernel call each, and a small one
    del step
    return {
        "w": (torch.randn(LEAF_MIN // 64, 64, generator=gen) * 0.3).to(dtype),
        "v": (torch.randn(LEAF_MIN + 5, generator=gen) * 0.3).to(dtype),
        "small": torch.randn(7, generator=gen).to(dtype),
    }


def _many(gen: torch.Generator, dtype: torch.dtype, step: int = 0) -> dict[str, object]:
    # runs of small leaves (staged through packed buffers; every third step one leaf has no
    # gradient, and the chain runs) plus a loner of its own shape
    return {
        "mats": [(torch.randn(7, 5, generator=gen) * 0.3).to(dtype) for _ in range(6)],
        "vecs": [
            None if step % 3 == 2 and k == 2 else torch.randn(3, generator=gen).to(dtype)
            for k in range(5)
        ],
        "odd": torch.randn(2, 2, generator=gen).to(dtype),
    }


def _mixed(gen: torch.Generator, dtype: torch.dtype, step: int = 0) -> dict[str, object]:
    # groups the routing must split or skip: a non-contiguous leaf among five of its shape, a
    # same-shape run in another dtype, empty leaves, and 0-d leaves
    del step

    def leaf(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.3).to(dt)

    return {
        "mats": [leaf(7, 5) for _ in range(5)] + [leaf(5, 7).t()],
        "wide": [leaf(7, 5, dt=torch.float64) for _ in range(4)],
        "empty": [leaf(0, 3) for _ in range(4)],
        "scalars": [leaf() for _ in range(5)],
    }


# (bfloat16: a 0-d leaf whose weight decay nearly cancels its step is far smaller than its
# terms; the bound is relative to the terms, which the magnitude run gives)
@pytest.mark.numerics
@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.1}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kernel_routing_of_mixed_leaves_matches_chain(
    options: dict[str, object], dtype: torch.dtype
) -> None:
    _check_kernel_paths(options, dtype, _mixed)


# (each case of a large tree compiles its dreamerv3's engine: a few cases cover the dtypes
# and the options' code paths, the tree of small leaves runs the chain)
KERNEL_CASES = [
    (KERNEL_OPTIONS[0], torch.float32),
    (KERNEL_OPTIONS[0], torch.bfloat16),
    (KERNEL_OPTIONS[1], torch.float64),
    (KERNEL_OPTIONS[2], torch.float32),
    (KERNEL_OPTIONS[3], torch.float32),
]


@pytest.mark.parametrize(
    ("options", "dtype", "make"),
    [
        pytest.param(options, dtype, make, id=f"options{k}-{str(dtype)[6:]}-{name}")
        for k, (options, dtype) in enumerate(KERNEL_CASES)
        for make, name in ((_big, "large-leaves"), (_many, "stacked-runs"))
        # (a large tree compiles the engine, 10-15 s with a cold cache: float32 with the default
        # options runs in test_engine_plain_update, a cosine schedule in the oracle's routes)
        if make is _many or k not in (0, 3)
    ],
)
def test_kernel_paths_match_chain_and_donation(
    make: Callable[[torch.Generator, torch.dtype, int], dict[str, object]],
    options: dict[str, object],
    dtype: torch.dtype,
) -> None:
    _check_kernel_paths(options, dtype, make)


@pytest.mark.numerics
def test_kernel_falls_back_to_eager_when_compiling_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as inductor

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(inductor, "compile_fx", broken)
    tx, chain = fo.dreamerv3(1e-2, warmup=0), fo.dreamerv3(1e-2, warmup=0, _fused=False)
    gen = torch.Generator().manual_seed(2)
    params = _big(gen, torch.float32)
    grads = _big(gen, torch.float32)
    with pytest.warns(RuntimeWarning, match="eagerly"):
        u, _ = tx.update(grads, tx.init(params), params)
    want, _ = chain.update(grads, chain.init(params), params)
    scale, _ = MagnitudeRun(chain, params).update(grads, params)
    ops = dreamerv3_leaf_ops(torch.float32)
    assert_close_rounding(u, want, dtype=torch.float32, ops=ops, scale=scale)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("make", [_big, _many], ids=["large-leaves", "stacked-runs"])
def test_autograd_through_the_fused_update_matches_the_chain(
    make: Callable[[torch.Generator, torch.dtype, int], dict[str, object]], donate: bool
) -> None:
    # Gradients and params autograd tracks (differentiating through the update, e.g. for a
    # meta-gradient): the kernels write nothing autograd needs, even when donated, and the
    # derivatives are the chain's.
    kwargs = {"lr": 1e-2, "warmup": 1, "weight_decay": 0.1}
    fused = fo.dreamerv3(**kwargs)  # type: ignore[arg-type]
    chain = fo.dreamerv3(**kwargs, _fused=False)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(5)
    params = fo.tree.map_params(lambda x: x.requires_grad_(), make(gen, torch.float64, 0))
    grads = fo.tree.map_params(lambda x: x.requires_grad_(), make(gen, torch.float64, 1))
    inputs = _tensors((grads, params))
    kept = [x.detach().clone() for x in inputs]
    extra = {"donate": True} if donate else {}
    outs = []
    for tx in (fused, chain):
        updates, state = tx.update(grads, tx.init(params), params, **extra)
        loss = sum((u * u).sum() for u in _tensors(updates))
        loss = loss + sum(n.sum() for n in _tensors(state[1].nu))
        outs.append((_tensors(updates), torch.autograd.grad(loss, inputs)))
    assert_bitwise(inputs, kept)
    (u_f, d_f), (u_c, d_c) = outs
    # an update autograd records runs the chain's ops: the same values and derivatives
    assert_bitwise([*u_f, *d_f], [*u_c, *d_c])
