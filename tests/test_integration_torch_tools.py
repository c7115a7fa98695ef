"""Our optimizers with torch.optim's own tools: ``ReduceLROnPlateau``, ``swa_utils``
(``AveragedModel``, ``SWALR``), step and state-dict hooks, and ``torch.compile`` of a training
step that calls ``optimizer.step()``.

Each test runs a ``TransformOptimizer`` of a factory (``fo.adam``), a ``TransformOptimizer`` of
a ready-made chain, and ``DreamerV3Optimizer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

import functional_opt as fo
from functional_opt.adapters import DreamerV3Optimizer, TransformOptimizer

LR = 1e-2
EPS = torch.finfo(torch.float32).eps


def make_adam(params: Any) -> torch.optim.Optimizer:
    return TransformOptimizer(params, fo.adam, lr=LR)


def make_chain(params: Any) -> torch.optim.Optimizer:
    return TransformOptimizer(params, fo.chain(fo.clip_by_global_norm(1.0), fo.adam(LR)))


def make_dreamerv3(params: Any) -> torch.optim.Optimizer:
    return DreamerV3Optimizer(params, lr=LR, warmup_steps=0)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": make_adam,
    "chain": make_chain,
    "dreamerv3": make_dreamerv3,
}
KINDS = sorted(OPTIMIZERS)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.rand(16, 4, generator=g) * 4 - 2
        out.append((x, torch.sin(x[:, :1]) * x[:, 1:2]))
    return out


def backward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], scale: float = 1) -> None:
    x, y = batch
    (nn.functional.mse_loss(model(x), y) * scale).backward()


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# ReduceLROnPlateau


def train_with_lrs(kind: str, lrs: list[float] | None, metrics: list[float]) -> Any:
    """Steps on fixed batches; ``lrs``: the group lr set by hand before each step, or ``None``
    for a ``ReduceLROnPlateau`` fed ``metrics``. Returns the model and the lr of each step."""
    model = make_model()
    opt = OPTIMIZERS[kind](model.parameters())
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    used = []
    for i, batch in enumerate(data(len(metrics))):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[i]
        used.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        backward(model, batch)
        opt.step()
        if lrs is None:
            plateau.step(metrics[i])
    return model, used


@pytest.mark.parametrize("kind", KINDS)
def test_reduce_lr_on_plateau_halves_the_lr_that_drives_the_step(kind: str) -> None:
    metrics = [1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]  # no improvement after the second step
    model, lrs = train_with_lrs(kind, None, metrics)
    # patience 1: the lr halves after every second step without improvement
    assert lrs == [LR, LR, LR, LR, LR / 2, LR / 2, LR / 4]
    by_hand, _ = train_with_lrs(kind, lrs, metrics)
    assert equal(params_of(model), params_of(by_hand))  # the scheduler's writes are the lr
    constant, _ = train_with_lrs(kind, [LR] * len(metrics), metrics)
    assert not equal(params_of(model), params_of(constant))  # and the lr drives the step


# ---------------------------------------------------------------------------------------------
# Stochastic weight averaging


@pytest.mark.parametrize("kind", KINDS)
def test_swa_averaged_model_and_swalr(kind: str) -> None:
    model = make_model()
    opt = OPTIMIZERS[kind](model.parameters())
    swa_model = swa_utils.AveragedModel(model)
    swa_lr = 5e-3
    swa_sched = swa_utils.SWALR(opt, swa_lr=swa_lr, anneal_epochs=2, anneal_strategy="linear")
    reference = torch.optim.SGD(make_model().parameters(), lr=LR)  # SWALR's lrs for torch's own
    reference_sched = swa_utils.SWALR(
        reference, swa_lr=swa_lr, anneal_epochs=2, anneal_strategy="linear"
    )
    snapshots = []
    lrs, expected_lrs = [], []
    for batch in data(6):
        lrs.append(opt.param_groups[0]["lr"])
        expected_lrs.append(reference.param_groups[0]["lr"])
        opt.zero_grad()
        backward(model, batch)
        opt.step()
        swa_model.update_parameters(model)
        snapshots.append(params_of(model))
        swa_sched.step()
        reference.step()  # (no gradients: only its lr moves)
        reference_sched.step()
    assert lrs == expected_lrs and lrs[-1] == swa_lr and lrs[0] != swa_lr
    assert int(swa_model.n_averaged) == len(snapshots)

    averaged = [p.detach().clone() for p in swa_model.module.parameters()]
    for j, avg in enumerate(averaged):
        values = torch.stack([s[j].double() for s in snapshots])
        # a running mean of k float32 values: each of its k updates rounds a few times
        bound = 4 * len(snapshots) * EPS * float(values.abs().max())
        exact = values.mean(0)
        assert float((avg.double() - exact).abs().max()) <= bound
    # the average is a copy: the live params do not share its storage, and further steps of
    # the live model leave it alone
    swa_ptrs = {p.untyped_storage().data_ptr() for p in swa_model.module.parameters()}
    assert not swa_ptrs & {p.untyped_storage().data_ptr() for p in model.parameters()}
    for batch in data(2):
        opt.zero_grad()
        backward(model, batch)
        opt.step()
    assert equal(averaged, [p.detach() for p in swa_model.module.parameters()])


# ---------------------------------------------------------------------------------------------
# Hooks


@pytest.mark.parametrize("kind", KINDS)
def test_step_pre_and_post_hooks(kind: str) -> None:
    """A pre hook runs before the optimizer reads the gradients, a post hook after the update;
    removed hooks do not run."""
    model = make_model()
    opt = OPTIMIZERS[kind](model.parameters())
    seen: list[tuple[str, list[torch.Tensor]]] = []

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        assert optimizer is opt
        seen.append(("pre", params_of(model)))
        for p in model.parameters():
            assert p.grad is not None
            p.grad.mul_(2)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        assert optimizer is opt
        seen.append(("post", params_of(model)))

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    twin = make_model()
    twin_opt = OPTIMIZERS[kind](twin.parameters())
    plain = make_model()
    plain_opt = OPTIMIZERS[kind](plain.parameters())
    batches = data(4)
    for i, batch in enumerate(batches[:3]):
        before = params_of(model)
        for m, o, scale in ((model, opt, 1), (twin, twin_opt, 2), (plain, plain_opt, 1)):
            o.zero_grad()
            backward(m, batch, scale)  # twin: the doubled gradient computed by backward
            o.step()
        assert [name for name, _ in seen[2 * i :]] == ["pre", "post"]
        assert equal(seen[2 * i][1], before) and equal(seen[2 * i + 1][1], params_of(model))
    assert equal(params_of(model), params_of(twin))  # x2 is exact: bit for bit
    assert not equal(params_of(model), params_of(plain))

    for handle in handles:
        handle.remove()
    opt.zero_grad()
    backward(model, batches[3])
    opt.step()
    assert len(seen) == 6


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_hooks_and_a_load_pre_hook_that_adapts_the_checkpoint(kind: str) -> None:
    """torch's documented way to load a checkpoint whose layout differs: a load-state-dict pre
    hook rewrites it before loading. Here the checkpoint's per-param state names are changed
    (``name`` -> ``old_name``) and the hook renames them back."""
    model = make_model()
    opt = OPTIMIZERS[kind](model.parameters())
    batches = data(4)
    for batch in batches[:2]:
        opt.zero_grad()
        backward(model, batch)
        opt.step()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("save-post"))
    saved = opt.state_dict()
    assert calls == ["save-pre", "save-post"]
    old = {
        "state": {
            i: {f"old_{name}": value for name, value in entry.items()}
            for i, entry in saved["state"].items()
        },
        "param_groups": saved["param_groups"],
    }

    def rename(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append("load-pre")
        state = {
            i: {name.removeprefix("old_"): value for name, value in entry.items()}
            for i, entry in state_dict["state"].items()
        }
        return {"state": state, "param_groups": state_dict["param_groups"]}

    resumed = make_model(seed=1)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = OPTIMIZERS[kind](resumed.parameters())
    resumed_opt.register_load_state_dict_pre_hook(rename)
    resumed_opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    resumed_opt.load_state_dict(old)
    assert calls[2:] == ["load-pre", "load-post"]
    for m, o in ((model, opt), (resumed, resumed_opt)):
        for batch in batches[2:]:
            o.zero_grad()
            backward(m, batch)
            o.step()
    assert equal(params_of(model), params_of(resumed))


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_optimizer_step_compiles_nothing_more_once_running(kind: str) -> None:
    """``torch.compile`` of a function calling ``optimizer.step()`` (graph breaks allowed),
    given new gradient tensors every step (``zero_grad()`` sets them to ``None``): once the
    first steps have compiled their frames, later steps compile nothing. The state copy's
    check for a tensor that is both source and destination took each tensor's ``id()``, a
    guard on that object in dynamo's code: every step compiled that frame again."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = make_model()
    opt = OPTIMIZERS[kind](model.parameters())
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    counts = []
    for _ in range(6):
        opt.zero_grad()
        model(x).sum().backward()
        step()
        counts.append(counter.frame_count)
    assert counts[2] == counts[-1], counts


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_training_step_with_an_lr_scheduler(kind: str) -> None:
    """``torch.compile`` of forward, backward, ``optimizer.step()`` (graph breaks allowed), with
    the lr changed by a scheduler between steps, follows the same steps run eagerly."""
    torch._dynamo.reset()
    # dyadic inputs: every gradient of this linear model is exact in any summation order, so
    # the compiled and eager steps see identical gradients and differ only in the update's
    # rounding
    x = torch.tensor([[0.25, -0.5, 1.0, 0.75], [1.5, 0.5, -0.25, 2.0], [0.5, 1.0, 0.5, -1.0]])

    def setup() -> tuple[nn.Module, Any, Any]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = OPTIMIZERS[kind](model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
        return model, opt, sched

    def train_step(model: nn.Module, opt: Any) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss.detach()

    compiled_step = torch.compile(train_step)
    (a, opt_a, sched_a), (b, opt_b, sched_b) = setup(), setup()
    start = params_of(a)
    steps = 3
    for _ in range(steps):
        compiled_step(a, opt_a)
        sched_a.step()
        train_step(b, opt_b)
        sched_b.step()
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == LR / (1 + steps)
    assert not equal(params_of(a), start)
    # Per step, each element's update (at most about LR in size) goes through a few rounded
    # operations in either implementation, and adding it to the param rounds once more.
    scale = max(float(p.abs().max()) for p in params_of(b)) + LR
    for p, q in zip(params_of(a), params_of(b), strict=True):
        assert float((p - q).abs().max()) <= steps * 16 * EPS * scale
