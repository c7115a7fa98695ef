"""Oracle tests: ``lion``, ``lamb``, ``rmsprop``, ``adagrad``, ``nadam``, ``radam`` and
``adabelief`` (and the transforms they are chains of) match optax's namesakes in float64, update
by update and state by state, over generated gradient streams.

Tolerance (``tests/conftest.py``'s rule 2, with the roundings counted where they happen)
--------------------------------------------------------------------------------------
These optimizers are not all sums and products of nonnegative terms, so a magnitude run
(``MagnitudeRun``) does not bound their errors: AdaBelief subtracts the mean from the gradient,
centered RMSProp the squared mean from the mean square, LAMB divides by the norm of a step whose
terms cancel, RAdam's ``rho_t - 4`` cancels, and Lion takes a sign. So each is also written here
as a float64 reference in :class:`Tracked` numbers, which carry with each value a first-order
bound on its error (Wilkinson's running error analysis) in units of ``u = eps(float64) / 2``:
every ``+ - * /``, square root and power adds its own rounding, counted relative to the
magnitudes of its operands (``|x| + |y|`` for a sum, which also covers any order or fused
multiply-add of a sum of terms), and propagates the errors of its inputs by its derivative
(errors carried in state add up over the steps; a decay only shrinks them). Two implementations
that each make at most those roundings are within ``B u`` of the exact value, so within
``2 B u = B eps`` of each other: the check is
``assert_close_rounding(ours, optax, ops=1, scale=B)`` with ``B`` the reference's bound.
A discrete choice on a computed value (a sign, ``rho_t >= threshold``) may go either way only
where the value is within its error bound of the switch; there the bound also takes the
difference between the two outcomes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree
import pytest
import torch
from conftest import assert_close_rounding
from hypothesis import example, given, settings
from hypothesis import strategies as st
from oracle_utils import (
    optax,
    optax_leaves,
    ours_leaves,
    randn,
    random_grads,
    random_params,
    to_jax,
)

import functional_opt as fo

U = float(torch.finfo(torch.float64).eps) / 2
TINY = float(torch.finfo(torch.float64).tiny)
"""A product, quotient or power below the normal range errs by up to half a subnormal ulp
absolutely (``u * TINY``): each adds ``TINY`` (in units of ``u``) to its bound."""
FTZ = TINY / (2 * U)
"""XLA on the CPU flushes subnormal results to zero: optax's values may differ from ours by up
to ``TINY`` absolutely, which is ``FTZ * eps`` (a bound of ``FTZ`` in units of ``u``, doubled
by the comparison)."""
STEPS = 6


def _t(x: Any) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


class Tracked:
    """A float64 value ``v`` with a bound ``b`` on its absolute error, in units of ``u``.

    The bounds of ``+``, ``*``, ``/`` and ``sqrt`` are rigorous, not first-order: an operation on
    values that carry errors ``b`` adds the worst case of those errors' effect (products of two
    errors, a denominator or a square root's argument that may be smaller than its value by its
    error), then its own rounding, relative to the computed value (``|v|`` plus the error
    found). First-order bounds fall short
    where an error is a large fraction of the value it is on: centered RMSProp's variance, which
    cancels to rounding noise, under a square root and then a divisor (hypothesis found a case
    1.37x over such a bound).

    ``low``: a lower bound of the computed value, ``v - b u`` unless an operation knows a
    better one (a square root's is at least 0, and a sum of values with such bounds at least
    their sum, rounded down), so that a divisor such as ``sqrt(variance) + eps`` keeps a
    positive bound where its error bound exceeds its value."""

    def __init__(self, v: Any, b: Any = 0.0, low: torch.Tensor | None = None) -> None:
        self.v = _t(v)
        self.b = torch.zeros_like(self.v) + _t(b)
        self.low = self.v - self.b * U if low is None else torch.maximum(low, self.v - self.b * U)

    @staticmethod
    def of(x: Any) -> Tracked:
        return x if isinstance(x, Tracked) else Tracked(x)  # an exact input

    def __add__(self, other: Any) -> Tracked:
        o = Tracked.of(other)
        err = self.b + o.b
        low = self.low + o.low
        low = torch.where(low >= 0, low * (1 - U), low * (1 + U))  # (rounded down)
        return Tracked(self.v + o.v, err + self.v.abs() + o.v.abs() + err * U, low)

    __radd__ = __add__

    def __neg__(self) -> Tracked:
        return Tracked(-self.v, self.b)

    def __sub__(self, other: Any) -> Tracked:
        return self + (-Tracked.of(other))

    def __rsub__(self, other: Any) -> Tracked:
        return Tracked.of(other) + (-self)

    def __mul__(self, other: Any) -> Tracked:
        o = Tracked.of(other)
        v = self.v * o.v
        err = o.v.abs() * self.b + self.v.abs() * o.b + self.b * o.b * U
        return Tracked(v, err + v.abs() + err * U + TINY)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Tracked:
        o = Tracked.of(other)
        v = self.v / o.v
        # |x'/y' - x/y| <= (|y| bx + |x| by) u / (|y| |y'|), with |y'| >= |y| - by u, and
        # y' >= y's low bound where that is positive
        room = torch.maximum(o.v.abs() - o.b * U, torch.where(o.v > 0, o.low, 0.0))
        err = torch.where(room > 0, (self.b + v.abs() * o.b) / room, math.inf)
        return Tracked(v, err + v.abs() + err * U + TINY)

    def __rtruediv__(self, other: Any) -> Tracked:
        return Tracked.of(other) / self

    def sqrt(self) -> Tracked:
        # for x' within d = b u of x: |sqrt(x') - sqrt(x)| = |x' - x| / (sqrt(x') + sqrt(x)),
        # at most d / (sqrt(x) + sqrt(max(x - d, 0))) (x' = x - d is the worst) and sqrt(d)
        x = self.v.clamp(min=0)
        v = x.sqrt()
        lower = (x - self.b * U).clamp(min=0).sqrt()
        first = torch.where(v > 0, self.b / (v + lower), torch.full_like(v, math.inf))
        err = torch.minimum(first, (self.b / U).sqrt())
        return Tracked(v, err + v + err * U, torch.zeros_like(v))  # (a square root is >= 0)

    def sum(self) -> Tracked:
        """A sum of ``n`` terms: ``n`` roundings relative to the sum of their magnitudes."""
        n = self.v.numel()
        return Tracked(self.v.sum(), self.b.sum() + n * self.v.abs().sum())

    @staticmethod
    def power(base: float, t: torch.Tensor) -> Tracked:
        """``base**t`` (exact inputs): a libm ``pow`` errs by at most 2 ulp (4 u) here, and by
        2 subnormal ulps below the normal range."""
        v = _t(base) ** t.to(torch.float64)
        flushed = torch.where(v.abs() < TINY, TINY / U, 0.0)  # XLA's flush to zero
        return Tracked(v, 4 * v.abs() + 4 * TINY + flushed)

    @staticmethod
    def choose(switch: Tracked, on: Tracked, off: Tracked) -> Tracked:
        """``on`` where ``switch >= 0``, else ``off``; where ``switch`` is within its error of
        0, either (the bound takes the larger error and the outcomes' difference)."""
        on, off = Tracked.of(on), Tracked.of(off)
        on_v, off_v = torch.broadcast_tensors(on.v, off.v)
        on_b, off_b = torch.broadcast_tensors(on.b, off.b)
        pick = switch.v >= 0
        v = torch.where(pick, on_v, off_v)
        b = torch.where(pick, on_b, off_b)
        unsure = switch.v.abs() <= switch.b * U
        either = torch.maximum(on_b, off_b) + (on_v - off_v).abs() / U
        return Tracked(v, torch.where(unsure, either, b))


def _moment(m: Tracked, g: Tracked, decay: float, order: int) -> Tracked:
    x = g if order == 1 else g * g
    return decay * m + (1 - Tracked(decay)) * x


def _debias(x: Tracked, decay: float, t: torch.Tensor) -> Tracked:
    return x / (1 - Tracked.power(decay, t))


def _mu_hat(mu: Tracked, g: Tracked, b1: float, t: torch.Tensor, nesterov: bool) -> Tracked:
    if not nesterov:
        return _debias(mu, b1, t)
    return b1 * _debias(mu, b1, t + 1) + (1 - Tracked(b1)) * _debias(g, b1, t)


def _sign(x: Tracked) -> Tracked:
    """``sign(x)``; where ``x`` is within its error of 0 any of -1, 0, 1 (a difference of 2)."""
    v = torch.sign(x.v)
    unsure = x.v.abs() <= x.b * U
    return Tracked(v, torch.where(unsure, torch.full_like(v, 2 / U), torch.zeros_like(v)))


# --- references: per leaf, flat lists of leaves; state a dict of lists of Tracked ----------

Ref = Callable[[list[Tracked], list[Tracked], dict[str, Any], torch.Tensor], list[Tracked]]


def ref_adam_core(
    g: Tracked, s: dict[str, Any], i: int, t: torch.Tensor, hp: dict[str, Any]
) -> Tracked:
    s["mu"][i] = _moment(s["mu"][i], g, hp["b1"], 1)
    s["nu"][i] = _moment(s["nu"][i], g, hp["b2"], 2)
    mu_hat = _mu_hat(s["mu"][i], g, hp["b1"], t, hp.get("nesterov", False))
    nu_hat = _debias(s["nu"][i], hp["b2"], t)
    return mu_hat / ((nu_hat + hp["eps_root"]).sqrt() + hp["eps"])


def ref_lamb(g, p, s, t, hp):
    out = []
    for i, (gi, pi) in enumerate(zip(g, p, strict=True)):
        a = ref_adam_core(gi, s, i, t, hp) + hp["weight_decay"] * pi
        p_norm, a_norm = (pi * pi).sum().sqrt(), (a * a).sum().sqrt()
        ratio = p_norm / a_norm
        if float(p_norm.v) == 0 or float(a_norm.v) == 0:  # (exact zeros in both)
            ratio = Tracked(1.0)
        out.append(-hp["lr"] * (a * ratio))
    return out


def ref_lion(g, p, s, t, hp):
    out = []
    for i, (gi, pi) in enumerate(zip(g, p, strict=True)):
        c = hp["b1"] * s["mu"][i] + (1 - Tracked(hp["b1"])) * gi
        out.append(-hp["lr"] * (_sign(c) + hp["weight_decay"] * pi))
        s["mu"][i] = _moment(s["mu"][i], gi, hp["b2"], 1)
    return out


def ref_rmsprop(g, p, s, t, hp):
    out = []
    for i, gi in enumerate(g):
        s["nu"][i] = _moment(s["nu"][i], gi, hp["decay"], 2)
        nu = _debias(s["nu"][i], hp["decay"], t) if hp["bias_correction"] else s["nu"][i]
        if hp["centered"]:
            s["mu"][i] = _moment(s["mu"][i], gi, hp["decay"], 1)
            mu = _debias(s["mu"][i], hp["decay"], t) if hp["bias_correction"] else s["mu"][i]
            nu = nu - mu * mu
        if hp["eps_in_sqrt"]:
            scaled = gi * (1 / (nu + hp["eps"]).sqrt())
        else:
            scaled = gi / (nu.sqrt() + hp["eps"])
        step = -hp["lr"] * scaled
        if hp["momentum"] is not None:
            s["trace"][i] = step + hp["momentum"] * s["trace"][i]
            step = step + hp["momentum"] * s["trace"][i] if hp["nesterov"] else s["trace"][i]
        out.append(step)
    return out


def ref_adagrad(g, p, s, t, hp):
    out = []
    for i, gi in enumerate(g):
        s["sum_of_squares"][i] = s["sum_of_squares"][i] + gi * gi
        total = s["sum_of_squares"][i]
        inv = 1 / (total + hp["eps"]).sqrt()
        inv = Tracked(torch.where(total.v > 0, inv.v, 0.0), torch.where(total.v > 0, inv.b, 0.0))
        out.append(-hp["lr"] * (gi * inv))
    return out


def ref_radam(g, p, s, t, hp):
    b2 = hp["b2"]
    rho_inf = 2 / (1 - Tracked(b2)) - 1
    b2_t = Tracked.power(b2, t)
    rho = rho_inf - 2 * Tracked(t.to(torch.float64)) * b2_t / (1 - b2_t)
    r = ((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho)).sqrt()
    out = []
    for i, gi in enumerate(g):
        s["mu"][i] = _moment(s["mu"][i], gi, hp["b1"], 1)
        s["nu"][i] = _moment(s["nu"][i], gi, b2, 2)
        mu_hat = _mu_hat(s["mu"][i], gi, hp["b1"], t, hp["nesterov"])
        nu_hat = _debias(s["nu"][i], b2, t)
        rectified = r * mu_hat / ((nu_hat + hp["eps_root"]).sqrt() + hp["eps"])
        out.append(-hp["lr"] * Tracked.choose(rho - hp["threshold"], rectified, mu_hat))
    return out


def ref_adabelief(g, p, s, t, hp):
    out = []
    for i, gi in enumerate(g):
        s["mu"][i] = _moment(s["mu"][i], gi, hp["b1"], 1)
        s["nu"][i] = _moment(s["nu"][i], gi - s["mu"][i], hp["b2"], 2) + hp["eps_root"]
        mu_hat = _mu_hat(s["mu"][i], gi, hp["b1"], t, hp["nesterov"])
        nu_hat = _debias(s["nu"][i], hp["b2"], t)
        out.append(-hp["lr"] * (mu_hat / (nu_hat.sqrt() + hp["eps"])))
    return out


# --- the comparison ----------------------------------------------------------------------


def _close(ours: Sequence[np.ndarray], theirs: Sequence[np.ndarray], ref, what: str) -> None:
    assert len(ours) == len(theirs) == len(ref), f"{what}: {len(ours)}, {len(theirs)}, {len(ref)}"
    for i, (a, e, r) in enumerate(zip(ours, theirs, ref, strict=True)):
        x, y = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(e))
        assert x.shape == y.shape == r.v.shape, f"{what}, leaf {i}: shapes"
        # Where the reference's own error bound exceeds its value, the value is rounding noise
        # (centered RMSProp's first bias-corrected variance cancels to noise of either sign):
        # optax's square root of a negative noise is NaN there, ours clamps the variance at 0
        # and stays finite, which the bound then covers.
        noise = torch.isnan(y) & torch.isfinite(x) & (r.b >= r.v.abs())
        y = torch.where(noise, x, y)
        # |ours - optax| <= B eps (see the module docstring): ops=1 with the bound B as scale
        assert_close_rounding(
            x, y, dtype=torch.float64, ops=1, scale=r.b + FTZ, msg=f"{what}, leaf {i}"
        )


