"""Contract checks for any :class:`~functional_opt.GradientTransformation`.

Each ``check_*`` function runs a transform over ``params`` and a gradient stream (the given
``grads``, or :func:`~functional_opt.testing.streams.gradient_stream` of ``steps`` steps from
``seed``) and raises an ``AssertionError`` whose message starts with the check's name and names
the leaf (by its dotted path, as :func:`functional_opt.state_to_dict` names state entries).
:func:`check_transform` runs them all.

Comparisons follow the rounding rule of :mod:`functional_opt.testing.tolerance`: bit for bit
where the same kernels run on the same inputs (a repeated call, donated vs pure, a restored
checkpoint, a ``None`` leaf vs an absent parameter), and a rounding-derived bound where two
implementations compute the same math (compiled vs eager, vmapped vs per member):
``ops`` roundings per update in each leaf's dtype, times the updates so far (each path carries
its own state), relative to the magnitudes of a :class:`~functional_opt.testing.MagnitudeRun`.
The default count is :func:`default_ops`.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import Tensor

from functional_opt import tree
from functional_opt.base import DONATE, GradientTransformation, apply_updates, extra_keywords
from functional_opt.checkpoint import state_from_dict, state_paths, state_to_dict
from functional_opt.packed import Packed
from functional_opt.testing.streams import gradient_stream, rebuild, tensor_leaves
from functional_opt.testing.tolerance import (
    MagnitudeRun,
    Ops,
    assert_bitwise,
    assert_close_rounding,
)
from functional_opt.tree import PyTree

__all__ = [
    "CHECKS",
    "DEFAULT_ELEMENTWISE_OPS",
    "check_checkpoint_round_trip",
    "check_compile",
    "check_donation",
    "check_dtype_policy",
    "check_mismatched_trees_error",
    "check_none_gradients_keep_state",
    "check_purity",
    "check_transform",
    "check_vmap",
    "default_ops",
]

DEFAULT_ELEMENTWISE_OPS = 32
"""Roundings per element in one update of the longest elementwise chain of the library's
transforms (AdamW with Nesterov, ``eps_root``, weight decay and a cosine schedule: the first
moment 3, the second 4, two bias corrections 3 each, the Nesterov mix 4, ``sqrt(v + eps_root) +
eps`` 3, the quotient 1, weight decay 2, the schedule 5, the learning rate 1: 31, rounded up)."""

OpsArg = Ops | Callable[[Tensor], Ops] | None
Grads = Sequence[PyTree] | None


def default_ops(params: PyTree) -> int:
    """The default count of roundings of one update, per implementation:
    :data:`DEFAULT_ELEMENTWISE_OPS` plus a norm over every element of ``params`` (``n``
    squares summed, its root and a quotient: ``n + 2``), which covers global and per-tensor
    norms. Pass ``ops=`` to a check for a transform that rounds more per update."""
    numel = sum(x.numel() for x in tree.leaves(params) if isinstance(x, Tensor))
    return DEFAULT_ELEMENTWISE_OPS + numel + 2


def _fail(check: str, message: str) -> AssertionError:
    return AssertionError(f"{check}: {message}")


@contextlib.contextmanager
def _named(check: str, what: str) -> Iterator[None]:
    """Re-raises an exception of the transform as an ``AssertionError`` naming the check."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as e:
        raise _fail(check, f"{what} raised {type(e).__name__}: {e}") from e


def _stream(params: PyTree, grads: Grads, steps: int, seed: int) -> list[PyTree]:
    if grads is not None:
        return list(grads)
    return gradient_stream(params, steps, seed=seed)


def _snapshot(value: PyTree) -> list[tuple[Any, ...]]:
    """(clone, dtype, version counter) of every tensor leaf; other leaves as they are."""
    out: list[tuple[Any, ...]] = []
    for x in tree.leaves(value):
        if isinstance(x, Tensor):
            out.append((x.detach().clone(), x.dtype, x._version))
        else:
            out.append((x,))
    return out


