"""``DreamerV3Optimizer``: torchrl's DreamerV3 optimizer, on ``functional_opt.dreamerv3``.

A drop-in for ``torchrl.trainers.algorithms.DreamerV3Optimizer`` (torchrl 0.14.1): the same
signature, options, ``step`` contract and checkpoint layout (per-parameter ``"rms"`` and
``"momentum"`` in float32 for 16-bit params, a Python-int ``"step"`` per param group), so a
checkpoint of either loads into the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from functional_opt import _lists
from functional_opt.dreamerv3 import dreamerv3

from .flat_dreamerv3 import FlatBucket, eligible_options, eligible_params
from .transform_optimizer import TransformOptimizer, _Layout

__all__ = ["DreamerV3Optimizer"]


def _all_reduced(buckets: list[FlatBucket], parts: list[Tensor], n: int) -> list[Tensor]:
    """Each bucket's ``[2, k]`` local sums (:meth:`FlatBucket.squares`) summed over the ranks of
    the buckets' process group (as they are when it is ``None``), all in one ``all_reduce`` of a
    ``[2, n]`` tensor in the group's param order (the same on every rank, unlike the buckets'
    orders), in float64 when the buckets' dtypes differ."""
    group = buckets[0].group
    if group is None:
        return parts
    dtypes = {t.dtype for t in parts}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    total = parts[0].new_zeros((2, n), dtype=dtype)
    for bucket, part in zip(buckets, parts, strict=True):
        total[:, bucket.positions] = part.to(dtype)
    torch.distributed.all_reduce(total, group=group)
    return [
        total[:, bucket.positions].to(part.dtype)
        for bucket, part in zip(buckets, parts, strict=True)
    ]


_FLOAT_OPTIONS = ("lr", "agc", "parameter_norm_min", "beta1", "beta2", "eps")


