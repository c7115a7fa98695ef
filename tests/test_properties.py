"""Property tests: every transform against an independent float64 reference written here.

Each reference is the transform's per-element formula (optax's, or DreamerV3's), written with plain
tensor arithmetic leaf by leaf; nothing here calls ``functional_opt`` to compute an expected value.
Hypothesis draws the pytree (nested dicts/lists, mixed shapes, 0-d included), the gradient
sequence (>= 10 steps) and the hyperparameters from their valid ranges.

Tolerances follow ``tests/conftest.py``'s rule: the transform and its reference compute the
same math in float64 with other ops, so after ``t`` updates they agree to ``t`` times one
update's roundings (:func:`step_ops`), relative to the magnitudes of the terms (the transform
run alongside on absolute values: :class:`conftest.MagnitudeRun`); where both run the same op
(a clamp, a power-of-two scale) they agree bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import (
    ELEMENTWISE_OPS,
    SCHEDULE_OPS,
    MagnitudeRun,
    assert_bitwise,
    assert_close_rounding,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    Problem,
    decays,
    from_list,
    masks_for,
    problems,
    tleaves,
    tmap,
)

import functional_opt as fo
from functional_opt.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale

SETTINGS = settings(max_examples=20, deadline=None)

Ref = Callable[[Any, Any], Any]  # (grads, params) -> updates, closing over its own state


def run(tx: fo.GradientTransformation, problem: Problem, params_seq: list[Any] | None = None):
    """Updates of ``tx`` over the problem's gradients (params fixed unless ``params_seq``)."""
    state = tx.init(problem.params)
    outs = []
    for i, g in enumerate(problem.grads):
        p = problem.params if params_seq is None else params_seq[i]
        u, state = tx.update(g, state, p)
        outs.append(u)
    return outs, state


def step_ops(params: Any) -> int:
    """Roundings of one update, per implementation: the longest elementwise chain
    (``ELEMENTWISE_OPS``) plus a norm over at most every element of the tree (``n`` squares
    summed, the square root and the clip factor's quotient: ``n + 2``)."""
    return ELEMENTWISE_OPS + sum(x.numel() for x in tleaves(params) if x is not None) + 2


def close(actual: Any, expected: Any, steps: int, params: Any, scale: Any, msg: str = "") -> None:
    """The rule's bound in float64 after ``steps`` updates (errors carried in state add up)."""
    ops = steps * step_ops(params)
    assert_close_rounding(actual, expected, dtype=torch.float64, ops=ops, scale=scale, msg=msg)


def check_run(
    tx: fo.GradientTransformation, problem: Problem, ref: Ref, exact: bool = False
) -> tuple[Any, Any]:
    """``tx``'s updates equal ``ref``'s step by step (``exact``: bit for bit); returns the final
    state and the magnitude run's state."""
    outs, state = run(tx, problem)
    magnitudes = MagnitudeRun(tx, problem.params)
    for t, (g, u) in enumerate(zip(problem.grads, outs, strict=True)):
        u_mag, _ = magnitudes.update(g, problem.params)
        expected = ref(g, problem.params)
        if exact:
            assert_bitwise(u, expected, f"step {t}")
        else:
            close(u, expected, t + 1, problem.params, u_mag, f"step {t}")
    return state, magnitudes.state


def check(tx: fo.GradientTransformation, problem: Problem, ref: Ref, exact: bool = False) -> Any:
    return check_run(tx, problem, ref, exact)[0]


def close_state(actual: Any, expected: Any, problem: Problem, scale: Any) -> None:
    """State after the problem's updates (see :func:`close`)."""
    close(actual, expected, len(problem.grads), problem.params, scale, "state")