def _unchanged(check: str, value: PyTree, before: list[tuple[Any, ...]], what: str) -> None:
    now = tree.leaves(value)
    if len(now) != len(before):
        raise _fail(check, f"{what} changed its structure")
    for i, (x, old) in enumerate(zip(now, before, strict=True)):
        if isinstance(x, Tensor):
            clone, dtype, version = old
            if x.dtype != dtype:
                raise _fail(check, f"{what} changed dtype at leaf {state_paths(value)[i]}")
            if x._version != version:
                raise _fail(check, f"{what} was written in place at leaf {state_paths(value)[i]}")
            try:
                assert_bitwise(x, clone)
            except AssertionError as e:
                leaf = state_paths(value)[i]
                raise _fail(check, f"{what} changed value at leaf {leaf}: {e}") from None
        elif x is not old[0]:
            raise _fail(check, f"{what} replaced leaf {state_paths(value)[i]}")


def _layout(state: PyTree) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {k: (v.shape, v.dtype) for k, v in state_to_dict(state).items()}


def _per_step(ops: OpsArg, params: PyTree, steps: int) -> Ops | Callable[[Tensor], Ops]:
    """``ops`` per update (default :func:`default_ops`) times ``steps``."""
    if ops is None:
        return steps * default_ops(params)
    if callable(ops):
        fn = ops
        return lambda leaf: _times(fn(leaf), steps)
    return _times(ops, steps)


def _times(ops: Ops, steps: int) -> Ops:
    if isinstance(ops, Mapping):
        return {dt: n * steps for dt, n in ops.items()}
    return ops * steps


def _agree(actual: PyTree, expected: PyTree, *, ops: Any, scale: Any, msg: str) -> None:
    """Two paths of the same math: integer and bool leaves bit for bit, floating ones within
    the rounding bound in each expected leaf's own dtype."""
    a_leaves, e_leaves = tree.leaves(actual), tree.leaves(expected)
    exact = [
        isinstance(e, Tensor) and not (e.dtype.is_floating_point or e.dtype.is_complex)
        for e in e_leaves
    ]
    if len(a_leaves) != len(e_leaves):
        assert_bitwise(actual, expected, msg)  # names where the structures differ
    names = state_paths(expected)
    scales = [None] * len(e_leaves) if scale is None else tree.leaves(scale)
    for name, a, e, s, bits in zip(names, a_leaves, e_leaves, scales, exact, strict=True):
        if bits or not isinstance(e, Tensor):
            assert_bitwise(a, e, f"{msg}: leaf {name}")
            continue
        assert isinstance(a, Tensor), f"{msg}: leaf {name}: {a!r} is not a tensor"
        dtype = torch.promote_types(e.dtype, torch.float32) if e.is_complex() else e.dtype
        real = {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)
        assert_close_rounding(a, e, dtype=real, ops=ops, scale=s, msg=f"{msg}: leaf {name}")


def _member(value: PyTree, i: int, like: PyTree) -> PyTree:
    """Member ``i`` of a tree stacked along dim 0, with the structure of ``like``."""
    leaves = [None if x is None else x[i] for x in tree.leaves(value)]
    return tree.unflatten(tree.flatten(like)[1], leaves)


def _dims(value: PyTree) -> Any:
    """vmap's ``in_dims``/``out_dims`` for a tree: 0, with ``None`` for its ``None`` leaves
    (a tree without any is just 0: packed trees hold no ``None``)."""
    if all(x is not None for x in tree.leaves(value)):
        return 0
    return torch_pytree.tree_map(lambda x: None if x is None else 0, value)


def _scaled(value: PyTree, factor: float) -> PyTree:
    """Floating leaves times a power of two (exact, barring overflow)."""
    leaves = [
        x * factor if isinstance(x, Tensor) and x.dtype.is_floating_point else x
        for x in tree.leaves(value)
    ]
    return rebuild(value, leaves)


