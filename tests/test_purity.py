"""The core is pure: it works under ``torch.func.grad``, ``torch.func.vmap`` and
``torch.compile(fullgraph=True)``.

* ``grad`` through three unrolled updates equals central finite differences (float64);
* ``vmap`` of ``init``/``update`` over a stacked ensemble equals a per-member loop;
* a ``fullgraph`` compiled ``update`` equals eager and does not recompile after its second call,
  not even when an injected hyperparameter changes;
* eager ``update`` never writes into its inputs and is deterministic in them.

Where a test is one of :mod:`functional_opt.testing`'s checks (purity, vmap vs per member,
compiled vs eager) it calls that check; the harnesses here drive the cases the checks do not
(hyperparameters edited between steps, branches, per-member values).

Tolerances follow ``tests/conftest.py``'s rule: bit for bit where the same ops run; where two
paths compute the same math (vmapped vs per member, compiled vs eager), ``ops`` roundings per
update times the updates, relative to a magnitude run on absolute values. A finite-difference
check compares with its own error estimate (:func:`central_differences`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import ELEMENTWISE_OPS, MagnitudeRun, assert_bitwise, assert_close_rounding
from torch import Tensor
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import grad, vmap

import functional_opt as fo
from functional_opt.testing import (
    Fault,
    check_compile,
    check_purity,
    check_vmap,
    default_ops,
    gradient_stream,
)

Tree = Any


def step_ops(params: Tree) -> int:
    """Roundings of one update (per implementation): the longest elementwise chain plus a norm
    over at most every element of the tree (``n`` squares summed, its root and quotient)."""
    return ELEMENTWISE_OPS + sum(x.numel() for x in optree.tree_leaves(params)) + 2


def assert_paths_agree(
    actual: Tree, expected: Tree, *, steps: int, params: Tree, scale: Tree, msg: str = ""
) -> None:
    """Two paths of the same math after ``steps`` updates, each carrying its own state."""
    dtype = next(x.dtype for x in optree.tree_leaves(params) if x.is_floating_point())
    ops = steps * step_ops(params)
    assert_close_rounding(actual, expected, dtype=dtype, ops=ops, scale=scale, msg=msg)


def member(tree: Tree, i: int) -> Tree:
    """Member ``i`` of a tree stacked along dim 0."""
    return optree.tree_map(lambda x: x[i], tree)


# --------------------------------------------------------------------------------------------
# 1. torch.func.grad through unrolled updates vs central finite differences (float64)
# --------------------------------------------------------------------------------------------

F64 = torch.float64
CURVATURE = {
    "w": torch.tensor([1.0, 2.0, 0.5], dtype=F64),
    "b": torch.tensor([[1.5, 0.7], [0.3, 1.1]], dtype=F64),
}
TARGET = {
    "w": torch.tensor([0.3, -0.2, 1.0], dtype=F64),
    "b": torch.tensor([[-0.5, 0.4], [0.9, -1.2]], dtype=F64),
}
THETA0 = {
    "w": torch.tensor([1.0, -1.0, 2.0], dtype=F64),
    "b": torch.tensor([[0.5, -0.3], [1.2, 0.8]], dtype=F64),
}
UNROLL = 3
FD_EPS = 1e-6


def quadratic_loss(params: dict[str, Tensor]) -> Tensor:
    terms = [(0.5 * CURVATURE[k] * (params[k] - TARGET[k]).square()).sum() for k in sorted(params)]
    return torch.stack(terms).sum()


def unrolled_loss(
    tx: fo.GradientTransformation,
    theta0: dict[str, Tensor],
    edit_state: Callable[[Any], Any] | None = None,
) -> Tensor:
    """Meta-objective: the loss after ``UNROLL`` updates from ``theta0`` (inner gradients by
    ``torch.func.grad``, so the outer ``grad`` differentiates through them)."""
    state = tx.init(theta0)
    if edit_state is not None:
        state = edit_state(state)
    params = theta0
    for _ in range(UNROLL):
        g = grad(quadratic_loss)(params)
        updates, state = tx.update(g, state, params)
        params = fo.apply_updates(params, updates)
    return quadratic_loss(params)


def _difference(f: Callable[[Any], Tensor], x: Any, dx: Any, h: float) -> tuple[Tensor, Tensor]:
    """``(f(x + h dx) - f(x - h dx)) / 2h`` and the largest ``|f|`` it read."""
    plus, minus = f(x + h * dx), f(x - h * dx)
    return (plus - minus) / (2 * h), torch.maximum(plus.abs(), minus.abs())


# Roundings of one evaluation of the unrolled loss in float64: each of the UNROLL updates (at
# most the longest elementwise chain, 32, and a norm over the 10 elements, 12), the inner
# gradient and the step (3), and the loss (5 per element, summed over 10): 3 * 47 + 60 = 201.
F_OPS = 201


def central_differences_checked(f: Callable[[Any], Tensor], x: Any, analytic: Any) -> None:
    """``analytic`` equals ``f``'s derivative by central differences (float64), within the
    differences' own error: the truncation error, estimated by Richardson's rule from steps h
    and h/2 (``|D(h) - D(h/2)| * 4/3``, doubled: it is an estimate), plus the rounding of the
    two evaluations divided by the step (``F_OPS`` roundings of ``|f|`` each, over ``2h``)
    and of the analytic derivative itself (``F_OPS`` roundings of it)."""
    eps64 = torch.finfo(torch.float64).eps
    if isinstance(x, Tensor):
        pairs = [(None, i) for i in range(x.numel())]
    else:
        pairs = [(name, i) for name, value in x.items() for i in range(value.numel())]
    for name, i in pairs:
        value = x if name is None else x[name]
        dx = torch.zeros_like(value)
        dx.view(-1)[i] = 1.0

        def along(t: Tensor, name: str | None = name) -> Tensor:
            return f(t) if name is None else f({**x, name: t})

        d_h, f_h = _difference(along, value, dx, FD_EPS)
        d_half, f_half = _difference(along, value, dx, FD_EPS / 2)
        want = (analytic if name is None else analytic[name]).reshape(-1)[i]
        truncation = 2 * (4 / 3) * (d_h - d_half).abs()
        rounding = F_OPS * eps64 * (torch.maximum(f_h, f_half) / FD_EPS + want.abs())
        assert (d_h - want).abs() <= truncation + rounding, (name, i, float(d_h), float(want))


def agc_ratios(tx: fo.GradientTransformation, agc: float, pmin: float = 1e-3) -> list[float]:
    """``||g|| / (agc * max(pmin, ||p||))`` for every tensor at every unrolled step (eagerly):
    DreamerV3's clip is active where this exceeds 1 and not differentiable where it equals 1."""
    state = tx.init(THETA0)
    params = THETA0
    ratios = []
    for _ in range(UNROLL):
        g = grad(quadratic_loss)(params)
        for k in params:
            upper = agc * max(pmin, params[k].norm().item())
            ratios.append(g[k].norm().item() / upper)
        updates, state = tx.update(g, state, params)
        params = fo.apply_updates(params, updates)
    return ratios