def norm(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt((x * x).sum())


# ---------------------------------------------------------------------------------------------
# Stateless scaling and clipping.


@SETTINGS
@given(problems(), st.floats(-10, 10))
def test_scale(problem: Problem, step: float) -> None:
    check(fo.scale(step), problem, lambda g, p: tmap(lambda x: step * x, g))


@SETTINGS
@given(problems(), st.floats(1e-4, 1.0), st.booleans(), st.booleans())
def test_scale_by_learning_rate(problem: Problem, lr: float, flip: bool, scheduled: bool) -> None:
    t = [0]
    sign = -1.0 if flip else 1.0
    if scheduled:
        learning_rate: Any = lambda c: lr / (1.0 + c.to(torch.float64))  # noqa: E731
    else:
        learning_rate = lr

    def ref(g: Any, p: Any) -> Any:
        value = lr / (1.0 + t[0]) if scheduled else lr
        t[0] += 1
        return tmap(lambda x: sign * value * x, g)

    check(fo.scale_by_learning_rate(learning_rate, flip_sign=flip), problem, ref)


@SETTINGS
@given(problems(), st.floats(-2, 2), st.floats(-0.5, 0.5))
def test_scale_by_schedule(problem: Problem, a: float, b: float) -> None:
    t = [0]

    def ref(g: Any, p: Any) -> Any:
        value = a + b * t[0]
        t[0] += 1
        return tmap(lambda x: value * x, g)

    state = check(fo.scale_by_schedule(lambda c: a + b * c.to(torch.float64)), problem, ref)
    assert int(state.count) == len(problem.grads)


@SETTINGS
@given(problems(), st.floats(0, 3))
def test_clip(problem: Problem, max_delta: float) -> None:
    check(
        fo.clip(max_delta),
        problem,
        lambda g, p: tmap(lambda x: torch.clamp(x, -max_delta, max_delta), g),
        exact=True,  # one clamp
    )


@SETTINGS
@given(problems(), st.floats(1e-3, 30))
def test_clip_by_global_norm(problem: Problem, max_norm: float) -> None:
    def ref(g: Any, p: Any) -> Any:
        total = math.sqrt(sum(float((x * x).sum()) for x in tleaves(g)))
        if total < max_norm:
            return g
        return tmap(lambda x: x / total * max_norm, g)

    check(fo.clip_by_global_norm(max_norm), problem, ref)


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    """optax's unit-wise norm: whole tensor for scalars/vectors, over axis 0 for rank 2-3, over
    axes 0-2 for rank 4, broadcast back to ``x``'s shape."""
    if sum(d > 1 for d in x.shape) <= 1:
        sq = (x * x).sum() * torch.ones_like(x)
    elif x.dim() in (2, 3):
        sq = (x * x).sum(dim=0, keepdim=True).expand_as(x)
    else:
        sq = (x * x).sum(dim=(0, 1, 2), keepdim=True).expand_as(x)
    return torch.sqrt(sq)


@SETTINGS
@given(problems(), st.floats(0, 2), st.floats(0, 1e-2))
def test_adaptive_grad_clip(problem: Problem, clipping: float, eps: float) -> None:
    def one(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        gn = unit_norm(x)
        mx = clipping * torch.clamp(unit_norm(p), min=eps)
        return torch.where(gn < mx, x, x * (mx / torch.clamp(gn, min=1e-6)))

    check(fo.adaptive_grad_clip(clipping, eps), problem, lambda g, p: tmap(one, g, p))


@SETTINGS
@given(problems(), st.just(0.0) | st.floats(1e-3, 1), st.floats(1e-4, 1e-2))
def test_clip_by_agc(problem: Problem, clip: float, pmin: float) -> None:
    def one(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if clip == 0:
            return x
        upper = clip * max(pmin, float(norm(p)))
        return x * (1.0 / max(1.0, float(norm(x)) / upper))

    check(fo.clip_by_agc(clip, pmin), problem, lambda g, p: tmap(one, g, p))


# ---------------------------------------------------------------------------------------------
# Moments.


@pytest.mark.parametrize("in_sqrt", [True, False])
@pytest.mark.parametrize("debias", [False, True])
@settings(max_examples=12, deadline=None)
@given(problem=problems(), decay=decays(), eps=st.floats(0, 1e-3), initial=st.floats(0, 1.0))
def test_scale_by_rms(
    problem: Problem, decay: float, eps: float, initial: float, in_sqrt: bool, debias: bool
) -> None:
    nu = tmap(lambda x: torch.full_like(x, initial), problem.params)
    t = [0]

    def ref(g: Any, p: Any) -> Any:
        nonlocal nu
        t[0] += 1
        nu = tmap(lambda n, x: decay * n + (1 - decay) * x * x, nu, g)
        nu_hat = tmap(lambda n: n / (1 - decay ** t[0]), nu) if debias else nu
        if in_sqrt:
            return tmap(lambda x, n: x / torch.sqrt(n + eps), g, nu_hat)
        return tmap(lambda x, n: x / (torch.sqrt(n) + eps), g, nu_hat)

    tx = fo.scale_by_rms(decay, eps, initial, eps_in_sqrt=in_sqrt, bias_correction=debias)
    state, mags = check_run(tx, problem, ref)
    close_state(state.nu, nu, problem, mags.nu)
    if debias:
        assert int(state.count) == len(problem.grads)


@pytest.mark.parametrize("nesterov", [False, True])
@SETTINGS
@given(
    problem=problems(),
    b1=decays(),
    b2=decays(),
    eps=st.floats(1e-10, 1e-3),
    eps_root=st.floats(0, 1e-3),
)
def test_scale_by_adam(
    problem: Problem, b1: float, b2: float, eps: float, eps_root: float, nesterov: bool
) -> None:
    mu = tmap(torch.zeros_like, problem.params)
    nu = tmap(torch.zeros_like, problem.params)
    t = [0]

    def ref(g: Any, p: Any) -> Any:
        nonlocal mu, nu
        t[0] += 1
        n = t[0]
        mu = tmap(lambda m, x: b1 * m + (1 - b1) * x, mu, g)
        nu = tmap(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
        if nesterov:
            mu_hat = tmap(
                lambda m, x: b1 * m / (1 - b1 ** (n + 1)) + (1 - b1) * x / (1 - b1**n), mu, g
            )
        else:
            mu_hat = tmap(lambda m: m / (1 - b1**n), mu)
        return tmap(lambda m, v: m / (torch.sqrt(v / (1 - b2**n) + eps_root) + eps), mu_hat, nu)

    tx = fo.scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov)
    state, mags = check_run(tx, problem, ref)
    close_state(state.mu, mu, problem, mags.mu)
    close_state(state.nu, nu, problem, mags.nu)
    assert int(state.count) == len(problem.grads)


@SETTINGS
@given(problems(), decays(), st.booleans())
def test_trace(problem: Problem, decay: float, nesterov: bool) -> None:
    m = tmap(torch.zeros_like, problem.params)

    def ref(g: Any, p: Any) -> Any:
        nonlocal m
        m = tmap(lambda a, x: x + decay * a, m, g)
        return tmap(lambda a, x: x + decay * a, m, g) if nesterov else m

    state, mags = check_run(fo.trace(decay, nesterov), problem, ref)
    close_state(state.trace, m, problem, mags.trace)


@SETTINGS
@given(problems(), decays(), st.booleans())
def test_ema(problem: Problem, decay: float, debias: bool) -> None:
    m = tmap(torch.zeros_like, problem.params)
    t = [0]

    def ref(g: Any, p: Any) -> Any:
        nonlocal m
        t[0] += 1
        m = tmap(lambda a, x: decay * a + (1 - decay) * x, m, g)
        return tmap(lambda a: a / (1 - decay ** t[0]), m) if debias else m

    state, mags = check_run(fo.ema(decay, debias), problem, ref)
    close_state(state.ema, m, problem, mags.ema)
    assert int(state.count) == len(problem.grads)


# ---------------------------------------------------------------------------------------------
# Weight decay and routing.


@SETTINGS
@given(problems(), st.floats(0, 1), st.data())
def test_add_decayed_weights(problem: Problem, wd: float, data: st.DataObject) -> None:
    mask = data.draw(st.none() | masks_for(problem.structure))
    as_fn = data.draw(st.booleans())
    flags = mask if mask is not None else tmap(lambda _: True, problem.params)
    tx = fo.add_decayed_weights(wd, (lambda p: mask) if as_fn and mask is not None else mask)
    check(tx, problem, lambda g, p: tmap(lambda x, q, f: x + wd * q if f else x, g, p, flags))


class AdamRef:
    """Adam on one leaf (optax's scale_by_adam, defaults eps=1e-8)."""

    def __init__(self, b1: float, b2: float) -> None:
        self.b1, self.b2, self.t = b1, b2, 0
        self.mu: torch.Tensor | float = 0.0
        self.nu: torch.Tensor | float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.t += 1
        self.mu = self.b1 * self.mu + (1 - self.b1) * x
        self.nu = self.b2 * self.nu + (1 - self.b2) * x * x
        mu_hat = self.mu / (1 - self.b1**self.t)
        nu_hat = self.nu / (1 - self.b2**self.t)
        return mu_hat / (torch.sqrt(nu_hat) + 1e-8)


@SETTINGS
@given(problems(), decays(), decays(), st.data())
def test_masked(problem: Problem, b1: float, b2: float, data: st.DataObject) -> None:
    mask = data.draw(masks_for(problem.structure))
    flags = tleaves(mask)
    refs = [AdamRef(b1, b2) for _ in flags]

    def ref(g: Any, p: Any) -> Any:
        leaves = tleaves(g)
        out = [r(x) if f else x for r, x, f in zip(refs, leaves, flags, strict=True)]
        return from_list(out, g)

    state, mags = check_run(fo.masked(fo.scale_by_adam(b1, b2), mask), problem, ref)
    mu = tleaves(state.inner_state.mu)
    for f, m, r, s in zip(flags, mu, refs, tleaves(mags.inner_state.mu), strict=True):
        assert (m is not None) == f
        if f:
            close_state(m, r.mu, problem, s)


@SETTINGS
@given(problems(), decays(), st.floats(-2, 2), st.data())
def test_partition(problem: Problem, decay: float, step: float, data: st.DataObject) -> None:
    n = len(tleaves(problem.structure))
    labels = data.draw(st.lists(st.sampled_from(["mom", "scale"]), min_size=n, max_size=n))
    label_tree = optree.tree_structure(problem.structure, none_is_leaf=True).unflatten(labels)
    m = [0.0] * n

    def ref(g: Any, p: Any) -> Any:
        out = []
        for i, (x, lab) in enumerate(zip(tleaves(g), labels, strict=True)):
            if lab == "mom":
                m[i] = x + decay * m[i]
                out.append(m[i])
            else:
                out.append(step * x)
        return from_list(out, g)

    tx = fo.partition({"mom": fo.trace(decay), "scale": fo.scale(step)}, label_tree)
    check(tx, problem, ref)


# ---------------------------------------------------------------------------------------------
# Guards and accumulation.


@SETTINGS
@given(problems(), decays(), st.integers(0, 3), st.data())
def test_apply_if_finite(problem: Problem, decay: float, max_errors: int, data: st.DataObject):
    n = len(tleaves(problem.structure))
    grads = []
    for g in problem.grads:
        leaves = [x.clone() for x in tleaves(g)]
        if data.draw(st.booleans()):
            i = data.draw(st.integers(0, n - 1))
            j = data.draw(st.integers(0, leaves[i].numel() - 1))
            leaves[i].view(-1)[j] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        grads.append(from_list(leaves, g))
    tx = fo.apply_if_finite(fo.trace(decay), max_errors)
    state = tx.init(problem.params)
    magnitudes = MagnitudeRun(tx, problem.params)
    m = tmap(torch.zeros_like, problem.params)
    notfinite = total = 0
    for t, g in enumerate(grads):
        u, state = tx.update(g, state, problem.params)
        u_mag, s_mag = magnitudes.update(g, problem.params)
        finite = all(bool(torch.isfinite(x).all()) for x in tleaves(g))
        notfinite = 0 if finite else notfinite + 1
        total += not finite
        if finite or notfinite > max_errors:
            m = tmap(lambda a, x: x + decay * a, m, g)
            expected = m
        else:
            expected = tmap(torch.zeros_like, g)
        close(u, expected, t + 1, problem.params, u_mag, f"step {t}")
        trace = state.inner_state.trace
        close(trace, m, t + 1, problem.params, s_mag.inner_state.trace, f"state at step {t}")
        assert int(state.notfinite_count) == notfinite
        assert bool(state.last_finite) == finite
        assert int(state.total_notfinite) == total


@SETTINGS
@given(
    problems(),
    st.integers(1, 4) | st.just("schedule"),
    st.booleans(),
    decays(),
    st.booleans(),
)
def test_multi_steps(
    problem: Problem, k: int | str, mean: bool, decay: float, transform_form: bool
) -> None:
    every_k: Any = (lambda step: 1 + step % 3) if k == "schedule" else k
    ms = fo.MultiSteps(fo.trace(decay), every_k, use_grad_mean=mean)
    tx = fo.multi_steps(fo.trace(decay), every_k, use_grad_mean=mean) if transform_form else ms
    state = tx.init(problem.params)
    magnitudes = MagnitudeRun(tx, problem.params)
    m = tmap(torch.zeros_like, problem.params)
    acc = tmap(torch.zeros_like, problem.params)
    mini = gradient_step = 0
    for t, g in enumerate(problem.grads):
        window = 1 + gradient_step % 3 if k == "schedule" else k
        u, state = tx.update(g, state, problem.params)
        u_mag, s_mag = magnitudes.update(g, problem.params)
        acc = tmap(torch.add, acc, g)
        mini += 1
        if mini == window:
            avg = tmap(lambda a, w=window: a / w, acc) if mean else acc
            m = tmap(lambda a, x: x + decay * a, m, avg)
            expected = m
            acc = tmap(torch.zeros_like, acc)
            mini = 0
            gradient_step += 1
        else:
            expected = tmap(torch.zeros_like, g)
        close(u, expected, t + 1, problem.params, u_mag, f"step {t}")
        trace, trace_mag = state.inner_opt_state.trace, s_mag.inner_opt_state.trace
        close(trace, m, t + 1, problem.params, trace_mag, f"inner state at step {t}")
        assert int(state.mini_step) == mini
        assert int(state.gradient_step) == gradient_step
        assert bool(ms.has_updated(state)) == (mini == 0)


# ---------------------------------------------------------------------------------------------
# DreamerV3.


def dreamer_lr(t: int, lr: float, warmup: int, schedule: str, anneal: int) -> float:
    """The learning rate DreamerV3 uses at update count ``t`` (from 0)."""
    if warmup and t < warmup:
        return lr * t / warmup
    s, span = t - warmup, anneal - warmup
    if schedule == "const" or span <= 0:
        return lr
    frac = min(max(s, 0), span) / span
    if schedule == "linear":
        return lr + (0.1 * lr - lr) * frac
    return lr * (0.9 * 0.5 * (1 + math.cos(math.pi * frac)) + 0.1)


@st.composite
def dreamer_options(draw: st.DrawFn, schedule: str) -> dict[str, Any]:
    warmup = draw(st.integers(0, 6))
    low = warmup + 1 if schedule == "cosine" else 0
    return {
        "lr": draw(st.floats(1e-4, 0.1)),
        "agc": draw(st.just(0.0) | st.floats(1e-3, 1)),
        "pmin": draw(st.floats(1e-4, 1e-2)),
        "beta1": draw(decays()),
        "beta2": draw(decays()),
        "eps": draw(st.sampled_from([1e-20, 1e-12, 1e-8])),
        "warmup": warmup,
        "momentum": draw(st.booleans()),
        "nesterov": draw(st.booleans()),
        "weight_decay": draw(st.just(0.0) | st.floats(0, 0.1)),
        "schedule": schedule,
        "anneal": draw(st.integers(low, low + 12)),
    }


def dreamer_step(
    o: dict[str, Any], flags: Any, params: Any, g: Any, nu: Any, mu: Any, t0: int
) -> tuple[Any, Any, Any]:
    """One DreamerV3 update (Hafner et al. 2023) in float64: (updates, nu, mu)."""
    t = t0 + 1
    b1, b2, eps, wd = o["beta1"], o["beta2"], o["eps"], o["weight_decay"]

    def agc(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if o["agc"] == 0:
            return x
        upper = o["agc"] * max(o["pmin"], float(norm(p)))
        return x / max(1.0, float(norm(x)) / upper)

    x = tmap(agc, g, params)
    nu = tmap(lambda v, y: b2 * v + (1 - b2) * y * y, nu, x)
    r = tmap(lambda y, v: y / (torch.sqrt(v / (1 - b2**t)) + eps), x, nu)
    if o["momentum"]:
        mu = tmap(lambda m, y: b1 * m + (1 - b1) * y, mu, r)
        if o["nesterov"]:
            r = tmap(lambda m, y: (b1 * m + (1 - b1) * y) / (1 - b1**t), mu, r)
        else:
            r = tmap(lambda m: m / (1 - b1**t), mu)
    r = tmap(lambda y, p, f: y + wd * p if f else y, r, params, flags)
    lr = dreamer_lr(t0, o["lr"], o["warmup"], o["schedule"], o["anneal"])
    return tmap(lambda y: -lr * y, r), nu, mu


@pytest.mark.parametrize("schedule", ["const", "linear", "cosine"])
@SETTINGS
@given(data=st.data())
def test_dreamerv3(schedule: str, data: st.DataObject) -> None:
    problem = data.draw(problems(), label="problem")
    o = data.draw(dreamer_options(schedule), label="options")
    mask = data.draw(st.none() | masks_for(problem.structure))
    tx = fo.dreamerv3(**o, weight_decay_mask=mask)
    state = tx.init(problem.params)
    magnitudes = MagnitudeRun(tx, problem.params)
    flags = tmap(lambda _: True, problem.params) if mask is None else mask
    params = problem.params
    nu = tmap(torch.zeros_like, params)
    mu = tmap(torch.zeros_like, params)
    for t0, g in enumerate(problem.grads):
        u, state = tx.update(g, state, params)
        u_mag, _ = magnitudes.update(g, params)
        expected, nu, mu = dreamer_step(o, flags, params, g, nu, mu, t0)
        close(u, expected, t0 + 1, params, u_mag, f"step {t0}")
        params = tmap(torch.add, params, expected)


# ---------------------------------------------------------------------------------------------
# Aliases and inject_hyperparams.


@SETTINGS
@given(problems(), st.floats(1e-4, 0.1), decays(), decays(), st.floats(0, 0.1), st.booleans())
def test_adam_adamw(
    problem: Problem, lr: float, b1: float, b2: float, wd: float, decoupled: bool
) -> None:
    refs = [AdamRef(b1, b2) for _ in tleaves(problem.structure)]

    def ref(g: Any, p: Any) -> Any:
        out = [
            -lr * (r(x) + (wd * q if decoupled else 0.0))
            for r, x, q in zip(refs, tleaves(g), tleaves(p), strict=True)
        ]
        return from_list(out, g)

    tx = fo.adamw(lr, b1, b2, weight_decay=wd) if decoupled else fo.adam(lr, b1, b2)
    check(tx, problem, ref)


@SETTINGS
@given(problems(), st.floats(1e-4, 0.1), st.none() | decays(), st.booleans())
def test_sgd(problem: Problem, lr: float, momentum: float | None, nesterov: bool) -> None:
    m = tmap(torch.zeros_like, problem.params)

    def ref(g: Any, p: Any) -> Any:
        nonlocal m
        if momentum is None:
            return tmap(lambda x: -lr * x, g)
        m = tmap(lambda a, x: x + momentum * a, m, g)
        d = tmap(lambda a, x: x + momentum * a, m, g) if nesterov else m
        return tmap(lambda y: -lr * y, d)

    check(fo.sgd(lr, momentum, nesterov), problem, ref)


@SETTINGS
@given(problems(), st.floats(1e-4, 0.1), st.floats(1e-4, 0.1), decays(), decays())
def test_inject_hyperparams(problem: Problem, lr: float, lr2: float, b1: float, b2: float):
    tx = fo.inject_hyperparams(fo.adam)(learning_rate=lr, b1=b1, b2=b2)
    state = tx.init(problem.params)
    magnitudes = MagnitudeRun(tx, problem.params)
    refs = [AdamRef(b1, b2) for _ in tleaves(problem.structure)]
    half = len(problem.grads) // 2

    def new_rate(state: Any) -> Any:
        hp = dict(state.hyperparams)
        hp["learning_rate"] = torch.tensor(lr2, dtype=hp["learning_rate"].dtype)
        return state._replace(hyperparams=hp)

    for t, g in enumerate(problem.grads):
        if t == half:
            state, magnitudes.state = new_rate(state), new_rate(magnitudes.state)
        rate = lr if t < half else lr2
        u, state = tx.update(g, state, problem.params)
        u_mag, _ = magnitudes.update(g, problem.params)
        out = [-rate * r(x) for r, x in zip(refs, tleaves(g), strict=True)]
        close(u, from_list(out, g), t + 1, problem.params, u_mag, f"step {t}")
        assert int(state.count) == t + 1


# ---------------------------------------------------------------------------------------------
# Schedules.

STEPS = st.integers(0, 40)


def assert_schedule(
    fn: Callable[[Any], torch.Tensor], ref: Callable[[int], float], scale: Any = None
) -> None:
    """The schedule's values at counts 0..44 (as ints and int32 tensors) equal ``ref``'s to the
    rule's schedule count (``SCHEDULE_OPS``), relative to the largest value, or to ``scale``
    (per count) where the terms of a value may be far larger than every value shown."""
    expected = torch.tensor([ref(t) for t in range(45)], dtype=torch.float64)
    for kind in (int, torch.int32):
        values = []
        for t in range(45):
            got = fn(t if kind is int else torch.tensor(t, dtype=torch.int32))
            assert isinstance(got, torch.Tensor) and got.dim() == 0
            values.append(got.to(torch.float64))
        assert_close_rounding(
            torch.stack(values),
            expected,
            dtype=torch.float64,
            ops=SCHEDULE_OPS,
            scale=scale,
            msg=str(kind),
        )


@SETTINGS
@given(st.floats(-10, 10))
def test_constant_schedule(value: float) -> None:
    assert_schedule(fo.constant_schedule(value), lambda t: value)


@SETTINGS
@given(st.floats(-5, 5), st.floats(-5, 5), st.integers(-3, 30), st.integers(-5, 20))
def test_linear_schedule(init: float, end: float, steps: int, begin: int) -> None:
    def ref(t: int) -> float:
        if steps <= 0:
            return init
        c = min(max(t - max(begin, 0), 0), steps)
        return (init - end) * (1 - c / steps) + end

    assert_schedule(fo.linear_schedule(init, end, steps, begin), ref)


@SETTINGS
@given(st.floats(-5, 5), st.integers(1, 40), st.floats(0, 1), st.floats(0.5, 3))
def test_cosine_decay_schedule(init: float, steps: int, alpha: float, exponent: float) -> None:
    def ref(t: int) -> float:
        c = min(t, steps)
        cosine = 0.5 * (1 + math.cos(math.pi * c / steps))
        return init * ((1 - alpha) * cosine**exponent + alpha)

    assert_schedule(fo.cosine_decay_schedule(init, steps, alpha, exponent), ref)


@SETTINGS
@given(
    st.floats(0, 1),
    st.just(0.0) | st.floats(1e-3, 5),
    st.integers(0, 15),
    st.integers(1, 25),
    st.floats(0, 1),
    st.floats(0.5, 2),
)
def test_warmup_cosine_decay_schedule(
    init: float, peak: float, warmup: int, extra: int, end: float, exponent: float
) -> None:
    decay_steps = warmup + extra
    alpha = 0.0 if peak == 0 else end / peak

    def ref(t: int) -> float:
        if t < warmup:
            return init + (peak - init) * t / warmup
        c = min(t - warmup, extra)
        cosine = 0.5 * (1 + math.cos(math.pi * c / extra))
        return peak * ((1 - alpha) * cosine**exponent + alpha)

    fn = fo.warmup_cosine_decay_schedule(init, peak, warmup, decay_steps, end, exponent)
    assert_schedule(fn, ref)


@SETTINGS
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=4), st.data())
def test_join_schedules(values: list[float], data: st.DataObject) -> None:
    bounds = sorted(data.draw(st.lists(STEPS, min_size=len(values) - 1, max_size=len(values) - 1)))
    slopes = [data.draw(st.floats(-0.1, 0.1)) for _ in values]
    parts = [fo.linear_schedule(v, v + s * 50, 50) for v, s in zip(values, slopes, strict=True)]

    def part(t: int) -> int:
        return sum(t >= b for b in bounds)

    def ref(t: int) -> float:
        i = part(t)
        start = bounds[i - 1] if i else 0
        c = min(t - start, 50)
        return values[i] + slopes[i] * c

    # A part cut short by the next boundary never shows its end value, yet its values are
    # (init - end) * frac + end: terms up to |init| + 2 |end| of the part in use
    ends = [v + s * 50 for v, s in zip(values, slopes, strict=True)]
    terms = torch.tensor(
        [abs(values[part(t)]) + 2 * abs(ends[part(t)]) for t in range(45)], dtype=torch.float64
    )
    assert_schedule(fo.join_schedules(parts, bounds), ref, terms)


@SETTINGS
@given(
    st.floats(1e-4, 1),
    st.integers(0, 10),
    st.sampled_from(["const", "linear", "cosine"]),
    st.integers(0, 30),
)
def test_dreamerv3_schedule(lr: float, warmup: int, schedule: str, extra: int) -> None:
    anneal = warmup + max(extra, 1) if schedule == "cosine" else extra
    fn = fo.dreamerv3_schedule(lr, warmup, schedule, anneal)
    assert_schedule(fn, lambda t: dreamer_lr(t, lr, warmup, schedule, anneal))


# ---------------------------------------------------------------------------------------------
# Loss scales.


@SETTINGS
@given(problems(min_steps=1, max_steps=1), st.booleans())
def test_noop_loss_scale(problem: Problem, finite: bool) -> None:
    ls = NoOpLossScale()
    g = problem.grads[0]
    assert ls.scale(g) is g
    assert ls.unscale(g) is g
    assert ls.adjust(torch.tensor(finite)) is ls
    assert float(ls.loss_scale) == 1.0


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


@SETTINGS
@given(problems(min_steps=1, max_steps=1), st.floats(1e-3, 2.0**24), st.booleans())
def test_static_loss_scale(problem: Problem, s: float, finite: bool) -> None:
    ls = StaticLossScale(s)
    g = problem.grads[0]
    # one product each: the same op on the same values, bit for bit
    assert_bitwise(ls.scale(g), tmap(lambda x: x * f32(s), g))
    # GradScaler unscales with the float32 reciprocal of the float32 scale, computed in float64.
    inv = f32(1.0 / f32(s))
    assert_bitwise(ls.unscale(g), tmap(lambda x: x * inv, g))
    assert ls.adjust(torch.tensor(finite)) is ls
    assert float(ls.loss_scale) == f32(s)


def test_dynamic_loss_scale_defaults_match_grad_scaler() -> None:
    ls = DynamicLossScale()
    scaler = torch.amp.GradScaler("cpu")
    assert float(ls.loss_scale) == scaler.get_scale() == 2.0**16
    assert ls.period == scaler.get_growth_interval() == 2000
    assert ls.factor == scaler.get_growth_factor() == 1 / scaler.get_backoff_factor() == 2.0
    assert ls.min_scale == 1.0


@SETTINGS
@given(
    st.integers(-10, 127),
    st.integers(1, 5),
    st.sampled_from([2.0, 1.5, 4.0]),
    st.sampled_from([1.0, 2.0**-20, 0.5, 256.0]),
    st.lists(st.booleans(), min_size=10, max_size=60),
)
def test_dynamic_loss_scale_rules(
    exponent: int, period: int, factor: float, min_scale: float, finite: list[bool]
) -> None:
    """GradScaler's rules plus a floor: x factor after ``period`` finite steps in a row (if the
    result is finite in float32), / factor on overflow (never below ``min_scale``)."""
    scale = max(2.0**exponent, min_scale)
    ls = DynamicLossScale(scale, period, factor, min_scale)
    counter = 0
    for t, ok in enumerate(finite):
        ls = ls.adjust(torch.tensor(ok))
        if ok:
            counter += 1
            if counter == period:
                grown = f32(scale * factor)
                scale = grown if math.isfinite(grown) else scale
                counter = 0
        else:
            scale = max(min_scale, f32(scale / factor))
            counter = 0
        # float32 products and quotients of float32 values, as rounding the exact float64
        # results to float32 gives them (double rounding is harmless for these ops): equal
        assert float(ls.loss_scale) == scale, t
        assert int(ls.counter) == counter, t
        assert ls.loss_scale.dtype == torch.float32
        assert (ls.period, ls.factor, ls.min_scale) == (period, factor, min_scale)


@SETTINGS
@given(
    st.integers(-10, 127),
    st.integers(1, 5),
    st.lists(st.booleans(), min_size=10, max_size=60),
)
def test_dynamic_loss_scale_matches_torch_amp_update_scale(
    exponent: int, period: int, finite: list[bool]
) -> None:
    """Same sequence as the kernel behind ``GradScaler.update`` (factor 2, backoff 0.5), with a
    floor too low to matter."""
    ls = DynamicLossScale(2.0**exponent, period, 2.0, 2.0**-100)
    scale = torch.tensor(2.0**exponent, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for t, ok in enumerate(finite):
        ls = ls.adjust(torch.tensor(ok))
        found_inf = torch.tensor(0.0 if ok else 1.0)
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, period)
        assert float(ls.loss_scale) == float(scale), t
        assert int(ls.counter) == int(tracker), t


@SETTINGS
@given(problems(min_steps=1, max_steps=1), st.integers(-10, 30))
def test_dynamic_loss_scale_scale_unscale(problem: Problem, exponent: int) -> None:
    ls = DynamicLossScale(2.0**exponent)
    g = problem.grads[0]
    assert_bitwise(ls.scale(g), tmap(lambda x: x * 2.0**exponent, g))
    assert_bitwise(ls.unscale(ls.scale(g)), g)
    finite = fo.loss_scale.all_finite(g)
    assert finite.dtype == torch.bool and bool(finite)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_detects_non_finite(bad: float) -> None:
    tree = {"a": torch.ones(3), "b": [None, torch.tensor(bad)]}
    assert not bool(fo.loss_scale.all_finite(tree))
    assert bool(fo.loss_scale.all_finite({"a": torch.ones(3), "b": [None]}))