def _stack(members: list[PyTree]) -> PyTree:
    first = members[0]
    columns = zip(*(tree.leaves(m) for m in members), strict=True)
    leaves = [None if col[0] is None else torch.stack(col) for col in columns]
    if isinstance(first, Packed):
        from functional_opt.packed import pack

        return pack(tree.unflatten(tree.flatten(first.tree)[1], leaves), batch_dims=1)
    return tree.unflatten(tree.flatten(first)[1], leaves)


def _path_names(value: PyTree, i: int) -> list[str]:
    """The ways a message may name flat leaf ``i``: ``['w'][0]`` and ``w.0``."""
    inner = value.tree if isinstance(value, Packed) else value
    paths = optree.tree_paths(inner, none_is_leaf=True, namespace=tree.NAMESPACE)
    return [tree.path_str(paths[i]), state_paths(inner)[i]]


# ------------------------------------------------------------------------------ the checks


def check_purity(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 3,
    seed: int = 0,
) -> None:
    """``init`` and ``update`` never write into their inputs (values, dtypes, version
    counters), give the same outputs for the same inputs (bit for bit, ``init`` too), and the
    returned updates never share memory with the new state (editing them in place cannot
    change it)."""
    name = "check_purity"
    stream = _stream(params, grads, steps, seed)
    before = _snapshot(params)
    with _named(name, "init"):
        state = state0 = tx.init(params)
        again = tx.init(params)
    _unchanged(name, params, before, "init changed the params:")
    assert_bitwise(again, state0, f"{name}: init gave another state the second time")
    kept = _snapshot(state0)
    for t, g in enumerate(stream):
        inputs = (_snapshot(g), _snapshot(state), _snapshot(params))
        with _named(name, f"update at step {t}"):
            first = tx.update(g, state, params)
            second = tx.update(g, state, params)
        for value, snap, what in zip(
            (g, state, params), inputs, ("updates", "state", "params"), strict=True
        ):
            _unchanged(name, value, snap, f"update at step {t} wrote into its {what}:")
        assert_bitwise(second, first, f"{name}: a second update from the same inputs at step {t}")
        _no_aliasing(name, first, t)
        state = first[1]
    _unchanged(name, state0, kept, "the initial state changed:")


def _no_aliasing(check: str, out: tuple[PyTree, PyTree], step: int) -> None:
    updates, state = out
    owners: dict[int, int] = {}
    for i, x in enumerate(tree.leaves(state)):
        if isinstance(x, Tensor) and x.numel():
            owners[x.untyped_storage().data_ptr()] = i
    for j, u in enumerate(tree.leaves(updates)):
        if isinstance(u, Tensor) and u.numel():
            shared = owners.get(u.untyped_storage().data_ptr())
            if shared is not None:
                raise _fail(
                    check,
                    f"the update at leaf {state_paths(updates)[j]} shares memory with the state "
                    f"entry {state_paths(state)[shared]} at step {step}: editing the updates in "
                    "place would change the state",
                )


