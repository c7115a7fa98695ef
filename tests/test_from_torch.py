"""``from_torch``: torch.optim optimizers as pure transforms, checked against torch.optim itself.

Both sides run torch's kernels on the same inputs, so params, updates and state are compared bit
for bit (rule 1), except where the module's docstring says otherwise: ``p + (p_new - p)`` is
``p_new`` exactly when the subtraction is exact (Sterbenz), and within a derived bound where a
param crosses zero (rule 2, ``test_update_crossing_zero``).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
from conftest import assert_bitwise, assert_close_rounding

import functional_opt as fo
from functional_opt.adapters import TransformOptimizer
from functional_opt.torch_optim import FromTorchState, from_torch

O = torch.optim
CONFIGS = [
    pytest.param(O.Adam, {"lr": 1e-2}, id="adam"),
    pytest.param(O.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}, id="adam-amsgrad"),
    pytest.param(O.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, id="adamw"),
    pytest.param(O.SGD, {"lr": 1e-2}, id="sgd"),
    pytest.param(
        O.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, id="nesterov"
    ),
    # dampening: torch's first step copies the gradient into the buffer, later steps dampen it
    pytest.param(O.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}, id="sgd-dampening"),
    pytest.param(O.RMSprop, {"lr": 1e-2, "centered": True, "momentum": 0.5}, id="rmsprop"),
    pytest.param(O.Adagrad, {"lr": 1e-2, "lr_decay": 0.01}, id="adagrad"),
    pytest.param(O.Adamax, {"lr": 1e-2}, id="adamax"),
    pytest.param(
        O.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1}, id="nadam"
    ),
    pytest.param(O.RAdam, {"lr": 1e-2}, id="radam"),
    pytest.param(O.Adadelta, {"lr": 1.0}, id="adadelta"),
    pytest.param(O.ASGD, {"lr": 1e-2, "t0": 3}, id="asgd"),  # averaging from step 3
    pytest.param(O.Rprop, {"lr": 1e-2}, id="rprop"),
    pytest.param(O.Muon, {"lr": 1e-2}, id="muon"),
]
STEPS = 8


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    # In [1, 2] and stepped by at most ~0.2: each new value is within a factor 2 of the old,
    # so p + (p_new - p) == p_new exactly (Sterbenz) and the runs may be compared bit for bit.
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(4, 3, generator=g) + 1, "v": torch.rand(3, 5, generator=g) + 1}


def _grads(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in params.items()}


def _torch_state(opt: torch.optim.Optimizer, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    keys = {k for p in ref.values() for k in opt.state[p]}
    return {key: {n: opt.state[p][key] for n, p in ref.items()} for key in sorted(keys)}


@pytest.mark.parametrize(("cls", "kw"), CONFIGS)
def test_matches_torch_bitwise(cls: type[torch.optim.Optimizer], kw: dict[str, Any]) -> None:
    """Params, updates and state equal torch's optimizer's after every one of STEPS steps."""
    params = _params()
    ref = {k: v.clone() for k, v in params.items()}
    opt = cls(list(ref.values()), **kw)
    tx = from_torch(cls, **kw)
    state = tx.init(params)
    for step in range(STEPS):
        grads = _grads(params, step)
        for k, v in ref.items():
            v.grad = grads[k].clone()
        before = {k: v.clone() for k, v in ref.items()}
        opt.step()
        updates, state = tx.update(grads, state, params)
        assert_bitwise(updates, {k: ref[k] - before[k] for k in ref}, f"updates, step {step}")
        params = fo.apply_updates(params, updates)
        assert_bitwise(params, ref, f"params, step {step}")
        assert_bitwise({k: state.slots[k] for k in sorted(state.slots)}, _torch_state(opt, ref))


def test_update_crossing_zero() -> None:
    """Where a param crosses zero, p + (p_new - p) may round: bit for bit wherever Sterbenz's
    lemma makes the subtraction exact, within the two roundings' bound elsewhere."""
    g = torch.Generator().manual_seed(3)
    p = torch.randn(2000, generator=g) * 0.1
    grad = torch.randn(2000, generator=g)
    ref = p.clone()
    opt = O.SGD([ref], lr=0.3)
    ref.grad = grad.clone()
    opt.step()
    tx = from_torch(O.SGD, lr=0.3)
    (u,), _ = tx.update((grad,), tx.init((p,)), (p,))
    assert_bitwise(u, ref - p)  # torch's p_new, then one subtraction
    new = fo.apply_updates(p, u)
    sterbenz = (torch.sign(ref) == torch.sign(p)) & (ref.abs() <= 2 * p.abs())
    sterbenz &= p.abs() <= 2 * ref.abs()
    assert_bitwise(new[sterbenz], ref[sterbenz])
    # fl(p_new - p) errs by eps/2 |p_new - p|, and fl(p + u) by eps/2 |p + u| ~ eps/2 |p_new|:
    # one eps relative to |p_new - p| + |p_new| covers both (to first order, with room)
    assert_close_rounding(new, ref, dtype=torch.float32, ops=1, scale=(ref - p).abs() + ref.abs())


