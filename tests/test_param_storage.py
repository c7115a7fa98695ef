"""``DreamerV3Optimizer`` never changes the storage of a user's params (DESIGN.md section 6).

After any number of steps, on every route of the flat path (merged, staged, direct, shared) and
in float32 and bfloat16, each param has the storage, offset and strides it had: aliases of
``p.data`` stay valid, weights tied by storage stay tied (each tied param's update added to the
shared memory from the values before the step, as the generic path adds them), ``safetensors``
round-trips the model, and ``torch.save`` of one param writes that param only. The opt-in
``own_param_storage=True`` moves the params into the optimizer's buffers, with the documented
consequences, which these tests also show (so they can tell the two behaviours apart).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bitwise, assert_close_rounding
from test_flat_dreamerv3 import STEP_OPS, oracle, signs

from functional_opt.adapters import DreamerV3Optimizer
from functional_opt.adapters.flat_dreamerv3 import DIRECT, MERGE

DTYPES = [torch.float32, torch.bfloat16]


def identity(p: torch.Tensor) -> tuple[Any, ...]:
    """What must not change: the storage, where the param starts in it, its layout."""
    return (p.untyped_storage().data_ptr(), p.storage_offset(), p.stride(), p.shape, p.dtype)


def many_small(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """W2-like: a staged run of 300 equal tensors (``300 * 257 >= MERGE``) and merged ones."""
    assert MERGE <= 300 * 257
    g = torch.Generator().manual_seed(0)
    sizes = [(257,)] * 300 + [(3,)] * 20 + [(2, 5)] * 3
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in sizes]


def large(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Direct params (contiguous, ``>= DIRECT`` elements, at offset 0), a transposed one and
    one at a storage offset (staged), and a bias."""
    g = torch.Generator().manual_seed(1)
    out = [
        torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))
        for s in [(200, 200), (DIRECT + 5,), (200, 200), (64,)]
    ]
    out.append(torch.nn.Parameter(torch.randn(300, 120, generator=g).to(dtype).t()))
    base = torch.randn(DIRECT + 7, generator=g).to(dtype)
    out.append(torch.nn.Parameter(base[7:]))
    return out


KINDS = {"many_small": many_small, "large": large}


def train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    """Steps with fresh gradients, gradients zeroed in place, and a param skipping a step."""
    for t in range(steps):
        g = torch.Generator().manual_seed(10 + t)
        for i, p in enumerate(params):
            grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)
            if t == 2 and i == 0:
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=t % 2 == 0)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_params_keep_their_storage(kind: str, dtype: torch.dtype) -> None:
    params = KINDS[kind](dtype)
    before = [identity(p) for p in params]
    initial = [p.detach().clone() for p in params]
    aliases = [p.data for p in params]  # e.g. an EMA helper's, a CUDA graph's
    detached = [p.detach() for p in params]
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0)
    train(opt, params, 5)
    assert [identity(p) for p in params] == before
    for i, (p, x) in enumerate(zip(params, initial, strict=True)):
        assert not torch.equal(p.detach(), x), f"param {i} did not move"
    for alias in (aliases, detached):
        assert_bitwise(alias, [p.detach() for p in params])
        assert [a.data_ptr() for a in alias] == [p.data_ptr() for p in params]


@pytest.mark.parametrize("dtype", DTYPES)
def test_own_param_storage_moves_the_params(dtype: torch.dtype) -> None:
    # The opt-in mode does what its documentation says (and what the tests above rule out).
    params = many_small(dtype)[:330] + large(dtype)[:2]
    before = [identity(p) for p in params]
    aliases = [p.data for p in params]
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0, own_param_storage=True)
    train(opt, params, 2)
    after = [identity(p) for p in params]
    assert all(a[0] != b[0] for a, b in zip(after, before, strict=True))
    assert len({a[0] for a in after}) == 1  # one buffer for the whole group
    assert not torch.equal(aliases[5], params[5].detach())  # the alias went stale
    # and the fast path keeps the params there, step after step
    train(opt, params, 2)
    assert [identity(p) for p in params] == after


