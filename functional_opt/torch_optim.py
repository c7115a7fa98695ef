"""Any ``torch.optim`` optimizer as a pure :class:`GradientTransformation`: :func:`from_torch`.

``from_torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)`` runs torch's own optimizer code,
the same kernels a ``torch.optim.AdamW`` over the same params would run, on copies: each
``update`` builds a throwaway optimizer over clones of the params, hands it clones of the state
(the state a torch optimizer keeps per param, ``optimizer.state[p]``), calls ``step()`` and
reads the stepped clones and their state back. Nothing the caller passed is written.

The update is ``u = p_new - p`` (in the param's dtype), so ``apply_updates(params, updates)``
computes ``p + (p_new - p)``. That is ``p_new`` bit for bit whenever the subtraction is exact,
which it is (Sterbenz's lemma) whenever ``p_new`` lies between ``p / 2`` and ``2 p``: every
element whose step does not cross zero or halve or double it, i.e. every ordinary optimizer
step. An element that does (a param crossing zero) gets ``p_new`` to within one rounding of the
difference and one of the sum: ``|p + u - p_new| <= eps / 2 * (|p_new - p| + |p_new|)``.
The state is torch's state bit for bit in every case.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_opt import tree
from functional_opt.base import (
    EXTRA_KEYWORDS,
    GradientTransformation,
    Params,
    StepSize,
    UnknownStepSize,
    Updates,
    accepting,
    check_extra,
    constant_step_size,
    declare_step_size,
    donating,
    expect_state,
)
from functional_opt.tree import PyTree

__all__ = ["FromTorchState", "from_torch"]


class FromTorchState(NamedTuple):
    """The state of a :func:`from_torch` transform: what the torch optimizer keeps per param.

    ``slots[name]`` is a tree with the params' structure holding, for each param, the tensor
    ``optimizer.state[p][name]`` (e.g. ``"step"``, ``"exp_avg"``, ``"exp_avg_sq"`` for Adam;
    ``None`` where the param is ``None``). ``created[name]`` exists for an entry that torch
    creates at a param's first step rather than at its initialisation (SGD's
    ``"momentum_buffer"``): per param a 0-d bool tensor, whether torch's optimizer would hold the
    entry yet; until then ``slots[name]`` holds zeros that are never read."""

    slots: dict[str, PyTree]
    created: dict[str, PyTree]


# Optimizers that cannot run from gradients alone.
_REFUSED = {
    "LBFGS": "its step() needs a closure that re-evaluates the loss, and an update gets "
    "gradients only",
    "SparseAdam": "it needs sparse gradients; use from_torch(torch.optim.Adam, ...) for dense ones",
}

# Optimizers whose update is lr times a quantity that does not depend on lr (the state does not
# depend on lr either), given options named here as {option: value that makes it so}.
_LINEAR_IN_LR: dict[str, dict[str, Any]] = {
    "Adam": {},
    "AdamW": {},
    "SGD": {},
    "RMSprop": {},
    "Adamax": {},
    "NAdam": {},
    "RAdam": {},
    "Adadelta": {},
    "Muon": {},
    "Adagrad": {"lr_decay": 0},
    "ASGD": {"lambd": 0},
}

_DEVICE_OPTIONS = ("foreach", "fused", "capturable")


def from_torch(optimizer: type[torch.optim.Optimizer], /, **options: Any) -> GradientTransformation:
    """The ``torch.optim`` optimizer class ``optimizer`` with ``options`` as a pure transform.

    ``update(grads, state, params)`` returns ``p_new - p`` for each param, where ``p_new`` is
    what ``optimizer(params, **options).step()`` would make of ``p`` given the gradient and the
    state; ``params`` are required. Torch's code runs on clones, so no argument is written.
    Params whose gradient is ``None`` are skipped, as torch skips params without ``.grad``
    (their state, ``"step"`` included, is carried over). See :class:`FromTorchState` for the
    state and the module's docstring for which numbers are bit-equal to torch's.

    * ``options`` are checked by constructing the optimizer once (over a 2x2 dummy param):
      an option torch rejects is a ``ValueError``, an unknown one a ``TypeError``. Optimizers
      that cannot run from gradients alone (``LBFGS``, ``SparseAdam``) are refused.
    * ``torch.func.grad`` through ``update`` (meta-gradients, e.g. with respect to a tensor
      ``lr``) needs ``differentiable=True``, as torch's step runs without autograd otherwise;
      without it (or for an optimizer that has no such option, e.g. ``Muon``) an update of
      tensors that ``torch.func.grad`` tracks raises ``ValueError``. Under plain autograd the
      update of a non-differentiable optimizer is a constant, as torch's in-place step is.
    * ``torch.func.vmap`` (an ensemble of models) runs where torch's kernels have batching
      rules and do not read a tensor as a Python number: optimizers whose non-``capturable``
      step reads ``"step"`` with ``.item()`` need ``capturable=True`` there; an update that
      fails under ``vmap`` raises ``RuntimeError`` naming the optimizer and torch's reason.
    * ``donate=True``/``"state"`` lets torch's kernels write the new state into the state's
      buffers (not with ``differentiable=True``); the results are the same.
    * ``torch.compile`` cannot trace the optimizer's construction: ``fullgraph=True`` fails,
      and without it the update runs with graph breaks (torch's compiled step).
    * The step size is declared (``-lr``) for the optimizers whose update is proportional to
      ``lr`` (all of torch's but ``Rprop``, ``Adagrad`` with ``lr_decay`` and ``ASGD`` with
      ``lambd``), so ``TransformOptimizer(params, from_torch(torch.optim.Adam, lr=1e-3))``
      exposes ``group["lr"] == 1e-3`` and LR schedulers scale its updates.
    """
    cls = _check_class(optimizer)
    name = f"from_torch({cls.__name__})"
    group = _probe(cls, options, name)
    differentiable = bool(group.get("differentiable", False))
    has_differentiable = "differentiable" in group
    lazy = _lazy_entries(cls, options, name)

    def init_fn(params: Params) -> FromTorchState:
        values, spec = tree.flatten(params)
        present = [i for i, v in enumerate(values) if v is not None]
        for i in present:
            if not isinstance(values[i], Tensor):
                raise TypeError(
                    f"{name}: the param at {_path(params, i)} is a {type(values[i]).__name__}, "
                    "not a tensor"
                )
        ps = [values[i].detach() for i in present]
        states = _initial_states(cls, options, ps, params, present, name)
        keys = _same_keys(states, params, present, name)
        slots: dict[str, PyTree] = {}
        for key in keys:
            slots[key] = _placed(spec, len(values), present, [s[key] for s in states])
        created: dict[str, PyTree] = {}
        for key, (param_like, dtype) in lazy.items():
            if key in slots:
                continue
            slots[key] = _placed(
                spec, len(values), present, [_placeholder(p, param_like, dtype) for p in ps]
            )
            created[key] = _placed(
                spec,
                len(values),
                present,
                [torch.zeros((), dtype=torch.bool, device=p.device) for p in ps],
            )
        return FromTorchState(slots, created)

    def update_fn(
        updates: Updates, state: FromTorchState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, FromTorchState]:
        check_extra(extra, name)
        expect_state(state, FromTorchState, name)
        donate = donating(extra) and not differentiable
        if params is None:
            raise ValueError(f"{name}: update() needs params (torch's step reads them)")
        g, at = tree.split(updates)
        ps = at.take(params, "params")
        _check_dtypes(ps, g, at, name)
        keys = list(state.slots)
        olds = {k: _present(at, state.slots[k], f"state.slots[{k!r}]") for k in keys}
        flags = {k: _present(at, state.created[k], f"state.created[{k!r}]") for k in state.created}
        if not has_differentiable or not differentiable:
            _refuse_func_grad(
                name, cls.__name__, has_differentiable, ps, g, *olds.values(), options
            )
        per_param = [{k: olds[k][j] for k in keys} for j in range(len(g))]
        if flags:
            # Torch creates these entries at a param's first step, which its kernels tell from
            # their absence: run both ways and keep, per param, the one torch would have run.
            fresh = [{k: v for k, v in s.items() if k not in flags} for s in per_param]
            new_a, st_a = _step(cls, options, ps, g, fresh, differentiable, False, name)
            new_b, st_b = _step(cls, options, ps, g, per_param, differentiable, donate, name)
            new_p = []
            new_states = []
            for j in range(len(g)):
                made = [flags[k][j] for k in flags]
                cond = made[0]
                for c in made[1:]:
                    cond = cond & c
                new_p.append(torch.where(cond, new_b[j], new_a[j]))
                new_states.append({k: torch.where(cond, st_b[j][k], st_a[j][k]) for k in keys})
        else:
            new_p, new_states = _step(cls, options, ps, g, per_param, differentiable, donate, name)
        if differentiable:
            out = [n - p for n, p in zip(new_p, ps, strict=True)]
        else:
            out = [n.sub_(p.detach()) for n, p in zip(new_p, ps, strict=True)]
        new_slots = {
            k: at.carry(state.slots[k], [s[k] for s in new_states], f"state.slots[{k!r}]")
            for k in keys
        }
        new_created = {
            k: at.carry(
                state.created[k],
                [torch.ones_like(f) for f in flags[k]],
                f"state.created[{k!r}]",
            )
            for k in state.created
        }
        return at.updates(out), FromTorchState(new_slots, new_created)

    def declared() -> StepSize:
        linear = _LINEAR_IN_LR.get(cls.__name__)
        if linear is None or cls.__module__.split(".")[:2] != ["torch", "optim"]:
            raise UnknownStepSize(f"{name}: its update is not known to be proportional to lr")
        for option, value in linear.items():
            if group.get(option) != value:
                raise UnknownStepSize(
                    f"{name}: with {option}={group.get(option)!r} its update is not "
                    f"proportional to lr (it is with {option}={value!r})"
                )
        return StepSize(-constant_step_size(group["lr"], f"{name}'s lr").factor, False)

    update = accepting(update_fn, EXTRA_KEYWORDS)
    declare_step_size(update, declared)
    return GradientTransformation(init_fn, update)


# --------------------------------------------------------------------------------------------
# Construction


def _check_class(optimizer: Any) -> type[torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"from_torch: got an instance of {type(optimizer).__name__}; pass the class and its "
            f"options, e.g. from_torch(torch.optim.{type(optimizer).__name__}, lr=1e-3)"
        )
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(
            f"from_torch: optimizer must be a torch.optim.Optimizer subclass (e.g. "
            f"torch.optim.AdamW), got {optimizer!r}"
        )
    if optimizer is torch.optim.Optimizer:
        raise TypeError("from_torch: torch.optim.Optimizer is the base class, not an optimizer")
    why = _REFUSED.get(optimizer.__name__)
    if why is not None and optimizer.__module__.startswith("torch.optim"):
        raise TypeError(
            f"from_torch: torch.optim.{optimizer.__name__} cannot be a transform: {why}"
        )
    return optimizer


def _probe(cls: type[torch.optim.Optimizer], options: dict[str, Any], name: str) -> dict[str, Any]:
    """The optimizer's resolved options (its param group), after torch checked them."""
    if "params" in options:
        raise TypeError(f"{name}: pass the optimizer's options only; the params come to update()")
    try:
        opt = cls([torch.zeros(2, 2)], **options)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{name}: torch.optim.{cls.__name__} refuses these options: {e}") from None
    group = dict(opt.param_groups[0])
    del group["params"]
    return group


def _lazy_entries(
    cls: type[torch.optim.Optimizer], options: dict[str, Any], name: str
) -> dict[str, tuple[bool, torch.dtype | None]]:
    """The state entries torch creates at a param's first step rather than at initialisation,
    found by stepping a dummy param: ``{name: (param-shaped, dtype or None for the param's)}``."""
    dummy = torch.zeros(2, 2)
    trial = {k: v for k, v in options.items() if k not in _DEVICE_OPTIONS}
    opt = cls([dummy], **trial)
    before = set(_initial_states(cls, trial, [dummy], None, [0], name)[0])
    dummy.grad = torch.zeros_like(dummy)
    with torch.no_grad():
        opt.step()
    after = opt.state[dummy]
    out: dict[str, tuple[bool, torch.dtype | None]] = {}
    for key, value in after.items():
        if key in before:
            continue
        if not isinstance(value, Tensor) or value.shape not in (dummy.shape, torch.Size()):
            raise TypeError(
                f"{name}: torch's state entry {key!r} is a {type(value).__name__}"
                + (f" of shape {tuple(value.shape)}" if isinstance(value, Tensor) else "")
                + ": only tensors shaped like the param or 0-d are supported"
            )
        out[key] = (value.shape == dummy.shape, None if value.dtype == dummy.dtype else value.dtype)
    return out


def _placeholder(p: Tensor, param_like: bool, dtype: torch.dtype | None) -> Tensor:
    if param_like:
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return torch.zeros((), dtype=dtype or p.dtype, device=p.device)


def _initial_states(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    ps: list[Tensor],
    params: PyTree,
    present: list[int],
    name: str,
) -> list[dict[str, Tensor]]:
    """The state torch's optimizer sets up for each of ``ps`` before its first step (what its
    ``_init_group`` creates; ``{}`` for an optimizer without one)."""
    if not ps:
        return []
    stand_ins = [p.detach() for p in ps]  # new tensor objects: torch keys its state by identity
    try:
        opt = cls(stand_ins, **options)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{name}: {_which(cls, options, stand_ins, params, present, e)}") from None
    init_group = getattr(opt, "_init_group", None)
    if init_group is not None:
        for q in stand_ins:
            q.grad = torch.zeros_like(q)
        lists = [
            p
            for p in inspect.signature(init_group).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ][1:]  # after the group
        with torch.no_grad():
            init_group(opt.param_groups[0], *([] for _ in lists))
    out = []
    for q in stand_ins:
        state = dict(opt.state.get(q, {}))
        for key, value in state.items():
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"{name}: torch's state entry {key!r} is a {type(value).__name__}, not a tensor"
                )
        out.append(state)
    return out