def run_against_optax(
    ours: fo.GradientTransformation,
    theirs: Any,
    ref: Ref,
    state_keys: Sequence[str],
    hp: dict[str, Any],
    seed: int,
    steps: int = STEPS,
) -> None:
    """Runs ``ours``, optax's ``theirs`` and the tracked reference on the same gradients and
    params (ours, moved by our updates), comparing updates and float state leaves (in the
    order ``state_keys`` lists the reference's state) each step; integer leaves (counters)
    must be equal."""
    # one tree structure (JAX compiles its eager kernels once per shape), values from the seed
    rng = np.random.default_rng(seed)
    params = optree.tree_map(lambda x: randn(rng, tuple(x.shape)), random_params(0))
    grads = random_grads(seed, params, steps=steps)
    leaves = optree.tree_leaves(params)
    state = {k: [Tracked(torch.zeros_like(x)) for x in leaves] for k in state_keys}
    for k, init in hp.get("init_state", {}).items():
        state[k] = [Tracked(torch.full_like(x, init)) for x in leaves]
    s_o, s_t = ours.init(params), theirs.init(to_jax(params))
    p = params
    for step, g in enumerate(grads):
        u_o, s_o = ours.update(g, s_o, p)
        u_t, s_t = theirs.update(to_jax(g), s_t, to_jax(p))
        exact = [Tracked(x) for x in optree.tree_leaves(g)]
        u_r = ref(
            exact, [Tracked(x) for x in optree.tree_leaves(p)], state, torch.tensor(step + 1), hp
        )
        _close(ours_leaves(u_o), optax_leaves(u_t), u_r, f"updates at step {step}")
        mine, theirs_ = ours_leaves(s_o), optax_leaves(s_t)
        ints = [(a, b) for a, b in zip(mine, theirs_, strict=True) if a.dtype.kind in "iu"]
        for a, b in ints:
            np.testing.assert_array_equal(a, b, err_msg=f"counter after step {step}")
        floats_o = [a for a in mine if a.dtype.kind == "f"]
        floats_t = [b for b in theirs_ if b.dtype.kind == "f"]
        expected_state = [x for k in state_keys for x in state[k]]
        _close(floats_o, floats_t, expected_state, f"state after step {step}")
        p = fo.apply_updates(p, u_o)


