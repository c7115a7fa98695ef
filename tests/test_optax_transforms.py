"""optax's pieces (issue 17, section 2): target network updates, guards (``zero_nans``,
``set_to_zero``, ``freeze``), ``MultiSteps(should_skip_update_fn=...)`` with
``skip_not_finite``/``skip_large_updates``, monitoring (``snapshot``, ``monitor``,
``measure_with_ema``) and ``adaptive_grad_clip(axis=...)``.

Formulas are checked against float64 references at derived rounding counts; selections and
copies bit for bit. ``torch.func.vmap`` runs stand for "no host sync": a read of a batched
tensor on the host (``bool``, ``.item()``) raises under it. The comparisons with optax itself
are in ``test_oracle_optax_transforms.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from conftest import assert_bitwise, assert_close_rounding
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_opt as fo
from functional_opt.base import stateless
from functional_opt.testing import check_transform
from functional_opt.transforms import accumulation

NAN, INF = math.nan, math.inf


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 4, generator=gen).to(dtype),
        "b": torch.randn(4, generator=gen).to(dtype),
        "s": torch.randn((), generator=gen).to(dtype),
    }


def _like(params: dict[str, Any], seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()}


def _clone(tree: Any) -> Any:
    return fo.tree.map_params(torch.clone, tree)


# --- target networks --------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(step_size=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_incremental_update_is_polyak_averaging(step_size: float, seed: int) -> None:
    new, old = _params(seed), _params(seed + 1)
    before_new, before_old = _clone(new), _clone(old)
    got = fo.incremental_update(new, old, step_size)
    s32 = torch.tensor(step_size, dtype=torch.float32).double()
    r32 = torch.tensor(1.0 - step_size, dtype=torch.float32).double()
    for k in new:
        expected = s32 * new[k].double() + r32 * old[k].double()
        terms = (s32 * new[k].double()).abs() + (r32 * old[k].double()).abs()
        # two products and their sum, rounded to float32 (the scalars above are float32 already)
        assert_close_rounding(
            got[k], expected, dtype=torch.float32, ops=3, scale=terms, check_dtype=False, msg=k
        )
        assert got[k].dtype == torch.float32
    assert_bitwise(new, before_new, "new_tensors unchanged")
    assert_bitwise(old, before_old, "old_tensors unchanged")


def test_incremental_update_ends_none_and_dtypes() -> None:
    new, old = _params(0), _params(1)
    assert_bitwise(fo.incremental_update(new, old, 1.0), new, "step_size=1 copies new")
    assert_bitwise(fo.incremental_update(new, old, 0.0), old, "step_size=0 keeps old")
    assert_bitwise(fo.incremental_update(new, old, torch.tensor(1.0)), new, "a tensor step_size")
    # A None leaf of new gives None (optax); the target keeps its dtype.
    got = fo.incremental_update({**new, "b": None}, {**old, "b": old["b"]}, 0.5)
    assert got["b"] is None
    target16 = fo.tree.map_params(lambda x: x.to(torch.bfloat16), old)
    mixed = fo.incremental_update(new, target16, 0.25)
    for k in new:
        assert mixed[k].dtype == torch.bfloat16
        expected = 0.25 * new[k].double() + 0.75 * target16[k].double()
        terms = (0.25 * new[k].double()).abs() + (0.75 * target16[k].double()).abs()
        # float32 math (3 roundings), then one rounding to bfloat16
        assert_close_rounding(
            mixed[k],
            expected,
            dtype=torch.bfloat16,
            ops={torch.float32: 3, torch.bfloat16: 1},
            scale=terms,
            check_dtype=False,
            msg=k,
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step_size": 1.5}, "step_size"),
        ({"step_size": -0.1}, "step_size"),
        ({"step_size": NAN}, "step_size"),
        ({"step_size": "0.1"}, "step_size"),
        ({"step_size": torch.ones(2)}, "step_size"),
        ({"step_size": 0.1, "old": {"w": torch.zeros(4, 3)}}, r"\['w'\].*old_tensors has shape"),
        ({"step_size": 0.1, "old": {"v": torch.zeros(3, 4)}}, "old_tensors"),
        ({"step_size": 0.1, "old": {"w": None}}, r"old_tensors at \['w'\] is None"),
        ({"step_size": 0.1, "new": {"w": torch.zeros(3, 4, dtype=torch.int64)}}, "new_tensors"),
    ],
)
def test_incremental_update_refuses(kwargs: dict[str, Any], match: str) -> None:
    kwargs = dict(kwargs)
    new = kwargs.pop("new", {"w": torch.zeros(3, 4)})
    old = kwargs.pop("old", {"w": torch.ones(3, 4)})
    with pytest.raises((ValueError, TypeError), match=match):
        fo.incremental_update(new, old, **kwargs)


def test_periodic_update_copies_every_period() -> None:
    new, old = _params(0), _params(1)
    for step in range(7):
        for steps in (step, torch.tensor(step, dtype=torch.int32)):
            got = fo.periodic_update(new, old, steps, 3)
            assert_bitwise(got, new if step % 3 == 0 else old, f"steps={steps!r}")
            if step % 3 == 0:  # a copy: editing the online net later leaves the target alone
                for k in new:
                    assert got[k].data_ptr() != new[k].data_ptr()
    # update_period as a tensor; integer leaves (buffers) are selected too
    got = fo.periodic_update(
        {"n": torch.tensor(5)}, {"n": torch.tensor(2)}, torch.tensor(8), torch.tensor(4)
    )
    assert_bitwise(got, {"n": torch.tensor(5)})


def test_periodic_update_reads_nothing_on_the_host() -> None:
    # Under vmap a host read of the batched steps would raise.
    new, old = {"w": torch.randn(6, 2)}, {"w": torch.randn(6, 2)}
    steps = torch.arange(6)
    got = torch.func.vmap(lambda n, o, t: fo.periodic_update(n, o, t, 2))(new, old, steps)
    expected = torch.where((steps % 2 == 0)[:, None], new["w"], old["w"])
    assert_bitwise(got, {"w": expected})


@pytest.mark.parametrize(
    ("steps", "period", "match"),
    [
        (-1, 2, "steps"),
        (1.0, 2, "steps"),
        (torch.tensor(1.0), 2, "steps"),
        (torch.tensor([1, 2]), 2, "steps"),
        (torch.tensor(True), 2, "steps"),
        (1, 0, "update_period"),
        (1, 2.0, "update_period"),
        (1, 2**63, "update_period"),
    ],
)
def test_periodic_update_refuses(steps: Any, period: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        fo.periodic_update({"w": torch.zeros(2)}, {"w": torch.ones(2)}, steps, period)


# --- guards -----------------------------------------------------------------------------------


def test_zero_nans_replaces_nans_and_flags_leaves() -> None:
    params = _params(0)
    tx = fo.zero_nans()
    state = tx.init(params)
    assert_bitwise(state.found_nan, {k: torch.tensor(False) for k in params})
    g = _like(params, 1)
    g["w"][0, 1] = NAN
    g["w"][2, 2] = INF
    before = _clone(g)
    u, state = tx.update(g, state, params)
    expected = torch.where(before["w"].isnan(), 0.0, before["w"])
    assert_bitwise(u, {**before, "w": expected})
    assert_bitwise(
        state.found_nan,
        {"w": torch.tensor(True), "b": torch.tensor(False), "s": torch.tensor(False)},
    )
    assert_bitwise(g, before, "updates unchanged")
    # A None update keeps its leaf's flag; a clean update clears it.
    u, state = tx.update({"w": None, "b": g["b"], "s": g["s"]}, state, params)
    assert u["w"] is None and bool(state.found_nan["w"])
    _, state = tx.update(_like(params, 2), state, params)
    assert not any(bool(f) for f in state.found_nan.values())


def test_zero_nans_under_vmap() -> None:
    g = torch.randn(4, 3)
    g[2, 1] = NAN
    tx = fo.zero_nans()
    state = torch.func.vmap(tx.init)({"w": g})
    u, state = torch.func.vmap(lambda x, s: tx.update(x, s))({"w": g}, state)
    assert_bitwise(u["w"], torch.where(g.isnan(), 0.0, g))
    assert_bitwise(state.found_nan["w"], torch.tensor([False, False, True, False]))


def test_set_to_zero_keeps_params_bit_for_bit() -> None:
    params = {"w": torch.tensor([-0.0, 0.0, 1.5, NAN]), "b": torch.ones(2)}
    tx = fo.set_to_zero()
    g = {"w": torch.tensor([NAN, INF, -2.0, 3.0]), "b": None}
    u, state = tx.update(g, tx.init(params), params)
    assert state == fo.EmptyState() and u["b"] is None
    assert_bitwise(u["w"], torch.full((4,), -0.0))
    assert_bitwise(fo.apply_updates(params, u), params, "params unchanged, -0.0 included")


def test_freeze_zeroes_masked_leaves_and_keeps_no_state() -> None:
    params = _params(0)
    g = _like(params, 1)
    for mask, frozen in [
        ({"w": True, "b": False, "s": False}, {"w"}),
        (True, {"w", "b", "s"}),
        (False, set()),
        (lambda p: {k: v.dim() >= 1 for k, v in p.items()}, {"w", "b"}),
    ]:
        tx = fo.freeze(mask)
        state = tx.init(params)
        assert fo.state_to_dict(state) == {}
        u, _ = tx.update(g, state, params)
        for k in params:
            if k in frozen:
                assert_bitwise(u[k], torch.full_like(g[k], -0.0), k)
            else:
                assert u[k] is g[k], k  # passed on unchanged


@pytest.mark.parametrize("mask", [1, "w", None, 1.0, {"w": 1}, {"w": torch.tensor(True)}])
def test_freeze_refuses_masks_that_are_not_bools(mask: Any) -> None:
    with pytest.raises(TypeError, match="mask"):
        fo.freeze(mask)


def test_skip_functions() -> None:
    g = {"w": torch.tensor([1.0, NAN, INF]), "b": None, "c": torch.tensor([-INF])}
    skip, info = fo.skip_not_finite(g, torch.tensor(0), None)
    assert_bitwise(
        (skip, info),
        (
            torch.tensor(True),
            {"should_skip": torch.tensor(True), "num_not_finite": torch.tensor(3)},
        ),
    )
    skip, _ = fo.skip_not_finite({"w": torch.ones(2), "b": None}, torch.tensor(0), None)
    assert not bool(skip)
    # ||u||^2 = 2 exactly: skipped unless ||u||^2 < max_squared_norm (optax's comparison)
    ones = {"w": torch.ones(2), "b": None}
    assert bool(fo.skip_large_updates(ones, torch.tensor(0), None, 2.0)[0])
    skip, info = fo.skip_large_updates(ones, torch.tensor(0), None, 2.0000005)
    assert not bool(skip) and float(info["norm_squared"]) == 2.0
    assert bool(fo.skip_large_updates(g, torch.tensor(0), None, 1e30)[0])  # a NaN norm
    with pytest.raises(ValueError, match="max_squared_norm"):
        fo.skip_large_updates(ones, torch.tensor(0), None, -1.0)


# --- MultiSteps(should_skip_update_fn=...) ----------------------------------------------------


def _stream(params: dict[str, Any], n: int, bad: set[int]) -> list[dict[str, Any]]:
    out = []
    for t in range(n):
        g = _like(params, 100 + t)
        if t in bad:
            g["w"][1, 1] = NAN if t % 2 else INF
        out.append(g)
    return out


def _run(tx: Any, params: Any, grads: list[Any]) -> tuple[list[Any], list[Any]]:
    state = tx.init(params)
    updates, states = [], []
    for g in grads:
        u, state = tx.update(g, state, params)
        updates.append(u)
        states.append(state)
    return updates, states


@pytest.mark.parametrize("path", ["branch", "where"])
def test_multi_steps_skipped_mini_steps_never_happened(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = _params(0)
    bad = {1, 4, 5}
    grads = _stream(params, 9, bad)
    ms = fo.MultiSteps(fo.adam(0.1), 2, should_skip_update_fn=fo.skip_not_finite)
    if path == "where":  # the torch.where path of an accelerator's flag, compile and vmap
        monkeypatch.setattr(accumulation, "_can_branch", lambda counter: False)
    got_u, got_s = _run(ms, params, grads)
    plain = fo.MultiSteps(fo.adam(0.1), 2)
    want_u, want_s = _run(plain, params, [g for t, g in enumerate(grads) if t not in bad])
    kept = [t for t in range(len(grads)) if t not in bad]
    for t in range(len(grads)):
        n_bad = sum(1 for b in bad if b <= t)
        assert bool(got_s[t].skip_state["should_skip"]) == (t in bad)
        assert int(got_s[t].skip_state["num_not_finite"]) == (t in bad)
        if t in bad:
            assert_bitwise(
                got_u[t],
                fo.tree.map_params(lambda x: torch.full_like(x, -0.0), grads[t]),
                f"step {t}",
            )
            previous = got_s[t - 1] if t else ms.init(params)
            assert_bitwise(got_s[t]._replace(skip_state=()), previous._replace(skip_state=()))
        else:
            i = kept.index(t)
            assert i == t - n_bad
            assert_bitwise(got_u[t], want_u[i], f"updates at step {t}")
            assert_bitwise(got_s[t]._replace(skip_state=()), want_s[i], f"state at step {t}")


def test_multi_steps_skip_under_vmap_and_large_updates() -> None:
    # vmap: the flag is batched, so nothing may read it on the host.
    ms = fo.MultiSteps(
        fo.sgd(1.0),
        1,
        should_skip_update_fn=functools.partial(fo.skip_large_updates, max_squared_norm=4.0),
    )
    params = {"w": torch.zeros(3, 2)}
    g = {"w": torch.tensor([[1.0, 1.0], [2.0, 1.0], [0.5, 0.0]])}
    state = torch.func.vmap(ms.init)(params)
    assert_bitwise(state.skip_state["norm_squared"], torch.zeros(3))
    u, state = torch.func.vmap(lambda x, s, p: ms.update(x, s, p))(g, state, params)
    skipped = torch.tensor([False, True, False])
    assert_bitwise(state.skip_state["should_skip"], skipped)
    assert_bitwise(state.gradient_step, torch.tensor([1, 0, 1], dtype=torch.int32))
    assert_bitwise(u["w"], torch.where(skipped[:, None], -0.0, -g["w"]))


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda u, t, p: (torch.tensor(1.0), ()), "0-d bool"),
        (lambda u, t, p: (torch.tensor([True]), ()), "0-d bool"),
        (lambda u, t, p: torch.tensor(True), "pair"),
    ],
)
def test_multi_steps_refuses_bad_skip_answers(fn: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        fo.MultiSteps(fo.sgd(0.1), 2, should_skip_update_fn=fn).init({"w": torch.zeros(2)})


def test_multi_steps_refuses_a_skip_fn_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match="should_skip_update_fn"):
        fo.MultiSteps(fo.sgd(0.1), 2, should_skip_update_fn=0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="should_skip_update_fn"):
        fo.multi_steps(fo.sgd(0.1), 2, True, torch.float32)  # type: ignore[arg-type]


# --- monitoring -------------------------------------------------------------------------------


def test_monitor_records_measures_without_changing_updates() -> None:
    params = _params(0)
    tx = fo.chain(
        fo.monitor(
            {
                "grad_norm": fo.update_norm,
                "grad_rms": fo.update_rms,
                "not_finite": fo.update_not_finite,
                "not_finite_ema": fo.measure_with_ema(fo.update_not_finite, 0.5),
                "param_norm": stateless(lambda u, p: fo.update_norm(p)),
            }
        ),
        fo.sgd(0.1),
        fo.snapshot("update", lambda u: u),
    )
    state = tx.init(params)
    first = fo.measurements(state)
    assert sorted(first) == [
        "grad_norm",
        "grad_rms",
        "not_finite",
        "not_finite_ema",
        "param_norm",
        "update",
    ]
    paths = sorted(fo.state_to_dict(state))
    flags = []
    for t in range(3):
        g = _like(params, 10 + t)
        if t == 1:
            g["b"][0] = INF
        before = _clone(g)
        u, state = tx.update(g, state, params)
        assert_bitwise(g, before, "gradients unchanged")
        m = fo.measurements(state)
        n = sum(x.numel() for x in g.values())
        norm64 = torch.sqrt(sum((x.double() ** 2).sum() for x in g.values()))
        if t != 1:
            # a sum of n squares (n roundings), the square root, and the quotient by sqrt(n)
            assert_close_rounding(
                m["grad_norm"], norm64, dtype=torch.float32, ops=n + 2, check_dtype=False
            )
            assert_close_rounding(
                m["grad_rms"],
                norm64 / math.sqrt(n),
                dtype=torch.float32,
                ops=n + 4,
                check_dtype=False,
            )
        flags.append(float(t == 1))
        assert bool(m["not_finite"]) == (t == 1)
        # the EMA of the flag, debiased: sum_i 0.5^(t-i) (1-0.5) f_i / (1 - 0.5^(t+1)); three
        # roundings per step carried in the average (two products, a sum), and the quotient
        ema = sum(0.5 ** (t - i) * 0.5 * f for i, f in enumerate(flags)) / (1 - 0.5 ** (t + 1))
        assert_close_rounding(
            m["not_finite_ema"],
            torch.tensor(ema, dtype=torch.float64),
            dtype=torch.float32,
            ops=3 * (t + 1) + 1,
            check_dtype=False,
        )
        assert_bitwise(m["param_norm"], fo.update_norm(params))
        assert_bitwise(m["update"], u)
        assert all(m["update"][k] is not u[k] for k in u)  # a copy, never the updates
        assert sorted(fo.state_to_dict(state)) == paths  # one structure from init on
    # checkpoint round trip
    loaded = fo.state_from_dict(tx.init(params), fo.state_to_dict(state))
    assert_bitwise(fo.measurements(loaded), fo.measurements(state))


def test_monitor_under_vmap_reads_nothing_on_the_host() -> None:
    g = torch.randn(4, 3)
    g[1, 0] = NAN
    tx = fo.monitor({"norm": fo.update_norm, "bad": fo.update_not_finite})
    state = torch.func.vmap(tx.init)({"w": g})
    u, state = torch.func.vmap(lambda x, s: tx.update(x, s))({"w": g}, state)
    assert_bitwise(u["w"], g)
    assert_bitwise(state.measurements["bad"], torch.tensor([False, True, False, False]))
    assert_bitwise(state.measurements["norm"][0], fo.update_norm({"w": g[0]}))


def test_measurements_refuses_duplicate_names() -> None:
    tx = fo.chain(fo.snapshot("n", fo.update_norm), fo.monitor({"n": fo.update_rms}))
    with pytest.raises(ValueError, match="'n'"):
        fo.measurements(tx.init({"w": torch.ones(2)}))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: fo.snapshot("", fo.update_norm), "measure_name"),
        (lambda: fo.snapshot(1, fo.update_norm), "measure_name"),
        (lambda: fo.snapshot("n", 1.0), "measure"),
        (lambda: fo.monitor({}), "measures"),
        (lambda: fo.monitor([fo.update_norm]), "measures"),
        (lambda: fo.monitor({"n": 1.0}), r"measures\['n'\]"),
        (lambda: fo.monitor({2: fo.update_norm}), "measures"),
        (lambda: fo.measure_with_ema(fo.update_norm, 1.0), "decay"),
        (lambda: fo.measure_with_ema(None, 0.9), "measure"),
    ],
)
def test_monitoring_refuses_bad_arguments(build: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_monitor_refuses_unknown_keywords() -> None:
    tx = fo.monitor({"n": fo.update_norm})
    with pytest.raises(TypeError, match="rng"):
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}), rng=1)


# --- adaptive_grad_clip(axis=...) ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 4), (4, 1), (2, 3, 2, 2), (5,), ()])
def test_adaptive_grad_clip_torch_layout_clips_per_output(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(shape, generator=gen, dtype=torch.float64)
    g = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3
    u, _ = fo.adaptive_grad_clip(0.2, axis="torch").update({"p": g}, fo.EmptyState(), {"p": p})
    # Reference: one unit per output row (axis 0) for rank >= 2, the whole tensor otherwise.
    rows = g.reshape(shape[0], -1) if len(shape) >= 2 else g.reshape(1, -1)
    prow = p.reshape(shape[0], -1) if len(shape) >= 2 else p.reshape(1, -1)
    gn = rows.norm(dim=1, keepdim=True)
    bound = 0.2 * prow.norm(dim=1, keepdim=True).clamp(min=1e-3)
    expected = torch.where(gn < bound, rows, rows * bound / gn).reshape(shape)
    unit = int(rows.shape[1])
    # a norm over a unit (unit + 1 roundings), the bound, the quotient and the product
    assert_close_rounding(u["p"], expected, dtype=torch.float64, ops=unit + 4)


def test_adaptive_grad_clip_torch_layout_is_the_transposed_default() -> None:
    # A Linear weight (out, in) under axis="torch" is its transpose (in, out) under optax's
    # default layout: the same units, so the same clipped values (norms summed in another
    # order: at the rule's count).
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(5, 7, generator=gen)
    g = torch.randn(5, 7, generator=gen) * 0.5
    u_t, _ = fo.adaptive_grad_clip(0.1, axis="torch").update({"w": g}, (), {"w": w})
    u_d, _ = fo.adaptive_grad_clip(0.1).update({"w": g.T}, (), {"w": w.T})
    assert not torch.equal(u_t["w"], g)  # some units were clipped
    assert_close_rounding(u_t["w"], u_d["w"].T, dtype=torch.float32, ops=7 + 4)
    # ... and differs from optax's default on the (out, in) weight itself
    u_j, _ = fo.adaptive_grad_clip(0.1).update({"w": g}, (), {"w": w})
    assert not torch.allclose(u_j["w"], u_t["w"])


def test_adaptive_grad_clip_axis_errors() -> None:
    params = {"w": torch.ones(3, 4), "b": torch.ones(4)}
    tx = fo.adaptive_grad_clip(0.1, axis=1)
    with pytest.raises(ValueError, match=r"\['b'\].*axis 1 is out of range"):
        tx.update(params, tx.init(params), params)
    for bad in ("rows", 1.0, True, (0, 0), [0.5], torch.tensor(0)):
        with pytest.raises((ValueError, TypeError), match="axis"):
            fo.adaptive_grad_clip(0.1, axis=bad)  # type: ignore[arg-type]
    # () makes each element a unit: |u| <= clipping * max(|p|, eps) elementwise
    u, _ = fo.adaptive_grad_clip(0.5, axis=()).update(
        {"w": torch.tensor([3.0, -0.1])}, (), {"w": torch.tensor([2.0, 1.0])}
    )
    assert_bitwise(u["w"], torch.tensor([1.0, -0.1]))


# --- the contract checks of functional_opt.testing --------------------------------------------

CONTRACT = {
    "zero_nans": lambda: fo.zero_nans(),
    "set_to_zero": lambda: fo.set_to_zero(),
    "freeze": lambda: fo.freeze({"w": True, "b": False, "s": False}),
    "monitor": lambda: fo.monitor(
        {
            "norm": fo.update_norm,
            "updates": lambda u: u,
            "rms_ema": fo.measure_with_ema(fo.update_rms, 0.9),
        }
    ),
    "snapshot": lambda: fo.snapshot("updates", lambda u: u),
    "multi_steps_skip": lambda: fo.multi_steps(
        fo.adam(0.1), 2, should_skip_update_fn=fo.skip_not_finite
    ),
    "agc_torch": lambda: fo.adaptive_grad_clip(0.1, axis="torch"),
}


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_contract_checks(name: str) -> None:
    # Every check but torch.compile's (tens of seconds each; the vmap check covers the
    # absence of host reads). A None gradient keeps each measurement's last value, and updates
    # of another shape than their param are refused (naming the leaf) also by transforms that
    # pass them on unchanged.
    check_transform(CONTRACT[name](), _params(0), skip=("compile",))


def test_measurements_of_none_updates_keep_their_last_value() -> None:
    params = _params(0)
    tx = fo.snapshot("u", lambda u: u)
    _, state = tx.update(_like(params, 1), tx.init(params), params)
    before = state.measurement["u"]["b"]
    _, state = tx.update({**_like(params, 2), "b": None}, state, params)
    assert state.measurement["u"]["b"] is before
    assert sorted(fo.state_to_dict(state)) == sorted(fo.state_to_dict(tx.init(params)))


@pytest.mark.parametrize("name", ["zero_nans", "monitor", "snapshot"])
def test_updates_of_another_shape_are_refused(name: str) -> None:
    params = _params(0)
    tx = CONTRACT[name]()
    with pytest.raises(ValueError, match=r"\['w'\]"):
        tx.update({**_like(params, 1), "w": torch.ones(4, 3)}, tx.init(params), params)


def test_monitor_compiles_once() -> None:
    # Dynamo only (backend="eager": no inductor, fast): fresh updates each step reuse the graph
    # (the copy of a measured update leaf must not guard on the tensors' ids).
    params = _params(0)
    tx = fo.chain(fo.monitor({"norm": fo.update_norm}), fo.snapshot("u", lambda u: u))
    step = torch.compile(tx.update, backend="eager", fullgraph=True)
    state = tx.init(params)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(3):
            u, state = step(_like(params, t), state, params)
    assert_bitwise(fo.measurements(state)["u"], u)