def _which(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    ps: list[Tensor],
    params: PyTree,
    present: list[int],
    error: Exception,
) -> str:
    """Torch's message, with the path of the first param it refuses on its own."""
    for p, i in zip(ps, present, strict=True):
        try:
            cls([p.detach()], **options)
        except (ValueError, RuntimeError) as e:
            return f"the param at {_path(params, i)}: {e}"
    return str(error)


def _same_keys(
    states: list[dict[str, Tensor]], params: PyTree, present: list[int], name: str
) -> list[str]:
    if not states:
        return []
    keys = list(states[0])
    for s, i in zip(states, present, strict=True):
        if list(s) != keys:
            raise TypeError(
                f"{name}: torch keeps the state entries {list(s)} for the param at "
                f"{_path(params, i)} but {keys} for others: a state must have one structure"
            )
    return keys


def _placed(spec: Any, n: int, present: list[int], values: list[Tensor]) -> PyTree:
    out: list[Any] = [None] * n
    for i, v in zip(present, values, strict=True):
        out[i] = v
    return tree.unflatten(spec, out)


def _path(params: PyTree, i: int) -> str:
    if params is None:
        return "<dummy>"
    values, spec = tree.flatten(params)
    return tree.Leaves(values, spec, params, "params").path(i)


# --------------------------------------------------------------------------------------------
# Update


