"""``MixedPrecisionOptimizationStepper``: torchrl's training-step object on the functional core.

A drop-in for ``torchrl.trainers.MixedPrecisionOptimizationStepper`` (torchrl 0.14.1): the same
signature, ``step`` contract, metric keys and checkpoint layout (a checkpoint of either loads into
the other). Loss scaling is :class:`functional_opt.loss_scale.DynamicLossScale` (no
``torch.amp.GradScaler``), the global norm and finite checks are the core's multi-tensor pieces.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import Tensor

from functional_opt import _lists, _validate
from functional_opt.loss_scale import DynamicLossScale, NoOpLossScale, _reciprocal, all_finite
from functional_opt.metrics import dreamerv3_metrics

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["MixedPrecisionOptimizationStepper"]

logger = logging.getLogger(__name__)

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6), at most 1
# GradScaler has no floor on its scale; DynamicLossScale needs a positive one.
_MIN_SCALE = float(torch.finfo(torch.float32).tiny)


class LossTrainer(Protocol):
    """What :meth:`MixedPrecisionOptimizationStepper.step` needs from a trainer."""

    def compute_loss(self, sub_batch: Any) -> Any:
        """A mapping (``TensorDict`` or ``dict``) of loss tensors for ``sub_batch``."""


class RegisteringTrainer(Protocol):
    """What :meth:`MixedPrecisionOptimizationStepper.register` needs from a trainer."""

    def register_module(self, module_name: str, module: Any) -> None:
        """Record ``module`` for checkpointing under ``module_name``."""


class DataParallelContext(Protocol):
    """What the stepper uses of a trainer's ``data_parallel_context`` (torchrl's
    ``DataParallelContext``): gradients stay local during ``backward()`` and are averaged
    across ranks by one explicit call."""

    def sync_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average the gradients of ``optimizer``'s params across ranks."""


def _data_parallel_modules(modules: Any) -> tuple[list[Any], list[Any]]:
    """The ``DistributedDataParallel`` wrappers and FSDP2 (``fully_shard``) modules in
    ``modules`` (a module or an iterable of them) and their submodules; ``ValueError`` when
    there is none or an entry is not a module."""
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    elif isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise ValueError(
            "sync_modules must be an nn.Module or an iterable of them, got "
            f"{type(modules).__name__}"
        )
    fsdp_type = None
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        fsdp_type = FSDPModule
    ddp: list[Any] = []
    fsdp: list[Any] = []
    seen: set[int] = set()
    for i, root in enumerate(modules):
        if not isinstance(root, torch.nn.Module):
            raise ValueError(f"sync_modules[{i}] must be an nn.Module, got {type(root).__name__}")
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            if isinstance(module, torch.nn.parallel.DistributedDataParallel):
                ddp.append(module)
            elif fsdp_type is not None and isinstance(module, fsdp_type):
                fsdp.append(module)
    if not (ddp or fsdp):
        raise ValueError(
            "sync_modules has no DistributedDataParallel or fully_shard (FSDP2) module: there "
            "is no gradient synchronisation to defer (pass the wrapped model, not its .module)"
        )
    return ddp, fsdp


def _fsdp_param_groups(module: Any) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.8: one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _discard_unsynced(fsdp_modules: list[Any]) -> None:
    """Drop the gradients FSDP2 accumulated, unsharded, in backward passes without gradient sync
    (``optimizer.zero_grad`` only clears the sharded params' ``.grad``). FSDP2 has no public
    call for this; its params keep them in ``unsharded_accumulated_grad`` (when the reduce dtype
    differs from the params') or in the unsharded param's ``.grad``."""
    for module in fsdp_modules:
        try:
            for group in _fsdp_param_groups(module):
                for fsdp_param in group.fsdp_params:
                    fsdp_param.unsharded_accumulated_grad = None
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
        except AttributeError as error:  # a torch whose FSDP2 keeps them elsewhere
            raise RuntimeError(
                "cannot discard the gradients FSDP2 accumulated without sync in this torch "
                f"version ({error}); a dropped accumulation window would leak them into the "
                "next one: do not pass FSDP2 modules as sync_modules"
            ) from error


def _is_tensordict(value: Any) -> bool:
    # tensordict is optional: a TensorDict can only exist if its module is already imported.
    td = sys.modules.get("tensordict")
    return td is not None and isinstance(value, td.TensorDictBase)