@pytest.mark.parametrize(
    ("options", "clip_active"),
    [
        pytest.param({"lr": 0.05, "warmup": 0, "agc": 10.0}, False, id="no-warmup-clip-inactive"),
        pytest.param({"lr": 0.05, "warmup": 0, "agc": 0.3}, True, id="no-warmup-clip-active"),
        pytest.param({"lr": 0.1, "warmup": 2, "agc": 0.3}, True, id="warmup"),
        pytest.param({"lr": 0.05, "warmup": 0, "nesterov": True}, True, id="nesterov"),
    ],
)
def test_grad_through_unrolled_dreamerv3_matches_finite_differences(
    options: dict[str, Any], clip_active: bool
) -> None:
    tx = fo.dreamerv3(momentum=True, **options)
    # Stay away from the clip's kink so that finite differences are meaningful.
    ratios = agc_ratios(tx, options.get("agc", 0.3))
    assert all(abs(r - 1) > 0.05 for r in ratios), ratios
    assert any(r > 1 for r in ratios) == clip_active, ratios

    analytic = grad(lambda theta: unrolled_loss(tx, theta))(THETA0)
    assert max(v.abs().max().item() for v in analytic.values()) > 1e-2
    central_differences_checked(lambda theta: unrolled_loss(tx, theta), THETA0, analytic)


