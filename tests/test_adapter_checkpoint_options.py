"""Callable options never reach a checkpoint (issue 15, section 3): ``state_dict()`` holds tensors
and plain data only, loads with ``torch.load(weights_only=True)``, and ``load_state_dict`` takes
the options it leaves out (a ``mask`` function) from the optimizer being loaded, as built."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import functional_opt as fo
from functional_opt.adapters import TransformOptimizer


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def data(seed: int = 1) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 4, generator=g) for _ in range(6)]


def train(model: nn.Module, opt: torch.optim.Optimizer, xs: list[Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def matrices_only(params: list[Tensor]) -> list[bool]:
    """A module-level mask function: decay the weights, not the biases."""
    return [p.dim() > 1 for p in params]


def roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_plain(value: Any, where: str = "state_dict") -> None:
    """Only tensors, numbers, strings, None and lists/tuples/dicts of them."""
    if isinstance(value, (Tensor, type(None), bool, int, float, str, torch.dtype)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_plain(v, f"{where}[{i}]")
        return
    assert isinstance(value, dict), f"{where} is a {type(value).__name__}"
    for k, v in value.items():
        assert_plain(v, f"{where}[{k!r}]")


MASKS: list[tuple[str, Callable[[list[Tensor]], list[bool]]]] = [
    ("lambda", lambda ps: [p.dim() > 1 for p in ps]),
    ("function", matrices_only),
]


@pytest.mark.parametrize("mask", [m for _, m in MASKS], ids=[n for n, _ in MASKS])
def test_a_callable_option_round_trips_through_a_weights_only_checkpoint(
    mask: Callable[[list[Tensor]], list[bool]],
) -> None:
    def build(model: nn.Module) -> TransformOptimizer:
        return TransformOptimizer(
            model.parameters(), fo.adamw, lr=1e-2, weight_decay=0.5, mask=mask
        )

    xs = data()
    model = make_model()
    opt = build(model)
    train(model, opt, xs[:3])
    checkpoint = roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    assert_plain(checkpoint["optim"])
    train(model, opt, xs[3:])  # uninterrupted

    resumed_model = make_model(seed=5)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = build(resumed_model)
    resumed.load_state_dict(checkpoint["optim"])
    assert resumed.param_groups[0]["mask"] is mask  # the optimizer's own, as built
    train(resumed_model, resumed, xs[3:])
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_live_groups_keep_their_callables() -> None:
    model = make_model()
    opt = TransformOptimizer(
        model.parameters(), fo.adamw, lr=1e-2, weight_decay=0.5, mask=matrices_only
    )
    sd = opt.state_dict()
    assert "mask" not in sd["param_groups"][0]
    assert opt.param_groups[0]["mask"] is matrices_only
    assert sd["param_groups"][0]["lr"] == 1e-2  # plain options stay


def test_a_plain_mask_is_saved_and_loaded() -> None:
    model = make_model()
    mask = [p.dim() > 1 for p in model.parameters()]
    opt = TransformOptimizer(model.parameters(), fo.adamw, lr=1e-2, weight_decay=0.5, mask=mask)
    sd = roundtrip(opt.state_dict())
    assert sd["param_groups"][0]["mask"] == mask
    other = TransformOptimizer(
        make_model().parameters(), fo.adamw, lr=1e-2, weight_decay=0.5, mask=matrices_only
    )
    other.load_state_dict(sd)
    assert other.param_groups[0]["mask"] == mask  # the checkpoint's plain value wins


def test_a_checkpoint_lacking_a_plain_option_is_refused() -> None:
    model = make_model()
    opt = TransformOptimizer(model.parameters(), fo.adamw, lr=1e-2, weight_decay=0.5)
    sd = opt.state_dict()
    del sd["param_groups"][0]["weight_decay"]
    with pytest.raises(ValueError, match="weight_decay"):
        opt.load_state_dict(sd)


def test_state_dict_hooks_see_what_is_saved_and_run_once() -> None:
    model = make_model()
    opt = TransformOptimizer(
        model.parameters(), fo.adamw, lr=1e-2, weight_decay=0.5, mask=matrices_only
    )
    train(model, opt, data()[:1])
    seen: list[str] = []

    def post(optimizer: Any, sd: dict[str, Any]) -> None:
        seen.append("save-post")
        assert_plain(sd)

    def load_pre(optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
        seen.append("load-pre")
        groups = [{**g, "lr": 0.5} for g in sd["param_groups"]]  # adapted before the checks
        return {**sd, "param_groups": groups}

    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(
        lambda o: seen.append(f"load-post {o.param_groups[0]['lr']}")
    )
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = -1.0  # refused unless the pre hook replaces it
    opt.load_state_dict(sd)
    assert seen == ["save-post", "load-pre", "load-post 0.5"]
    assert opt.param_groups[0]["mask"] is matrices_only