def tied_model(dtype: torch.dtype) -> tuple[list[torch.nn.Parameter], list[tuple[int, int]]]:
    """Params with weights tied by storage as users tie them: an encoder's weight and its
    transpose as the decoder's (``dec.weight.data = enc.weight.data.t()``; large enough for
    the direct route if it were not shared), a small embedding and an output projection on the
    same memory, and untied params around them. Returns the params and the tied pairs."""
    enc = torch.nn.Linear(64, 600, dtype=dtype)
    dec = torch.nn.Linear(600, 64, dtype=dtype)
    dec.weight.data = enc.weight.data.t()
    emb = torch.nn.Parameter(torch.randn(10, 8).to(dtype))
    out = torch.nn.Parameter(emb.data)
    params = [enc.weight, enc.bias, emb, dec.weight, dec.bias, out]
    assert enc.weight.numel() >= DIRECT
    return params, [(0, 3), (2, 5)]


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "generic"])
def test_tied_weights_stay_tied_and_add_both_updates(dtype: torch.dtype, flat: bool) -> None:
    # Each step, from the optimizer's own params and state (teacher-forced; norm-exact data as in
    # test_flat_dreamerv3): the shared memory becomes p + u_a + u_b, each tied param's update
    # computed from the values before the step, added in the group's order (the generic path's
    # sequential adds): within one step's roundings of each update and the two sums (and one
    # rounding to bfloat16), relative to the terms.
    params, pairs = tied_model(dtype)
    before_ids = [identity(p) for p in params]
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0, agc=0.3)
    opt.flat_step = flat
    for t in range(1, 5):
        with torch.no_grad():
            for i in (0, 1, 2, 4):  # the tied pairs' memory set through one of the two
                params[i].copy_(signs(params[i], 100 * t + i) * 2.0 ** -(2 + i % 3))
        for i, p in enumerate(params):
            p.grad = (signs(p, 7000 + 100 * t + i) * 2.0 ** -(1 + (i + t) % 4)).to(dtype)
        state = [
            {k: opt.state[p][k].clone() for k in ("rms", "momentum")} if p in opt.state else None
            for p in params
        ]
        values = [p.detach().clone() for p in params]
        grads = [p.grad.detach().clone() for p in params]
        opt.step()
        group = opt.param_groups[0]
        want = []
        for p, g, s in zip(values, grads, state, strict=True):
            zeros = torch.zeros_like(p, dtype=torch.float64)
            nu, mu = (zeros, zeros) if s is None else (s["rms"], s["momentum"])
            want.append(oracle(p, g, nu, mu, t, group))
        wide = torch.float32
        for a, b in pairs:
            # b's view of the memory in a's layout (the transpose, or the same shape)
            as_a = (lambda x: x) if params[b].shape == params[a].shape else (lambda x: x.t())
            expected = want[a]["p"] + as_a(want[b]["p"] - values[b].double())
            scale = want[a]["p_mag"] + as_a(want[b]["p_mag"] - values[b].double().abs())
            ops = {wide: STEP_OPS + 2} | ({dtype: 1} if dtype != wide else {})
            assert_close_rounding(
                params[a].detach(),
                expected,
                dtype=wide,
                ops=ops,
                scale=scale,
                check_dtype=False,
                msg=f"tied {a}/{b} step {t}",
            )
            assert params[b].data_ptr() == params[a].data_ptr()  # still one memory
        for i, p in enumerate(params):
            for k, name in (("nu", "rms"), ("mu", "momentum")):
                assert_close_rounding(
                    opt.state[p][name],
                    want[i][k],
                    dtype=wide,
                    ops=STEP_OPS,
                    scale=want[i][f"{k}_mag"],
                    check_dtype=False,
                    msg=f"{name} of param {i} step {t}",
                )
    assert [identity(p) for p in params] == before_ids


@pytest.mark.parametrize("own", [False, True], ids=["default", "own_param_storage"])
def test_safetensors_round_trip_after_steps(tmp_path: Path, own: bool) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 600), torch.nn.Tanh(), torch.nn.Linear(600, 10)
        )

    net = model(0)
    opt = DreamerV3Optimizer(net.parameters(), lr=1e-2, warmup_steps=0, own_param_storage=own)
    x = torch.randn(32, 64)
    for _ in range(3):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path / "model.safetensors"
    if own:  # the documented consequence: safetensors refuses tensors sharing a storage
        with pytest.raises(RuntimeError, match=r"share memory|shared|storage"):
            safetensors_torch.save_model(net, str(path))
        return
    safetensors_torch.save_model(net, str(path))
    restored = model(1)
    missing, unexpected = safetensors_torch.load_model(restored, str(path))
    assert not missing and not unexpected
    assert_bitwise(dict(restored.state_dict()), dict(net.state_dict()))


@pytest.mark.parametrize("own", [False, True], ids=["default", "own_param_storage"])
def test_torch_save_of_one_param_writes_that_param(own: bool) -> None:
    params = large(torch.float32) + many_small(torch.float32)
    opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0, own_param_storage=own)
    train(opt, params, 2)
    total = sum(p.numel() * p.element_size() for p in params)
    for p in (params[3], params[0], params[-1]):  # a merged bias, a direct and a staged param
        buffer = io.BytesIO()
        torch.save(p, buffer)
        size = len(buffer.getvalue())
        if own:
            assert size >= total  # the documented consequence: the whole flat buffer
        else:
            assert size <= p.numel() * p.element_size() + 2048
        buffer.seek(0)
        assert_bitwise(torch.load(buffer, weights_only=True).detach(), p.detach())
