"""functional_opt: optax-style pure-functional gradient transformations for PyTorch.

A transform is ``init(params) -> state`` and ``update(updates, state, params=None) ->
(updates, state)`` over pytrees of tensors; ``apply_updates(params, updates)`` adds the updates.
"""

from functional_opt import (
    _tensordict,  # noqa: F401  (TensorDict as a tree node, once imported)
    loss_scale,
    metrics,
    packed,
    schedules,
    tree,
)
from functional_opt.aliases import (
    adabelief,
    adagrad,
    adam,
    adamw,
    lamb,
    lion,
    nadam,
    radam,
    rmsprop,
    sgd,
)
from functional_opt.base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    chain,
    identity,
    named_chain,
    safe_increment,
    stateless,
    stateless_with_tree_map,
)
from functional_opt.checkpoint import state_from_dict, state_to_dict
from functional_opt.dreamerv3 import dreamerv3, dreamerv3_schedule
from functional_opt.engine import fused, fused_step
from functional_opt.metrics import dreamerv3_metrics
from functional_opt.packed import Packed, pack
from functional_opt.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from functional_opt.torch_optim import FromTorchState, from_torch
from functional_opt.transforms.accumulation import MultiSteps, MultiStepsState, multi_steps
from functional_opt.transforms.adagrad import ScaleByRssState, scale_by_rss
from functional_opt.transforms.belief import ScaleByBeliefState, scale_by_belief
from functional_opt.transforms.clipping import (
    adaptive_grad_clip,
    clip,
    clip_by_agc,
    clip_by_global_norm,
)
from functional_opt.transforms.combinators import MaskedState, PartitionState, masked, partition
from functional_opt.transforms.finite import ApplyIfFiniteState, apply_if_finite
from functional_opt.transforms.guards import (
    ZeroNansState,
    freeze,
    set_to_zero,
    skip_large_updates,
    skip_not_finite,
    zero_nans,
)
from functional_opt.transforms.hyperparams import InjectHyperparamsState, inject_hyperparams
from functional_opt.transforms.lion import ScaleByLionState, scale_by_lion
from functional_opt.transforms.moments import (
    EmaState,
    ScaleByAdamState,
    ScaleByRmsState,
    ScaleByRmsWithCountState,
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    TraceState,
    ema,
    scale_by_adam,
    scale_by_rms,
    scale_by_stddev,
    trace,
)
from functional_opt.transforms.monitoring import (
    MonitorState,
    SnapshotState,
    measure_with_ema,
    measurements,
    monitor,
    snapshot,
    update_norm,
    update_not_finite,
    update_rms,
)
from functional_opt.transforms.radam import scale_by_radam
from functional_opt.transforms.scaling import (
    ScaleByScheduleState,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
)
from functional_opt.transforms.target import incremental_update, periodic_update
from functional_opt.transforms.trust_ratio import scale_by_trust_ratio
from functional_opt.transforms.weight_decay import add_decayed_weights
from functional_opt.tree import global_norm, tree_map

__version__ = "0.1.0"

__all__ = [
    "ApplyIfFiniteState",
    "EmaState",
    "EmptyState",
    "FromTorchState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedState",
    "MonitorState",
    "MultiSteps",
    "MultiStepsState",
    "Packed",
    "PartitionState",
    "ScaleByAdamState",
    "ScaleByBeliefState",
    "ScaleByLionState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "SnapshotState",
    "TraceState",
    "ZeroNansState",
    "adabelief",
    "adagrad",
    "adam",
    "adamw",
    "adaptive_grad_clip",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip",
    "clip_by_agc",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "dreamerv3",
    "dreamerv3_metrics",
    "dreamerv3_schedule",
    "ema",
    "exponential_decay",
    "freeze",
    "from_torch",
    "fused",
    "fused_step",
    "global_norm",
    "identity",
    "incremental_update",
    "inject_hyperparams",
    "join_schedules",
    "lamb",
    "linear_schedule",
    "lion",
    "loss_scale",
    "masked",
    "measure_with_ema",
    "measurements",
    "metrics",
    "monitor",
    "multi_steps",
    "nadam",
    "named_chain",
    "pack",
    "packed",
    "partition",
    "periodic_update",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "radam",
    "rmsprop",
    "safe_increment",
    "scale",
    "scale_by_adam",
    "scale_by_belief",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_stddev",
    "scale_by_trust_ratio",
    "schedules",
    "set_to_zero",
    "sgd",
    "sgdr_schedule",
    "skip_large_updates",
    "skip_not_finite",
    "snapshot",
    "state_from_dict",
    "state_to_dict",
    "stateless",
    "stateless_with_tree_map",
    "trace",
    "tree",
    "tree_map",
    "update_norm",
    "update_not_finite",
    "update_rms",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    "zero_nans",
]