def test_grad_through_unrolled_dreamerv3_wrt_injected_lr() -> None:
    tx = fo.inject_hyperparams(fo.dreamerv3)(lr=0.05, warmup=2)
    assert all(abs(r - 1) > 0.05 for r in agc_ratios(tx, 0.3))

    def meta(lr: Tensor) -> Tensor:
        def set_lr(state: fo.InjectHyperparamsState) -> fo.InjectHyperparamsState:
            assert state.hyperparams["lr"].dtype == lr.dtype
            return state._replace(hyperparams={**state.hyperparams, "lr": lr})

        return unrolled_loss(tx, THETA0, set_lr)

    lr = torch.tensor(0.05, dtype=F64)
    analytic = grad(meta)(lr)
    assert abs(analytic.item()) > 1e-2
    central_differences_checked(meta, lr, analytic)


def test_grad_through_unrolled_adam_matches_finite_differences() -> None:
    tx = fo.adam(0.1)
    analytic = grad(lambda theta: unrolled_loss(tx, theta))(THETA0)
    assert max(v.abs().max().item() for v in analytic.values()) > 1e-2
    central_differences_checked(lambda theta: unrolled_loss(tx, theta), THETA0, analytic)


def test_grad_through_unrolled_adam_wrt_learning_rate_tensor() -> None:
    def meta(lr: Tensor) -> Tensor:
        return unrolled_loss(fo.adam(lr, b1=0.8), THETA0)

    lr = torch.tensor(0.1, dtype=F64)
    analytic = grad(meta)(lr)
    assert abs(analytic.item()) > 1e-2
    central_differences_checked(meta, lr, analytic)


# --------------------------------------------------------------------------------------------
# 2. torch.func.vmap over a stacked ensemble vs a per-member loop
# --------------------------------------------------------------------------------------------

MEMBERS = 4


def ensemble_params() -> dict[str, Tensor]:
    # float64: the vmapped path computes per tensor and the loop with ``torch._foreach_*``; in
    # float32 their roundings differ enough to hide a formula error behind a loose tolerance.
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(MEMBERS, 3, 2, generator=gen, dtype=F64),
        "b": torch.randn(MEMBERS, 3, generator=gen, dtype=F64),
        "s": torch.randn(MEMBERS, generator=gen, dtype=F64),
    }


def run_ensemble(
    tx: fo.GradientTransformation,
    steps: int,
    nan_at: tuple[int, int] | None = None,
    edit_state: Callable[[Any, int | None], Any] | None = None,
    frozen: str | None = None,
) -> tuple[list[Tree], Tree]:
    """Runs ``steps`` updates vmapped over the ensemble and member by member, checks they agree
    after every step, and returns the vmapped updates of each step and the final state.

    ``nan_at=(step, i)`` puts a NaN into member ``i``'s gradient at ``step``. ``edit_state(state,
    i)`` edits the stacked state (``i=None``) or member ``i``'s state right after ``init``.
    ``frozen`` names a parameter whose gradient is always ``None``."""
    params = ensemble_params()
    # vmap takes no None leaf under a batch dim: the None gradient/update gets in/out dim None.
    dims = {k: None if k == frozen else 0 for k in params}
    update_v = vmap(tx.update, in_dims=(dims, 0, 0), out_dims=(dims, 0))
    gen = torch.Generator().manual_seed(1)
    state_v = vmap(tx.init)(params)
    states = [tx.init(member(params, i)) for i in range(MEMBERS)]
    assert_bitwise(member(state_v, 0), states[0])
    magnitudes = [MagnitudeRun(tx, member(params, i)) for i in range(MEMBERS)]
    if edit_state is not None:
        state_v = edit_state(state_v, None)
        states = [edit_state(s, i) for i, s in enumerate(states)]
        for i, m in enumerate(magnitudes):
            m.state = edit_state(m.state, i)
    history = []
    for step in range(steps):
        g: dict[str, Tensor | None] = {
            k: None if k == frozen else torch.randn(v.shape, generator=gen, dtype=F64)
            for k, v in params.items()
        }
        if nan_at is not None and step == nan_at[0]:
            g["w"][nan_at[1], 0, 0] = float("nan")  # type: ignore[index]
        updates_v, state_v = update_v(g, state_v, params)
        for i in range(MEMBERS):
            p_i = member(params, i)
            updates_i, states[i] = tx.update(member(g, i), states[i], p_i)
            u_mag, s_mag = magnitudes[i].update(member(g, i), p_i)
            what = f"member {i} at step {step}"
            agree = {"steps": step + 1, "params": p_i, "msg": what}
            assert_paths_agree(member(updates_v, i), updates_i, scale=u_mag, **agree)
            assert_paths_agree(member(state_v, i), states[i], scale=s_mag, **agree)
        history.append(updates_v)
        params = fo.apply_updates(params, updates_v)
    return history, state_v