def _present(at: tree.Leaves, state: PyTree, name: str) -> list[Tensor]:
    values = at.flat(state, name)
    out = [values[i] for i in at.index]
    for i, v in zip(at.index, out, strict=True):
        if not isinstance(v, Tensor):
            raise TypeError(
                f"{name} at {at.path(i)} is a {type(v).__name__}, where the update is a tensor"
            )
    return out


def _check_dtypes(ps: list[Tensor], g: list[Tensor], at: tree.Leaves, name: str) -> None:
    for i, p, u in zip(at.index, ps, g, strict=True):
        if p.dtype != u.dtype or p.device != u.device:
            raise TypeError(
                f"{name}: the gradient at {at.path(i)} is {u.dtype} on {u.device} but the param "
                f"is {p.dtype} on {p.device}: torch.optim needs them equal"
            )


def _step(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    ps: list[Tensor],
    gs: list[Tensor],
    states: list[dict[str, Tensor]],
    differentiable: bool,
    donate: bool,
    name: str,
) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """Torch's ``step()`` over clones of ``ps`` with gradients ``gs`` and state ``states``
    (cloned unless donated): the stepped clones and their new state."""
    if not ps:
        return [], []
    if differentiable:
        # torch's differentiable kernels may write into the gradient (SGD's weight decay)
        qs = [p.clone() for p in ps]
        grads = [g.clone() for g in gs]
    else:
        qs = [p.detach().clone() for p in ps]
        grads = [g.detach() for g in gs]
    opt = cls(qs, **options)
    for q, grad, state in zip(qs, grads, states, strict=True):
        q.grad = grad
        opt.state[q] = {k: v if donate else v.clone() for k, v in state.items()}
    try:
        opt.step()
    except RuntimeError as e:
        if not _under_vmap(qs):
            raise
        if ".item()" in str(e):
            why = (
                "its step reads the 'step' count as a Python number (.item()), which vmap "
                "cannot batch; capturable=True (on the devices torch allows it) keeps it a tensor"
            )
        else:
            why = f"torch's kernel has no batching rule for it: {str(e).splitlines()[0]}"
        raise RuntimeError(
            f"{name}: torch.optim.{cls.__name__}'s step cannot run under torch.func.vmap with "
            f"these options: {why}"
        ) from e
    return qs, [opt.state[q] for q in qs]


