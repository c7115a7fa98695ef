"""Every ``TransformOptimizer`` has a ``group["lr"]`` that LR schedulers read and write and that
drives the step (issue 15, section 2), a ready-made transform included; a transform whose
learning rate cannot be found is refused at construction, never run with ``lr`` ignored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import functional_opt as fo
from functional_opt.adapters import DreamerV3Optimizer, TransformOptimizer

EPS32 = torch.finfo(torch.float32).eps


def make_params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((5, 3), (3,), (7,))]


def grad_sequence(params: list[nn.Parameter], steps: int, seed: int = 1) -> list[list[Tensor]]:
    """Fixed gradients, the same for every run (they do not depend on the params)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


READY_MADE: list[tuple[str, Callable[[], fo.GradientTransformation], float]] = [
    ("clip+adam", lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-3)), 1e-3),
    ("adam", lambda: fo.adam(3e-3), 3e-3),
    ("adamw", lambda: fo.adamw(2e-3, weight_decay=0.1), 2e-3),
    ("sgd momentum", lambda: fo.sgd(0.1, momentum=0.9), 0.1),
    ("dreamerv3", lambda: fo.dreamerv3(1e-2, warmup=3), 1e-2),
    ("apply_if_finite", lambda: fo.apply_if_finite(fo.adam(4e-3), 2), 4e-3),
    ("MultiSteps", lambda: fo.MultiSteps(fo.adam(5e-3), 2).gradient_transformation(), 5e-3),
    (
        "named_chain",
        lambda: fo.named_chain(("m", fo.scale_by_adam()), ("lr", fo.scale_by_learning_rate(6e-3))),
        6e-3,
    ),
    ("trailing scale", lambda: fo.chain(fo.adam(1e-3), fo.scale(0.5)), 5e-4),
]


@pytest.mark.parametrize(
    ("make", "lr"), [(m, lr) for _, m, lr in READY_MADE], ids=[n for n, *_ in READY_MADE]
)
def test_a_ready_made_transform_has_its_learning_rate_in_every_group(
    make: Callable[[], fo.GradientTransformation], lr: float
) -> None:
    params = make_params()
    opt = TransformOptimizer([{"params": params[:2]}, {"params": params[2:], "lr": lr / 4}], make())
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr, lr / 4], rel=1e-12)
    assert opt.defaults["lr"] == pytest.approx(lr, rel=1e-12)


@pytest.mark.parametrize(
    ("make", "lr"), [(m, lr) for _, m, lr in READY_MADE], ids=[n for n, *_ in READY_MADE]
)
def test_lr_zero_freezes_the_params(
    make: Callable[[], fo.GradientTransformation], lr: float
) -> None:
    params = make_params()
    opt = TransformOptimizer(params, make())
    grads = grad_sequence(params, 4)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    opt.step()  # a first step at the built-in lr
    opt.param_groups[0]["lr"] = 0.0
    frozen = [p.detach().clone() for p in params]
    for step in grads[1:]:
        for p, g in zip(params, step, strict=True):
            p.grad = g
        opt.step()
    for p, q in zip(params, frozen, strict=True):
        assert torch.equal(p, q)


def test_lr_zero_freezes_the_params_of_factories_too() -> None:
    for make in (
        lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-2),
        lambda ps: DreamerV3Optimizer(ps, lr=1e-2, warmup_steps=0),
    ):
        params = make_params()
        opt = make(params)
        opt.param_groups[0]["lr"] = 0.0
        frozen = [p.detach().clone() for p in params]
        for step in grad_sequence(params, 3):
            for p, g in zip(params, step, strict=True):
                p.grad = g
            opt.step()
        for p, q in zip(params, frozen, strict=True):
            assert torch.equal(p, q)


SCHEDULERS: list[tuple[str, Callable[[torch.optim.Optimizer], Any]]] = [
    ("StepLR", lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)),
    ("LambdaLR", lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))),
    (
        "OneCycleLR",
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1e-2, total_steps=8, cycle_momentum=False
        ),
    ),
]


@pytest.mark.parametrize(
    "make_scheduler", [s for _, s in SCHEDULERS], ids=[n for n, _ in SCHEDULERS]
)
def test_torch_schedulers_drive_a_ready_made_transform(
    make_scheduler: Callable[[torch.optim.Optimizer], Any],
) -> None:
    """Each step equals the same transform built with the scheduler's lr of that step."""
    base = 1e-3
    params = make_params()
    opt = TransformOptimizer(params, fo.chain(fo.clip_by_global_norm(1.0), fo.adam(base)))
    scheduler = make_scheduler(opt)
    reference = [p.detach().clone() for p in params]
    state = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(base)).init(reference)
    steps = grad_sequence(params, 8)
    lrs = []
    bound_terms = 0.0
    for step in steps:
        lr = opt.param_groups[0]["lr"]
        lrs.append(lr)
        for p, g in zip(params, step, strict=True):
            p.grad = g
        opt.step()
        scheduler.step()
        tx = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(lr))  # the adam state: lr-free
        updates, state = tx.update(step, state, reference)
        reference = fo.apply_updates(reference, updates)
        # Per step the two differ by the roundings of the applied update (ours: -base cast to
        # float32 and the product, lr/base cast and its product; the reference: -lr cast and the
        # product: 6 half-ulps = 3 eps of the update) and of the two sums (eps of the param).
        bound_terms += max(
            3 * EPS32 * float(u.abs().max()) + EPS32 * float(p.abs().max())
            for u, p in zip(updates, reference, strict=True)
        )
    assert len(set(lrs)) > 2  # the scheduler did change the lr
    for p, q in zip(params, reference, strict=True):
        err = float((p.detach().double() - q.double()).abs().max())
        assert err <= bound_terms, (err, bound_terms)
    # and not what the built-in lr alone gives
    fixed = [p.detach().clone() for p in make_params()]
    fixed_state = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(base)).init(fixed)
    for step in steps:
        u, fixed_state = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(base)).update(
            step, fixed_state, fixed
        )
        fixed = fo.apply_updates(fixed, u)
    assert any(
        float((p.detach() - q).abs().max()) > 100 * bound_terms
        for p, q in zip(params, fixed, strict=True)
    )


