"""TransformOptimizer and DreamerV3Optimizer: parity with torchrl 0.14.1, torch.optim and the pure
core; LR schedulers; checkpoints; skipped params; errors.

Parity with another implementation is checked step by step (:class:`Lockstep`): both take one
step from the same params on the same batch, their results must agree to the rounding bound of
``tests/conftest.py``, then the second is reset to the first's params (each keeps its own
state), so a trajectory's sensitivity to rounding never enters the comparison. Only the tests
that compare against torchrl need it installed.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import (
    ELEMENTWISE_OPS,
    MagnitudeRun,
    Ops,
    assert_bitwise,
    assert_close_rounding,
    dreamerv3_leaf_ops,
    rounding_bound,
)
from torch import nn

import functional_opt as fo
from functional_opt.adapters import DreamerV3Optimizer, TransformOptimizer

Factory = Callable[..., torch.optim.Optimizer]


@pytest.fixture
def torchrl_dreamerv3() -> Any:
    """torchrl's DreamerV3Optimizer (the tests that compare with it skip without torchrl)."""
    return pytest.importorskip("torchrl.trainers.algorithms").DreamerV3Optimizer


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


def same_params(a: nn.Module, b: nn.Module) -> None:
    assert_bitwise([p.detach() for p in a.parameters()], [p.detach() for p in b.parameters()])


class Lockstep:
    """Optimizers ``a`` and ``b`` over twin models, stepped together: each step both take the
    same batch from the same params (so the same gradients), their new params (and, with
    ``states``, their state tensors under the same keys) agree to the rule's bound for ``ops``
    (a count, or a function of the leaf), and ``b``'s params are reset to ``a``'s. ``m``, the
    same kind of optimizer as ``a`` over a float64 twin, steps on the absolute values of the
    params and gradients: its steps are the magnitudes of the terms each update sums (the
    rule's scale; the magnitude of a new param is ``|p| + |step|``)."""

    def __init__(
        self,
        make_a: Callable[[nn.Module], torch.optim.Optimizer],
        make_b: Callable[[nn.Module], torch.optim.Optimizer],
        make_m: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
        dtype: torch.dtype = torch.float32,
        states: bool = False,
    ) -> None:
        self.dtype, self.states = dtype, states
        self.models = (make_model(dtype), make_model(dtype), make_model(torch.float64))
        self.opts = [
            make(model)
            for make, model in zip((make_a, make_b, make_m or make_a), self.models, strict=True)
        ]
        self.steps = 0

    def params(self, k: int) -> list[nn.Parameter]:
        return list(self.models[k].parameters())

    def step(self, x: torch.Tensor, ops: Ops | Callable[[torch.Tensor], Ops]) -> None:
        (a, b, m), (opt_a, opt_b, opt_m) = self.models, self.opts
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
        before = [p.detach().clone() for p in a.parameters()]
        grads = [p.grad for p in a.parameters()]
        assert_bitwise([p.grad for p in b.parameters()], grads)  # same params, same gradients
        with torch.no_grad():
            for pm, p, g in zip(m.parameters(), before, grads, strict=True):
                pm.copy_(p.abs())
                pm.grad = None if g is None else g.abs().to(torch.float64)
        opt_a.step()
        opt_b.step()
        opt_m.step()
        self.steps += 1
        for pa, pb, pm, p in zip(
            a.parameters(), b.parameters(), m.parameters(), before, strict=True
        ):
            scale = p.abs().to(torch.float64) + (pm.detach() - p.abs().to(torch.float64)).abs()
            what = f"step {self.steps}"
            assert_close_rounding(
                pb.detach(), pa.detach(), dtype=self.dtype, ops=ops, scale=scale, msg=what
            )
            if self.states:
                assert opt_b.state[pb].keys() == opt_a.state[pa].keys()
                for key in opt_a.state[pa]:
                    assert_close_rounding(
                        opt_b.state[pb][key],
                        opt_a.state[pa][key],
                        dtype=self.dtype,
                        ops=ops,
                        scale=opt_m.state[pm][key].abs(),
                        msg=f"{what}: state[{key!r}]",
                    )
            with torch.no_grad():
                pb.copy_(pa)

    def add_param_group(self, k: int, options: dict[str, Any]) -> None:
        """Adds the ``k``-th layer of each model as a new group to its optimizer."""
        for model, opt in zip(self.models, self.opts, strict=True):
            opt.add_param_group({"params": model[k].parameters(), **options})


