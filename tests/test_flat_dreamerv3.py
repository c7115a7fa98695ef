"""DreamerV3Optimizer's fast path (flat buffers, compiled kernel) against the generic path."""

from __future__ import annotations

import io

import pytest
import torch

from functional_opt.adapters import DreamerV3Optimizer
from functional_opt.adapters.flat_dreamerv3 import MERGE


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # Merged runs (small sizes; 2 x 20000 < MERGE elements), a run of one large tensor, a 2-D
    # run of three equal tensors and one of two, a 0-d param.
    shapes = [(3, 5), (5,), (3, 5), (7,), (), (MERGE + 3,), (2, MERGE // 2), (5,), (1,)]
    shapes += [(100, 300), (20000,), (300, 100), (MERGE // 2,), (100, 300), (20000,), (MERGE // 2,)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def _grads(params: list[torch.nn.Parameter], step: int, skip: set[int]) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        scale = 10.0 ** (i % 4 - 2)
        grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)
        p.grad = None if i in skip else grad


def _run(flat: bool, dtype: torch.dtype, steps: int, **options: float) -> list[torch.Tensor]:
    params = _params(dtype)
    opt = DreamerV3Optimizer(params, **options)
    opt.flat_step = flat
    for t in range(steps):
        _grads(params, t, skip={1, 4} if t % 3 == 1 else set())
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    "options",
    [
        {"lr": 1e-2, "warmup_steps": 0},
        {"lr": 1e-2, "warmup_steps": 3, "agc": 0.05},
        {"lr": 3e-3, "warmup_steps": 0, "agc": 0.0, "beta1": 0.5, "eps": 1e-8},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_flat_path_matches_generic_path(options: dict[str, float], dtype: torch.dtype) -> None:
    flat = _run(True, dtype, 8, **options)
    generic = _run(False, dtype, 8, **options)
    tol = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(flat, generic, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_params_without_gradient_are_untouched() -> None:
    params = _params()
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0)
    _grads(params, 0, skip=set())
    opt.step()
    frozen = params[1].detach().clone()
    state = {k: v.clone() for k, v in opt.state[params[1]].items()}
    for t in range(1, 4):
        _grads(params, t, skip={1})
        opt.step()
    assert torch.equal(params[1].detach(), frozen)
    for k, v in state.items():
        assert torch.equal(opt.state[params[1]][k], v)
    never = _params()
    opt = DreamerV3Optimizer(never, lr=1e-2, warmup_steps=0)
    _grads(never, 0, skip={2})
    before = never[2].detach().clone()
    opt.step()
    assert torch.equal(never[2].detach(), before)
    assert never[2] not in opt.state


def test_checkpoint_round_trip_and_repointed_params_stay_exact() -> None:
    def run(save_at: int | None) -> list[torch.Tensor]:
        params = _params()
        opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=2)
        for t in range(6):
            if t == save_at:
                buffer = io.BytesIO()
                torch.save(
                    {"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer
                )
                buffer.seek(0)
                ckpt = torch.load(buffer, weights_only=True)
                params = _params(seed=1)
                with torch.no_grad():
                    for p, v in zip(params, ckpt["params"], strict=True):
                        p.copy_(v)
                opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=2)
                opt.load_state_dict(ckpt["opt"])
            if t == 4:  # someone replaces a param's storage: the bucket is rebuilt
                params[0].data = params[0].data.clone()
            _grads(params, t, skip=set())
            opt.step()
        return [p.detach().clone() for p in params]

    for a, b in zip(run(None), run(3), strict=True):
        assert torch.equal(a, b)


def test_state_entries_are_views_of_the_buckets() -> None:
    params = _params()
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0)
    _grads(params, 0, skip=set())
    opt.step()
    rms = [opt.state[p]["rms"] for p in params]
    assert len({t.untyped_storage().data_ptr() for t in rms}) == 1
    assert all(
        t.dtype == torch.float32 and t.shape == p.shape for t, p in zip(rms, params, strict=True)
    )


def test_changing_hyperparameters_does_not_recompile() -> None:
    params = _params()
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=3)
    for t in range(2):
        _grads(params, t, skip=set())
        opt.step()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t, (lr, agc, beta2) in enumerate([(3e-3, 0.3, 0.999), (1e-4, 0.1, 0.99)]):
            for group in opt.param_groups:
                group.update(lr=lr, agc=agc, beta2=beta2)
            _grads(params, 2 + t, skip={0} if t else set())
            opt.step()


def test_step_under_torch_compile_matches_eager() -> None:
    # Compiling optimizer.step traces the kernels into the step's own graphs.
    eager, compiled = _params(), _params()
    opt_eager = DreamerV3Optimizer(eager, lr=1e-2, warmup_steps=0)
    opt_compiled = DreamerV3Optimizer(compiled, lr=1e-2, warmup_steps=0)
    step = torch.compile(opt_compiled.step)
    for t in range(3):
        _grads(eager, t, skip=set())
        _grads(compiled, t, skip=set())
        opt_eager.step()
        step()
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
