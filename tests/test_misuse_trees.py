"""Misuse of trees and of ``update`` (issue 14, section 2): every public transform refuses what
it cannot use, with a ``ValueError``/``TypeError`` naming the leaf path or the argument, and
never hands back updates that share memory with its state.

* **Shapes.** A gradient whose shape differs from its param's (broadcastable or not) is refused
  by the first operation that meets it with a param-shaped tensor (a state leaf, a param,
  ``apply_updates``), naming the leaf's path. Nothing is broadcast.
* **Dtypes.** Integer updates, complex updates against a real state or param: refused.
* **Trees and states.** Mismatched trees name the first differing path; another transform's
  state is refused with a clear error on every path (chain, fused and packed DreamerV3).
* **Keywords.** Unknown keywords of ``update`` are a ``TypeError`` naming them; a user's
  transform inside a ``chain`` still gets its own keywords.
* **Aliasing.** Editing returned updates in place never changes the returned state.
* **Complex params.** Second moments use ``|g|^2`` (as optax), checked against a complex128
  reference with the suite's rounding rule (``tests/conftest.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from conftest import (
    ELEMENTWISE_OPS,
    MagnitudeRun,
    assert_bitwise,
    assert_close_rounding,
    dreamerv3_leaf_ops,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import Leaf, structures

import functional_opt as fo
from functional_opt import tree as fotree

Make = Callable[[], fo.GradientTransformation]


def _dim_mask(params: Any) -> Any:
    return fotree.map_params(lambda x: x.dim() > 0, params)


def _labels(params: Any) -> Any:
    return fotree.map_params(lambda x: "even" if x.dim() % 2 == 0 else "odd", params)


# Every public transform (and the options that change its code path), as a factory.
TRANSFORMS: dict[str, Make] = {
    "identity": fo.identity,
    "scale": lambda: fo.scale(0.5),
    "scale_by_learning_rate": lambda: fo.scale_by_learning_rate(0.1),
    "scale_by_learning_rate_schedule": lambda: fo.scale_by_learning_rate(
        fo.linear_schedule(0.1, 0.01, 10)
    ),
    "scale_by_schedule": lambda: fo.scale_by_schedule(fo.constant_schedule(0.5)),
    "clip": lambda: fo.clip(1.0),
    "clip_by_global_norm": lambda: fo.clip_by_global_norm(1.0),
    "adaptive_grad_clip": lambda: fo.adaptive_grad_clip(0.1),
    "clip_by_agc": lambda: fo.clip_by_agc(0.3),
    "scale_by_rms": lambda: fo.scale_by_rms(0.9),
    "scale_by_rms_debiased": lambda: fo.scale_by_rms(0.9, bias_correction=True),
    "scale_by_adam": lambda: fo.scale_by_adam(),
    "scale_by_adam_nesterov": lambda: fo.scale_by_adam(nesterov=True),
    "trace": lambda: fo.trace(0.9),
    "trace_nesterov": lambda: fo.trace(0.9, nesterov=True),
    "ema": lambda: fo.ema(0.9),
    "ema_no_debias": lambda: fo.ema(0.9, debias=False),
    "add_decayed_weights": lambda: fo.add_decayed_weights(0.1),
    "add_decayed_weights_masked": lambda: fo.add_decayed_weights(0.1, _dim_mask),
    "masked": lambda: fo.masked(fo.trace(0.9), _dim_mask),
    "partition": lambda: fo.partition(
        {"even": fo.adam(0.1), "odd": fo.sgd(0.1, momentum=0.9)}, _labels
    ),
    "apply_if_finite": lambda: fo.apply_if_finite(fo.adam(0.1), 2),
    "MultiSteps": lambda: fo.MultiSteps(fo.adam(0.1), 2).gradient_transformation(),
    "multi_steps": lambda: fo.multi_steps(fo.sgd(0.1, momentum=0.9), 1),
    "inject_hyperparams": lambda: fo.inject_hyperparams(fo.adam)(learning_rate=0.1),
    "adam": lambda: fo.adam(0.1),
    "adamw": lambda: fo.adamw(0.1),
    "sgd": lambda: fo.sgd(0.1),
    "sgd_momentum": lambda: fo.sgd(0.1, momentum=0.9),
    "dreamerv3": lambda: fo.dreamerv3(1e-2, warmup=0),
    "dreamerv3_nesterov": lambda: fo.dreamerv3(1e-2, warmup=0, nesterov=True),
    "dreamerv3_no_momentum": lambda: fo.dreamerv3(1e-2, warmup=0, momentum=False),
    "dreamerv3_masked_decay": lambda: fo.dreamerv3(
        1e-2, warmup=0, weight_decay=0.1, weight_decay_mask=_dim_mask
    ),
    "chain": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adam(0.1)),
    "named_chain": lambda: fo.named_chain(("clip", fo.clip(1.0)), ("opt", fo.sgd(0.1, 0.9))),
    "stateless": lambda: fo.stateless(lambda u, p: u, elementwise=True),
    "stateless_with_tree_map": lambda: fo.stateless_with_tree_map(lambda u, p: u * 2),
    "fused": lambda: fo.fused(fo.chain(fo.clip_by_global_norm(1.0), fo.adam(0.1))),
    "from_torch": lambda: fo.from_torch(torch.optim.Adam, lr=0.1),
    "lion": lambda: fo.lion(0.1),
    "lamb": lambda: fo.lamb(0.1),
    "rmsprop": lambda: fo.rmsprop(0.1, momentum=0.9, centered=True),
    "adagrad": lambda: fo.adagrad(0.1),
    "nadam": lambda: fo.nadam(0.1),
    "radam": lambda: fo.radam(0.1),
    "adabelief": lambda: fo.adabelief(0.1),
    "scale_by_lion": lambda: fo.scale_by_lion(),
    "scale_by_trust_ratio": lambda: fo.scale_by_trust_ratio(),
    "scale_by_rss": lambda: fo.scale_by_rss(),
    "scale_by_radam": lambda: fo.scale_by_radam(),
    "scale_by_belief": lambda: fo.scale_by_belief(),
    "scale_by_stddev": lambda: fo.scale_by_stddev(),
    "zero_nans": fo.zero_nans,
    "set_to_zero": fo.set_to_zero,
    "freeze": lambda: fo.freeze(_dim_mask),
    "snapshot": lambda: fo.snapshot("norm", fo.update_norm),
    "monitor": lambda: fo.monitor({"rms": fo.update_rms}),
}


# Public callables of ``functional_opt`` that do not build a transform.
NOT_TRANSFORMS = frozenset(
    {
        "apply_updates",
        "constant_schedule",
        "exponential_decay",
        "fused_step",
        "global_norm",
        "incremental_update",
        "measure_with_ema",
        "measurements",
        "periodic_update",
        "piecewise_constant_schedule",
        "polynomial_schedule",
        "sgdr_schedule",
        "skip_large_updates",
        "skip_not_finite",
        "tree_map",
        "update_norm",
        "update_not_finite",
        "update_rms",
        "warmup_exponential_decay_schedule",
        "cosine_decay_schedule",
        "dreamerv3_metrics",
        "dreamerv3_schedule",
        "join_schedules",
        "linear_schedule",
        "pack",
        "safe_increment",
        "state_from_dict",
        "state_to_dict",
        "warmup_cosine_decay_schedule",
    }
)


def test_every_public_transform_is_covered() -> None:
    """Each public factory of a transform is in ``TRANSFORMS`` (a new one must be added)."""
    public = {
        name
        for name in fo.__all__
        if callable(getattr(fo, name))
        and (not isinstance(getattr(fo, name), type) or name == "MultiSteps")
        and name not in NOT_TRANSFORMS
    }
    assert public - set(TRANSFORMS) == set()


SETTINGS = settings(max_examples=8, deadline=None, database=None)


def _path(tree: Any, i: int) -> str:
    return fotree.path_str(
        optree.tree_paths(tree, none_is_leaf=True, namespace=fotree.NAMESPACE)[i]
    )


def _realize(structure: Any, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> Any:
    """Random tensors in the shapes of the ``Leaf`` markers (``None`` stays ``None``)."""
    return optree.tree_map(lambda s: torch.randn(s.shape, generator=gen, dtype=dtype), structure)


def _wrong_shape(shape: tuple[int, ...], how: str) -> tuple[int, ...]:
    """Another shape for a leaf of ``shape``: broadcastable ones (a trailing or leading 1),
    the same number of elements in another arrangement, or another size."""
    if how == "trailing_1":
        return (*shape, 1)
    if how == "leading_1":
        return (1, *shape)
    if how == "same_numel":
        n = 1
        for d in shape:
            n *= d
        flat = (n,)
        return flat if flat != shape else (n, 1)
    return (*shape[:-1], shape[-1] + 1) if shape else (2,)


@st.composite
def misshapen(draw: st.DrawFn) -> tuple[Any, Any, Any, int, tuple[int, ...]]:
    """(structure, params, grads, flat index of the bad leaf, its shape): grads match params
    but at one leaf, some other leaves may be ``None`` (no gradient)."""
    structure = draw(structures(max_leaves=5))
    shapes = [leaf.shape for leaf in optree.tree_leaves(structure)]
    bad = draw(st.integers(0, len(shapes) - 1))
    how = draw(st.sampled_from(["trailing_1", "leading_1", "same_numel", "grow"]))
    wrong = _wrong_shape(shapes[bad], how)
    missing = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    params = _realize(structure, gen)
    leaves, spec = optree.tree_flatten(structure, none_is_leaf=True)
    leaves = [
        Leaf(wrong) if i == bad else (None if missing[i] else leaf) for i, leaf in enumerate(leaves)
    ]
    grads = _realize(spec.unflatten(leaves), gen)
    return structure, params, grads, bad, wrong


# ---------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@SETTINGS
@given(case=misshapen())
def test_a_gradient_of_another_shape_is_refused_naming_its_path(
    name: str, case: tuple[Any, Any, Any, int, tuple[int, ...]]
) -> None:
    _, params, grads, bad, _ = case
    tx = TRANSFORMS[name]()
    state = tx.init(params)
    path = _path(params, bad)
    with pytest.raises(ValueError, match="shape") as err:
        tx.update(grads, state, params)
    assert path in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="shape") as err:
        fo.apply_updates(params, grads)
    assert path in str(err.value)


def test_the_issue_cases_are_refused() -> None:
    """A (3, 1) gradient for a (3,) param: MultiSteps' accumulator, apply_updates and
    DreamerV3's large-leaf route (same element count, another shape) all refuse it."""
    params = {"w": torch.ones(3)}
    grads = {"w": torch.ones(3, 1)}
    multi = fo.MultiSteps(fo.sgd(0.1), 2)
    with pytest.raises(ValueError, match=r"\['w'\].*shape"):
        multi.update(grads, multi.init(params), params)
    with pytest.raises(ValueError, match=r"\['w'\].*shape"):
        fo.apply_updates(params, grads)
    big = {"w": torch.ones(128, 130)}
    tx = fo.dreamerv3(warmup=0)
    for flag in (False, "state", True):
        with pytest.raises(ValueError, match=r"\['w'\].*shape"):
            tx.update({"w": torch.ones(130, 128)}, tx.init(big), big, donate=flag)


