"""The engine's usual step: gradients that persist between steps become bucket views, and a step
whose gradients, params and state are the ones the last step checked skips the per-param checks
(``PackedGroup.usual_grads``), while anything that changed in between takes the checked path.

Both runs of a comparison take the same compiled kernels on the same values, so they are
bit-equal (rule 1 of tests/README.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_bitwise

import functional_opt as fo
from functional_opt.adapters import TransformOptimizer


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(12, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _opt(model: torch.nn.Module, direct: bool) -> TransformOptimizer:
    opt = TransformOptimizer(
        model.parameters(), fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(1e-2, 0.9, 0.99))
    )
    opt.fused_min_numel = 0
    # a.weight (384) and b.weight (1024) on the direct route, the rest packed
    opt.direct_min_numel = 300 if direct else 2**40
    opt.direct_rest_max = 0
    return opt


def _engine(opt: TransformOptimizer):  # type: ignore[no-untyped-def]
    engine = opt._layouts[0].engine  # type: ignore[union-attr]
    assert engine not in (None, False)
    return engine


def _train(
    model: torch.nn.Module, opt: TransformOptimizer, xs: list[torch.Tensor], to_none: bool
) -> None:
    for x in xs:
        opt.zero_grad(set_to_none=to_none)
        model(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("direct", [False, True], ids=["packed", "with-direct"])
def test_persisting_gradients_become_bucket_views_and_step_the_same(direct: bool) -> None:
    """With ``zero_grad(set_to_none=False)`` the packed params' gradients are the engine's views
    of its gradient buffer from the second step on (backward accumulates into them, the step
    reads them in place and never writes them); with the default ``set_to_none=True`` they stay
    backward's own tensors. Both give the same params bit for bit."""
    torch.manual_seed(0)
    model = _Model()
    twin = copy.deepcopy(model)
    opt, twin_opt = _opt(model, direct), _opt(twin, direct)
    xs = [torch.randn(8, 12) for _ in range(5)]
    _train(model, opt, xs[:2], to_none=False)
    _train(twin, twin_opt, xs[:2], to_none=True)
    engine = _engine(opt)
    assert bool(engine.direct) == direct
    params = list(model.parameters())
    for i, p in enumerate(params):
        view = engine.grad_views[i]
        assert (p.grad is view) == (view is not None)  # a direct param's gradient stays its own
    for p, view in zip(twin.parameters(), _engine(twin_opt).grad_views, strict=True):
        assert p.grad is not view
    for x in xs[2:]:
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        opt.step()
        assert_bitwise([p.grad for p in params], grads)  # read, never written
        for i, p in enumerate(params):
            assert engine.grad_views[i] is None or p.grad is engine.grad_views[i]
    _train(twin, twin_opt, xs[2:], to_none=True)
    assert engine.usual is not None
    assert_bitwise([p.detach() for p in params], [p.detach() for p in twin.parameters()])


def test_a_usual_step_notices_what_changed_since_the_last_one() -> None:
    """After usual steps, a gradient set to ``None``, a state dict replaced by hand and a param's
    memory re-pointed each take the checked path: the param without a gradient is skipped, the
    replaced state is adopted (its values used), and a re-pointed param of another shape raises
    ``ValueError`` naming it, changing nothing."""
    torch.manual_seed(1)
    model = _Model()
    twin = copy.deepcopy(model)
    opt, ref = _opt(model, True), _opt(twin, True)
    xs = [torch.randn(8, 12) for _ in range(6)]
    _train(model, opt, xs[:3], to_none=False)
    _train(twin, ref, xs[:3], to_none=True)  # fresh gradients: every step checked
    engine = _engine(opt)
    assert engine.usual is not None

    def both(change) -> None:  # type: ignore[no-untyped-def]
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad(set_to_none=o is ref)
            m(xs[3]).pow(2).mean().backward()
            change(m, o)
            o.step()
        assert_bitwise(
            [p.detach() for p in model.parameters()], [p.detach() for p in twin.parameters()]
        )

    def no_grad(m: torch.nn.Module, o: TransformOptimizer) -> None:
        m.c.bias.grad = None

    frozen = model.c.bias.detach().clone()
    both(no_grad)
    assert_bitwise(model.c.bias.detach(), frozen)

    def replaced(m: torch.nn.Module, o: TransformOptimizer) -> None:
        p = m.a.bias
        o.state[p] = {name: value.clone().mul_(0.5) for name, value in o.state[p].items()}

    both(replaced)
    for i, p in enumerate(model.parameters()):  # the state entries are the engine's again
        for name, entries in engine.state_entries.items():
            assert opt.state[p][name] is entries[i]
    opt.zero_grad(set_to_none=False)
    model(xs[4]).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.c.bias.data = torch.zeros(5)
    with pytest.raises(ValueError, match="parameter 5 of param group 0"):
        opt.step()
    params = list(model.parameters())
    assert_bitwise([p.detach() for p in params[:5]], before[:5])
    with pytest.raises(ValueError, match="parameter 5 of param group 0"):
        opt.step()  # (still checked)
    with torch.no_grad():
        model.c.bias.data = before[5].clone()
    opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