def check_none_gradients_keep_state(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 3,
    seed: int = 0,
    leaves: Sequence[int] | None = None,
    accumulators: Sequence[str] = (),
) -> None:
    """A ``None`` gradient means "no gradient for this parameter this step".

    For each tensor leaf (``leaves``: their indices among the tensor leaves; default all):

    * a leaf whose gradient is always ``None`` gets ``None`` updates, keeps its per-parameter
      state at its initial value, and every other update and state entry equals, bit for bit,
      a run in which the parameter is absent (``None`` in the params, so the trees keep their
      structure and masks still apply);
    * a leaf whose gradient is present on the first step and ``None`` afterwards keeps its
      per-parameter state unchanged on every step that returns a ``None`` update for it, and
      the state's integer entries (counters) advance as in a run where every gradient is
      present (with zeros in place of the ``None``). State entries whose dotted name contains
      one of ``accumulators`` are exempt from the first half (a window's running mean counts
      a ``None`` as a zero gradient, as ``MultiSteps`` documents: pass
      ``accumulators=("acc_grads",)``).

    A packed tree cannot hold ``None`` gradients (its layout would change): for packed
    ``params`` the check runs on the unpacked tree."""
    name = "check_none_gradients_keep_state"
    if isinstance(params, Packed):
        plain = [
            g.tree if isinstance(g, Packed) else g for g in _stream(params, grads, steps, seed)
        ]
        check_none_gradients_keep_state(
            tx, params.tree, plain, leaves=leaves, accumulators=accumulators
        )
        return
    stream = _stream(params, grads, steps, seed)
    positions = tensor_leaves(params)
    chosen = range(len(positions)) if leaves is None else leaves
    flat_p = tree.leaves(params)
    for k in chosen:
        pos = positions[k]
        leaf = state_paths(params)[pos]

        def without(value: PyTree, pos: int = pos) -> PyTree:
            values = list(tree.leaves(value))
            values[pos] = None
            return rebuild(value, values)

        # 1. always None vs absent
        with _named(name, "init"):
            full = tx.init(params)
        absent, reduced_params, reduced = _absent(tx, params, pos)
        if absent is None:
            raise _fail(
                name,
                f"init of the params without leaf {leaf} (None there, or its key dropped) "
                f"raised {reduced!r}: an absent parameter must be accepted",
            )
        initial = state_to_dict(full)
        own = set(initial) - set(state_to_dict(reduced))
        for t, g in enumerate(stream):
            g_k = without(g)
            with _named(name, f"update with leaf {leaf}'s gradient None at step {t}"):
                u_full, full = tx.update(g_k, full, params)
                u_red, reduced = tx.update(absent(g), reduced, reduced_params)
            at = f"leaf {leaf}'s gradient None at step {t}"
            got = tree.leaves(u_full)[pos] if len(tree.leaves(u_full)) == len(flat_p) else "?"
            if got is not None:
                raise _fail(name, f"{at}: its update is {got!r}, not None")
            assert_bitwise(
                absent(u_full),
                u_red,
                f"{name}: {at}: the updates differ from the parameter's absence",
            )
            d_full, d_red = state_to_dict(full), state_to_dict(reduced)
            if set(d_full) - own != set(d_red):
                raise _fail(
                    name, f"{at}: state entries {sorted(set(d_full) ^ set(d_red) - own)} differ"
                )
            for key, value in d_red.items():
                assert_bitwise(
                    d_full[key],
                    value,
                    f"{name}: {at}: state entry {key} differs from the parameter's absence",
                )
            for key in own:
                assert_bitwise(
                    d_full[key], initial[key], f"{name}: {at}: its own state entry {key} changed"
                )
        # 2. present, then None
        if len(stream) < 2:
            continue
        with _named(name, "init"):
            sparse = dense = tx.init(params)
        for t, g in enumerate(stream):
            g_t = g if t == 0 else without(g)
            g_dense = g if t == 0 else _zero_at(g, pos)
            before = state_to_dict(sparse)
            with _named(name, f"update with leaf {leaf}'s gradient None at step {t}"):
                u, sparse = tx.update(g_t, sparse, params)
                _, dense = tx.update(g_dense, dense, params)
            after, d_dense = state_to_dict(sparse), state_to_dict(dense)
            at = f"leaf {leaf}'s gradient None at step {t} (present at step 0)"
            if t > 0 and tree.leaves(u)[pos] is None:
                for key in own:
                    if any(a in key for a in accumulators):
                        continue
                    assert_bitwise(
                        after[key], before[key], f"{name}: {at}: its own state entry {key} changed"
                    )
            for key, value in after.items():
                if key not in own and not (value.dtype.is_floating_point or value.dtype.is_complex):
                    assert_bitwise(
                        value,
                        d_dense[key],
                        f"{name}: {at}: counter {key} differs from a run with every gradient",
                    )


def _zero_at(value: PyTree, pos: int) -> PyTree:
    values = list(tree.leaves(value))
    if isinstance(values[pos], Tensor):
        values[pos] = torch.zeros_like(values[pos])
    return rebuild(value, values)