def test_packed_trees_of_other_shapes_are_refused() -> None:
    params = fo.pack({"a": torch.ones(3), "b": torch.ones(2)})
    other = fo.pack({"a": torch.ones(3), "b": torch.ones(1, 2)})
    tx = fo.dreamerv3(warmup=0)
    with pytest.raises(ValueError, match=r"\['b'\].*shape"):
        tx.update(other, tx.init(params), params)
    with pytest.raises(ValueError, match=r"\['b'\].*shape"):
        fo.apply_updates(params, other)
    adam = fo.adam(0.1)
    with pytest.raises(ValueError, match=r"\['b'\].*shape"):
        adam.update(other, adam.init(params), params)


def test_shapes_are_checked_under_vmap_and_compile() -> None:
    """Under ``vmap`` shapes are per member; under ``torch.compile(fullgraph=True)`` the check
    is resolved while tracing (the compiled step runs unchanged) and a mismatch still names
    the path."""
    params = {"w": torch.ones(3), "b": torch.zeros(2, 2)}
    tx = fo.adam(0.1)
    state = tx.init(params)
    batched = {"w": torch.ones(4, 3), "b": torch.ones(4, 2, 2)}
    updates, _ = torch.vmap(lambda g: tx.update(g, state, params))(batched)
    assert updates["w"].shape == (4, 3)
    with pytest.raises(ValueError, match=r"\['w'\].*shape"):
        torch.vmap(lambda g: tx.update(g, state, params))(
            {"w": torch.ones(4, 3, 1), "b": torch.ones(4, 2, 2)}
        )
    step = torch.compile(tx.update, fullgraph=True)
    good = {"w": torch.ones(3), "b": torch.ones(2, 2)}
    assert_bitwise(step(good, state, params), tx.update(good, state, params))
    with pytest.raises(Exception, match=r"\['w'\].*shape"):
        step({"w": torch.ones(3, 1), "b": torch.ones(2, 2)}, state, params)
    loose = torch.compile(tx.update)  # (graph breaks on the error, then raises it)
    with pytest.raises(ValueError, match=r"\['w'\].*shape"):
        loose({"w": torch.ones(3, 1), "b": torch.ones(2, 2)}, state, params)