def test_none_gradient_keeps_param_and_state() -> None:
    """A param without a gradient is skipped, as torch skips one without .grad; its first
    gradient later is its first step (SGD's buffer is made from it then)."""
    kw = {"lr": 1e-2, "momentum": 0.9, "dampening": 0.3}
    params = _params()
    ref = {k: v.clone() for k, v in params.items()}
    opt = O.SGD(list(ref.values()), **kw)
    tx = from_torch(O.SGD, **kw)
    state = tx.init(params)
    for step in range(3):
        grads: dict[str, torch.Tensor | None] = dict(_grads(params, step))
        if step == 0:
            grads["v"] = None
        for k, v in ref.items():
            gk = grads[k]
            v.grad = None if gk is None else gk.clone()
        opt.step()
        updates, state = tx.update(grads, state, params)
        if step == 0:
            assert updates["v"] is None
            assert not bool(state.created["momentum_buffer"]["v"])
        params = fo.apply_updates(params, updates)
        assert_bitwise(params, ref)
        held = {k: opt.state[v]["momentum_buffer"] for k, v in ref.items() if opt.state[v]}
        assert_bitwise({k: state.slots["momentum_buffer"][k] for k in held}, held)
        assert_bitwise(state.created["momentum_buffer"], {k: torch.tensor(k in held) for k in ref})


def test_pure() -> None:
    """No argument is written, though torch's kernels write into params and state (and, for
    SGD's differentiable weight decay by a tensor that requires grad, into the gradient)."""
    params = _params()
    weight_decay = torch.tensor(0.1, requires_grad=True)
    for tx in (
        from_torch(O.Adam, lr=1e-2, amsgrad=True),
        from_torch(O.SGD, lr=1e-2, momentum=0.9, weight_decay=weight_decay, differentiable=True),
    ):
        state = tx.init(params)
        state = tx.update(_grads(params, 0), state, params)[1]
        grads = _grads(params, 1)
        copies = [
            torch.utils._pytree.tree_map(lambda x: x.detach().clone(), t)
            for t in (grads, state, params)
        ]
        tx.update(grads, state, params)
        for before, after in zip(copies, (grads, state, params), strict=True):
            assert_bitwise(torch.utils._pytree.tree_map(lambda x: x.detach(), after), before)


