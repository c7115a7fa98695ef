""":func:`functional_opt.fused_step` inside a user's ``torch.compile``: the step as one opaque op.

Traced inline, a transform's update over a plain tree is a handful of ops *per leaf*: a
DreamerV3 step over 120 tensors is about 3600 ops, which took dynamo and inductor 81 s to
compile with an empty cache (and never finished for 2000 tensors). The engine already runs that
step over plain trees (:mod:`functional_opt.plain_trees`) with a few kernels compiled once per
process with dynamic shapes. So while ``torch.compile`` traces a ``fused_step`` over a plain
tree, the step goes into the graph as one op, ``functional_opt::fused_step``, which mutates the
params and the state it is given (as ``torch.optim``'s fused Adam is one op in a compiled
graph); when the compiled code runs, the op runs the engine's step on the real tensors and
writes the new params and state into them. The result is the same, bit for bit, as calling the
``fused_step`` outside ``torch.compile``. The gradients are read, never written (where the engine
refuses a tree, the op runs the transform's update with only the state donated).

A custom op's arguments are tensors, lists and numbers, not Python objects, so the op names its step
by a number (:class:`Opaque`, made once per ``fused_step``, held by the compiled code's closure; the
table here holds only weak references), names the params by their keys, and rebuilds the state's
structure, when the op runs, from ``tx.init`` of the params on the ``meta`` device (no memory; of
the params themselves where an ``init`` cannot run there). The op is taken when the params are a
``list``, ``tuple`` or ``dict`` (string keys) of plain tensors, the gradients have the same keys,
the state's leaves are tensors or ``None``, autograd records none of the tensors, and no
``torch.func`` transform is being traced; other steps are traced inline, as before.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch import Tensor

from functional_opt import tree
from functional_opt.base import STATE_ONLY, GradientTransformation, OptState, apply_updates

__all__ = ["Opaque"]

_PLAIN = frozenset((Tensor, torch.nn.Parameter))
_SEQUENCE, _TUPLE, _DICT = 0, 1, 2

_Spec = tuple[Any, tuple[int, ...], list["int | None"], list[torch.Size]]
"""What :meth:`Opaque._spec` finds: optree's spec of the state, the ``None`` leaves' positions,
optree's order of the tensors, their shapes."""

_STEPS: dict[int, weakref.ref[Opaque]] = {}
"""The live :class:`Opaque` steps by number (weak: an entry goes with its step)."""
_NUMBERS = itertools.count()