def test_a_list_of_leaves_is_checked_under_compile_as_any_tree() -> None:
    """Under ``torch.compile`` a list of tensors is split without ``optree``
    (``tree._leaf_list``); the compiled update still equals the eager one within rounding, and
    a gradient of another shape or a state of another structure is refused naming it."""
    params = [torch.ones(3), torch.zeros(2, 2), torch.full((4,), 2.0)]
    tx = fo.adam(0.1)
    state = tx.init(params)
    grads = [torch.linspace(-1, 1, 3), torch.ones(2, 2), torch.linspace(0, 3, 4)]
    step = torch.compile(tx.update, fullgraph=True)
    got, got_state = step(grads, state, params)
    want, want_state = tx.update(grads, state, params)
    assert type(got) is list
    # (compiled and eager code round the same math differently: rule 2 of tests/README.md)
    assert_close_rounding(got, want, dtype=torch.float32, ops=ELEMENTWISE_OPS)
    got_leaves, want_leaves = fotree.leaves(got_state), fotree.leaves(want_state)
    assert [x is None for x in got_leaves] == [x is None for x in want_leaves]
    assert_close_rounding(
        [x for x in got_leaves if x is not None],
        [x for x in want_leaves if x is not None],
        dtype=torch.float32,
        ops=ELEMENTWISE_OPS,
    )
    loose = torch.compile(tx.update)  # (graph breaks on the error, then raises it)
    with pytest.raises(ValueError, match=r"\[2\].*shape"):
        loose([grads[0], grads[1], torch.ones(4, 1)], state, params)
    other = tx.init({"a": params[0], "b": params[1], "c": params[2]})
    with pytest.raises(ValueError, match="structure"):
        loose(grads, other, params)