def test_chain_donate_and_checkpoint() -> None:
    """In a chain after clipping it is the same transform fed the clipped gradients; donation
    changes nothing; a checkpoint loaded with weights_only=True resumes the same run."""
    clip = fo.clip_by_global_norm(0.5)
    adam = from_torch(O.Adam, lr=1e-2, weight_decay=0.1)
    tx = fo.chain(clip, adam)
    params = _params()
    state = tx.init(params)
    alone_state = adam.init(params)
    for step in range(3):
        grads = _grads(params, step)
        donated = tx.update(
            {k: v.clone() for k, v in grads.items()},
            torch.utils._pytree.tree_map(torch.clone, state),
            params,
            donate=True,
        )
        updates, state = tx.update(grads, state, params)
        assert_bitwise(donated, (updates, state))
        clipped = clip.update(grads, (), params)[0]
        u, alone_state = adam.update(clipped, alone_state, params)
        assert_bitwise(u, updates)
        params = fo.apply_updates(params, updates)
    buffer = io.BytesIO()
    torch.save(fo.state_to_dict(state), buffer)
    buffer.seek(0)
    loaded = fo.state_from_dict(tx.init(params), torch.load(buffer, weights_only=True))
    assert isinstance(loaded[1], FromTorchState)
    grads = _grads(params, 9)
    assert_bitwise(tx.update(grads, loaded, params), tx.update(grads, state, params))


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(O.SGD, {"momentum": 0.9}), (O.Adam, {"weight_decay": 0.1})],
    ids=["sgd", "adam"],
)
def test_meta_gradient(cls: type[torch.optim.Optimizer], kw: dict[str, Any]) -> None:
    """torch.func.grad with respect to a tensor lr through one update equals autograd through
    torch's own differentiable optimizer (the same kernels forward and backward)."""
    params = _params()
    grads = _grads(params, 0)

    def loss(lr: torch.Tensor) -> torch.Tensor:
        tx = from_torch(cls, lr=lr, differentiable=True, **kw)
        updates, _ = tx.update(grads, tx.init(params), params)
        new = fo.apply_updates(params, updates)
        return sum((v**2).sum() for v in new.values())  # type: ignore[return-value]

    ours = torch.func.grad(loss)(torch.tensor(0.1))
    lr = torch.tensor(0.1, requires_grad=True)
    ref = {k: v.clone() for k, v in params.items()}
    opt = cls(list(ref.values()), lr=lr, differentiable=True, **kw)
    for k, v in ref.items():
        v.grad = grads[k].clone()
    opt.step()
    (expected,) = torch.autograd.grad(sum((v**2).sum() for v in ref.values()), lr)
    assert_bitwise(ours, expected)


def test_func_grad_needs_differentiable() -> None:
    params = _params()
    grads = _grads(params, 0)

    def loss(p: dict[str, torch.Tensor], tx: fo.GradientTransformation) -> torch.Tensor:
        updates, _ = tx.update(grads, tx.init(p), p)
        return fo.apply_updates(p, updates)["w"].sum()

    with pytest.raises(ValueError, match=r"from_torch\(SGD\).*differentiable=True"):
        torch.func.grad(loss)(params, from_torch(O.SGD, lr=0.1))
    with pytest.raises(ValueError, match=r"Muon has no differentiable mode"):
        torch.func.grad(loss)(params, from_torch(O.Muon, lr=0.1))


def test_vmap_ensemble() -> None:
    """An ensemble of 3 members under torch.func.vmap equals each member's own update to the
    rounding of the batched kernels (their vectorized loops may fuse a multiply-add where the
    unbatched ones round twice)."""
    tx = from_torch(O.SGD, lr=0.1, momentum=0.9)
    stacked = {k: torch.stack([_params(i)[k] for i in range(3)]) for k in ("w", "v")}
    state = torch.func.vmap(tx.init)(stacked)
    batched = torch.func.vmap(tx.update)
    state = batched(_grads(stacked, 0), state, stacked)[1]  # a non-zero momentum buffer
    grads = _grads(stacked, 1)
    updates, new_state = batched(grads, state, stacked)
    new = fo.apply_updates(stacked, updates)
    for i in range(3):
        p = {k: v[i] for k, v in stacked.items()}
        old = {k: v[i] for k, v in state.slots["momentum_buffer"].items()}
        s = FromTorchState(
            {"momentum_buffer": old},
            {"momentum_buffer": {k: v[i] for k, v in state.created["momentum_buffer"].items()}},
        )
        u, s = tx.update({k: v[i] for k, v in grads.items()}, s, p)
        # buffer 0.9 buf + g: a multiply and an add, relative to their terms' magnitudes
        terms = {k: 0.9 * old[k].abs() + grads[k][i].abs() for k in old}
        buf = {k: v[i] for k, v in new_state.slots["momentum_buffer"].items()}
        assert_close_rounding(
            buf, s.slots["momentum_buffer"], dtype=torch.float32, ops=2, scale=terms
        )
        # params p - 0.1 buf: the buffer's 2 roundings (scaled by 0.1) and the param's multiply
        # and add, relative to |p| (the largest term); p + (p_new - p) is exact here (Sterbenz)
        assert_close_rounding(
            {k: v[i] for k, v in new.items()}, fo.apply_updates(p, u), dtype=torch.float32, ops=4
        )


