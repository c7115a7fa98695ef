"""The DreamerV3 optimizer (Hafner et al. 2023, arXiv:2301.04104), as a chain of transforms."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from functional_opt import _lists, _validate, plain_trees, tree
from functional_opt.base import (
    DONATE,
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    StepSize,
    Updates,
    chain,
    constant_step_size,
    declare_fusable,
    declare_leafwise,
    declare_step_size,
    describe,
    donate_mode,
    donating_updates,
    fusable,
    leafwise_level,
)
from functional_opt.engine import Runner
from functional_opt.packed import Packed
from functional_opt.plain_trees import PlainTreeStep
from functional_opt.schedules import Schedule
from functional_opt.transforms.clipping import check_agc, clip_by_agc
from functional_opt.transforms.moments import (
    EmaState,
    MomentDtype,
    ScaleByRmsWithCountState,
    ema,
    scale_by_rms,
)
from functional_opt.transforms.scaling import ScaleByScheduleState, scale_by_learning_rate
from functional_opt.transforms.weight_decay import add_decayed_weights
from functional_opt.tree import PyTree

__all__ = ["dreamerv3", "dreamerv3_schedule"]

SCHEDULES = ("const", "linear", "cosine")

Number = float | int | Tensor
"""A hyperparameter: a Python number or a tensor (injected hyperparameters are 0-d tensors)."""


def check_state(momentum: bool, state: OptState) -> None:
    """Raises a ``ValueError`` naming the first place where ``state`` is not a state of
    dreamerv3 with these options (its chain's states: ``EmptyState()`` for ``clip_by_agc``,
    ``ScaleByRmsWithCountState``, ``EmaState`` with momentum, ``EmptyState()`` for the weight
    decay and ``ScaleByScheduleState``). A few ``isinstance`` checks, once per update; the
    per-parameter trees inside are checked when their leaves are taken."""
    kinds: list[type] = [EmptyState, ScaleByRmsWithCountState]
    if momentum:
        kinds.append(EmaState)
    kinds += [EmptyState, ScaleByScheduleState]
    if not isinstance(state, tuple) or type(state) is not tuple or len(state) != len(kinds):
        raise ValueError(
            f"dreamerv3: the state must be a tuple of {len(kinds)} states "
            f"({', '.join(k.__name__ for k in kinds)}), got {describe(state)} at <root> (the "
            "state of another transform, or of dreamerv3 with other options?)"
        )
    for i, (kind, s) in enumerate(zip(kinds, state, strict=True)):
        if not isinstance(s, kind):
            raise ValueError(
                f"dreamerv3: the state at [{i}] must be a {kind.__name__}, got {describe(s)} "
                "(the state of another transform, or of dreamerv3 with other options?)"
            )


def _writable(x: Tensor) -> bool:
    """Whether a donated update buffer takes the new update in place: not tracked by autograd,
    and at least 32-bit (writing 16-bit data back into the buffer being read measured twice as
    slow as writing a fresh one)."""
    return x.element_size() >= 4 and not (torch.is_grad_enabled() and x.requires_grad)


def _where(cond: Tensor, a: Tensor | float, b: Tensor | float) -> Tensor:
    return torch.where(
        cond, torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    )


def _check_schedule(lr: Number, warmup: Number, schedule: Any, anneal: Number) -> None:
    _validate.non_negative("lr", lr)
    _validate.counter("warmup", warmup)
    _validate.counter("anneal", anneal)
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def dreamerv3_schedule(
    lr: Number,
    warmup: Number = 1000,
    schedule: Literal["const", "linear", "cosine"] = "const",
    anneal: Number = 0,
) -> Schedule:
    """DreamerV3's learning rate at update count ``t`` (from 0).

    Warm-up: ``lr * t / warmup`` for ``t < warmup`` (0 on the first update). Then, with
    ``s = t - warmup`` and ``T = anneal - warmup``: ``const`` gives ``lr``; ``linear`` goes
    linearly to ``0.1 lr`` at ``s = T``; ``cosine`` gives
    ``lr * (0.9 * 0.5 * (1 + cos(pi * min(s, T) / T)) + 0.1)``. ``T <= 0`` gives ``lr``.
    Works with tensor hyperparameters (no Python branching on their values).

    Checked: ``lr`` is a finite number ``>= 0`` and ``warmup``, ``anneal`` are integers in
    ``[0, 2**31 - 1]`` (a later step is never reached by the int32 update counter), or 0-d
    tensors (then the caller's promise).
    """
    _check_schedule(lr, warmup, schedule, anneal)

    def fn(count: int | Tensor) -> Tensor:
        t = torch.as_tensor(count).to(torch.float64)
        w = torch.as_tensor(warmup).to(torch.float64)
        span = torch.as_tensor(anneal).to(torch.float64) - w
        # Linear ramp from 0 to lr over `warmup` updates (optax.linear_schedule(0, lr, warmup)).
        ramp = (0.0 - lr) * (1 - torch.clamp(t, min=0) / torch.clamp(w, min=1)) + lr
        s = t - w
        safe_span = torch.clamp(span, min=1)
        if schedule == "const":
            body = torch.zeros_like(t) + lr
        elif schedule == "linear":
            frac = 1 - torch.minimum(torch.clamp(s, min=0), safe_span) / safe_span
            body = _where(span > 0, (lr - 0.1 * lr) * frac + 0.1 * lr, torch.zeros_like(t) + lr)
        else:
            cosine = 0.5 * (1 + torch.cos(math.pi * torch.minimum(s, safe_span) / safe_span))
            body = _where(span > 0, lr * ((1 - 0.1) * cosine + 0.1), torch.zeros_like(t) + lr)
        return torch.where(t < w, ramp, body)

    return fn


def dreamerv3(
    lr: Number = 4e-5,
    *,
    agc: Number = 0.3,
    pmin: Number = 1e-3,
    beta1: Number = 0.9,
    beta2: Number = 0.999,
    eps: Number = 1e-20,
    warmup: Number = 1000,
    momentum: bool = True,
    nesterov: bool = False,
    weight_decay: Number = 0.0,
    weight_decay_mask: PyTree | Callable[[Params], PyTree] | None = None,
    schedule: Literal["const", "linear", "cosine"] = "const",
    anneal: Number = 0,
    _fused: bool = True,
) -> GradientTransformation:
    """DreamerV3's optimizer.

    ``chain(clip_by_agc(agc, pmin), scale_by_rms(beta2, eps, eps_in_sqrt=False,
    bias_correction=True), ema(beta1, debias=True), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(dreamerv3_schedule(lr, warmup, schedule, anneal)))``. That is
    ``u = u / max(1, ||u|| / (agc max(pmin, ||p||)))``, ``nu = b2 nu + (1-b2) u^2``,
    ``r = u / (sqrt(nu / (1-b2^t)) + eps)``, ``mu = b1 mu + (1-b1) r``,
    ``u = -lr_t (mu / (1-b1^t) + wd p)``. ``nesterov`` uses ``b1 mu + (1-b1) r`` in place of
    ``mu``; ``momentum=False`` drops the ``mu`` step. Moments are float32 for 16-bit params.

    Checked when built (``ValueError``, or ``HyperparameterTypeError`` for a wrong type, naming
    the argument): ``lr``, ``weight_decay >= 0``; ``beta1``, ``beta2`` in ``[0, 1)``; ``eps`` a
    positive normal float32 (``>= 1.2e-38``: moments are at least float32, where a smaller
    ``eps`` is 0 and a zero gradient gives ``0 / 0 = NaN``, for good); ``agc >= 0`` and, unless
    ``agc == 0``, ``pmin > 0`` with ``agc * pmin >= 1.2e-38`` (with a zero clipping bound a zero
    param with a zero gradient gives NaN); ``warmup`` and ``anneal`` integers in
    ``[0, 2**31 - 1]`` (the int32 update counter's range); ``momentum``/``nesterov`` bools.
    Tensor hyperparameters (``inject_hyperparams``) are checked for their shape only.

    In eager mode, over a plain tree of separate tensors with at least
    :data:`functional_opt.plain_trees.TREE_MIN` elements in all (and params given), the update
    runs on the engine as :func:`functional_opt.fused`'s does (its chain compiled: the same
    result to float rounding; the first call compiles); over packed trees the engine compiles
    its chain over the buffers. Elsewhere (smaller trees, ``torch.compile``, ``vmap``, tensor
    hyperparameters, a ``weight_decay_mask``, an update autograd records) it runs the chain
    itself. Like the chain, it is fusable: :func:`functional_opt.fused`,
    :func:`functional_opt.fused_step` and ``TransformOptimizer`` compile the chain.
    """
    _check_schedule(lr, warmup, schedule, anneal)
    check_agc(agc, pmin, "agc")
    _validate.unit_interval("beta1", beta1)
    _validate.unit_interval("beta2", beta2)
    _validate.float32_magnitude("eps", eps)
    _validate.non_negative("weight_decay", weight_decay)
    _validate.boolean("momentum", momentum)
    _validate.boolean("nesterov", nesterov)
    _validate.boolean("_fused", _fused)
    static = isinstance(anneal, int) and isinstance(warmup, int)
    if schedule == "cosine" and static and anneal <= warmup:
        raise ValueError(
            f"anneal must be > warmup for the cosine schedule, got anneal={anneal}, warmup={warmup}"
        )
    moments: MomentDtype = "float32_for_16bit"
    sched = dreamerv3_schedule(lr, warmup, schedule, anneal)
    parts = [
        clip_by_agc(agc, pmin),
        scale_by_rms(beta2, eps, eps_in_sqrt=False, bias_correction=True, _moment_dtype=moments),
    ]
    if momentum:
        parts.append(ema(beta1, debias=True, _moment_dtype=moments, _nesterov=nesterov))
    parts.append(add_decayed_weights(weight_decay, weight_decay_mask))
    parts.append(scale_by_learning_rate(sched))
    reference = chain(*parts)

    def declared() -> StepSize:  # -lr times warm-up and decay factors that do not depend on lr
        return StepSize(-constant_step_size(lr, "dreamerv3's lr").factor, False)

    declare_step_size(reference.update, declared)
    if weight_decay_mask is not None or not _fused:
        return reference
    numbers = (lr, agc, pmin, beta1, beta2, eps, warmup, weight_decay, anneal)
    # (tensor hyperparameters come from inject_hyperparams, which builds a new dreamerv3 on
    # every update: a runner of its own would compile every step)
    engine = None if any(isinstance(x, Tensor) for x in numbers) else Runner(reference)
    plain = (
        None
        if engine is None
        else PlainTreeStep(reference, engine, updates_only=True, min_numel=plain_trees.TREE_MIN)
    )

    def update_fn(
        updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]:
        if isinstance(updates, Packed):
            check_state(momentum, state)
            return _packed_update(engine, reference, updates, state, params, extra)
        if plain is not None and set(extra) <= {DONATE}:
            check_state(momentum, state)
            done = plain.update(updates, state, params, donate_mode(extra))
            if done is not None:
                return done
        out, new_state = reference.update(updates, state, params, **extra)
        if donating_updates(extra) and torch.compiler.is_compiling():
            out = _into_donated(updates, out)
        return out, new_state

    declare_step_size(update_fn, declared)
    # under torch.compile the fast paths step aside and the chain runs: the engine compiles it
    declare_fusable(update_fn, fusable(reference))
    declare_leafwise(update_fn, lambda: leafwise_level(reference))
    return GradientTransformation(reference.init, update_fn)


def _packed_update(
    engine: Runner | None,
    reference: GradientTransformation,
    updates: Packed,
    state: OptState,
    params: Params | None,
    extra: dict[str, Any],
) -> tuple[Updates, OptState]:
    """Packed trees: the chain compiled over their buffers by the engine (the first call with
    a layout compiles), a loose tree of updates copied into buffers first. With tensor
    hyperparameters the chain runs as it is (over the buffers), as it does wherever the engine
    does not compile (see :mod:`functional_opt.engine`: under compile, batch dimensions,
    buffers autograd records...)."""
    if engine is None:
        return reference.update(updates, state, params, **extra)
    if updates.buffers is None and not torch.compiler.is_compiling():
        updates = updates.repack()  # (a copy: the caller's leaves are never written)
    return engine(updates, state, params, extra)


def _into_donated(updates: Updates, out: Updates) -> Updates:
    """Under ``torch.compile``: ``out`` written into the donated ``updates``' buffers, which
    lets inductor store the update where the gradient was instead of in a fresh buffer (fresh
    multi-MB buffers cost page faults on every step). Unchanged where a buffer cannot take it."""
    g, at = tree.split(updates)
    u = at.take(out, "updates")
    if not _lists.distinct(g) or not _lists.use_foreach(g):
        return out
    for x, y in zip(g, u, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape or not _writable(x):
            return out
    torch._foreach_copy_(g, u)  # type: ignore[misc]
    return at.updates(g)