# ---------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_integer_updates_are_refused_naming_the_leaf(name: str) -> None:
    params = {"a": torch.ones(3), "b": [torch.ones(2), torch.ones(())]}
    grads = {"a": torch.ones(3), "b": [torch.tensor([1, 2]), torch.ones(())]}
    tx = TRANSFORMS[name]()
    with pytest.raises(TypeError, match=r"\['b'\]\[0\].*int64"):
        tx.update(grads, tx.init(params), params)
    with pytest.raises(TypeError, match=r"\['b'\]\[0\].*int64"):
        fo.apply_updates(params, grads)


def test_complex_updates_against_a_real_state_or_param_are_refused() -> None:
    real = {"w": torch.ones(3)}
    grads = {"w": torch.ones(3, dtype=torch.complex64)}
    for tx in (fo.adam(0.1), fo.trace(0.9), fo.scale_by_rms(), fo.dreamerv3(warmup=0)):
        with pytest.raises(TypeError, match=r"\['w'\].*complex"):
            tx.update(grads, tx.init(real), real)
    with pytest.raises(TypeError, match=r"\['w'\].*complex"):
        fo.apply_updates(real, grads)
    with pytest.raises(TypeError, match=r"\['w'\].*complex"):
        fo.apply_updates(fo.pack(real), fo.pack(grads))


