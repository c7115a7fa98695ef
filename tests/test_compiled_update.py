"""The compiled (``torch.compile``) DreamerV3 update: donated updates land in the gradients'
buffers, per-update scalars are computed once per call rather than in every elementwise loop,
and neither changes a value."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import functional_opt as fo
from functional_opt import _lists

SIZE = 4099  # odd, to find the loops over the leaf in inductor's generated code


def _tree(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(SIZE, generator=gen) * 0.3).to(dtype),
        "b": (torch.randn(7, generator=gen) * 0.3).to(dtype),
    }


def _steps(donate: bool | str, dtype: torch.dtype, steps: int = 4) -> list[object]:
    torch._dynamo.reset()
    tx = fo.dreamerv3(1e-2, warmup=2, weight_decay=0.01)
    update = torch.compile(
        functools.partial(tx.update, donate=donate) if donate else tx.update, fullgraph=True
    )
    params = _tree(0, dtype)
    state = tx.init(params)
    eager_params, eager_state = _tree(0, dtype), tx.init(_tree(0, dtype))
    out = []
    for step in range(steps):
        grads = _tree(10 + step, dtype)
        ptrs = {k: v.data_ptr() for k, v in grads.items()}
        u, state = update(
            {k: v.clone() for k, v in grads.items()} if not donate else grads, state, params
        )
        want, eager_state = tx.update(_tree(10 + step, dtype), eager_state, eager_params)
        for k in want:  # (16-bit: compiled and eager round differently)
            tol = (
                {"rtol": 2e-6, "atol": 1e-9}
                if dtype == torch.float32
                else {"rtol": 0, "atol": 2e-4}
            )
            torch.testing.assert_close(u[k], want[k], **tol)
        out.append((u, ptrs))
        params = fo.apply_updates(params, u)
        eager_params = fo.apply_updates(eager_params, want)
    return out


@pytest.mark.parametrize("donate", [False, "state", True])
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
