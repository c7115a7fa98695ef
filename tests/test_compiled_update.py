"""The compiled (``torch.compile``) DreamerV3 update: donated updates land in the gradients'
buffers, per-update scalars are computed once per call rather than in every elementwise loop,
and neither changes a value."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from conftest import MagnitudeRun, assert_close_rounding, dreamerv3_ops
from torch._inductor.utils import run_and_get_code

import functional_opt as fo
from functional_opt import _lists

SIZE = 4099  # odd, to find the loops over the leaf in inductor's generated code


def _tree(
    seed: int, dtype: torch.dtype = torch.float32, scale: float = 0.3
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(SIZE, generator=gen) * scale).to(dtype),
        "b": (torch.randn(7, generator=gen) * scale).to(dtype),
    }


def _grads(step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # ||g|| / ||p|| is about 0.03, far below the clip's 0.3 in both codes: the clip factor is
    # exactly 1 in both, so the norms' rounding never reaches the comparison
    return _tree(10 + step, dtype, scale=0.01)


def _steps(donate: bool | str, dtype: torch.dtype, steps: int = 4) -> list[object]:
    torch._dynamo.reset()
    tx = fo.dreamerv3(1e-2, warmup=2, weight_decay=0.01)
    update = torch.compile(
        functools.partial(tx.update, donate=donate) if donate else tx.update, fullgraph=True
    )
    params = _tree(0, dtype)
    state, eager_state = tx.init(params), tx.init(params)
    magnitudes = MagnitudeRun(tx, params)
    out = []
    for step in range(steps):
        grads = _grads(step, dtype)
        ptrs = {k: v.data_ptr() for k, v in grads.items()}
        u, state = update(
            {k: v.clone() for k, v in grads.items()} if not donate else grads, state, params
        )
        want, eager_state = tx.update(_grads(step, dtype), eager_state, params)
        scale, _ = magnitudes.update(_grads(step, dtype), params)
        # compiled vs eager, each carrying its own state: the rule's dreamerv3 count
        ops = dreamerv3_ops(dtype, numel=0, steps=step + 1)
        assert_close_rounding(u, want, dtype=dtype, ops=ops, scale=scale, msg=f"step {step}")
        out.append((u, ptrs))
        params = fo.apply_updates(params, u)
    return out


@pytest.mark.parametrize("donate", [False, "state", pytest.param(True, marks=pytest.mark.numerics)])
def test_compiled_update_matches_eager_and_takes_donated_buffers(donate: bool | str) -> None:
    for u, ptrs in _steps(donate, torch.float32):  # type: ignore[misc]
        in_place = {k: u[k].data_ptr() == ptrs[k] for k in ptrs}
        # only donate=True gives up the gradients; then every (32-bit) update is written there
        assert all(in_place.values()) == (donate is True)
        assert any(in_place.values()) == (donate is True)


def test_compiled_16bit_update_keeps_a_fresh_buffer() -> None:
    # writing 16-bit updates over the gradients they are computed from measured slower
    for u, ptrs in _steps(True, torch.bfloat16, steps=2):  # type: ignore[misc]
        assert not any(u[k].data_ptr() == ptrs[k] for k in ptrs)


def _loop_bodies(source: str, bound: str) -> list[str]:
    """The text of each C++ ``for`` loop whose header mentions ``bound``."""
    bodies = []
    for match in re.finditer(r"for\s*\(", source):
        start = source.index("{", match.end())
        if bound not in source[match.end() : start]:
            continue
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            if depth == 0:
                break
            i += 1
        bodies.append(source[start:i])
    return bodies


def test_compiled_update_computes_bias_corrections_outside_the_elementwise_loops() -> None:
    torch._dynamo.reset()
    tx = fo.dreamerv3(1e-2, warmup=2)
    params = {"w": torch.randn(SIZE)}
    state = tx.init(params)
    update = torch.compile(functools.partial(tx.update, donate=True), fullgraph=True)
    _, codes = run_and_get_code(update, {"w": torch.randn(SIZE)}, state, params)
    source = "\n".join(codes)
    loops = _loop_bodies(source, f"{SIZE}L")
    assert loops, "no loop over the leaf found in the generated code"
    assert "pow" in source  # the bias corrections are there...
    assert not any("pow" in body for body in loops)  # ...but not in any loop over the leaf


def test_once_is_the_identity() -> None:
    values = [
        torch.tensor(-0.0),
        torch.tensor(float("nan")),
        torch.tensor(3.5, dtype=torch.float64),
    ]
    assert _lists.once(values[0]) is values[0]  # eager: untouched

    @torch.compile(fullgraph=True)
    def through(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return _lists.once(xs)  # type: ignore[no-any-return]

    out = through(values)
    for got, want in zip(out, values, strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got, want) or (got.isnan() and want.isnan())
        if not want.isnan():
            assert torch.signbit(got) == torch.signbit(want)


def _by_rank(params: list[torch.Tensor]) -> list[str]:
    return ["m" if p.ndim == 2 else "v" for p in params]


@pytest.mark.parametrize(
    "make",
    [
        lambda: fo.dreamerv3(1e-2, warmup=0),
        lambda: fo.fused(fo.dreamerv3(1e-2, warmup=0)),
        lambda: fo.adam(1e-2),
        lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2)),
        lambda: fo.partition({"m": fo.adam(1e-2), "v": fo.sgd(1e-2, momentum=0.9)}, _by_rank),
        lambda: fo.fused(
            fo.partition({"m": fo.adam(1e-2), "v": fo.sgd(1e-2, momentum=0.9)}, _by_rank)
        ),
        lambda: fo.masked(fo.adam(1e-2), lambda p: [x.ndim == 2 for x in p]),
        lambda: fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-2)), 3),
        lambda: fo.MultiSteps(fo.adamw(1e-2), 2),
        lambda: fo.inject_hyperparams(fo.adamw)(learning_rate=1e-2),
    ],
    ids=[
        "dreamerv3",
        "fused(dreamerv3)",
        "adam",
        "clip+adamw",
        "partition",
        "fused(partition)",
        "masked(adam)",
        "apply_if_finite",
        "MultiSteps",
        "inject_hyperparams",
    ],
)
@pytest.mark.parametrize("donate", [False, True])
def test_a_compiled_step_given_fresh_gradients_each_call_compiles_once(
    make: object, donate: bool
) -> None:
    """A training step compiled with ``tx.update`` and ``apply_updates`` gets new gradient
    tensors every call, and compiles once. The donated paths' checks that no tensor is in a
    list twice took each tensor's ``id()``, which dynamo turns into a guard on that object:
    every call compiled again (a minute each on W1), until dynamo's recompile limit sent the
    step back to eager code. ``masked`` (and ``partition``, made of it) filled a memo of its
    inner transform's kinds while traced: its second call compiled again. ``fused(partition)``
    did not compile at all (its per-label route ran under dynamo)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    tx = make()  # type: ignore[operator]
    counter = CompileCounter()

    def step(g: list[torch.Tensor], s: object, p: list[torch.Tensor]) -> tuple[object, object]:
        u, s = tx.update(g, s, p, donate=donate)
        return fo.apply_updates(p, u, donate=donate), s

    compiled = torch.compile(step, backend=counter, fullgraph=True)

    def leaves(seed: int, scale: float) -> list[torch.Tensor]:  # (a matrix: two labels)
        gen = torch.Generator().manual_seed(seed)
        return [*_tree(seed, scale=scale).values(), torch.randn(6, 5, generator=gen) * scale]

    params = leaves(0, 0.3)
    state = tx.init(params)
    for k in range(4):
        params, state = compiled(leaves(10 + k, 0.01), state, params)
    assert counter.frame_count == 1