# ---------------------------------------------------------------------- trees and states
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@SETTINGS
@given(structure=structures(max_leaves=5), data=st.data())
def test_mismatched_trees_name_the_first_differing_path(
    name: str, structure: Any, data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(0)
    params = _realize(structure, gen)
    grads = dict(_realize(structure, gen))
    key = data.draw(st.sampled_from(sorted(grads)))
    grads["q" + key] = grads.pop(key)  # a renamed top-level entry
    tx = TRANSFORMS[name]()
    with pytest.raises(ValueError) as err:
        tx.update(grads, tx.init(params), params)
    assert f"['{key}']" in str(err.value) or f"['q{key}']" in str(err.value), str(err.value)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_another_transforms_state_is_refused(name: str) -> None:
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    grads = {"w": torch.ones(3), "b": torch.ones(2)}
    tx = TRANSFORMS[name]()
    own = optree.tree_structure(tx.init(params), none_is_leaf=True, namespace=fotree.NAMESPACE)
    others = [fo.adam(0.1).init(params), fo.trace(0.9).init(params), {"w": torch.ones(3)}]
    others += [fo.EmptyState(), (fo.EmptyState(), fo.EmptyState())]
    for other in others:
        kind = optree.tree_structure(other, none_is_leaf=True, namespace=fotree.NAMESPACE)
        if kind == own:
            continue  # (this transform's own kind of state)
        with pytest.raises((TypeError, ValueError)) as err:
            tx.update(grads, other, params)
        assert "state" in str(err.value).lower(), str(err.value)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("flag", [False, "state", True])
def test_dreamerv3_fast_paths_name_a_wrong_state(packed: bool, flag: bool | str) -> None:
    """The fused and packed paths used to fail with a bare AttributeError/KeyError."""
    big = {"big": torch.ones(128, 130), "run": [torch.ones(3) for _ in range(4)]}
    params = fo.pack(big) if packed else big
    grads = fo.pack(big) if packed else fotree.map_params(torch.clone, big)
    tx = fo.dreamerv3(warmup=0)
    named = fo.named_chain(("a", fo.identity()), ("b", fo.adam(0.1)))
    cases = [
        (fo.adam(0.1).init(params), r"<root>"),
        (named.init(params), r"<root>"),
        (fo.dreamerv3(warmup=0, momentum=False).init(params), r"<root>"),
        (fo.chain(*[fo.identity()] * 5).init(params), r"\[1\]"),
    ]
    state = tx.init(params)
    cases.append(((state[0], state[1], state[1], state[3], state[4]), r"\[2\]"))
    for wrong, where in cases:
        with pytest.raises(ValueError, match=where):
            tx.update(grads, wrong, params, donate=flag)
    other = {"big": torch.ones(128, 130), "run": [torch.ones(3) for _ in range(3)]}
    other_state = tx.init(fo.pack(other) if packed else other)
    with pytest.raises(ValueError, match=r"\['run'\]"):
        tx.update(grads, other_state, params, donate=flag)


# -------------------------------------------------------------------------------- keywords
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("flag", [None, "state", True])
def test_unknown_keywords_are_a_type_error(name: str, flag: bool | str | None) -> None:
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    tx = TRANSFORMS[name]()
    state = tx.init(params)
    for _ in range(2):  # MultiSteps: a mini-step that emits nothing, then one that emits
        grads = {"w": torch.ones(3), "b": torch.ones(2)}
        extra: dict[str, Any] = {"inplace": True}
        if flag is not None:
            extra["donate"] = flag
        with pytest.raises(TypeError, match="'inplace'"):
            tx.update(grads, state, params, **extra)
        _, state = tx.update(grads, state, params)


def test_a_users_transform_gets_its_own_keywords_inside_a_chain() -> None:
    """A user's transform may take keywords of its own: a chain passes them to it (and only to
    it), and still refuses a keyword that no member takes."""
    seen: list[Any] = []

    def noisy_update(
        updates: Any, state: Any, params: Any = None, *, rng: Any = None
    ) -> tuple[Any, Any]:
        seen.append(rng)
        return updates, state

    def open_update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        seen.append(sorted(extra))
        return updates, state

    noisy = fo.GradientTransformation(lambda p: fo.EmptyState(), noisy_update)
    tx = fo.chain(noisy, fo.adam(0.1))
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    tx.update({"w": torch.ones(3)}, state, params, rng=7, donate="state")
    assert seen == [7]
    with pytest.raises(TypeError, match="'inplace'"):
        tx.update({"w": torch.ones(3)}, state, params, inplace=True)
    masked = fo.masked(tx, {"w": True})
    masked.update({"w": torch.ones(3)}, masked.init(params), params, rng=8)
    assert seen[-1] == 8
    with pytest.raises(TypeError, match="'inplace'"):
        masked.update({"w": torch.ones(3)}, masked.init(params), params, inplace=True)
    # A transform that takes any keyword checks its own; the library's beside it never see it.
    tx = fo.chain(fo.GradientTransformation(lambda p: fo.EmptyState(), open_update), fo.adam(0.1))
    tx.update({"w": torch.ones(3)}, tx.init(params), params, seed=1, donate=True)
    assert seen[-1] == ["donate", "seed"]


# -------------------------------------------------------------------------------- aliasing
def _route_params(gen: torch.Generator) -> dict[str, Any]:
    """Leaves for every DreamerV3 route: a large leaf (compiled kernel), a run of equal small
    shapes (stacked kernel), and others (multi-tensor ops)."""
    return {
        "big": torch.randn(128, 130, generator=gen),
        "run": [torch.randn(3, 4, generator=gen) for _ in range(4)],
        "small": torch.randn(5, generator=gen),
        "scalar": torch.randn((), generator=gen),
    }


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in fotree.leaves(tree) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("flag", [None, "state", True])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_editing_returned_updates_never_changes_the_state(
    name: str, flag: bool | str | None, packed: bool
) -> None:
    if packed and name not in ("dreamerv3", "adam", "sgd_momentum", "ema_no_debias", "trace"):
        pytest.skip("packed trees: the transforms with fast paths, and the ones that aliased")
    gen = torch.Generator().manual_seed(5)
    params = _route_params(gen)
    if packed:
        params = fo.pack(params)
    tx = TRANSFORMS[name]()
    state = tx.init(params)
    extra = {} if flag is None else {"donate": flag}
    for step in range(3):
        raw = _route_params(gen)
        grads = fo.pack(raw) if packed else raw
        updates, state = tx.update(grads, state, params, **extra)
        kept = [x.clone() for x in _tensors(state)]
        for u in _tensors(updates):
            u.fill_(float("nan"))  # the caller edits the updates in place
        assert_bitwise(_tensors(state), kept, msg=f"{name}, step {step}")


# ------------------------------------------------------------------------- complex params
def _complex_params(gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    real = torch.float32 if dtype == torch.complex64 else torch.float64
    return {
        "w": torch.complex(
            torch.randn(4, 3, generator=gen, dtype=real),
            torch.randn(4, 3, generator=gen, dtype=real),
        ),
        "b": torch.complex(
            torch.randn(5, generator=gen, dtype=real), torch.randn(5, generator=gen, dtype=real)
        ),
    }


def _adam_reference(
    grads: list[dict[str, torch.Tensor]], lr: float, b1: float, b2: float, eps: float
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], list[Any]]:
    """Adam on complex params in complex128, as optax defines it: ``nu`` averages ``|g|^2``.
    Returns the updates, the ``nu`` states, and the magnitudes the updates are computed from
    (the rounding rule's ``scale``: ``lr * mu_abs_hat / (sqrt(nu_hat) + eps)``, with ``mu_abs``
    the same average of ``|g|``)."""
    mu = {k: torch.zeros_like(v, dtype=torch.complex128) for k, v in grads[0].items()}
    mu_abs = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in grads[0].items()}
    nu = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in grads[0].items()}
    outs, nus, scales = [], [], []
    for t, g in enumerate(grads, start=1):
        out, scale = {}, {}
        for k, gk in g.items():
            x = gk.to(torch.complex128)
            mu[k] = b1 * mu[k] + (1 - b1) * x
            mu_abs[k] = b1 * mu_abs[k] + (1 - b1) * x.abs()
            nu[k] = b2 * nu[k] + (1 - b2) * (x.real**2 + x.imag**2)
            denom = torch.sqrt(nu[k] / (1 - b2**t)) + eps
            out[k] = -lr * (mu[k] / (1 - b1**t)) / denom
            scale[k] = lr * (mu_abs[k] / (1 - b1**t)) / denom
        outs.append(out)
        nus.append({k: v.clone() for k, v in nu.items()})
        scales.append(scale)
    return outs, nus, scales


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_adam_on_complex_params_matches_a_complex128_reference(dtype: torch.dtype) -> None:
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    gen = torch.Generator().manual_seed(11)
    params = _complex_params(gen, dtype)
    grads = [_complex_params(gen, dtype) for _ in range(3)]
    tx = fo.adam(lr, b1, b2, eps)
    state = tx.init(params)
    want, want_nu, scales = _adam_reference(grads, lr, b1, b2, eps)
    real = torch.float32 if dtype == torch.complex64 else torch.float64
    for t, g in enumerate(grads):
        updates, state = tx.update(g, state, params)
        nu = state[0].nu
        for v in nu.values():  # |g|^2 averages: real, whatever dtype holds them
            assert v.dtype == dtype and bool((v.imag == 0).all())
        # nu, per step: |g|^2 (2 products, 1 sum), b2 (a cast) times nu, (1 - b2) (a cast)
        # times |g|^2, and the sum: 8 roundings, all terms positive; errors carried in the
        # state add up over the steps.
        assert_close_rounding(
            {k: v.real for k, v in nu.items()}, want_nu[t], dtype=real, ops=8 * (t + 1),
            check_dtype=False, msg=f"nu, step {t}",
        )  # fmt: skip
        # The update: mu (5 a step: two casts, two products, the sum), nu (8 a step), the two
        # bias corrections (a cast and a division each: 4), sqrt (complex: 2), + eps (1), the
        # complex division (3) and -lr (a cast and a product: 2): 13 (t + 1) + 12 roundings
        # per component; times 2 for the modulus of a complex error (|re| + |im| bounds it).
        assert_close_rounding(
            updates, want[t], dtype=real, ops=2 * (13 * (t + 1) + 12), scale=scales[t],
            check_dtype=False, msg=f"updates, step {t}",
        )  # fmt: skip