def _nonzero_per_member(updates: dict[str, Tensor | None]) -> Tensor:
    present = [v for v in updates.values() if v is not None]
    return torch.stack([(v.reshape(MEMBERS, -1) != 0).any(dim=1) for v in present]).any(0)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: fo.dreamerv3(lr=1e-2, warmup=2), id="dreamerv3"),
        pytest.param(lambda: fo.dreamerv3(lr=1e-2, warmup=0, agc=0.05), id="dreamerv3-clipping"),
        pytest.param(lambda: fo.adam(1e-2), id="adam"),
        pytest.param(
            lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)), id="clip-global-adam"
        ),
    ],
)
def test_vmap_matches_per_member_loop(make: Callable[[], fo.GradientTransformation]) -> None:
    # functional_opt.testing's check (members: the params times 2**-i, gradients times 2**i),
    # in float64 at default_ops per update: the longest elementwise chain plus a norm over
    # the tree (step_ops)
    params = member(ensemble_params(), 0)
    assert default_ops(params) == step_ops(params)
    check_vmap(make(), params, gradient_stream(params, 4, seed=1), members=MEMBERS)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: fo.dreamerv3(lr=1e-2, warmup=0, weight_decay=0.1), id="dreamerv3"),
        pytest.param(lambda: fo.MultiSteps(fo.adam(1e-2), 2).gradient_transformation(), id="ms"),
        pytest.param(
            lambda: fo.apply_if_finite(fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)), 2),
            id="apply-if-finite-clip-adam",
        ),
    ],
)
def test_vmap_with_a_parameter_without_gradient(
    make: Callable[[], fo.GradientTransformation],
) -> None:
    tx = make()
    history, state = run_ensemble(tx, steps=4, frozen="b")
    assert all(u["b"] is None for u in history)
    assert bool(_nonzero_per_member(history[-1]).all())
    # The frozen parameter's per-parameter state is still its initial value.
    initial = vmap(tx.init)(ensemble_params())
    b_state = [v for p, v in zip(*_paths_and_leaves(state), strict=True) if p[-1:] == ("b",)]
    b_initial = [v for p, v in zip(*_paths_and_leaves(initial), strict=True) if p[-1:] == ("b",)]
    assert b_state, "no per-parameter state for 'b' found"
    assert_bitwise(b_state, b_initial)


def _paths_and_leaves(tree: Tree) -> tuple[list[tuple[Any, ...]], list[Any]]:
    return optree.tree_paths(tree), optree.tree_leaves(tree)


def test_vmap_multi_steps_takes_both_branches() -> None:
    tx = fo.MultiSteps(fo.adam(1e-2), 2).gradient_transformation()
    history, state = run_ensemble(tx, steps=5)
    emitted = [bool(_nonzero_per_member(u).all()) for u in history]
    silent = [not bool(_nonzero_per_member(u).any()) for u in history]
    assert emitted == [False, True, False, True, False]
    assert silent == [True, False, True, False, True]
    assert state.gradient_step.tolist() == [2] * MEMBERS
    assert state.mini_step.tolist() == [1] * MEMBERS


def test_vmap_apply_if_finite_with_nan_in_one_member() -> None:
    tx = fo.apply_if_finite(fo.adam(1e-2), 2)
    history, state = run_ensemble(tx, steps=4, nan_at=(2, 1))
    assert _nonzero_per_member(history[2]).tolist() == [True, False, True, True]
    assert state.total_notfinite.tolist() == [0, 1, 0, 0]
    assert state.last_finite.tolist() == [True] * MEMBERS
    # The skipped step did not advance member 1's inner Adam count.
    assert state.inner_state[0].count.tolist() == [4, 3, 4, 4]


def test_vmap_inject_hyperparams_with_a_learning_rate_per_member() -> None:
    lrs = torch.tensor([1e-3, 1e-2, 3e-2, 1e-1], dtype=F64)

    def set_lr(state: fo.InjectHyperparamsState, i: int | None) -> fo.InjectHyperparamsState:
        lr = lrs if i is None else lrs[i]
        return state._replace(hyperparams={**state.hyperparams, "lr": lr})

    tx = fo.inject_hyperparams(fo.dreamerv3)(lr=1e-2, warmup=0)
    history, state = run_ensemble(tx, steps=3, edit_state=set_lr)
    assert torch.equal(state.hyperparams["lr"], lrs)
    scale = history[-1]["b"].abs().mean(dim=1)
    assert bool((scale[1:] > scale[:-1]).all()), scale


