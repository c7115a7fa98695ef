"""DreamerV3 optimizer metrics against float64 references."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_opt.metrics import dreamerv3_metrics, tree_rms


def _tree(seed: int, dtype: torch.dtype) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": (torch.randn(3, 4, generator=g) * 3).to(dtype),
        "b": [torch.randn((), generator=g).to(dtype), None],
        "c": (torch.randn(7, generator=g) * 1e-3).to(dtype),
    }


def _ref_rms(values: list[torch.Tensor]) -> float:
    flat = torch.cat([v.double().reshape(-1) for v in values])
    return math.sqrt(float((flat**2).mean()))


def _leaves(t: dict[str, object]) -> list[torch.Tensor]:
    return [t["a"], t["b"][0], t["c"]]  # type: ignore[index, list-item]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_metrics_match_float64_reference(seed: int, dtype: torch.dtype) -> None:
    grads, updates, params = (_tree(seed + k, dtype) for k in range(3))
    m = dreamerv3_metrics(
        grads,
        updates=updates,
        params=params,
        grad_scale=torch.tensor(1024.0),
        grads_finite=torch.tensor(False),
        count=torch.tensor(7, dtype=torch.int32),
    )
    flat = torch.cat([g.double().reshape(-1) for g in _leaves(grads)])
    # Each metric is an RMS (or norm) of the tree's values, which the reference takes in
    # float64 from the same values; the metric is computed in float32 or wider: n squares, their
    # sum (n + 1 roundings), the mean, the sqrt and the float32 result (3), all terms positive:
    # (n + 4) roundings relative to the value.
    tol = (flat.numel() + 4) * torch.finfo(torch.float32).eps
    assert math.isclose(float(m["grad_norm"]), float(flat.norm()), rel_tol=tol)
    assert math.isclose(float(m["grad_rms"]), _ref_rms(_leaves(grads)), rel_tol=tol)
    assert math.isclose(float(m["update_rms"]), _ref_rms(_leaves(updates)), rel_tol=tol)
    assert math.isclose(float(m["param_rms"]), _ref_rms(_leaves(params)), rel_tol=tol)
    assert float(m["grad_scale"]) == 1024.0 and float(m["grad_overflow"]) == 1.0
    assert float(m["updates"]) == 7.0
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in m.values())


def test_metrics_are_optional_and_handle_empty_trees() -> None:
    m = dreamerv3_metrics({"w": None})
    assert set(m) == {"grad_norm", "grad_rms"} and float(m["grad_norm"]) == 0.0
    assert float(tree_rms([])) == 0.0
    assert (
        float(dreamerv3_metrics([torch.ones(4)], grads_finite=torch.tensor(True))["grad_overflow"])
        == 0.0
    )