@pytest.mark.numerics
@pytest.mark.numerics
def test_dreamerv3_on_complex_params_squares_moduli_on_every_path() -> None:
    """The fused path (complex leaves keep to the multi-tensor ops: the kernels are real) and
    the chain agree bit for bit; the packed path (the engine leaves complex buffers to the
    chain, over the buffers: inductor has no complex code) within rounding (its clip's norms
    are summed per row of a buffer); their second moments are real: ``|g|^2``, not ``g * g``."""
    gen = torch.Generator().manual_seed(2)

    def make() -> dict[str, Any]:
        parts = [torch.randn(2, 128, 130, generator=gen), torch.randn(2, 4, 3, 4, generator=gen)]
        return {
            "big": torch.complex(parts[0][0], parts[0][1]),
            "run": list(torch.complex(parts[1][0], parts[1][1]).unbind()),
        }

    params = make()
    fused, chain = (
        fo.dreamerv3(1e-2, warmup=0),
        fo.dreamerv3(1e-2, warmup=0, weight_decay_mask={"big": True, "run": [True] * 4}),
    )
    s_fused, s_chain, s_packed = fused.init(params), chain.init(params), fused.init(fo.pack(params))
    magnitudes = MagnitudeRun(chain, params)
    for step in range(3):
        grads = make()
        scale, _ = magnitudes.update(grads, params)
        u_fused, s_fused = fused.update(fotree.map_params(torch.clone, grads), s_fused, params)
        u_chain, s_chain = chain.update(fotree.map_params(torch.clone, grads), s_chain, params)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no compile of complex buffers, no fallback)
            u_packed, s_packed = fused.update(fo.pack(grads), s_packed, fo.pack(params))
        assert_bitwise(u_fused, u_chain)
        assert_bitwise(s_fused[1].nu, s_chain[1].nu)
        ops = dreamerv3_leaf_ops(torch.float32, steps=step + 1)
        assert_close_rounding(
            _tensors(u_packed.tree), _tensors(u_fused), dtype=torch.float32, ops=ops,
            scale=_tensors(scale),
        )  # fmt: skip
        for nu in (s_fused[1].nu, s_packed[1].nu.tree):
            assert all(bool((x.imag == 0).all()) for x in _tensors(nu))


