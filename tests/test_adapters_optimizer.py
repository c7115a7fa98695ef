"""TransformOptimizer and DreamerV3Optimizer: parity with torchrl 0.14.1, torch.optim and the pure
core; LR schedulers; checkpoints; skipped params; errors."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import functional_opt as fo
from functional_opt.adapters import DreamerV3Optimizer, TransformOptimizer

torchrl_algorithms = pytest.importorskip("torchrl.trainers.algorithms")
TorchRLDreamerV3Optimizer = torchrl_algorithms.DreamerV3Optimizer

Factory = Callable[..., torch.optim.Optimizer]


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return model.to(dtype)


def batches(dtype: torch.dtype = torch.float32, seed: int = 1) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(16, 4, generator=g).to(dtype)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    data: Iterator[torch.Tensor],
    scheduler: Any = None,
) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(next(data)).square().mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (x.double() - y.double()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def groups(model: nn.Module, grouped: bool) -> Any:
    if not grouped:
        return model.parameters()
    return [
        {"params": model[0].parameters(), "lr": 1e-2, "warmup_steps": 3, "agc": 0.0},
        {"params": model[2].parameters(), "beta1": 0.5},
    ]


DREAMER_OPTIONS = [
    {},
    {"lr": 1e-2, "warmup_steps": 0},
    {"lr": 1e-2, "warmup_steps": 5},
    {"lr": 1e-2, "warmup_steps": 0, "agc": 0.0},
    {
        "lr": 3e-3,
        "warmup_steps": 4,
        "beta1": 0.8,
        "beta2": 0.99,
        "eps": 1e-8,
        "parameter_norm_min": 0.1,
    },
]


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("options", DREAMER_OPTIONS)
def test_dreamerv3_matches_torchrl_fp32(options: dict[str, Any], grouped: bool) -> None:
    models, opts = [], []
    for cls in (TorchRLDreamerV3Optimizer, DreamerV3Optimizer):
        model = make_model()
        opts.append(cls(groups(model, grouped), **options))
        models.append(model)
        train(model, opts[-1], 25, batches())
    assert max_diff(*models) < 1e-6
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        for key in ("rms", "momentum"):
            torch.testing.assert_close(
                opts[1].state[q][key], opts[0].state[p][key], rtol=1e-5, atol=1e-6
            )
    assert [g["step"] for g in opts[1].param_groups] == [g["step"] for g in opts[0].param_groups]


@pytest.mark.parametrize("grouped", [False, True])
def test_dreamerv3_matches_torchrl_bf16(grouped: bool) -> None:
    """torchrl rounds the momentum to bf16 before scaling by lr, we round p + u once: the
    trajectories agree to a few bf16 ulps."""
    models, opts = [], []
    for cls in (TorchRLDreamerV3Optimizer, DreamerV3Optimizer):
        model = make_model(torch.bfloat16)
        opts.append(cls(groups(model, grouped), lr=1e-2, warmup_steps=3))
        models.append(model)
        train(model, opts[-1], 20, batches(torch.bfloat16))
    assert max_diff(*models) < 2e-2
    for p in models[1].parameters():
        assert p.dtype == torch.bfloat16
        assert {k: v.dtype for k, v in opts[1].state[p].items()} == {
            "rms": torch.float32,
            "momentum": torch.float32,
        }


def test_dreamerv3_per_group_counters_match_torchrl() -> None:
    """A group added later starts its own counter (and warm-up) at 0."""
    models, opts = [], []
    for cls in (TorchRLDreamerV3Optimizer, DreamerV3Optimizer):
        model = make_model()
        opt = cls(model[0].parameters(), lr=1e-2, warmup_steps=4)
        data = batches()
        train(model, opt, 5, data)
        opt.add_param_group({"params": model[2].parameters(), "lr": 5e-3})
        train(model, opt, 10, data)
        models.append(model)
        opts.append(opt)
    assert [g["step"] for g in opts[1].param_groups] == [15, 10]
    assert max_diff(*models) < 1e-6


def test_dreamerv3_matches_pure_transform() -> None:
    model = make_model()
    opt = DreamerV3Optimizer(model.parameters(), lr=1e-2, warmup_steps=3, agc=0.2)
    reference = make_model()
    params = {k: v.detach().clone() for k, v in reference.named_parameters()}
    tx = fo.dreamerv3(lr=1e-2, warmup=3, agc=0.2)
    state = tx.init(params)
    data = batches()
    for _ in range(25):
        x = next(data)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        grads = torch.func.grad(
            lambda p, x=x: torch.func.functional_call(reference, p, (x,)).square().mean()
        )(params)
        updates, state = tx.update(grads, state, params)
        params = fo.apply_updates(params, updates)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], rtol=0, atol=1e-6)


def test_transform_optimizer_bit_matches_pure_bf16() -> None:
    """Same transform, same gradients: the in-place step is apply_updates, bit for bit."""
    model = make_model(torch.bfloat16)
    opt = TransformOptimizer(model.parameters(), fo.dreamerv3(lr=1e-2, warmup=0))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = fo.dreamerv3(lr=1e-2, warmup=0)
    state = tx.init(params)
    data = batches(torch.bfloat16)
    for _ in range(10):
        opt.zero_grad()
        model(next(data)).square().mean().backward()
        grads = {k: v.grad.clone() for k, v in model.named_parameters()}
        opt.step()
        updates, state = tx.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), params[name])


TORCH_PAIRS: list[tuple[str, Factory, Factory]] = [
    (
        "adam",
        lambda p: TransformOptimizer(p, fo.adam, lr=1e-2),
        lambda p: torch.optim.Adam(p, lr=1e-2),
    ),
    (
        "adam-betas",
        lambda p: TransformOptimizer(p, fo.adam, lr=3e-3, b1=0.8, b2=0.95, eps=1e-6),
        lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.95), eps=1e-6),
    ),
    (
        "adamw",
        lambda p: TransformOptimizer(p, fo.adamw, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ),
    (
        "sgd-momentum",
        lambda p: TransformOptimizer(p, fo.sgd, lr=1e-2, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    ),
    (
        "sgd-nesterov",
        lambda p: TransformOptimizer(p, fo.sgd, lr=1e-2, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    ),
    (
        "sgd",
        lambda p: TransformOptimizer(p, fo.sgd, lr=1e-1),
        lambda p: torch.optim.SGD(p, lr=1e-1),
    ),
]


@pytest.mark.parametrize(("name", "ours", "theirs"), TORCH_PAIRS, ids=[t[0] for t in TORCH_PAIRS])
def test_matches_torch_optim(name: str, ours: Factory, theirs: Factory) -> None:
    a, b = make_model(), make_model()
    train(a, ours(a.parameters()), 50, batches())
    train(b, theirs(b.parameters()), 50, batches())
    assert max_diff(a, b) < 1e-6


def test_adamw_mask_matches_torch_param_groups() -> None:
    a, b = make_model(), make_model()
    ours = TransformOptimizer(
        a.parameters(),
        fo.adamw,
        lr=1e-2,
        weight_decay=0.5,
        mask=lambda params: [p.dim() > 1 for p in params],
    )
    decay = [p for p in b.parameters() if p.dim() > 1]
    rest = [p for p in b.parameters() if p.dim() <= 1]
    theirs = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.5
    )
    b_order = [*decay, *rest]
    a_order = [p for p in a.parameters() if p.dim() > 1] + [
        p for p in a.parameters() if p.dim() <= 1
    ]
    train(a, ours, 30, batches())
    train(b, theirs, 30, batches())
    for x, y in zip(a_order, b_order, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


SCHEDULERS: list[tuple[str, Callable[[torch.optim.Optimizer], Any]]] = [
    ("lambda", lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t))),
    ("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5)),
    ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20)),
    (
        "onecycle",
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=5e-2, total_steps=40, cycle_momentum=False
        ),
    ),
]


@pytest.mark.parametrize(("name", "make_scheduler"), SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_lr_schedulers_match_torch_adam(name: str, make_scheduler: Any) -> None:
    a, b = make_model(), make_model()
    ours = TransformOptimizer(a.parameters(), fo.adam, lr=1e-2)
    theirs = torch.optim.Adam(b.parameters(), lr=1e-2)
    sa, sb = make_scheduler(ours), make_scheduler(theirs)
    train(a, ours, 40, batches(), sa)
    train(b, theirs, 40, batches(), sb)
    assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
    assert max_diff(a, b) < 1e-6


def test_lr_scheduler_dreamerv3_matches_pure_lr_sequence() -> None:
    model = make_model()
    opt = DreamerV3Optimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3)
    reference = make_model()
    params = {k: v.detach().clone() for k, v in reference.named_parameters()}
    tx = fo.inject_hyperparams(fo.dreamerv3)(lr=1e-2, warmup=2)
    state = tx.init(params)
    data = batches()
    for _ in range(12):
        lr = opt.param_groups[0]["lr"]
        x = next(data)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        scheduler.step()
        grads = torch.func.grad(
            lambda p, x=x: torch.func.functional_call(reference, p, (x,)).square().mean()
        )(params)
        state.hyperparams["lr"] = torch.tensor(lr)
        updates, state = tx.update(grads, state, params)
        params = fo.apply_updates(params, updates)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], rtol=0, atol=1e-6)


def _dreamer(params: Any) -> torch.optim.Optimizer:
    return DreamerV3Optimizer(params, lr=1e-2, warmup_steps=3)


def _adam(params: Any) -> torch.optim.Optimizer:
    return TransformOptimizer(params, fo.adam, lr=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make_opt", [_dreamer, _adam], ids=["dreamerv3", "adam"])
def test_checkpoint_resume_is_bit_exact(make_opt: Factory, dtype: torch.dtype) -> None:
    straight = make_model(dtype)
    opt = make_opt(straight.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    data = batches(dtype)
    train(straight, opt, 6, data, sched)
    buffer = io.BytesIO()
    torch.save(
        {"model": straight.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
        buffer,
    )
    train(straight, opt, 6, data, sched)

    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    resumed = make_model(dtype, seed=5)
    opt2 = make_opt(resumed.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=4, gamma=0.5)
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    data = batches(dtype)
    for _ in range(6):
        next(data)
    train(resumed, opt2, 6, data, sched2)
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == opt2.state[q].keys()
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
            assert opt.state[p][key].dtype == opt2.state[q][key].dtype


@pytest.mark.parametrize("direction", ["torchrl->ours", "ours->torchrl"])
def test_checkpoints_interchange_with_torchrl(direction: str) -> None:
    first, second = (
        (TorchRLDreamerV3Optimizer, DreamerV3Optimizer)
        if direction == "torchrl->ours"
        else (DreamerV3Optimizer, TorchRLDreamerV3Optimizer)
    )
    a = make_model()
    opt_a = first(a.parameters(), lr=1e-2, warmup_steps=5)
    data = batches()
    train(a, opt_a, 4, data)
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    b = copy.deepcopy(a)
    opt_b = second(b.parameters(), lr=1e-2, warmup_steps=5)
    buffer.seek(0)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))
    rest = list(zip(range(8), data, strict=False))
    train(a, opt_a, 8, iter(x for _, x in rest))
    train(b, opt_b, 8, iter(x for _, x in rest))
    assert max_diff(a, b) < 1e-6


def test_skipped_params_and_state_untouched() -> None:
    model = nn.ModuleDict(
        {"used": nn.Linear(3, 2), "frozen": nn.Linear(3, 2), "unused": nn.Linear(3, 2)}
    )
    model["frozen"].requires_grad_(False)
    opt = TransformOptimizer(model.parameters(), fo.adam, lr=1e-2)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.ones(4, 3)
    for _ in range(3):
        opt.zero_grad()
        (model["used"](x) + model["frozen"](x)).sum().backward()
        opt.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == name.startswith("used")
        assert (p in opt.state) == name.startswith("used")
    # A param that has state but no gradient this step: params and state stay, counters advance.
    weight = model["used"].weight
    state_before = {k: v.clone() for k, v in opt.state[weight].items()}
    value_before = weight.detach().clone()
    opt.zero_grad()
    model["used"](x).sum().backward()
    weight.grad = None
    opt.step()
    assert torch.equal(weight, value_before)
    for key, value in opt.state[weight].items():
        assert torch.equal(value, state_before[key])
    assert int(opt.param_groups[0]["transform_state"]["count"]) == 4
    # Params without state round-trip through checkpoints and copies.
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin_model, twin = copy.deepcopy((model, opt))
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    assert len(twin.state) == len(opt.state) == 2
    opt.zero_grad()
    twin.zero_grad()
    model["used"](x).sum().backward()
    twin_model["used"](x).sum().backward()
    opt.step()
    twin.step()
    assert max_diff(model, twin_model) == 0


def test_no_gradient_raises_and_closure_returns_loss() -> None:
    model = make_model()
    for opt in (
        DreamerV3Optimizer(model.parameters()),
        TransformOptimizer(model.parameters(), fo.adam, lr=1e-3),
    ):
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="gradient"):
            opt.step()
        x = torch.ones(2, 4)

        def closure(opt: torch.optim.Optimizer = opt, x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss

        with torch.no_grad():
            loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.requires_grad


def test_transform_optimizer_layout_and_group_counters() -> None:
    model = make_model()
    opt = TransformOptimizer(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}],
        fo.adam,
        lr=1e-2,
    )
    train(model, opt, 3, batches())
    model[0].weight.grad = None
    model[0].bias.grad = None
    opt.step()  # group 0 has no gradient: its counters still advance (None = no gradient)
    assert set(opt.state[model[0].weight]) == {"mu", "nu"}
    assert opt.param_groups[1]["lr"] == 1e-3
    for group in opt.param_groups:
        assert {k: int(v) for k, v in group["transform_state"].items()} == {
            "count": 4,
            "0.count": 4,
        }
    opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    assert int(opt.param_groups[2]["transform_state"]["count"]) == 0


def test_plain_transform_and_deepcopy() -> None:
    model = make_model()
    opt = TransformOptimizer(
        model.parameters(), fo.chain(fo.clip_by_global_norm(1.0), fo.sgd(0.1, momentum=0.5))
    )
    train(model, opt, 2, batches())
    twin_model, twin = copy.deepcopy((model, opt))
    data = batches(seed=3)
    xs = [next(data) for _ in range(3)]
    train(model, opt, 3, iter(xs))
    train(twin_model, twin, 3, iter(xs))
    assert max_diff(model, twin_model) == 0


def test_bad_arguments() -> None:
    params = list(make_model().parameters())
    for bad in (
        {"lr": -1.0},
        {"beta1": 1.0},
        {"beta2": -0.1},
        {"eps": -1.0},
        {"agc": -0.3},
        {"parameter_norm_min": -1.0},
        {"warmup_steps": -1},
    ):
        with pytest.raises(ValueError):
            DreamerV3Optimizer(params, **bad)
        with pytest.raises(ValueError):
            DreamerV3Optimizer([{"params": params, **bad}])
    with pytest.raises(ValueError):
        TransformOptimizer(params, fo.adam, lr=1e-3, b1=1.5)
    with pytest.raises(TypeError):
        TransformOptimizer(params, fo.adam, lr=1e-3, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="lr"):
        TransformOptimizer(params, fo.adam)  # no learning rate anywhere
    with pytest.raises(TypeError, match="factory"):
        TransformOptimizer(params, fo.adam(1e-3), lr=1e-3)  # a built transform takes no options
    opt = TransformOptimizer(params, fo.adam, lr=1e-3)
    wrong = TransformOptimizer(params, fo.sgd, lr=1e-3, momentum=0.9)
    params[0].grad = torch.ones_like(params[0])
    wrong.step()
    with pytest.raises(ValueError):
        opt.load_state_dict(wrong.state_dict())


def test_load_state_dict_checks_before_changing_anything() -> None:
    model = make_model()
    opt = TransformOptimizer(model.parameters(), fo.adam, lr=1e-2)
    train(model, opt, 2, batches())
    good = copy.deepcopy(opt.state_dict())
    before = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    bad = copy.deepcopy(good)
    bad["state"][1]["m"] = bad["state"][1].pop("mu")
    with pytest.raises(ValueError, match="unexpected state"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["transform_state"]["count"] = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad)
    for p, s in opt.state.items():
        assert s.keys() == before[p].keys()
        assert all(torch.equal(s[k], before[p][k]) for k in s)
    opt.load_state_dict(good)  # loaded tensors are copies, not the checkpoint's
    assert all(
        opt.state[p]["mu"] is not v["mu"]
        for p, v in zip(model.parameters(), good["state"].values(), strict=True)
    )


def test_torch_distributed_checkpoint_round_trip(tmp_path: Any) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    sd_api = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    for flatten in (False, True):
        options = sd_api.StateDictOptions(flatten_optimizer_state_dict=flatten)
        a = make_model()
        opt_a = DreamerV3Optimizer(a.parameters(), lr=1e-2, warmup_steps=4)
        data = batches()
        train(a, opt_a, 3, data)
        path = tmp_path / f"ckpt-{flatten}"
        with warnings.catch_warnings():  # "torch.distributed is unavailable": one process
            warnings.simplefilter("ignore")
            dcp.save(
                {"optim": sd_api.get_optimizer_state_dict(a, opt_a, options=options)},
                checkpoint_id=path,
            )
        b = make_model(seed=3)
        b.load_state_dict(a.state_dict())
        opt_b = DreamerV3Optimizer(b.parameters(), lr=1e-2, warmup_steps=4)
        target = {"optim": sd_api.get_optimizer_state_dict(b, opt_b, options=options)}
        with warnings.catch_warnings():  # "torch.distributed is unavailable": one process
            warnings.simplefilter("ignore")
            dcp.load(target, checkpoint_id=path)
        sd_api.set_optimizer_state_dict(b, opt_b, target["optim"], options=options)
        assert opt_b.param_groups[0]["step"] == 3
        xs = [next(data) for _ in range(3)]
        train(a, opt_a, 3, iter(xs))
        train(b, opt_b, 3, iter(xs))
        assert max_diff(a, b) == 0


def test_option_aliases_masks_and_static_changes() -> None:
    params = list(make_model().parameters())
    opt = TransformOptimizer(params, fo.adam, learning_rate=1e-3)
    assert opt.param_groups[0]["lr"] == 1e-3 and "learning_rate" not in opt.param_groups[0]
    with pytest.raises(TypeError):
        TransformOptimizer(params, fo.adam, lr=1e-3, learning_rate=1e-3)
    mask = [p.dim() > 1 for p in params]
    a, b = make_model(), make_model()
    listed = TransformOptimizer(a.parameters(), fo.adamw, lr=1e-2, weight_decay=0.5, mask=mask)
    called = TransformOptimizer(
        b.parameters(),
        fo.adamw,
        lr=1e-2,
        weight_decay=0.5,
        mask=lambda ps: [p.dim() > 1 for p in ps],
    )
    train(a, listed, 5, batches())
    train(b, called, 5, batches())
    assert max_diff(a, b) == 0
    # A non-numeric option changed mid-run takes effect on the next step, as in torch.optim.
    a, b = make_model(), make_model()
    ours = TransformOptimizer(a.parameters(), fo.sgd, lr=1e-2, momentum=0.9)
    theirs = torch.optim.SGD(b.parameters(), lr=1e-2, momentum=0.9)
    data_a, data_b = batches(), batches()
    train(a, ours, 5, data_a)
    train(b, theirs, 5, data_b)
    ours.param_groups[0]["nesterov"] = True
    theirs.param_groups[0]["nesterov"] = True
    train(a, ours, 5, data_a)
    train(b, theirs, 5, data_b)
    assert max_diff(a, b) < 1e-6


@pytest.mark.parametrize("kind", ["flat", "generic", "plain transform"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_never_writes_the_gradients(kind: str, dtype: torch.dtype) -> None:
    # Large enough for the compiled kernels, which may overwrite donated updates.
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 300, generator=gen).to(dtype)) for _ in range(2)]
    opt: torch.optim.Optimizer
    if kind == "plain transform":  # no injected hyperparameters: dreamerv3's kernel path
        opt = TransformOptimizer(params, fo.dreamerv3(1e-2, warmup=0))
    else:
        opt = DreamerV3Optimizer(params, lr=1e-2, warmup_steps=0)
        opt.flat_step = kind == "flat"
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        opt.step()
        for p, g in zip(params, before, strict=True):
            assert torch.equal(p.grad, g)  # type: ignore[arg-type]