def test_vmap_unsupported_kernels_say_why() -> None:
    stacked = {"w": torch.rand(3, 4, 2) + 1}
    grads = {"w": torch.randn(3, 4, 2)}
    for cls, why in ((O.Adam, r"\.item\(\).*capturable=True"), (O.Rprop, "no batching rule")):
        tx = from_torch(cls, lr=0.1)
        state = torch.func.vmap(tx.init)(stacked)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's warnings about slow batching fallbacks
            with pytest.raises(RuntimeError, match=rf"{cls.__name__}.*vmap.*{why}"):
                torch.func.vmap(tx.update)(grads, state, stacked)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="Optimizer subclass"):
        from_torch(torch.nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass the class"):
        from_torch(O.Adam([torch.zeros(1, requires_grad=True)]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="closure"):
        from_torch(O.LBFGS)
    with pytest.raises(TypeError, match="betaz"):
        from_torch(O.Adam, betaz=(0.9, 0.99))
    with pytest.raises(ValueError, match=r"from_torch\(Adam\).*refuses.*learning rate"):
        from_torch(O.Adam, lr=-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        from_torch(O.SGD, nesterov=True)
    with pytest.raises(TypeError, match="options only"):
        from_torch(O.Adam, params=[])
    with pytest.raises(ValueError, match=r"\['b'\].*2D"):
        from_torch(O.Muon).init({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    tx = from_torch(O.Adam)
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    with pytest.raises(TypeError, match=r"\['w'\].*float32.*float64"):
        tx.update({"w": torch.zeros(2)}, tx.init(params), params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))
    with pytest.raises(TypeError, match="inplace"):
        tx.update(params, tx.init(params), params, inplace=True)
    with pytest.raises(TypeError, match="FromTorchState"):
        tx.update(params, fo.adam(1e-3).init(params), params)


def test_transform_optimizer_lr() -> None:
    """TransformOptimizer exposes the built lr as group["lr"] and steps as torch's optimizer;
    an optimizer whose update is not proportional to lr is refused there."""
    ws = [torch.nn.Parameter(v) for v in _params().values()]
    refs = [w.detach().clone() for w in ws]
    opt = TransformOptimizer(ws, from_torch(O.Adam, lr=1e-2, weight_decay=0.1))
    ref = O.Adam(refs, lr=1e-2, weight_decay=0.1)
    assert opt.param_groups[0]["lr"] == 1e-2
    for step in range(3):
        grads = _grads({str(i): w for i, w in enumerate(ws)}, step)
        for i, (w, r) in enumerate(zip(ws, refs, strict=True)):
            w.grad, r.grad = grads[str(i)].clone(), grads[str(i)].clone()
        opt.step()
        ref.step()
    assert_bitwise([w.detach() for w in ws], refs)
    with pytest.raises(ValueError, match=r"Rprop.*not known to be proportional"):
        TransformOptimizer(ws, from_torch(O.Rprop))
    with pytest.raises(ValueError, match=r"lr_decay=0\.1"):
        TransformOptimizer(ws, from_torch(O.Adagrad, lr_decay=0.1))


def test_packed_params() -> None:
    """On a packed tree it runs the same kernels on the same values as on the loose tree."""
    tx = from_torch(O.RMSprop, lr=1e-2, momentum=0.5)
    loose = _params()
    packed = fo.pack(loose)
    s_loose, s_packed = tx.init(loose), tx.init(packed)
    for step in range(2):
        grads = _grads(loose, step)
        u_loose, s_loose = tx.update(grads, s_loose, loose)
        u_packed, s_packed = tx.update(fo.pack(grads), s_packed, packed)
        loose = fo.apply_updates(loose, u_loose)
        packed = fo.apply_updates(packed, u_packed)
        assert_bitwise(packed.tree, loose)
    assert fo.state_to_dict(s_packed).keys() == fo.state_to_dict(s_loose).keys()