def _absent(
    tx: GradientTransformation, params: PyTree, pos: int
) -> tuple[Callable[[PyTree], PyTree] | None, PyTree, Any]:
    """How to take leaf ``pos`` out of params and gradients: ``None`` in its place (the
    structure stays, so masks given as trees still apply), else, where ``init`` refuses that
    (a mask function that reads every param), its key dropped from the dict holding it.
    Returns the function, the reduced params and their initial state (or ``None``, params
    and the last error)."""

    def none_at(value: PyTree) -> PyTree:
        values = list(tree.leaves(value))
        values[pos] = None
        return rebuild(value, values)

    path = optree.tree_paths(params, none_is_leaf=True, namespace=tree.NAMESPACE)[pos]
    candidates: list[Callable[[PyTree], PyTree]] = [none_at]
    if isinstance(params, dict) and len(path) == 1 and len(params) > 1:

        def drop(value: PyTree) -> PyTree:
            return {k: v for k, v in value.items() if k != path[0]}

        candidates.append(drop)
    error: Any = None
    for fn in candidates:
        try:
            reduced_params = fn(params)
            return fn, reduced_params, tx.init(reduced_params)
        except Exception as e:
            error = e
    return None, params, error


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_dtype_policy(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 3,
    seed: int = 0,
    dtypes: Sequence[torch.dtype | None] = (None, *FLOAT_DTYPES),
) -> None:
    """Every update keeps its incoming gradient's dtype and shape (0-d leaves included: a 0-d
    hyperparameter tensor must not promote them) and the updates keep the gradients'
    structure; the state keeps its layout (``state_to_dict``'s keys, shapes and dtypes) from
    ``init`` on. Run with the params and gradients as given (``None``) and cast to each
    floating dtype of ``dtypes``."""
    name = "check_dtype_policy"
    stream = _stream(params, grads, steps, seed)
    for dtype in dtypes:
        p = _cast(params, dtype)
        where = "as given" if dtype is None else f"in {dtype}"
        with _named(name, f"init {where}"):
            state = tx.init(p)
        first = _layout(state)
        for t, g in enumerate(stream):
            g = _cast(g, dtype)
            with _named(name, f"update {where} at step {t}"):
                u, state = tx.update(g, state, p)
            at = f"{where} at step {t}"
            if tree.flatten(u)[1] != tree.flatten(g)[1]:
                place = tree.difference(u, g) or "<root>"
                raise _fail(
                    name, f"{at}: the updates' structure differs from the gradients' at {place}"
                )
            for leaf, a, b in zip(state_paths(g), tree.leaves(u), tree.leaves(g), strict=True):
                if isinstance(b, Tensor) and (
                    not isinstance(a, Tensor) or (a.dtype, a.shape) != (b.dtype, b.shape)
                ):
                    got = f"{a.dtype}{list(a.shape)}" if isinstance(a, Tensor) else repr(a)
                    raise _fail(
                        name,
                        f"{at}: the update at leaf {leaf} is {got}, the gradient "
                        f"{b.dtype}{list(b.shape)}",
                    )
            now = _layout(state)
            if now != first:
                changed = sorted(k for k in set(now) | set(first) if now.get(k) != first.get(k))
                show = {k: (first.get(k), now.get(k)) for k in changed[:3]}
                raise _fail(name, f"{at}: the state's layout changed at {changed}: {show}")


def _cast(value: PyTree, dtype: torch.dtype | None) -> PyTree:
    if dtype is None:
        return value
    leaves = [
        x.to(dtype) if isinstance(x, Tensor) and x.dtype.is_floating_point else x
        for x in tree.leaves(value)
    ]
    return rebuild(value, leaves)