def _float(value: Any) -> Any:
    """An int option as a float, so that its injected hyperparameter tensor is a float one."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


class DreamerV3Optimizer(TransformOptimizer):
    """DreamerV3 adaptive gradient clipping, RMS scaling and momentum (Hafner et al. 2023,
    arXiv:2301.04104), with torchrl's signature and behaviour.

    On update ``t`` (from 1) of a group, per parameter with a gradient ``g`` (in float32 for
    16-bit params): ``g <- g / max(1, ||g|| / (agc * max(parameter_norm_min, ||p||)))`` (skipped
    when ``agc == 0``), ``rms <- beta2 rms + (1 - beta2) g^2``,
    ``r = g / (sqrt(rms / (1 - beta2^t)) + eps)``, ``momentum <- beta1 momentum + (1 - beta1) r``,
    ``p <- p - lr * min(1, (t - 1) / warmup_steps) * momentum / (1 - beta1^t)`` (no warm-up factor
    when ``warmup_steps == 0``). This is ``functional_opt.dreamerv3`` run by
    :class:`TransformOptimizer`.

    Param-group dicts override the keyword defaults (same option names as torchrl); each group
    counts its own updates in ``group["step"]`` (a Python int, the source of truth for the
    transform's counters). Params without a gradient are skipped (state kept); a step where no
    param has a gradient raises ``RuntimeError``; bad option values raise ``ValueError``.
    Moments are float32 for 16-bit params and in the param's dtype otherwise (torchrl computes
    float64 params in float32).

    The params keep their own storage: after any number of steps each has the same
    ``untyped_storage()``, storage offset and strides as before, so weights tied by storage stay
    tied (each tied param's update is added to the shared memory, as torch's optimizers do),
    aliases of ``p.data`` stay valid and ``safetensors`` (``accelerate``'s default checkpoint
    format) sees separate tensors. Gradients and the optimizer state live in the optimizer's
    flat buffers: after a step each ``p.grad`` and each ``state[p]`` entry is a view into them
    (as DDP's ``gradient_as_bucket_view`` does for gradients), which ``zero_grad`` and
    ``backward`` keep using.

    ``own_param_storage=True`` (opt-in, faster for models of many small tensors: see
    ``docs/performance.md``) instead moves the params into those buffers on the first step:
    ``p.data`` of every param of a group becomes a view into one flat buffer per device and
    dtype. That has these consequences for the user's model:

    * ``safetensors`` refuses or drops tensors that share a storage: ``safetensors.torch.
      save_model`` raises, and ``accelerate.Accelerator.save_state()`` (safetensors by default)
      keeps one tensor of the shared storage and drops the others with a "Removed shared
      tensor" warning, after which ``load_state()`` fails with missing keys;
    * weights tied by storage (``dec.weight.data = enc.weight.data.t()``) are untied: each gets
      its own copy, and they drift apart from the first step;
    * any alias of ``p.data`` taken before the first step (EMA helpers, CUDA graphs, hooks)
      goes stale: it keeps the old memory, which the optimizer no longer updates;
    * ``torch.save`` of one param writes the whole flat buffer.
    """

    options: ClassVar[dict[str, str]] = {
        "lr": "lr",
        "agc": "agc",
        "parameter_norm_min": "pmin",
        "beta1": "beta1",
        "beta2": "beta2",
        "eps": "eps",
        "warmup_steps": "warmup",
    }
    state_names: ClassVar[dict[str, str]] = {"nu": "rms", "ema": "momentum"}
    group_defaults: ClassVar[dict[str, Any]] = {"step": 0}
    upcast_16bit_grads: ClassVar[bool] = True
    flat_step: bool = True
    """Use the fast path (flat buffers, one compiled kernel; see
    :mod:`functional_opt.adapters.flat_dreamerv3`) for groups of plain dense tensors. Set to
    ``False`` to run every step through the generic :class:`TransformOptimizer` path."""

    def __init__(
        self,
        parameters: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 4e-5,
        agc: float = 0.3,
        parameter_norm_min: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-20,
        warmup_steps: int = 1000,
        own_param_storage: bool = False,
    ) -> None:
        if not isinstance(own_param_storage, bool):
            raise TypeError(
                f"own_param_storage must be a bool, got {type(own_param_storage).__name__}"
            )
        self.own_param_storage = own_param_storage
        super().__init__(
            parameters,
            dreamerv3,
            lr=_float(lr),
            agc=_float(agc),
            parameter_norm_min=_float(parameter_norm_min),
            beta1=_float(beta1),
            beta2=_float(beta2),
            eps=_float(eps),
            warmup_steps=warmup_steps,
        )

    def forget_param_norms(self) -> None:
        """:meth:`TransformOptimizer.forget_param_norms`, for the flat buckets' sharded steps
        too."""
        buckets: dict[int, tuple[_Layout, list[FlatBucket]]] = self.__dict__.get("_buckets", {})
        for _, flat in buckets.values():
            for bucket in flat:
                bucket.param_squares.clear()
        super().forget_param_norms()

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        params: list[Tensor] = group["params"]
        buckets: dict[int, tuple[_Layout, list[FlatBucket]]]
        buckets = self.__dict__.setdefault("_buckets", {})
        flat: list[FlatBucket] | None = None
        plans: list[tuple[list[int], list[int]] | None] | None = None
        if self.flat_step and eligible_options(group):
            layout = self._layout(index, group)  # validates the options before any change
            flat = self._flat_buckets(index, params, buckets, layout)
            if flat is not None:
                plans = [bucket.plan_grads() for bucket in flat]
        if flat is None or plans is None or any(plan is None for plan in plans):
            buckets.pop(index, None)  # the generic path may create state outside the buckets
            super()._step_group(index, group)
            return
        present = [
            bucket.take_grads(plan)  # type: ignore[arg-type]
            for bucket, plan in zip(flat, plans, strict=True)
        ]
        squares = None
        if flat[0].sharded and group["agc"] > 0:
            squares = _all_reduced(flat, [b.squares() for b in flat], len(params))
        step = group["step"] + 1
        warmup = group["warmup_steps"]
        lr = group["lr"] * (min(1.0, (step - 1) / warmup) if warmup else 1.0)
        b1, b2 = group["beta1"], group["beta2"]
        names = (self.state_names["nu"], self.state_names["ema"])
        for k, (bucket, indices) in enumerate(zip(flat, present, strict=True)):
            if not indices:
                continue
            bucket.step(
                indices,
                lr=lr,
                bc1=1 - b1**step,
                bc2=1 - b2**step,
                agc=group["agc"],
                pmin=group["parameter_norm_min"],
                beta1=b1,
                beta2=b2,
                eps=group["eps"],
                squares=None if squares is None else squares[k],
            )
            bucket.bind_state(self.state, names, indices)
        group["step"] = step

    def _flat_buckets(
        self,
        index: int,
        params: list[Tensor],
        buckets: dict[int, tuple[_Layout, list[FlatBucket]]],
        layout: _Layout,
    ) -> list[FlatBucket] | None:
        """The group's buckets (one per device and dtype), rebuilt when its params changed
        (the group's ``layout`` is rebuilt then) or a param's memory moved; ``None`` when the
        flat path cannot hold its params."""
        cached = buckets.get(index)
        if cached is not None and cached[0] is layout and all(b.intact() for b in cached[1]):
            return cached[1]
        tensors, shards = params, None
        if not eligible_params(params):
            # DTensors (FSDP2, HSDP): the same buckets over their local shards, the norms'
            # partial sums resolved in one collective per step (the params' storage is
            # FSDP2's: never owned, whatever own_param_storage says)
            shards = _lists.local_shards(params)
            if shards is None or not eligible_params(shards.locals):
                return None
            tensors = shards.locals
        own = self.own_param_storage and shards is None
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(tensors):
            by_kind.setdefault((p.device, p.dtype), []).append(i)
        shared: set[int] = set()
        if not own:
            for cluster in _lists.overlapping(tensors):
                if len({(tensors[i].device, tensors[i].dtype) for i in cluster}) > 1:
                    return None  # memory shared across dtypes: the generic path's order
                shared.update(cluster)
        names = (self.state_names["nu"], self.state_names["ema"])
        current = []
        for members in by_kind.values():
            bucket = FlatBucket(
                [tensors[i] for i in members],
                shared=[k for k, i in enumerate(members) if i in shared],
                own_param_storage=own,
                keys=None if shards is None else [params[i] for i in members],
                group=None if shards is None else shards.group,
                positions=members,
            )
            bucket.adopt_state(self.state, names)
            current.append(bucket)
        buckets[index] = (layout, current)
        return current

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["own_param_storage"] = self.own_param_storage
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("own_param_storage", False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint (torchrl's layout); the fast path re-adopts the loaded state."""
        super().load_state_dict(state_dict)
        self.__dict__.pop("_buckets", None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its options override the defaults (torchrl's names)."""
        for key in _FLOAT_OPTIONS:
            if key in param_group:
                param_group[key] = _float(param_group[key])
        super().add_param_group(param_group)

    # The group-level state of dreamerv3 is its update counters, which all equal the number of
    # updates of the group: torchrl's ``group["step"]`` holds it, and the counters are filled from
    # it before each update (CPU tensors, no device sync), so torchrl checkpoints load as they are.

    def _init_group_state(self, group: dict[str, Any], layout: _Layout, existing: bool) -> None:
        step = group.get("step")
        if isinstance(step, Tensor) and step.dim() == 0 and not step.is_floating_point():
            step = group["step"] = int(step)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"param group 'step' must be an integer >= 0, got {step!r}")
        for name, counter in layout.group_template.items():
            if counter.dim() != 0 or counter.is_floating_point() or counter.dtype == torch.bool:
                raise TypeError(f"dreamerv3's group-level state {name} is not a counter")
        layout.scratch = {name: t.clone() for name, t in layout.group_template.items()}

    def _group_state_in(self, group: dict[str, Any], layout: _Layout) -> dict[str, Tensor]:
        for counter in layout.scratch.values():
            counter.fill_(group["step"])
        return layout.scratch

    def _group_state_out(self, group: dict[str, Any], layout: _Layout) -> None:
        group["step"] += 1