@pytest.mark.numerics
def test_adaptive_grad_clip_on_complex_params_uses_moduli() -> None:
    """Unit norms of complex tensors sum ``|x|^2`` (``x * x`` would be complex and mix signs):
    equal to a complex128 reference computed from ``abs``."""
    gen = torch.Generator().manual_seed(5)
    parts = torch.randn(4, 3, 4, generator=gen, dtype=torch.float64)
    params = {"w": torch.complex(parts[0], parts[1])}
    grads = {"w": 10 * torch.complex(parts[2], parts[3])}
    tx = fo.adaptive_grad_clip(0.1)
    updates, _ = tx.update(grads, tx.init(params), params)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x.abs() ** 2).sum(0, keepdim=True)).expand(x.shape)

    bound = 0.1 * torch.clamp(unit(params["w"]), min=1e-3)
    g_norm = unit(grads["w"])
    g = grads["w"]
    want = torch.where(g_norm < bound, g, g * (bound / torch.clamp(g_norm, min=1e-6)))
    assert bool((g_norm >= bound).any())  # some unit is clipped
    # Per component: |x|^2 (3 roundings), a sum of 3 terms (3), sqrt (1), the bound (2), the
    # ratio (1) and the product (2), in each of the two codes: 12 roundings.
    assert_close_rounding(updates, {"w": want}, dtype=torch.float64, ops=2 * 12, check_dtype=False)


def test_clip_refuses_complex_updates_naming_the_leaf() -> None:
    params = {"a": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)}
    grads = {"a": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)}
    tx = fo.clip(1.0)
    with pytest.raises(TypeError, match=r"\['z'\].*complex"):
        tx.update(grads, tx.init(params), params)
