"""Donation mode: ``update(..., donate=True)`` gives the same results and reuses state buffers."""

from __future__ import annotations

import pytest
import torch

import functional_opt as fo


def _tree(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g).to(dtype),
        "b": [torch.randn(3, generator=g).to(dtype)],
    }


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


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_donated_updates_are_identical(name: str, dtype: torch.dtype) -> None:
    tx = TRANSFORMS[name]()
    params = _tree(0, dtype)
    pure_state = tx.init(params)
    donated_state = tx.init(params)
    for step in range(6):
        grads = _tree(step + 1, dtype)
        if name == "apply_if_finite" and step == 2:
            grads["w"] = grads["w"].clone()
            grads["w"][0, 0] = float("nan")
        u1, pure_state = tx.update(grads, pure_state, params)
        u2, donated_state = tx.update(grads, donated_state, params, donate=True)
        for a, b in zip(_leaves(u1), _leaves(u2), strict=True):
            assert torch.equal(a, b), name
        for a, b in zip(_leaves(pure_state), _leaves(donated_state), strict=True):
            assert torch.equal(a, b), name
        params = fo.apply_updates(params, u1)


@pytest.mark.parametrize("name", ["scale_by_rms", "scale_by_adam", "trace", "ema", "dreamerv3"])
def test_donation_reuses_moment_buffers(name: str) -> None:
    tx = TRANSFORMS[name]()
    params = _tree(0)
    state = tx.init(params)
    grads = _tree(1)
    big = [x for x in _leaves(state) if x.dim() > 0]
    ptrs = {x.data_ptr() for x in big}
    _, new_state = tx.update(grads, state, params, donate=True)
    assert {x.data_ptr() for x in _leaves(new_state) if x.dim() > 0} == ptrs
    # Without donation nothing is written into the old state.
    state = tx.init(params)
    before = [x.clone() for x in _leaves(state)]
    tx.update(grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(before, _leaves(state), strict=True))


def test_donate_must_be_a_python_bool() -> None:
    tx = fo.adam(1e-2)
    params = _tree(0)
    with pytest.raises(TypeError, match="donate"):
        tx.update(_tree(1), tx.init(params), params, donate=torch.tensor(True))