def check_donation(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 3,
    seed: int = 0,
    flags: Sequence[bool | str] = (True, "state"),
    apply: bool = True,
) -> None:
    """``update(..., donate=flag)`` gives the pure update's updates and state bit for bit (the
    same kernels on the same inputs), never writes into the params, and with
    ``donate="state"`` never writes into the gradients; the pure update writes into neither.
    ``apply``: the params move by the pure updates after each step (``apply_updates``)."""
    name = "check_donation"
    accepted = extra_keywords(tx)
    if accepted is not None and DONATE not in accepted:
        raise _fail(
            name,
            f"the transform's update does not accept {DONATE}= (it accepts {sorted(accepted)})",
        )
    stream = _stream(params, grads, steps, seed)
    for flag in flags:
        p = params
        with _named(name, "init"):
            pure, donated = tx.init(p), tx.init(p)
        for t, g in enumerate(stream):
            at = f"donate={flag!r} at step {t}"
            given = rebuild(g, [x.clone() if isinstance(x, Tensor) else x for x in tree.leaves(g)])
            kept_g, kept_given, kept_p = _snapshot(g), _snapshot(given), _snapshot(p)
            with _named(name, f"the pure update at step {t}"):
                u1, pure = tx.update(g, pure, p)
            _unchanged(name, g, kept_g, f"the pure update at step {t} wrote into its gradients:")
            _unchanged(name, p, kept_p, f"the pure update at step {t} wrote into the params:")
            with _named(name, f"the update with {at}"):
                u2, donated = tx.update(given, donated, p, **{DONATE: flag})
            _unchanged(name, p, kept_p, f"the update with {at} wrote into the params:")
            if flag != True:  # noqa: E712  (only True donates the gradients)
                _unchanged(
                    name, given, kept_given, f"the update with {at} wrote into the gradients:"
                )
            assert_bitwise(u2, u1, f"{name}: updates with {at} vs pure")
            assert_bitwise(donated, pure, f"{name}: state with {at} vs pure")
            if apply:
                p = apply_updates(p, u1)


def check_compile(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 3,
    seed: int = 0,
    ops: OpsArg = None,
    backend: str = "inductor",
    magnitudes: bool = True,
) -> None:
    """``torch.compile(tx.update, fullgraph=True)`` agrees with eager ``update``, each carrying
    its own state, within ``ops`` roundings per update (default :func:`default_ops`) times the
    updates so far, relative to the magnitudes of a float64 :class:`MagnitudeRun` on absolute
    values (``magnitudes=False``: each tensor's largest value); integer entries bit for bit.
    When every gradient tree has the same ``None`` leaves, nothing recompiles after the second
    call. Resets dynamo's caches first (``torch._dynamo.reset()``)."""
    name = "check_compile"
    from torch._dynamo.testing import CompileCounterWithBackend

    stream = _stream(params, grads, steps, seed)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    update = torch.compile(tx.update, fullgraph=True, backend=counter)
    with _named(name, "init"):
        eager, compiled = tx.init(params), tx.init(params)
    run = MagnitudeRun(tx, params) if magnitudes else None
    same = len({tuple(x is None for x in tree.leaves(g)) for g in stream}) <= 1
    with contextlib.ExitStack() as stack:
        for t, g in enumerate(stream):
            if t == 2 and same:
                stack.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
            with _named(name, f"eager update at step {t}"):
                want, eager = tx.update(g, eager, params)
            with _named(name, f"torch.compile(update, fullgraph=True) at step {t}"):
                got, compiled = update(g, compiled, params)
            u_mag, s_mag = run.update(g, params) if run is not None else (None, None)
            count = _per_step(ops, params, t + 1)
            _agree(got, want, ops=count, scale=u_mag, msg=f"{name}: updates at step {t}")
            _agree(compiled, eager, ops=count, scale=s_mag, msg=f"{name}: state at step {t}")