class Opaque:
    """One ``fused_step``'s route into compiled graphs: ``call(params, grads, state)`` (made
    while ``torch.compile`` traces) puts the op in the graph and returns ``(params, state)``,
    or returns ``None`` where the step is traced inline."""

    def __init__(self, tx: GradientTransformation, plain: Any) -> None:
        self.tx = tx
        self.plain = plain
        """The engine's step over a plain tree (params written in place; it returns ``None``
        where it does not apply)."""
        self.number = next(_NUMBERS)
        self.specs: dict[tuple[Any, ...], _Spec] = {}
        """Per params' keys, shapes and dtypes: what :meth:`_spec` finds."""
        self.checked: list[int] = []
        """The state's tensors last found of the right structure (by identity)."""
        _STEPS[self.number] = weakref.ref(self, _forget(self.number))

    def call(self, params: Any, grads: Any, state: OptState) -> tuple[Any, OptState] | None:
        """While tracing: the op over the flattened trees, or ``None`` (trace inline)."""
        kind, keys = _kind(params)
        if kind is None or _kind(grads) != (kind, keys):
            return None
        ps = _values(params, keys)
        gs = _values(grads, keys)
        leaves = _leaves_of(state)  # (optree's flatten costs dynamo seconds for 1000 leaves)
        if leaves is None:
            return None
        ss = [x for x in leaves if x is not None]
        # (comprehensions, not a function call per leaf: dynamo inlines every call it traces)
        if not {type(x) for x in ps}.union({type(x) for x in gs}, {type(x) for x in ss}) <= _PLAIN:
            return None
        if torch.is_grad_enabled() and True in {x.requires_grad for x in (*ps, *gs, *ss)}:
            return None
        if not isinstance(torch._C._functorch.peek_interpreter_stack(), type(None)):
            return None  # (a torch.func transform; dynamo traces ``is None`` of it wrongly)
        nones = [i for i, x in enumerate(leaves) if x is None]
        torch.ops.functional_opt.fused_step(ps, gs, ss, nones, kind, keys, self.number)
        return params, state

    def run(
        self,
        ps: list[Tensor],
        gs: list[Tensor],
        ss: list[Tensor],
        nones: list[int],
        kind: int,
        keys: list[str],
    ) -> None:
        """The op's body: the step on the real tensors, its results written into them."""
        params, grads = _rebuilt(kind, keys, ps), _rebuilt(kind, keys, gs)
        spec, init_nones, order, shapes = self._spec(params, kind, keys, ps)
        ids = [id(x) for x in ss]
        if ids != self.checked and (
            list(init_nones) != list(nones)
            or len(order) != len(ss) + len(nones)
            or any(x.shape != shape for x, shape in zip(ss, shapes, strict=True))
        ):
            raise RuntimeError(
                "fused_step under torch.compile: the state does not have the structure of "
                "tx.init(params) (its leaves, where they are None, or their shapes differ)"
            )
        self.checked = ids  # (the same tensors next step: not checked again)
        full = [None if k is None else ss[k] for k in order]  # (optree's leaf order)
        state = optree.tree_unflatten(spec, full)
        # (the returned state is copied into the given one and dropped: no caller keeps it)
        new_state = self.plain(params, grads, state, into_held=True)
        new_params = params
        if new_state is None:  # (a tree the engine refuses: the update, the gradients kept)
            updates, new_state = self.tx.update(grads, state, params, donate=STATE_ONLY)
            new_params = apply_updates(params, updates, donate=True)
        new_leaves = optree.tree_leaves(new_state, none_is_leaf=True, namespace=tree.NAMESPACE)
        if len(new_leaves) != len(full) or any(
            (x is None) != (y is None) for x, y in zip(new_leaves, full, strict=True)
        ):
            raise RuntimeError(
                "fused_step under torch.compile: the update returned a state of another "
                "structure than it was given"
            )
        olds: list[Tensor] = []
        values: list[Tensor] = []
        for old, new in zip((*ps, *full), (*_values(new_params, keys), *new_leaves), strict=True):
            if old is not None and new is not old:  # (results not written in place)
                olds.append(old)
                values.append(new)
        if olds:
            torch._foreach_copy_(olds, values)

    def _spec(self, params: Any, kind: int, keys: list[str], ps: list[Tensor]) -> _Spec:
        """For params of these keys, shapes and dtypes: the structure of ``tx.init(params)``
        (optree's spec), where :func:`_leaves_of` finds ``None`` leaves, for each of optree's
        leaves the position of the same leaf among :func:`_leaves_of`'s tensors (``None`` for a
        ``None`` leaf), found on one init (the two orders may differ: optree may be told to keep
        dicts in insertion order), and the shapes of those tensors."""
        key = (kind, tuple(keys), tuple((p.shape, p.dtype, p.device) for p in ps))
        found = self.specs.get(key)
        if found is None:
            metas = _rebuilt(kind, keys, [torch.empty_like(p, device="meta") for p in ps])
            try:
                init = self.tx.init(metas)
            except (NotImplementedError, RuntimeError):  # (an init that reads values)
                init = self.tx.init(params)
            theirs, spec = optree.tree_flatten(init, none_is_leaf=True, namespace=tree.NAMESPACE)
            mine = _leaves_of(init)
            if mine is None or len(mine) != len(theirs):
                raise RuntimeError(
                    "fused_step under torch.compile: tx.init(params) is not made of dicts, "
                    "lists, tuples, named tuples and tensors"
                )
            at = {id(x): k for k, x in enumerate(x for x in mine if x is not None)}
            order = [None if x is None else at[id(x)] for x in theirs]
            nones = tuple(i for i, x in enumerate(mine) if x is None)
            shapes = [x.shape for x in mine if x is not None]
            found = self.specs[key] = (spec, nones, order, shapes)
        return found


