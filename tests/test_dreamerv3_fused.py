"""dreamerv3's fused eager update equals its reference chain (bit for bit in float32/64)."""

from __future__ import annotations

import pytest
import torch

import functional_opt as fo

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
    extra = {"donate": True} if donate else {}
    for step in range(10):
        grads = _tree(gen, dtype, drop=step % 3 == 1)
        u_chain, s_chain = chain.update(grads, s_chain, params)
        u_fused, s_fused = fused.update(grads, s_fused, params, **extra)
        got = [x for x in fo.tree.leaves((u_fused, s_fused)) if x is not None]
        want = [x for x in fo.tree.leaves((u_chain, s_chain)) if x is not None]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            if dtype == torch.bfloat16:
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)
            else:
                assert torch.equal(a, b)
        assert u_fused["b"][0] is None if step % 3 == 1 else True
        params = fo.apply_updates(params, u_chain)