def _check_device_type(device_type: Any, what: str = "device_type") -> None:
    """Raises ``ValueError`` unless ``torch.amp.autocast`` takes ``device_type``."""
    ok = isinstance(device_type, str) and bool(device_type) and ":" not in device_type
    if ok:
        try:
            ok = torch.amp.is_autocast_available(device_type)
        except RuntimeError:  # not a device type torch knows
            ok = False
    if not ok:
        raise ValueError(
            f"{what} must be a device type that torch.amp.autocast supports (such as 'cpu' or "
            f"'cuda', without an index), got {device_type!r}"
        )


def _count(sd: Mapping[str, Any], key: str, where: str = "stepper state_dict", low: int = 0) -> int:
    """``sd[key]`` (0 when absent) as a Python int in ``[low, 2**31 - 1]``: a Python int or an
    integer 0-d tensor; anything else raises ``ValueError`` naming the entry."""
    value = sd.get(key, 0)
    name = f"{where}[{key!r}]"
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.is_floating_point() or value.is_complex():
            raise ValueError(f"{name} must be an integer, got a {value.dtype} tensor")
        if value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer, got a bool tensor")
        value = int(value)
    _validate.int_in_range(name, value, low, _validate.counter_max())
    return int(value)


def _real(sd: Mapping[str, Any], key: str, where: str) -> float:
    """``sd[key]`` as a Python float: a real number or a real 0-d tensor."""
    value = sd[key]
    if (
        isinstance(value, Tensor)
        and value.dim() == 0
        and value.dtype != torch.bool
        and not value.is_complex()
    ):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}[{key!r}] must be a real number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _mul_(xs: list[Tensor], factor: Tensor) -> None:
    """``x *= factor`` in place, one multi-tensor kernel where ``torch._foreach_*`` applies."""
    if not xs:
        return
    if _lists.use_foreach(xs):
        torch._foreach_mul_(xs, factor)
    else:
        for x in xs:
            x.mul_(factor)