def check_vmap(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 3,
    seed: int = 0,
    members: int = 3,
    ops: OpsArg = None,
    magnitudes: bool = True,
) -> None:
    """``torch.func.vmap`` of ``init`` and ``update`` over an ensemble of ``members`` stacked
    copies (member ``i``: params times ``2**-i`` and gradients times ``2**i``, exact scalings)
    agrees with each member run alone, within the rounding bound of :func:`check_compile`.
    Packed params are stacked with ``pack(..., batch_dims=1)``."""
    name = "check_vmap"
    stream = _stream(params, grads, steps, seed)
    ps = [_scaled(params, 2.0**-i) for i in range(members)]
    stacked = _stack(ps)
    with _named(name, "init"):
        states = [tx.init(p) for p in ps]
    state_dims = _dims(states[0])
    with _named(name, "vmap(init)"):
        state_v = torch.func.vmap(tx.init, out_dims=state_dims)(stacked)
    runs = [MagnitudeRun(tx, p) if magnitudes else None for p in ps]
    for i in range(members):
        _agree(
            _member(state_v, i, states[i]),
            states[i],
            ops=_per_step(ops, params, 1),
            scale=None,
            msg=f"{name}: init of member {i}",
        )
    for t, g in enumerate(stream):
        gs = [_scaled(g, 2.0**i) for i in range(members)]
        g_v = _stack(gs)
        dims = _dims(g_v)
        update = torch.func.vmap(
            tx.update, in_dims=(dims, state_dims, 0), out_dims=(dims, state_dims)
        )
        with _named(name, f"vmap(update) at step {t}"):
            u_v, state_v = update(g_v, state_v, stacked)
        count = _per_step(ops, params, t + 1)
        for i in range(members):
            with _named(name, f"update of member {i} at step {t}"):
                u_i, states[i] = tx.update(gs[i], states[i], ps[i])
            run = runs[i]
            u_mag, s_mag = run.update(gs[i], ps[i]) if run is not None else (None, None)
            at = f"member {i} at step {t}"
            _agree(
                _member(u_v, i, u_i), u_i, ops=count, scale=u_mag, msg=f"{name}: updates of {at}"
            )
            _agree(
                _member(state_v, i, states[i]),
                states[i],
                ops=count,
                scale=s_mag,
                msg=f"{name}: state of {at}",
            )