def _tracked_by_func_grad(x: Any) -> bool:
    """Whether ``x`` is a tensor that a ``torch.func`` gradient transform tracks."""
    if not isinstance(x, Tensor):
        return False
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(x):
        if functorch.is_gradtrackingtensor(x):
            return True
        x = functorch.get_unwrapped(x)
    return False


def _under_vmap(xs: Sequence[Tensor]) -> bool:
    functorch = torch._C._functorch
    for x in xs:
        while functorch.is_functorch_wrapped_tensor(x):
            if functorch.is_batchedtensor(x):
                return True
            x = functorch.get_unwrapped(x)
    return False


def _refuse_func_grad(
    name: str,
    cls_name: str,
    has_differentiable: bool,
    *lists: Sequence[Any] | dict[str, Any],
) -> None:
    if torch._C._functorch.maybe_current_level() is None:
        return  # no torch.func transform is running
    for xs in lists:
        values = list(xs.values()) if isinstance(xs, dict) else list(xs)
        if any(_tracked_by_func_grad(x) for x in values):
            if has_differentiable:
                raise ValueError(
                    f"{name}: update() runs under torch.func.grad on tensors it tracks, but "
                    f"torch.optim.{cls_name} steps without autograd unless differentiable=True: "
                    f"pass differentiable=True to from_torch (or call update outside the "
                    "differentiated function)"
                )
            raise ValueError(
                f"{name}: update() runs under torch.func.grad on tensors it tracks, but "
                f"torch.optim.{cls_name} has no differentiable mode: its step cannot be "
                "differentiated"
            )
