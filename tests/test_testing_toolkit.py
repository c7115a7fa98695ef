"""functional_opt.testing: every check passes on the library's transforms and fails, naming the
check and the leaf, on a transform broken in the way the check is about; the reference
comparison and the strategies."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_opt as fo
import functional_opt.testing as fot
from functional_opt.testing import strategies as fst

SETTINGS = settings(max_examples=10, deadline=None)


def make_params() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3, generator=gen),
        "b": [torch.randn(3, generator=gen)],
        "s": torch.randn((), generator=gen),
    }


GOOD = {
    "adam": lambda: fo.adam(1e-2),
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=2, weight_decay=0.1),
    "chain": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.trace(0.9), fo.scale(-1e-2)),
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_check_transform_passes_on_the_library_transforms(name: str) -> None:
    fot.check_transform(GOOD[name](), make_params(), skip=["compile"])


def test_check_transform_passes_on_packed_params_and_faulty_streams() -> None:
    params = make_params()
    faults = [fot.Fault(1, 0), fot.Fault(2, 2, float("inf"), 5)]
    grads = fot.gradient_stream(params, 3, seed=1, faults=faults)
    assert bool(grads[1]["b"][0].isnan().any()) and bool(grads[2]["w"].isinf().any())
    fot.check_transform(fo.apply_if_finite(fo.adam(1e-2), 2), params, grads, skip=["compile"])
    fot.check_transform(fo.adam(1e-2), fo.pack(params), skip=["compile"])


def test_check_transform_refuses_an_unknown_check() -> None:
    with pytest.raises(ValueError, match="unknown checks"):
        fot.check_transform(fo.adam(1e-2), make_params(), skip=["purty"])


# --------------------------------------------------------------------------- broken transforms


class MState(NamedTuple):
    m: Any


def momentum_like(step: Any, *, donated: Any = None, init: Any = None) -> fo.GradientTransformation:
    """A transform written as users do (``fo.tree.split``), with its per-leaf math
    ``step(g, m) -> (u, m')`` (``donated``: the math when ``donate=True``)."""

    def init_fn(params: Any) -> MState:
        return MState(fo.tree.map_params(init or torch.zeros_like, params))

    def update_fn(updates: Any, state: MState, params: Any = None, **extra: Any) -> Any:
        g, at = fo.tree.split(updates)
        m = at.take(state.m, "state.m")
        fn = donated if donated is not None and extra.get("donate") is True else step
        pairs = [fn(x, y) for x, y in zip(g, m, strict=True)]
        new = [p[1] for p in pairs]
        return at.updates([p[0] for p in pairs]), MState(at.carry(state.m, new, "state.m"))

    return fo.GradientTransformation(init_fn, update_fn)


def ema_step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new = 0.9 * m + 0.1 * g
    return -0.01 * new, new


def fails(check: Any, pattern: str, tx: fo.GradientTransformation, *args: Any, **kw: Any) -> str:
    params = kw.pop("params", None) or make_params()
    with pytest.raises(AssertionError) as info:
        check(tx, params, *args, **kw)
    message = str(info.value)
    assert message.startswith(check.__name__ + ":"), message
    assert re.search(pattern, message), message
    return message


def test_the_helper_transform_passes() -> None:
    fot.check_transform(momentum_like(ema_step), make_params(), skip=["compile"])


def test_check_purity_fails_on_a_transform_that_writes_its_gradients() -> None:
    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g.mul_(0.1)  # in place: the caller's gradient changes
        return -g, 0.9 * m + g

    fails(fot.check_purity, r"wrote into its updates.* at leaf (w|b\.0|s)", momentum_like(step))


def test_check_purity_fails_on_hidden_state() -> None:
    calls = [0]

    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        return -g * calls[0], m

    fails(fot.check_purity, r"second update from the same inputs.*leaf", momentum_like(step))


def test_check_purity_fails_on_updates_that_alias_the_state() -> None:
    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = 0.9 * m + g
        return new, new  # editing the update would edit the state

    fails(
        fot.check_purity,
        r"update at leaf .* shares memory with the state entry m\.",
        momentum_like(step),
    )


def ignoring_none() -> fo.GradientTransformation:
    """Treats a ``None`` gradient as zeros: the moment decays and an update comes out."""

    def init_fn(params: Any) -> MState:
        return MState(fo.tree.map_params(torch.zeros_like, params))

    def update_fn(updates: Any, state: MState, params: Any = None, **extra: Any) -> Any:
        filled = fo.tree.map_params(lambda x: x, updates)
        leaves, spec = fo.tree.flatten(filled)
        ms = fo.tree.leaves(state.m)
        out = [
            None if m is None else 0.9 * m + (0 if g is None else g)
            for g, m in zip(leaves, ms, strict=True)
        ]
        return fo.tree.unflatten(spec, out), MState(fo.tree.unflatten(spec, out))

    return fo.GradientTransformation(init_fn, update_fn)


def test_check_none_gradients_fails_on_a_transform_that_ignores_none() -> None:
    fails(
        fot.check_none_gradients_keep_state,
        r"leaf b\.0's gradient None at step 0: its update is tensor",
        ignoring_none(),
        leaves=[0],
    )


def test_check_none_gradients_fails_on_a_moment_that_decays_without_gradient() -> None:
    def update_fn(updates: Any, state: MState, params: Any = None, **extra: Any) -> Any:
        g, at = fo.tree.split(updates)
        m = at.take(state.m, "state.m")
        decayed = fo.tree.map_params(lambda x: 0.9 * x, state.m)  # every leaf, None or not
        new = [0.9 * y + x for x, y in zip(g, m, strict=True)]
        return at.updates(new), MState(at.carry(decayed, new, "state.m"))

    tx = fo.GradientTransformation(
        lambda p: MState(fo.tree.map_params(torch.ones_like, p)), update_fn
    )
    fails(fot.check_none_gradients_keep_state, r"its own state entry m\.w changed", tx, leaves=[2])


def test_check_dtype_policy_fails_on_a_promoted_0d_leaf() -> None:
    lr = torch.tensor(0.01, dtype=torch.float64)

    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return -lr * g, m  # a 0-d float64 tensor promotes 0-d float32 gradients

    fails(
        fot.check_dtype_policy,
        r"as given at step 0: the update at leaf s is torch\.float64\[\]",
        momentum_like(step),
    )


def test_check_dtype_policy_fails_on_a_state_that_changes_dtype() -> None:
    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return -g, (m + g).double()

    fails(fot.check_dtype_policy, r"layout changed at \['m\.b\.0'", momentum_like(step))


def test_check_donation_fails_on_a_donated_path_with_other_math() -> None:
    def donated(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = m.mul_(0.9).add_(g, alpha=0.1)  # in place, but another rounding order
        return new.mul(-0.01), new

    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = (0.9 * m + 0.1 * g) * 1.0000001  # differs in the last bits
        return -0.01 * new, new

    fails(
        fot.check_donation,
        r"(updates|state) with donate=True at step \d vs pure: leaf",
        momentum_like(ema_step, donated=donated),
        flags=[True],
    )
    fails(
        fot.check_donation,
        r"donate=True at step 0 vs pure: leaf",
        momentum_like(ema_step, donated=step),
        flags=[True],
    )


def test_check_donation_fails_on_a_donated_path_that_writes_the_params() -> None:
    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        if extra.get("donate"):
            for p in fo.tree.leaves(params):
                p.mul_(1.0)  # a write, although the values stay
        return fo.tree.map_params(lambda g: -g, updates), state

    tx = fo.GradientTransformation(lambda p: fo.EmptyState(), update_fn)
    fails(
        fot.check_donation,
        r"donate='state' at step 0 wrote into the params:.*leaf",
        tx,
        flags=["state"],
    )


def test_check_checkpoint_fails_on_a_python_counter_and_on_state_outside_it() -> None:
    class CountState(NamedTuple):
        count: int

    def update_fn(updates: Any, state: CountState, params: Any = None, **extra: Any) -> Any:
        return updates, CountState(state.count + 1)

    tx = fo.GradientTransformation(lambda p: CountState(0), update_fn)
    fails(
        fot.check_checkpoint_round_trip,
        r"state_to_dict.*raised TypeError: state leaf count is a int",
        tx,
    )

    hidden: dict[str, Any] = {}

    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(tuple(g.shape))
        hidden[key] = hidden.get(key, 0) + 1
        return -g * hidden[key], m  # a step count the checkpoint cannot see

    fails(
        fot.check_checkpoint_round_trip,
        r"updates after restoring, at step 2: leaf",
        momentum_like(step),
    )


def test_check_mismatched_trees_fails_on_bare_errors_and_broadcasts() -> None:
    def unchecked(updates: Any, state: MState, params: Any = None, **extra: Any) -> Any:
        new = fo.tree.map_params(lambda x: x, updates)
        leaves, spec = fo.tree.flatten(new)
        ms = fo.tree.leaves(state.m)
        out = [0.9 * m + g for g, m in zip(leaves, ms, strict=False)]  # broadcasts, truncates
        return fo.tree.unflatten(spec, out), MState(
            fo.tree.unflatten(fo.tree.flatten(state.m)[1], out)
        )

    tx = fo.GradientTransformation(
        lambda p: MState(fo.tree.map_params(torch.zeros_like, p)), unchecked
    )
    fails(
        fot.check_mismatched_trees_error,
        r"updates with another shape at leaf w.*(raised RuntimeError|changed)",
        tx,
    )
    fot.check_mismatched_trees_error(fo.adam(1e-2), make_params())
    fot.check_mismatched_trees_error(fo.scale(0.5), make_params())  # never looks at other trees


def test_check_vmap_fails_on_a_host_read() -> None:
    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = 1.0 if float(g.abs().sum()) < 1e9 else 0.5  # a host sync vmap refuses
        return -scale * g, m

    fails(fot.check_vmap, r"vmap\(update\) at step 0 raised", momentum_like(step))


def test_check_compile_fails_where_compiled_code_computes_something_else() -> None:
    # (the one compiled case here, on dynamo's eager backend: tracing only)
    def step(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factor = 1.001 if torch.compiler.is_compiling() else 1.0
        return -0.01 * g * factor, m

    params = {"w": torch.randn(3)}
    fails(
        fot.check_compile,
        r"updates at step 0: leaf w: .*outside the rounding bound",
        momentum_like(step),
        params=params,
        backend="eager",
        steps=1,
    )


# -------------------------------------------------------------------------- the reference


def adam_reference(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Any:
    def ref(g: torch.Tensor, p: torch.Tensor, memory: dict[str, Any]) -> torch.Tensor:
        t = memory["t"] = memory.get("t", 0) + 1
        mu = memory["mu"] = b1 * memory.get("mu", 0 * g) + (1 - b1) * g
        nu = memory["nu"] = b2 * memory.get("nu", 0 * g) + (1 - b2) * g * g
        return -lr * (mu / (1 - b1**t)) / ((nu / (1 - b2**t)).sqrt() + eps)

    return ref


# One float32 Adam update per element: the first moment (cast of 1 - b1, two products, the sum:
# 4), the second (cast, three products, the sum: 5), two bias corrections (a quotient each, the
# float64 powers cast: 4), sqrt and + eps (2), the quotient (1), the learning rate's cast and
# product (2): 18.
ADAM_OPS = 18


@SETTINGS
@given(params=fst.pytrees(max_leaves=4), data=st.data())
def test_assert_matches_reference_passes_on_adam(params: Any, data: st.DataObject) -> None:
    grads = data.draw(fst.gradient_streams(params, min_steps=2, max_steps=4))
    fot.assert_matches_reference(fo.adam(1e-2), adam_reference(1e-2), params, grads, ops=ADAM_OPS)


def test_assert_matches_reference_fails_on_another_formula() -> None:
    with pytest.raises(AssertionError, match=r"assert_matches_reference: step \d: leaf (w|b\.0|s)"):
        fot.assert_matches_reference(
            fo.adam(1e-2), adam_reference(1e-2, b2=0.99), make_params(), ops=ADAM_OPS
        )


# -------------------------------------------------------------------------- the strategies


ALL_CONTAINERS = ("list", "dict", "tuple", "namedtuple")


@SETTINGS
@given(
    params=fst.pytrees(
        shapes=fst.SHAPES + fst.EMPTY_SHAPES,
        dtypes=(torch.float32, torch.bfloat16, torch.float64),
        containers=ALL_CONTAINERS,
        none_leaves=True,
        packed=None,
    ),
    data=st.data(),
)
def test_checks_over_drawn_trees_and_faulty_streams(params: Any, data: st.DataObject) -> None:
    grads = data.draw(fst.gradient_streams(params, min_steps=2, max_steps=3, with_faults=True))
    tx = fo.chain(fo.clip_by_global_norm(1.0), fo.adam(1e-2))
    fot.check_purity(tx, params, grads)
    fot.check_checkpoint_round_trip(tx, params, grads)
    fot.check_donation(tx, params, grads)


@SETTINGS
@given(data=st.data())
def test_strategies_draw_what_they_say(data: st.DataObject) -> None:
    shape = data.draw(fst.shapes(max_dims=3, max_side=2))
    assert len(shape) <= 3 and all(0 <= n <= 2 for n in shape)
    tree = data.draw(fst.pytrees(containers=["namedtuple"], dtypes=[torch.float16]))
    leaves = fo.tree.leaves(tree)
    assert all(x.dtype == torch.float16 for x in leaves)
    assert all(isinstance(v, (fst.Pair, fst.Leaf, torch.Tensor)) for v in tree.values())
    packed = data.draw(fst.pytrees(packed=True))
    assert isinstance(packed, fo.Packed)
    stream = data.draw(fst.gradient_streams(packed, min_steps=2, max_steps=2))
    assert len(stream) == 2 and all(isinstance(g, fo.Packed) for g in stream)
    plain = data.draw(fst.pytrees())
    with_none = data.draw(fst.gradient_streams(plain, none_leaves=True, with_faults=True))
    assert all(fo.tree.flatten(g)[1] == fo.tree.flatten(plain)[1] for g in with_none)