def adam_like_ops(steps: int) -> float:
    """torch.optim's Adam/AdamW/SGD vs ours: each carries its moments (errors add up over the
    steps), then the add to the param (1)."""
    return steps * ELEMENTWISE_OPS + 1


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
def test_dreamerv3_matches_torchrl_fp32(
    options: dict[str, Any], grouped: bool, torchrl_dreamerv3: Any
) -> None:
    run = Lockstep(
        lambda m: DreamerV3Optimizer(groups(m, grouped), **options),
        lambda m: torchrl_dreamerv3(groups(m, grouped), **options),
        states=True,
    )
    data = batches()
    for t in range(25):
        run.step(next(data), dreamerv3_leaf_ops(torch.float32, steps=t + 1, apply=True))
    assert {k: v for k, v in run.opts[0].state[run.params(0)[0]].items()}.keys() == {
        "rms",
        "momentum",
    }
    steps = [[g["step"] for g in opt.param_groups] for opt in run.opts[:2]]
    assert steps[0] == steps[1]


@pytest.mark.parametrize("grouped", [False, True])
def test_dreamerv3_matches_torchrl_bf16(grouped: bool, torchrl_dreamerv3: Any) -> None:
    """torchrl rounds the momentum to bf16 before scaling by lr, we round p + u once: each step
    agrees to the rule's bfloat16 count."""
    run = Lockstep(
        lambda m: DreamerV3Optimizer(groups(m, grouped), lr=1e-2, warmup_steps=3),
        lambda m: torchrl_dreamerv3(groups(m, grouped), lr=1e-2, warmup_steps=3),
        dtype=torch.bfloat16,
        states=True,
    )
    data = batches(torch.bfloat16)
    for t in range(20):
        run.step(next(data), dreamerv3_leaf_ops(torch.bfloat16, steps=t + 1, apply=True))
    for p in run.params(0):
        assert p.dtype == torch.bfloat16
        assert {k: v.dtype for k, v in run.opts[0].state[p].items()} == {
            "rms": torch.float32,
            "momentum": torch.float32,
        }


def test_dreamerv3_per_group_counters_match_torchrl(torchrl_dreamerv3: Any) -> None:
    """A group added later starts its own counter (and warm-up) at 0."""
    run = Lockstep(
        lambda m: DreamerV3Optimizer(m[0].parameters(), lr=1e-2, warmup_steps=4),
        lambda m: torchrl_dreamerv3(m[0].parameters(), lr=1e-2, warmup_steps=4),
        states=True,
    )
    data = batches()
    for t in range(15):
        if t == 5:
            run.add_param_group(2, {"lr": 5e-3})
        run.step(next(data), dreamerv3_leaf_ops(torch.float32, steps=t + 1, apply=True))
    assert [g["step"] for g in run.opts[0].param_groups] == [15, 10]
    assert [g["step"] for g in run.opts[1].param_groups] == [15, 10]