# --- the cases -----------------------------------------------------------------------------

SETTINGS = settings(max_examples=4, deadline=None, database=None)
seeds = st.integers(0, 2**16)
decays = st.floats(0.0, 0.99)
lrs = st.floats(1e-3, 0.5)


@SETTINGS
@given(seed=seeds, lr=lrs, b1=decays, b2=decays, wd=st.sampled_from([0.0, 0.01, 0.5]))
def test_lion_matches_optax(seed, lr, b1, b2, wd):
    hp = {"lr": lr, "b1": b1, "b2": b2, "weight_decay": wd}
    ours = fo.lion(lr, b1, b2, weight_decay=wd)
    theirs = optax.lion(lr, b1, b2, weight_decay=wd)
    run_against_optax(ours, theirs, ref_lion, ["mu"], hp, seed)


@pytest.mark.numerics
@SETTINGS
@given(
    seed=seeds,
    lr=lrs,
    b1=decays,
    b2=st.floats(0.5, 0.999),
    eps=st.sampled_from([1e-6, 0.1]),
    eps_root=st.sampled_from([0.0, 1e-4]),
    wd=st.sampled_from([0.0, 0.01, 1.0]),
)
def test_lamb_matches_optax(seed, lr, b1, b2, eps, eps_root, wd):
    hp = {"lr": lr, "b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root, "weight_decay": wd}
    ours = fo.lamb(lr, b1, b2, eps, eps_root, weight_decay=wd)
    theirs = optax.lamb(lr, b1, b2, eps, eps_root, weight_decay=wd)
    run_against_optax(ours, theirs, ref_lamb, ["mu", "nu"], hp, seed)


def _centered_first_update(seed: int, decay: float) -> Any:
    """An explicit case of centered, bias-corrected RMSProp (``eps=1e-8``, no momentum), whose
    first update divides by the square root of a variance that cancels to rounding noise."""
    return example(
        seed=seed,
        lr=0.5,
        decay=decay,
        eps=1e-8,
        initial_scale=0.0,
        eps_in_sqrt=False,
        centered=True,
        momentum=None,
        nesterov=False,
        bias_correction=True,
    )


@settings(max_examples=8, deadline=None, database=None)
@given(
    seed=seeds,
    lr=lrs,
    decay=decays,
    eps=st.sampled_from([1e-8, 1e-3]),
    initial_scale=st.sampled_from([0.0, 0.5]),
    eps_in_sqrt=st.booleans(),
    centered=st.booleans(),
    momentum=st.sampled_from([None, 0.0, 0.9]),
    nesterov=st.booleans(),
    bias_correction=st.booleans(),
)
# found by hypothesis: the first bias-corrected centered update cancels (nu_hat - mu_hat^2 is
# rounding noise); a negative noise gave NaN, which the variance's clamp at 0 removes
@_centered_first_update(seed=0, decay=0.25)
# found by hypothesis (2026-12-07): the same cancellation with a denominator whose error bound is
# a large fraction of it, where first-order bounds of the square root and the quotient fell
# short (1.37x); the tracker's bounds of both are rigorous now (see Tracked.sqrt, __truediv__)
@_centered_first_update(seed=918, decay=0.125)
def test_rmsprop_matches_optax(
    seed, lr, decay, eps, initial_scale, eps_in_sqrt, centered, momentum, nesterov, bias_correction
):
    kw = {
        "decay": decay,
        "eps": eps,
        "initial_scale": initial_scale,
        "eps_in_sqrt": eps_in_sqrt,
        "centered": centered,
        "momentum": momentum,
        "nesterov": nesterov,
        "bias_correction": bias_correction,
    }
    hp = {"lr": lr, **kw, "init_state": {"nu": initial_scale}}
    keys = (["mu"] if centered else []) + ["nu"] + (["trace"] if momentum is not None else [])
    run_against_optax(fo.rmsprop(lr, **kw), optax.rmsprop(lr, **kw), ref_rmsprop, keys, hp, seed)


@SETTINGS
@given(
    seed=seeds,
    lr=lrs,
    initial=st.sampled_from([0.0, 0.1, 2.0]),
    eps=st.sampled_from([0.0, 1e-7, 0.1]),
)
def test_adagrad_matches_optax(seed, lr, initial, eps):
    hp = {"lr": lr, "eps": eps, "init_state": {"sum_of_squares": initial}}
    ours = fo.adagrad(lr, initial, eps)
    theirs = optax.adagrad(lr, initial, eps)
    run_against_optax(ours, theirs, ref_adagrad, ["sum_of_squares"], hp, seed)


@SETTINGS
@given(seed=seeds, lr=lrs, b1=decays, b2=st.floats(0.5, 0.999), eps_root=st.sampled_from([0, 1e-6]))
def test_nadam_matches_optax(seed, lr, b1, b2, eps_root):
    hp = {"lr": lr, "b1": b1, "b2": b2, "eps": 1e-8, "eps_root": eps_root, "nesterov": True}

    def ref(g, p, s, t, hp):
        return [-hp["lr"] * ref_adam_core(gi, s, i, t, hp) for i, gi in enumerate(g)]

    ours = fo.nadam(lr, b1, b2, eps_root=eps_root)
    theirs = optax.nadam(lr, b1, b2, eps_root=eps_root)
    run_against_optax(ours, theirs, ref, ["mu", "nu"], hp, seed)


@SETTINGS
@given(
    seed=seeds,
    lr=lrs,
    b1=decays,
    # rho_inf = 2 / (1 - b2) - 1 >= threshold within the steps run for the larger b2s
    b2=st.floats(0.6, 0.999),
    threshold=st.sampled_from([4.0, 5.0, 6.5]),
    nesterov=st.booleans(),
)
def test_radam_matches_optax(seed, lr, b1, b2, threshold, nesterov):
    hp = {
        "lr": lr,
        "b1": b1,
        "b2": b2,
        "eps": 1e-8,
        "eps_root": 0.0,
        "threshold": threshold,
        "nesterov": nesterov,
    }
    ours = fo.radam(lr, b1, b2, threshold=threshold, nesterov=nesterov)
    theirs = optax.radam(lr, b1, b2, threshold=threshold, nesterov=nesterov)
    run_against_optax(ours, theirs, ref_radam, ["mu", "nu"], hp, seed, steps=8)


def test_radam_switches_within_the_run():
    # The hypothesis cases above must see both branches: with b2 = 0.9, rho_t crosses 5 at
    # t = 6 (rho_5 = 4.4...: unrectified, rho_6 = 5.1...: rectified).
    _, r = fo.transforms.radam.rectification(0.9, torch.tensor(6), 5.0)
    on = [bool(fo.transforms.radam.rectification(0.9, torch.tensor(t), 5.0)[0]) for t in (5, 6)]
    assert on == [False, True] and 0 < float(r) < 1


@SETTINGS
@given(
    seed=seeds,
    lr=lrs,
    b1=decays,
    b2=st.floats(0.5, 0.999),
    eps=st.sampled_from([1e-16, 1e-8]),
    eps_root=st.sampled_from([0.0, 1e-16, 1e-6]),
    nesterov=st.booleans(),
)
def test_adabelief_matches_optax(seed, lr, b1, b2, eps, eps_root, nesterov):
    hp = {"lr": lr, "b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root, "nesterov": nesterov}
    ours = fo.adabelief(lr, b1, b2, eps, eps_root, nesterov=nesterov)
    theirs = optax.adabelief(lr, b1, b2, eps, eps_root, nesterov=nesterov)
    run_against_optax(ours, theirs, ref_adabelief, ["mu", "nu"], hp, seed)


def test_lion_masked_weight_decay_matches_optax():
    # the mask goes to add_decayed_weights: the reference decays the masked-in params only
    params = random_params(3)
    mask = optree.tree_map(lambda p: p.ndim >= 1, params)
    hp = {"lr": 0.1, "b1": 0.9, "b2": 0.99, "weight_decay": 0.3}
    ours, theirs = (
        fo.lion(0.1, mask=mask, weight_decay=0.3),
        optax.lion(0.1, mask=mask, weight_decay=0.3),
    )
    s_o, s_t = ours.init(params), theirs.init(to_jax(params))
    state = {"mu": [Tracked(torch.zeros_like(x)) for x in optree.tree_leaves(params)]}
    decayed = [
        Tracked(x if on else torch.zeros_like(x))
        for x, on in zip(optree.tree_leaves(params), optree.tree_leaves(mask), strict=True)
    ]
    assert any(optree.tree_leaves(mask)) and not all(optree.tree_leaves(mask))
    for step, g in enumerate(random_grads(3, params, steps=3)):
        u_o, s_o = ours.update(g, s_o, params)
        u_t, s_t = theirs.update(to_jax(g), s_t, to_jax(params))
        g_leaves = [Tracked(x) for x in optree.tree_leaves(g)]
        expected = ref_lion(g_leaves, decayed, state, torch.tensor(step + 1), hp)
        _close(ours_leaves(u_o), optax_leaves(u_t), expected, f"updates at step {step}")


# --- the new transforms alone ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["hard", "smooth", "refined"])
def test_scale_by_lion_modes_match_optax(mode):
    params = random_params(5)
    ours = fo.scale_by_lion(0.8, 0.95, mode=mode, smooth_beta=2.0)
    theirs = optax.scale_by_lion(0.8, 0.95, mode=mode, smooth_beta=2.0)
    s_o, s_t = ours.init(params), theirs.init(to_jax(params))
    mu = [Tracked(torch.zeros_like(x)) for x in optree.tree_leaves(params)]
    for step, g in enumerate(random_grads(5, params, steps=4)):
        u_o, s_o = ours.update(g, s_o)
        u_t, s_t = theirs.update(to_jax(g), s_t)
        expected = []
        for i, gi in enumerate(optree.tree_leaves(g)):
            c = 0.8 * mu[i] + (1 - Tracked(0.8)) * Tracked(gi)
            if mode == "hard":
                expected.append(_sign(c))
            elif mode == "refined":  # continuous, of slope <= 1: c's error at most
                expected.append(Tracked(torch.where(c.v.abs() < 1, c.v, torch.sign(c.v)), c.b))
            else:  # tanh(2 c): its slope 2 (1 - v^2) times c's error and the product's
                v = torch.tanh(2 * c.v)
                err = 2 * (1 - v * v) * (c.b + c.v.abs())
                expected.append(Tracked(v, err + 4 * v.abs()))  # tanh: 2 ulp
            mu[i] = _moment(mu[i], Tracked(gi), 0.95, 1)
        _close(ours_leaves(u_o), optax_leaves(u_t), expected, f"{mode}: updates, step {step}")


@pytest.mark.parametrize(
    ("min_norm", "coefficient", "eps"), [(0.0, 1.0, 0.0), (0.5, 0.7, 1e-3), (10.0, 2.0, 0.0)]
)
def test_scale_by_trust_ratio_matches_optax(min_norm, coefficient, eps):
    params = random_params(6)
    params["zero"] = torch.zeros(3, dtype=torch.float64)  # ratio 1 (or min_norm's)
    ours = fo.scale_by_trust_ratio(min_norm, coefficient, eps)
    theirs = optax.scale_by_trust_ratio(min_norm, coefficient, eps)
    for g in random_grads(6, params, steps=3):
        u_o, _ = ours.update(g, ours.init(params), params)
        u_t, _ = theirs.update(to_jax(g), theirs.init(to_jax(params)), to_jax(params))
        expected = []
        for gi, pi in zip(optree.tree_leaves(g), optree.tree_leaves(params), strict=True):
            p_norm = (Tracked(pi) * Tracked(pi)).sum().sqrt()
            u_norm = (Tracked(gi) * Tracked(gi)).sum().sqrt()
            p_norm = p_norm if float(p_norm.v) > min_norm else Tracked(min_norm)
            u_norm = u_norm if float(u_norm.v) > min_norm else Tracked(min_norm)
            if float(p_norm.v) == 0 or float(u_norm.v) == 0:
                ratio = Tracked(1.0)
            else:
                ratio = coefficient * p_norm / (u_norm + eps)
            expected.append(Tracked(gi) * ratio)
        _close(ours_leaves(u_o), optax_leaves(u_t), expected, "trust ratio")


def test_optax_state_layouts_match():
    # the state types (fields and order) of the new transforms are optax's
    params = random_params(7)
    pairs = [
        (fo.scale_by_lion(), optax.scale_by_lion()),
        (fo.scale_by_rss(), optax.scale_by_rss()),
        (fo.scale_by_radam(), optax.scale_by_radam()),
        (fo.scale_by_belief(), optax.scale_by_belief()),
        (fo.scale_by_stddev(), optax.scale_by_stddev()),
        (fo.scale_by_stddev(bias_correction=True), optax.scale_by_stddev(bias_correction=True)),
    ]
    for ours, theirs in pairs:
        s_o, s_t = ours.init(params), theirs.init(to_jax(params))
        assert s_o._fields == s_t._fields, (s_o._fields, s_t._fields)
        assert [a.shape for a in ours_leaves(s_o)] == [b.shape for b in optax_leaves(s_t)]