# --------------------------------------------------------------------------------------------
# 3. torch.compile(fullgraph=True) vs eager, with no recompilation after the second call
# --------------------------------------------------------------------------------------------


def compiled_matches_eager(
    tx: fo.GradientTransformation,
    steps: int,
    backend: str = "inductor",
    nan_at: int | None = None,
    edit_state: Callable[[Any, int], Any] | None = None,
    frozen: str | None = None,
) -> list[Tree]:
    """Runs ``tx.update`` eagerly and compiled side by side; after the first two calls any
    recompilation is an error. Returns the eager updates of each step. ``frozen`` names a
    parameter whose gradient is always ``None``."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    update = torch.compile(tx.update, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    state_eager, state_compiled = tx.init(params), tx.init(params)
    magnitudes = MagnitudeRun(tx, params)
    history = []
    with contextlib.ExitStack() as stack:
        for step in range(steps):
            if step == 2:
                stack.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
            g: dict[str, Tensor | None] = {
                k: None if k == frozen else torch.randn(v.shape, generator=gen)
                for k, v in params.items()
            }
            if step == nan_at:
                g["w"][1, 1] = float("nan")  # type: ignore[index]
            if edit_state is not None:
                state_eager = edit_state(state_eager, step)
                state_compiled = edit_state(state_compiled, step)
                magnitudes.state = edit_state(magnitudes.state, step)
            updates, state_eager = tx.update(g, state_eager, params)
            compiled, state_compiled = update(g, state_compiled, params)
            u_mag, s_mag = magnitudes.update(g, params)
            agree = {"steps": step + 1, "params": params, "msg": f"step {step}"}
            assert_paths_agree(compiled, updates, scale=u_mag, **agree)
            assert_paths_agree(state_compiled, state_eager, scale=s_mag, **agree)
            history.append(updates)
            params = fo.apply_updates(params, updates)
    assert 1 <= counter.frame_count <= 2
    return history


def _is_zero(updates: dict[str, Tensor | None]) -> bool:
    return all(bool((v == 0).all()) for v in updates.values() if v is not None)


def test_compile_dreamerv3() -> None:
    history = compiled_matches_eager(fo.dreamerv3(warmup=3), steps=6)
    assert _is_zero(history[0])  # warm-up starts at lr 0
    assert not any(_is_zero(u) for u in history[1:])


def test_compile_dreamerv3_with_a_parameter_without_gradient() -> None:
    tx = fo.dreamerv3(lr=1e-3, warmup=0, weight_decay=0.1)
    history = compiled_matches_eager(tx, steps=4, frozen="b")
    assert all(u["b"] is None for u in history)
    assert not any(_is_zero(u) for u in history)


def test_compile_clip_by_global_norm_adam() -> None:
    # functional_opt.testing's check: compiled vs eager at default_ops (step_ops) per update,
    # no recompilation after the second call
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    tx = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2))
    check_compile(tx, params, gradient_stream(params, 5, seed=0))


def test_compile_multi_steps() -> None:
    tx = fo.MultiSteps(fo.adam(1e-2), 3).gradient_transformation()
    history = compiled_matches_eager(tx, steps=7)
    assert [not _is_zero(u) for u in history] == [False, False, True, False, False, True, False]


def test_compile_apply_if_finite() -> None:
    tx = fo.apply_if_finite(fo.adam(1e-2), 2)
    history = compiled_matches_eager(tx, steps=5, nan_at=3)
    assert [not _is_zero(u) for u in history] == [True, True, True, False, True]


def test_compile_inject_hyperparams_lr_change_does_not_recompile() -> None:
    tx = fo.inject_hyperparams(fo.dreamerv3)(lr=1e-2, warmup=2)

    def change_lr(state: fo.InjectHyperparamsState, step: int) -> fo.InjectHyperparamsState:
        old = state.hyperparams["lr"]
        lr = torch.tensor(1e-2 * (step + 1), dtype=old.dtype)
        return state._replace(hyperparams={**state.hyperparams, "lr": lr})

    # Compiled and eager agree on every step although lr changes before each: the compiled
    # function reads the new tensor instead of a constant baked in at the first call.
    history = compiled_matches_eager(tx, steps=5, edit_state=change_lr)
    assert not any(_is_zero(u) for u in history[1:])


# --------------------------------------------------------------------------------------------
# 4. Eager update does not write into its inputs and depends only on them
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: fo.dreamerv3(lr=1e-2, warmup=2, weight_decay=0.1), id="dreamerv3"),
        pytest.param(
            lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2)), id="clip-global-adam"
        ),
        pytest.param(lambda: fo.MultiSteps(fo.adam(1e-2), 2).gradient_transformation(), id="ms"),
        pytest.param(lambda: fo.apply_if_finite(fo.adam(1e-2), 2), id="apply-if-finite"),
        pytest.param(lambda: fo.inject_hyperparams(fo.dreamerv3)(lr=1e-2), id="inject"),
    ],
)
def test_update_is_pure(make: Callable[[], fo.GradientTransformation]) -> None:
    # functional_opt.testing's check, over gradients with a NaN at step 1
    gen = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    grads = gradient_stream(params, 3, seed=2, faults=[Fault(step=1, leaf=0)])
    assert bool(grads[1]["b"].isnan().any())
    check_purity(make(), params, grads)


def test_vmap_over_a_learning_rate_with_shared_params() -> None:
    """A swept hyperparameter alone may be batched: params and grads stay unbatched."""
    params = {"w": torch.tensor([1.0, -2.0, 3.0])}
    grads = {"w": torch.tensor([0.5, 0.5, -1.0])}
    lrs = torch.tensor([0.1, 0.01, 0.001])

    def one(lr: torch.Tensor, p: dict, g: dict) -> dict:
        tx = fo.inject_hyperparams(fo.sgd)(learning_rate=0.0, momentum=0.9)
        state = tx.init(p)
        state.hyperparams["learning_rate"] = lr
        updates, _ = tx.update(g, state, p)
        return updates

    batched = torch.func.vmap(one, in_dims=(0, None, None))(lrs, params, grads)
    for i, lr in enumerate(lrs):  # (the first momentum is the gradient: one product)
        assert_bitwise(batched["w"][i], -lr * grads["w"])


def test_compiled_vmap_of_dreamerv3_matches_eager_vmap() -> None:
    # Under torch.compile a functorch transform sends the lists down the per-tensor path
    # (``_foreach_*`` ops have no batching rules, and dynamo cannot ask a tensor whether vmap
    # wrapped it).
    tx = fo.dreamerv3(lr=1e-2, warmup=0, agc=0.05)
    params = ensemble_params()
    update_v = vmap(tx.update)
    compiled = torch.compile(update_v, fullgraph=True)
    state_eager = state_compiled = vmap(tx.init)(params)
    magnitudes = MagnitudeRun(fo.GradientTransformation(vmap(tx.init), update_v), params)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        g = {k: torch.randn(v.shape, generator=gen, dtype=F64) for k, v in params.items()}
        updates, state_eager = update_v(g, state_eager, params)
        got, state_compiled = compiled(g, state_compiled, params)
        u_mag, s_mag = magnitudes.update(g, params)
        # (per member: the norms span one member's elements, fewer than the tree's)
        agree = {"steps": step + 1, "params": params, "msg": f"step {step}"}
        assert_paths_agree(got, updates, scale=u_mag, **agree)
        assert_paths_agree(state_compiled, state_eager, scale=s_mag, **agree)
        assert bool(_nonzero_per_member(updates).all())
        params = fo.apply_updates(params, updates)


def test_a_tensor_that_escaped_its_transform_is_a_plain_tensor_outside() -> None:
    # Outside every functorch transform the multi-tensor path skips the per-tensor wrapping
    # check: a wrapper that escaped its transform (here from grad) must act as a plain tensor.
    escaped: list[Tensor] = []

    def loss(x: Tensor) -> Tensor:
        escaped.append(x * 2)
        return (x * 2).sum()

    grad(loss)(torch.ones(3))
    assert torch._C._functorch.is_functorch_wrapped_tensor(escaped[0])
    tx = fo.adam(1e-2)
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    got, _ = tx.update({"w": escaped[0]}, state, params)
    want, _ = tx.update({"w": torch.full((3,), 2.0)}, state, params)
    assert torch.equal(got["w"], want["w"])