def _against_pure(
    opt: torch.optim.Optimizer,
    model: nn.Module,
    tx: fo.GradientTransformation,
    steps: int,
    before_step: Callable[[int, Any], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> None:
    """``opt`` over ``model`` and the pure ``tx`` step by step from the same params and
    gradients (each with its own state): the rule's dreamerv3 count after the add."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    magnitudes = MagnitudeRun(tx, params)
    data = batches()
    for t in range(steps):
        if before_step is not None:
            before_step(t, state)
        opt.zero_grad()
        model(next(data)).square().mean().backward()
        grads = {k: v.grad.clone() for k, v in model.named_parameters()}  # type: ignore[union-attr]
        opt.step()
        if after_step is not None:
            after_step()
        updates, state = tx.update(grads, state, params)
        u_mag, _ = magnitudes.update(grads, params)
        want = fo.apply_updates(params, updates)
        for name, p in model.named_parameters():
            assert_close_rounding(
                p.detach(),
                want[name],
                dtype=torch.float32,
                ops=dreamerv3_leaf_ops(torch.float32, steps=t + 1, apply=True),
                scale=params[name].abs().double() + u_mag[name],
                msg=f"{name} at step {t}",
            )
        params = {k: v.detach().clone() for k, v in model.named_parameters()}


def test_dreamerv3_matches_pure_transform() -> None:
    model = make_model()
    opt = DreamerV3Optimizer(model.parameters(), lr=1e-2, warmup_steps=3, agc=0.2)
    _against_pure(opt, model, fo.dreamerv3(lr=1e-2, warmup=3, agc=0.2), 25)


@pytest.mark.parametrize("kind", ["dreamerv3-optimizer", "transform-optimizer"])
def test_forgetting_param_norms_of_plain_params_changes_nothing(kind: str) -> None:
    """``forget_param_norms`` (for sharded steps, which keep each large shard's param norm
    between steps) may be called on any optimizer, before or between steps: plain params keep
    no norms, so the steps are bit for bit those without the calls."""
    runs = []
    for forget in (False, True):
        model = make_model()
        if kind == "dreamerv3-optimizer":
            opt: Any = DreamerV3Optimizer(model.parameters(), lr=1e-2, warmup_steps=0)
        else:
            opt = TransformOptimizer(model.parameters(), fo.dreamerv3(1e-2, warmup=0))
        for k in range(3):
            if forget:
                opt.forget_param_norms()
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01 * (k + 1))
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert_bitwise(runs[1], runs[0])


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
    run = Lockstep(lambda m: ours(m.parameters()), lambda m: theirs(m.parameters()))
    data = batches()
    for t in range(50):
        run.step(next(data), adam_like_ops(t + 1))


def test_adamw_mask_matches_torch_param_groups() -> None:
    def ours(model: nn.Module) -> torch.optim.Optimizer:
        return TransformOptimizer(
            model.parameters(),
            fo.adamw,
            lr=1e-2,
            weight_decay=0.5,
            mask=lambda params: [p.dim() > 1 for p in params],
        )

    def theirs(model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() > 1]
        rest = [p for p in model.parameters() if p.dim() <= 1]
        return torch.optim.AdamW(
            [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.5
        )

    run = Lockstep(ours, theirs)
    data = batches()
    for t in range(30):
        run.step(next(data), adam_like_ops(t + 1))


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
    run = Lockstep(
        lambda m: TransformOptimizer(m.parameters(), fo.adam, lr=1e-2),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    )
    schedulers = [make_scheduler(opt) for opt in run.opts]
    data = batches()
    for t in range(40):
        run.step(next(data), adam_like_ops(t + 1))
        for scheduler in schedulers:
            scheduler.step()
        assert run.opts[0].param_groups[0]["lr"] == run.opts[1].param_groups[0]["lr"]


def test_lr_scheduler_dreamerv3_matches_pure_lr_sequence() -> None:
    model = make_model()
    opt = DreamerV3Optimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3)

    def set_lr(step: int, state: Any) -> None:  # (the magnitude run keeps lr=1e-2 >= any lr)
        state.hyperparams["lr"] = torch.tensor(opt.param_groups[0]["lr"])

    tx = fo.inject_hyperparams(fo.dreamerv3)(lr=1e-2, warmup=2)
    _against_pure(opt, model, tx, 12, before_step=set_lr, after_step=scheduler.step)


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
def test_checkpoints_interchange_with_torchrl(direction: str, torchrl_dreamerv3: Any) -> None:
    first, second = (
        (torchrl_dreamerv3, DreamerV3Optimizer)
        if direction == "torchrl->ours"
        else (DreamerV3Optimizer, torchrl_dreamerv3)
    )
    a = make_model()
    opt_a = first(a.parameters(), lr=1e-2, warmup_steps=5)
    data = batches()
    train(a, opt_a, 4, data)
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    # Both go on from the same params and the checkpoint's state: the loaded one (b) and the
    # one that saved it (a); the magnitude run (ours) from their absolute values.
    run = Lockstep(
        lambda m: second(m.parameters(), lr=1e-2, warmup_steps=5),
        lambda m: first(m.parameters(), lr=1e-2, warmup_steps=5),
        lambda m: DreamerV3Optimizer(m.parameters(), lr=1e-2, warmup_steps=5),
        states=True,
    )
    for k, (opt, model) in enumerate(zip(run.opts, run.models, strict=True)):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        if k == 2:
            for values in saved["state"].values():
                for key, value in values.items():
                    if value.is_floating_point():
                        values[key] = value.abs().to(torch.float64)
        opt.load_state_dict(saved)
        with torch.no_grad():
            for p, q in zip(model.parameters(), a.parameters(), strict=True):
                p.copy_(q.abs() if k == 2 else q)
    for t in range(8):
        run.step(next(data), dreamerv3_leaf_ops(torch.float32, steps=t + 5, apply=True))


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
    same_params(model, twin_model)


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
    same_params(model, twin_model)


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
        same_params(a, b)


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
    same_params(a, b)
    # A non-numeric option changed mid-run takes effect on the next step, as in torch.optim.
    run = Lockstep(
        lambda m: TransformOptimizer(m.parameters(), fo.sgd, lr=1e-2, momentum=0.9),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
    )
    data = batches()
    for t in range(10):
        if t == 5:
            for opt in run.opts:
                opt.param_groups[0]["nesterov"] = True
        run.step(next(data), adam_like_ops(t + 1))


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
        assert_bitwise([p.grad for p in params], before)


@pytest.mark.parametrize("fused", [True, False], ids=["engine", "per-tensor"])
def test_state_missing_since_the_last_step_is_created_again(fused: bool) -> None:
    # The step looks the state up per param only when the state table changed since the last
    # step. A param that gets its first gradient, a state dict emptied, one removed: each is
    # noticed, and that param's moments start from zero (after one step, (1 - b) g and
    # (1 - b2) g^2), while the others' keep accumulating.
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)) for _ in range(4)]
    opt = TransformOptimizer(params, fo.adam, lr=1e-2)
    opt.fused_min_numel = 0
    opt.fused_steps = fused
    grads = [torch.randn(4, 3) for _ in params]

    def step(have: list[int]) -> None:
        for i, p in enumerate(params):
            p.grad = grads[i].clone() if i in have else None
        opt.step()

    # (each side rounds at most 3 times in float32: the factor 1 - b cast, the product or the
    # square and product, the sum with a zero moment (exact); so 6 roundings between them)
    bound = rounding_bound(torch.float32, 6)

    def fresh(i: int) -> bool:
        state, g = opt.state[params[i]], grads[i]
        return all(
            bool(((got - want).abs() <= bound * want.abs()).all())
            for got, want in ((state["mu"], 0.1 * g), (state["nu"], 0.001 * g * g))
        )

    step([0, 1, 2])
    step([0, 1, 2])
    assert params[3] not in opt.state and not fresh(0)
    step([0, 1, 2, 3])  # param 3's first gradient
    assert fresh(3) and not fresh(0)
    opt.state[params[1]].clear()
    step([0, 1, 2, 3])
    assert fresh(1) and not fresh(3)
    del opt.state[params[2]]
    step([0, 1, 2, 3])
    assert fresh(2) and not fresh(1)
    step([0, 1, 2, 3])
    assert not any(fresh(i) for i in range(4))