class MixedPrecisionOptimizationStepper:
    """Forward under autocast, (loss-scaled) backward, gradient accumulation, clipping and
    non-finite guards around any ``torch.optim.Optimizer``; torchrl's stepper, on the core.

    Every ``step(trainer, sub_batch)`` runs ``trainer.compute_loss(sub_batch)`` under
    ``torch.amp.autocast(device_type, enabled=mixed_precision, dtype=autocast_dtype)``, sums the
    entries whose key starts with ``"loss"``, divides by ``gradient_accumulation_steps`` and
    back-propagates (times a dynamic loss scale when ``mixed_precision`` and ``autocast_dtype`` is
    ``torch.float16``; GradScaler's defaults). Every ``gradient_accumulation_steps``-th call it
    unscales the gradients, clips them to global norm ``clip_norm`` (``None``: no clipping) and
    steps the optimizer unless the gradient is non-finite, then ``zero_grad(set_to_none=True)``.
    A non-finite loss drops the whole accumulation window.

    Returns detached scalar metrics: every loss-mapping entry (means of non-scalars);
    ``grad_norm`` on calls that end a window (pre-clip norm of the unscaled gradient; ``0.0``
    when a non-finite gradient skipped the step without loss scaling, as torchrl);
    ``grad_scale`` (the loss scale this call's backward used); ``skipped_nonfinite_steps`` and
    ``skipped_overflow_steps`` (running totals). A ``TensorDict`` when ``compute_loss`` returned
    one, else a ``dict``.

    Host synchronisation: one bool read per call. Inside a window it is the loss-finite flag
    (dropping the window needs it); on the window's last call the loss and gradient flags are
    read together, because ``optimizer.step()`` of an arbitrary optimizer cannot be masked.

    Distributed training (DDP, FSDP2): every rank must take the same decisions, or ranks diverge
    (or hang in the next collective when one rank skips a backward). The gradient norm is already
    the same everywhere (DDP all-reduces gradients; for FSDP2's ``DTensor`` gradients it is the
    norm of the whole gradient), but each rank's loss is its own. So the flags are reduced (one
    ``all_reduce`` MIN of two integers, just before the host read) over ``process_group``:
    ``"auto"`` (default) means the default group when ``torch.distributed`` is initialized with
    more than one rank, ``None`` never reduces (ranks that train independently), or a
    ``ProcessGroup``. Then one rank's non-finite loss or gradient skips the step on every rank.

    Gradient accumulation communicates once per optimizer step when the stepper knows the
    data-parallel modules: ``sync_modules`` (the ``DistributedDataParallel`` wrapper, the
    ``fully_shard`` root, or modules containing them) makes every call but a window's last run its
    forward and backward without gradient synchronisation (``DistributedDataParallel.no_sync()``,
    FSDP2's ``set_requires_gradient_sync(False)``, restored to ``True`` when the call returns);
    the gradients accumulate on each rank and the window's last backward reduces their sum once.
    The numbers are those of syncing every micro-batch (the same sums in another order). A
    dropped window also discards what FSDP2 accumulated unsharded. A trainer with a
    ``data_parallel_context`` (torchrl's ``DataParallelContext``: gradients stay local during
    ``backward()``) gets ``trainer.data_parallel_context.sync_gradients(optimizer)`` once per
    window, after its last backward and before unscaling, clipping and the step. The finite flags
    are still agreed on every call (an ``all_reduce`` of one integer inside a window).

    ``dreamerv3_metrics=True`` adds, on calls that end a window, the optimizer metrics DreamerV3
    logs (:func:`functional_opt.metrics.dreamerv3_metrics`): ``grad_rms`` (pre-clip),
    ``update_rms`` (of the step applied, ``0`` when skipped), ``param_rms`` (after the step),
    ``grad_overflow`` and ``updates`` (``optimizer_step_count``). It costs one copy of the params
    per optimizer step (to measure the update), hence off by default. No host syncs.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        mixed_precision: bool = False,
        autocast_dtype: torch.dtype = torch.bfloat16,
        gradient_accumulation_steps: int = 1,
        clip_norm: float | None = 1.0,
        device_type: str | None = None,
        process_group: ProcessGroup | Literal["auto"] | None = "auto",
        dreamerv3_metrics: bool = False,
        sync_modules: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(mixed_precision, bool):
            raise ValueError(f"mixed_precision must be a bool, got {mixed_precision!r}")
        if not isinstance(autocast_dtype, torch.dtype) or not autocast_dtype.is_floating_point:
            raise ValueError(
                f"autocast_dtype must be a floating-point torch.dtype, got {autocast_dtype!r}"
            )
        if (
            not isinstance(gradient_accumulation_steps, int)
            or isinstance(gradient_accumulation_steps, bool)
            or gradient_accumulation_steps < 1
        ):
            raise ValueError(
                "gradient_accumulation_steps must be an integer >= 1, "
                f"got {gradient_accumulation_steps!r}"
            )
        if clip_norm is not None and (
            not isinstance(clip_norm, (int, float))
            or isinstance(clip_norm, bool)
            or not (math.isfinite(clip_norm) and clip_norm > 0)
        ):
            raise ValueError(f"clip_norm must be a finite number > 0 or None, got {clip_norm!r}")
        if device_type is not None:
            _check_device_type(device_type)
        if not (
            process_group is None
            or (isinstance(process_group, str) and process_group == "auto")
            or (
                torch.distributed.is_available()
                and isinstance(process_group, torch.distributed.ProcessGroup)
            )
        ):
            raise ValueError(
                f"process_group must be 'auto', None or a ProcessGroup, got {process_group!r}"
            )

        ddp, fsdp = ([], []) if sync_modules is None else _data_parallel_modules(sync_modules)

        params = self._params(optimizer)
        device = params[0].device if params else torch.device("cpu")
        if device_type is None:
            _check_device_type(device.type, "the params' device type")
        self.optimizer = optimizer
        self.mixed_precision = mixed_precision
        self.autocast_dtype = autocast_dtype
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.device_type = device.type if device_type is None else device_type
        self.process_group = process_group
        if not isinstance(dreamerv3_metrics, bool):
            raise ValueError(f"dreamerv3_metrics must be a bool, got {dreamerv3_metrics!r}")
        self.dreamerv3_metrics = dreamerv3_metrics
        self._ddp_modules, self._fsdp_modules = ddp, fsdp
        self._use_loss_scale = mixed_precision and autocast_dtype == torch.float16
        self._loss_scale: DynamicLossScale | NoOpLossScale = (
            self._dynamic_scale(device, 2.0**16, 2000, 2.0, 0)
            if self._use_loss_scale
            else NoOpLossScale()
        )
        self._micro_step = 0  # position in the accumulation window
        self._optimizer_step_count = 0
        self._skipped_nonfinite_steps = 0  # dropped windows + non-finite grads without scaling
        self._skipped_overflow_steps = 0  # loss-scale overflows (fp16)

    # ------------------------------------------------------------------ accessors

    @property
    def optimizer_step_count(self) -> int:
        """Completed optimizer steps (no accumulation micro-steps, no skipped steps)."""
        return self._optimizer_step_count

    @property
    def loss_scale(self) -> DynamicLossScale | NoOpLossScale:
        """The current loss-scale object (replaced by ``adjust`` after every optimizer step)."""
        return self._loss_scale

    def register(self, trainer: RegisteringTrainer, name: str = "optimization_stepper") -> None:
        """Register with a trainer (``trainer.register_module(name, self)``) for checkpointing."""
        trainer.register_module(name, self)

    # ------------------------------------------------------------------ the step

    def step(self, trainer: LossTrainer, sub_batch: Any) -> Any:
        """One forward and (scaled) backward pass; the optimizer steps every
        ``gradient_accumulation_steps`` calls. Returns the metrics (see the class docstring)."""
        grad_scale = self._loss_scale.loss_scale
        if self._micro_step + 1 < self.gradient_accumulation_steps:
            with self._without_gradient_sync():
                losses, loss = self._forward(trainer, sub_batch)
                if not bool(self._agree(all_finite(loss.detach()))):  # host read: a bad loss
                    return self._drop_window(losses, loss, grad_scale)  # restarts the window
                self._backward(loss)
            self._micro_step += 1
            return self._metrics(losses, None, grad_scale)

        # Last call of the window: back-propagate even a non-finite loss (its gradient is
        # discarded below) so that one host read decides everything.
        losses, loss = self._forward(trainer, sub_batch)
        loss_finite = all_finite(loss.detach())
        self._backward(loss)
        context = getattr(trainer, "data_parallel_context", None)
        if context is not None:
            sync = getattr(context, "sync_gradients", None)
            if not callable(sync):
                raise TypeError(
                    "trainer.data_parallel_context must have a sync_gradients(optimizer) method "
                    f"(torchrl's DataParallelContext), got {type(context).__name__}"
                )
            sync(self.optimizer)
        grads = [p.grad for p in self._params(self.optimizer) if p.grad is not None]
        if self._use_loss_scale:
            _mul_(grads, _reciprocal(self._loss_scale.loss_scale))
        norm = _lists.global_norm(grads)
        grads_finite = torch.isfinite(norm)  # a NaN/inf element makes the norm non-finite
        if self.clip_norm is not None:
            _mul_(grads, torch.clamp(self.clip_norm / (norm + _CLIP_EPS), max=1.0))
        flags = self._agree(torch.stack([loss_finite, grads_finite.to(loss_finite.device)]))
        grads_finite = flags[1]
        loss_ok, grads_ok = flags.tolist()  # the one host read of this optimizer step
        if not loss_ok:
            return self._drop_window(losses, loss, grad_scale)

        self._micro_step = 0
        if self._use_loss_scale:
            self._loss_scale = self._loss_scale.adjust(grads_finite)
        grad_norm = norm.detach().float()
        params = self._params(self.optimizer) if self.dreamerv3_metrics else []
        before = [p.detach().clone() for p in params]
        if grads_ok:
            self.optimizer.step()
            self._optimizer_step_count += 1
        else:
            if self._use_loss_scale:
                self._skipped_overflow_steps += 1
                logger.debug("Loss-scale overflow: optimizer step skipped, scale reduced.")
            else:
                self._skipped_nonfinite_steps += 1
                logger.warning(
                    "Skipping optimizer step because the gradient norm is non-finite: %s. "
                    "Skipped non-finite steps: %d.",
                    norm.item(),
                    self._skipped_nonfinite_steps,
                )
                grad_norm = torch.zeros((), device=norm.device)  # as torchrl
        self.optimizer.zero_grad(set_to_none=True)
        out = self._metrics(losses, grad_norm, grad_scale)
        if self.dreamerv3_metrics:
            after = [p.detach() for p in params]
            extra = dreamerv3_metrics(
                [],  # grad_norm is the stepper's own (torchrl's semantics); grad_rms from it
                updates=_lists.sub(after, before) if params else [],
                params=after,
                grads_finite=grads_finite,
                count=self._optimizer_step_count,
            )
            del extra["grad_norm"]
            n = sum(g.numel() for g in grads)
            extra["grad_rms"] = norm.detach().float() / max(n, 1) ** 0.5
            for key, value in extra.items():
                out[key] = value
        return out

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, loss scale (``"scaler"``, GradScaler's layout) and counters; torchrl's
        keys. Loads with ``torch.load(weights_only=True)``. Raises mid-window."""
        if self._micro_step != 0:
            raise RuntimeError(
                "Cannot save stepper state mid-accumulation "
                f"(micro_step={self._micro_step}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}): the "
                "accumulated gradients are not part of a checkpoint. Save after the window's "
                "last step (align the save interval with gradient_accumulation_steps)."
            )
        sd: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "micro_step": 0,
            "optimizer_step_count": self._optimizer_step_count,
            "skipped_nonfinite_steps": self._skipped_nonfinite_steps,
            "skipped_overflow_steps": self._skipped_overflow_steps,
        }
        ls = self._loss_scale
        if isinstance(ls, DynamicLossScale):
            sd["scaler"] = {
                "scale": float(ls.loss_scale),
                "growth_factor": ls.factor,
                "backoff_factor": 1.0 / ls.factor,
                "growth_interval": ls.period,
                "_growth_tracker": int(ls.counter),
            }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; also takes torchrl's stepper checkpoints.

        All or nothing: the stepper's own entries (counters, loss scale) are checked and
        converted first, then the optimizer loads its entry (``torch.optim`` optimizers and
        :class:`~functional_opt.adapters.TransformOptimizer` check everything before they change
        anything), and only then, when nothing can fail any more, the stepper takes its values.
        A bad checkpoint raises ``ValueError`` (``KeyError`` for a missing entry) and leaves the
        stepper and its optimizer as they were."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"stepper state_dict must be a mapping, got {type(state_dict).__name__}"
            )
        if "optimizer" not in state_dict:
            raise KeyError("stepper state_dict has no 'optimizer' entry")
        optimizer_sd = state_dict["optimizer"]
        if not isinstance(optimizer_sd, dict):
            raise ValueError(
                "stepper state_dict['optimizer'] must be an optimizer's state dict, got "
                f"{type(state_dict['optimizer']).__name__}"
            )
        micro_step = _count(state_dict, "micro_step")
        if micro_step % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"stepper state_dict was saved mid-accumulation (micro_step={micro_step}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
            )
        counts = [
            _count(state_dict, key)
            for key in ("optimizer_step_count", "skipped_nonfinite_steps", "skipped_overflow_steps")
        ]
        loss_scale = self._loss_scale
        if isinstance(loss_scale, DynamicLossScale) and "scaler" in state_dict:
            loss_scale = self._scale_from_dict(state_dict["scaler"], loss_scale.loss_scale.device)
        self.optimizer.load_state_dict(optimizer_sd)
        # Nothing below can fail.
        self._loss_scale = loss_scale
        self._micro_step = 0
        self._optimizer_step_count, self._skipped_nonfinite_steps = counts[0], counts[1]
        self._skipped_overflow_steps = counts[2]

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    @staticmethod
    def _dynamic_scale(
        device: torch.device, scale: float, period: int, factor: float, counter: int
    ) -> DynamicLossScale:
        return DynamicLossScale(
            torch.tensor(scale, dtype=torch.float32, device=device),
            period,
            factor,
            _MIN_SCALE,
            counter=torch.tensor(counter, dtype=torch.int32, device=device),
        )

    @classmethod
    def _scale_from_dict(cls, sd: Any, device: torch.device) -> DynamicLossScale:
        """The loss scale of a checkpoint's ``"scaler"`` entry (``GradScaler``'s layout), every
        value checked: a NaN, infinite, zero or negative scale would stop training for good."""
        where = "stepper state_dict['scaler']"
        if not isinstance(sd, Mapping):
            raise ValueError(f"{where} must be a mapping, got {type(sd).__name__}")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval"} - set(sd)
        if missing:
            raise KeyError(f"{where} lacks {sorted(missing)}")
        scale = _real(sd, "scale", where)
        factor = _real(sd, "growth_factor", where)
        backoff = _real(sd, "backoff_factor", where)
        _validate.float32_magnitude(f"{where}['scale']", scale)
        _validate.at_least(f"{where}['growth_factor']", factor, 1.0)
        if not (math.isfinite(backoff) and math.isclose(backoff * factor, 1.0)):
            raise ValueError(
                f"{where}: backoff_factor must be 1 / growth_factor, got "
                f"{sd['backoff_factor']!r} and {sd['growth_factor']!r}"
            )
        interval = _count(sd, "growth_interval", where, low=1)
        tracker = _count(sd, "_growth_tracker", where)
        if tracker >= interval:
            raise ValueError(
                f"{where}['_growth_tracker'] must be below growth_interval ({interval}), got "
                f"{tracker}"
            )
        return cls._dynamic_scale(device, scale, interval, factor, tracker)

    @staticmethod
    def _total_loss(losses: Any) -> Tensor:
        if not (isinstance(losses, Mapping) or _is_tensordict(losses)):
            raise TypeError(
                "trainer.compute_loss must return a mapping (a dict or a TensorDict) of loss "
                f"tensors, got {type(losses).__name__}"
            )
        items = []
        for key, value in losses.items():
            if not (isinstance(key, str) and key.startswith("loss")):
                continue
            if not isinstance(value, Tensor) or not value.is_floating_point() or value.numel() != 1:
                shown = (
                    f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                    if isinstance(value, Tensor)
                    else f"a {type(value).__name__}"
                )
                raise TypeError(
                    f"trainer.compute_loss returned {shown} for {key!r}: every 'loss*' entry "
                    "must be a floating-point tensor with one element"
                )
            items.append(value)
        if not items:
            raise RuntimeError(
                "compute_loss returned no 'loss*' keys: prefix the entries to optimise with "
                f"'loss' (got keys {list(losses.keys())})"
            )
        total: Tensor = items[0]
        for item in items[1:]:
            total = total + item
        return total

    def _agree(self, flags: Tensor) -> Tensor:
        """``flags`` (bool) reduced with AND over ``process_group``'s ranks (unchanged when there
        is nothing to reduce over)."""
        group = self.process_group
        if isinstance(group, str):  # "auto"
            dist = torch.distributed
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
                return flags
            group = dist.group.WORLD
        if group is None:
            return flags
        as_int = flags.to(torch.int32)  # MIN of 0/1 is AND, on every backend
        torch.distributed.all_reduce(as_int, op=torch.distributed.ReduceOp.MIN, group=group)
        return as_int.bool()

    def _forward(self, trainer: LossTrainer, sub_batch: Any) -> tuple[Any, Tensor]:
        """``trainer.compute_loss`` under autocast: the losses and this call's total loss."""
        with torch.amp.autocast(
            self.device_type, enabled=self.mixed_precision, dtype=self.autocast_dtype
        ):
            losses = trainer.compute_loss(sub_batch)
            loss = self._total_loss(losses) / self.gradient_accumulation_steps
        return losses, loss

    @contextlib.contextmanager
    def _without_gradient_sync(self) -> Iterator[None]:
        """Forward and backward inside it keep their gradients on this rank (``sync_modules``)."""
        if not (self._ddp_modules or self._fsdp_modules):
            yield
            return
        with contextlib.ExitStack() as stack:
            for module in self._ddp_modules:
                stack.enter_context(module.no_sync())
            for module in self._fsdp_modules:
                stack.callback(module.set_requires_gradient_sync, True, recurse=False)
                module.set_requires_gradient_sync(False, recurse=False)
            yield

    def _backward(self, loss: Tensor) -> None:
        scaled: Tensor = self._loss_scale.scale(loss)
        torch.autograd.backward(scaled)

    def _drop_window(self, losses: Any, loss: Tensor, grad_scale: Tensor) -> Any:
        self._skipped_nonfinite_steps += 1
        logger.warning(
            "Skipping optimization step because the loss is non-finite: %s%s. "
            "Skipped non-finite steps: %d.",
            loss.detach(),
            " (on another rank)" if bool(all_finite(loss.detach())) else "",
            self._skipped_nonfinite_steps,
        )
        self.optimizer.zero_grad(set_to_none=True)
        _discard_unsynced(self._fsdp_modules)
        self._micro_step = 0
        return self._metrics(losses, None, grad_scale)

    def _metrics(self, losses: Any, grad_norm: Tensor | None, grad_scale: Tensor) -> Any:
        out: dict[str, Tensor] = {}
        for key, value in losses.items():
            if isinstance(value, Tensor):
                value = value.detach()
                out[key] = value.float().mean() if value.numel() > 1 else value
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        out["grad_scale"] = grad_scale.detach().clone()
        out["skipped_nonfinite_steps"] = torch.tensor(self._skipped_nonfinite_steps)
        out["skipped_overflow_steps"] = torch.tensor(self._skipped_overflow_steps)
        if _is_tensordict(losses):
            return sys.modules["tensordict"].TensorDict(out, [])
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(optimizer={type(self.optimizer).__name__}, "
            f"mixed_precision={self.mixed_precision}, autocast_dtype={self.autocast_dtype}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
            f"clip_norm={self.clip_norm}, device_type={self.device_type!r})"
        )