def check_checkpoint_round_trip(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 4,
    seed: int = 0,
) -> None:
    """After half the stream, ``state_to_dict`` saved with ``torch.save`` and loaded with
    ``torch.load(weights_only=True)`` into ``state_from_dict(tx.init(params), ...)`` gives a
    state of the same layout whose next updates and states equal the original's bit for
    bit."""
    name = "check_checkpoint_round_trip"
    stream = _stream(params, grads, steps, seed)
    half = max(1, len(stream) // 2)
    with _named(name, "init"):
        state = tx.init(params)
    for t, g in enumerate(stream[:half]):
        with _named(name, f"update at step {t}"):
            _, state = tx.update(g, state, params)
    buffer = io.BytesIO()
    with _named(name, "state_to_dict and torch.save"):
        torch.save(state_to_dict(state), buffer)
    buffer.seek(0)
    with _named(name, "torch.load(weights_only=True)"):
        loaded = torch.load(buffer, weights_only=True)
    with _named(name, "state_from_dict into a fresh init"):
        restored = state_from_dict(tx.init(params), loaded)
    assert_bitwise(restored, state, f"{name}: the restored state")
    for t, g in enumerate(stream[half:], start=half):
        with _named(name, f"update at step {t}"):
            u, state = tx.update(g, state, params)
            u2, restored = tx.update(g, restored, params)
        assert_bitwise(u2, u, f"{name}: updates after restoring, at step {t}")
        assert_bitwise(restored, state, f"{name}: state after restoring, at step {t}")


_REFUSALS = (ValueError, TypeError, KeyError)


def check_mismatched_trees_error(
    tx: GradientTransformation, params: PyTree, grads: Grads = None, *, seed: int = 0
) -> None:
    """Updates or params that do not match (a leaf of another shape, an extra or a missing
    leaf in a dict) are refused with a ``ValueError``/``TypeError``/``KeyError`` whose message
    names the leaf (``['w'][0]`` or ``w.0``), or, by a transform that never looks at that
    tree, handled as given: updates of the given structure and shapes and a state of
    unchanged layout. Never a bare torch or optree error, never a silent broadcast."""
    name = "check_mismatched_trees_error"
    g = _stream(params, grads, 1, seed)[0]
    with _named(name, "init"):
        state = tx.init(params)
    layout = _layout(state)
    positions = [i for i in tensor_leaves(params) if isinstance(tree.leaves(g)[i], Tensor)]
    cases: list[tuple[str, PyTree, PyTree, list[str]]] = []
    if positions:
        k = positions[-1]
        for what, base in (("updates", g), ("params", params)):
            leaves = list(tree.leaves(base))
            x = leaves[k]
            leaves[k] = torch.zeros((*x.shape, 2), dtype=x.dtype, device=x.device)
            bad = rebuild(base, leaves)
            pair = (bad, params) if what == "updates" else (g, bad)
            cases.append(
                (
                    f"{what} with another shape at leaf {_path_names(base, k)[1]}",
                    *pair,
                    _path_names(base, k),
                )
            )
    plain = g.tree if isinstance(g, Packed) else g
    if isinstance(plain, dict) and not isinstance(params, Packed):
        extra = dict(plain)
        extra["zz_extra_leaf"] = torch.zeros(1)
        cases.append(("updates with an extra leaf zz_extra_leaf", extra, params, ["zz_extra_leaf"]))
        if len(plain) > 1:
            dropped = sorted(plain)[-1]
            missing = {key: v for key, v in plain.items() if key != dropped}
            cases.append(
                (f"updates without the key {dropped!r}", missing, params, [repr(dropped), dropped])
            )
    for what, updates, p, names in cases:
        try:
            u, new_state = tx.update(updates, state, p)
        except _REFUSALS as e:
            if not any(n in str(e) for n in names):
                raise _fail(
                    name,
                    f"{what}: the {type(e).__name__} does not name the leaf "
                    f"({' or '.join(names)}): {e}",
                ) from None
            continue
        except Exception as e:
            raise _fail(
                name,
                f"{what}: raised {type(e).__name__} (not a ValueError/TypeError naming the "
                f"leaf): {e}",
            ) from e
        shapes = [None if x is None else tuple(x.shape) for x in tree.leaves(u)]
        given = [None if x is None else tuple(x.shape) for x in tree.leaves(updates)]
        if tree.flatten(u)[1] != tree.flatten(updates)[1] or shapes != given:
            raise _fail(
                name,
                f"{what}: accepted, and the updates' structure or shapes changed "
                f"({given} -> {shapes})",
            )
        if _layout(new_state) != layout:
            raise _fail(name, f"{what}: accepted, and the state's layout changed")


CHECKS: dict[str, Callable[..., None]] = {
    "purity": check_purity,
    "none_gradients": check_none_gradients_keep_state,
    "dtype_policy": check_dtype_policy,
    "donation": check_donation,
    "checkpoint": check_checkpoint_round_trip,
    "mismatched_trees": check_mismatched_trees_error,
    "vmap": check_vmap,
    "compile": check_compile,
}
"""The checks :func:`check_transform` runs, by the names its ``skip`` takes."""


def check_transform(
    tx: GradientTransformation,
    params: PyTree,
    grads: Grads = None,
    *,
    steps: int = 3,
    seed: int = 0,
    ops: OpsArg = None,
    skip: Sequence[str] = (),
) -> None:
    """Runs every check of :data:`CHECKS` on ``tx`` (in that order, ``compile`` last: it is
    the slowest), except those named in ``skip``. ``donation`` is skipped for a transform
    whose ``update`` does not accept ``donate=``. ``ops`` (roundings per update, see
    :func:`default_ops`) goes to the checks that compare two implementations."""
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(
            f"check_transform: unknown checks in skip: {unknown} (known: {sorted(CHECKS)})"
        )
    stream = _stream(params, grads, steps, seed)
    accepted = extra_keywords(tx)
    for key, check in CHECKS.items():
        if key in skip:
            continue
        if key == "donation" and accepted is not None and DONATE not in accepted:
            continue
        if key == "mismatched_trees":
            check(tx, params, stream[:1], seed=seed)
        elif key in ("vmap", "compile"):
            check(tx, params, stream, ops=ops)
        elif key == "checkpoint":
            check(tx, params, stream if len(stream) >= 2 else None, steps=max(2, steps), seed=seed)
        else:
            check(tx, params, stream)