def test_a_param_group_lr_drives_its_group() -> None:
    """A group's own lr: its step is the transform built with that lr."""
    params = make_params()
    opt = TransformOptimizer(
        [{"params": params[:1], "lr": 0.25}, {"params": params[1:]}], fo.sgd(0.5)
    )
    before = [p.detach().clone() for p in params]
    grads = [torch.ones_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    # sgd: p - lr * g; ours p + (lr / 0.5) * (-0.5 g): exact in binary for these values
    assert torch.equal(params[0].detach(), before[0] - 0.25)
    for p, b in zip(params[1:], before[1:], strict=True):
        assert torch.equal(p.detach(), b - 0.5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fo.scale_by_adam(),
        lambda: fo.adam(fo.linear_schedule(1e-3, 0.0, 10)),
        lambda: fo.masked(fo.adam(1e-3), lambda params: [True for _ in params]),
        lambda: fo.chain(fo.adam(1e-3), fo.clip(1.0)),
        lambda: fo.chain(fo.scale_by_adam(), fo.scale(0.0)),
    ],
    ids=["no-lr", "schedule", "masked", "clip-after-lr", "lr-0"],
)
def test_a_transform_without_a_findable_lr_is_refused_at_construction(
    make: Callable[[], fo.GradientTransformation],
) -> None:
    with pytest.raises(ValueError, match=r"learning rate.*TransformOptimizer\(params, fo\.adam"):
        TransformOptimizer(make_params(), make())


def test_a_factory_without_a_learning_rate_is_refused() -> None:
    with pytest.raises(TypeError, match="learning-rate argument"):
        TransformOptimizer(make_params(), fo.scale_by_adam)


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf"), "0.1", None])
def test_a_bad_lr_set_between_steps_is_refused_before_anything_changes(bad: Any) -> None:
    for make in (
        lambda ps: TransformOptimizer(ps, fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-3))),
        lambda ps: TransformOptimizer(ps, fo.adam, lr=1e-3),
        lambda ps: DreamerV3Optimizer(ps, lr=1e-3, warmup_steps=0),
    ):
        params = make_params()
        opt = make(params)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.param_groups[0]["lr"] = bad
        before = [p.detach().clone() for p in params]
        state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        with pytest.raises((ValueError, TypeError), match="lr"):
            opt.step()
        for p, b in zip(params, before, strict=True):
            assert torch.equal(p, b)
        for p, s in opt.state.items():
            for k, v in s.items():
                assert torch.equal(v, state[id(p)][k])
    with pytest.raises((ValueError, TypeError), match="lr"):
        TransformOptimizer([{"params": make_params(), "lr": bad}], fo.adam(1e-3))


def test_a_ready_made_lr_survives_a_checkpoint() -> None:
    params = make_params()
    opt = TransformOptimizer(params, fo.adam(1e-3))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in grad_sequence(params, 3):
        for p, g in zip(params, step, strict=True):
            p.grad = g
        opt.step()
        scheduler.step()
    twin = TransformOptimizer([p.detach().clone().requires_grad_() for p in params], fo.adam(1e-3))
    twin.load_state_dict(opt.state_dict())
    assert twin.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-3 / 8


def test_a_users_transform_that_declares_its_step_size_gets_an_lr() -> None:
    """``declare_step_size`` is how any transform (the library's or a user's) tells the adapter
    its learning rate; without it a user's transform is refused at construction."""

    def signed_sgd(lr: float) -> fo.GradientTransformation:
        def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            return fo.tree.map_params(lambda u: -lr * torch.sign(u), updates), state

        return fo.GradientTransformation(lambda params: fo.EmptyState(), update)

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="declares no constant step size"):
        TransformOptimizer([p], signed_sgd(0.5))
    tx = signed_sgd(0.5)
    fo.base.declare_step_size(tx.update, lambda: fo.base.StepSize(-0.5, False))
    opt = TransformOptimizer([p], tx)
    assert opt.param_groups[0]["lr"] == 0.5
    opt.param_groups[0]["lr"] = 0.25
    p.grad = torch.tensor([3.0, -1.0])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([0.75, -1.75]))