def _leaves_of(node: Any) -> list[Any] | None:
    """The leaves (tensors and ``None``) of a tree of dicts (keys sorted), lists, tuples and
    named tuples, in that order; ``None`` for a tree with other nodes. Written for dynamo to
    trace cheaply (a loop over a node's children, one call per node, not per leaf)."""
    t = type(node)
    if t is dict:
        try:
            children = [node[k] for k in sorted(node)]
        except TypeError:  # (keys that do not sort)
            return None
    elif t is list or t is tuple or (isinstance(node, tuple) and hasattr(t, "_fields")):
        children = list(node)
    elif node is None or isinstance(node, Tensor):
        return [node]
    else:
        return None
    out: list[Any] = []
    for child in children:
        if child is None or isinstance(child, Tensor):
            out.append(child)
            continue
        sub = _leaves_of(child)
        if sub is None:
            return None
        out.extend(sub)
    return out


def _forget(number: int) -> Callable[[Any], None]:
    def forget(_: Any) -> None:
        _STEPS.pop(number, None)

    return forget


def _kind(params: Any) -> tuple[int | None, list[str]]:
    """The op's code for the params' container and its keys; ``None`` for other trees."""
    if type(params) is list:
        return _SEQUENCE, []
    if type(params) is tuple:
        return _TUPLE, []
    if type(params) is dict and all(type(k) is str for k in params):
        return _DICT, list(params)
    return None, []


def _values(container: Any, keys: list[str]) -> list[Any]:
    return [container[k] for k in keys] if keys else list(container)


def _rebuilt(kind: int, keys: list[str], values: list[Any]) -> Any:
    if kind == _DICT:
        return dict(zip(keys, values, strict=True))
    return tuple(values) if kind == _TUPLE else list(values)


@torch.library.custom_op(
    "functional_opt::fused_step",
    mutates_args=("params", "state"),
    schema=(
        "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state, int[] nones, int kind, "
        "str[] keys, int number) -> ()"
    ),
    # (its body is Python that decides each step what to run: never captured in a CUDA graph)
    tags=(torch.Tag.cudagraph_unsafe,),
)
def _fused_step_op(
    params: list[Tensor],
    grads: list[Tensor],
    state: list[Tensor],
    nones: list[int],
    kind: int,
    keys: list[str],
    number: int,
) -> None:
    ref = _STEPS.get(number)
    opaque = None if ref is None else ref()
    if opaque is None:
        raise RuntimeError(
            "fused_step under torch.compile: the fused_step this graph was compiled with no "
            "longer exists (keep it alive as long as the compiled function)"
        )
    with _as_in_eager_code():
        opaque.run(params, grads, state, nones, kind, keys)


@contextlib.contextmanager
def _as_in_eager_code() -> Iterator[None]:
    """The op's body runs with the dispatch keys of eager code. The first call of an inductor
    graph runs the op through its in-place kernel (which marks the tensors written, then
    dispatches below itself: that key excluded); later calls reach the op directly. The
    engine's own compiled kernels guard on the excluded keys, so the second call compiled them
    again (about half a second on W1). With the key available as in eager code every call is
    the same to them (the in-place ops inside mark the tensors they write, as eagerly)."""
    key = torch._C.DispatchKey.ADInplaceOrView
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    if excluded:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        if excluded:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, True)


@_fused_step_op.register_fake
def _fused_step_fake(*args: object, **kwargs: object) -> None:
    """While tracing: the op returns nothing (its effect is the mutation of its arguments)."""
    return None
