"""Adapters: familiar PyTorch objects built on the functional core."""

from functional_opt.adapters.dreamerv3_optimizer import DreamerV3Optimizer
from functional_opt.adapters.stepper import MixedPrecisionOptimizationStepper
from functional_opt.adapters.transform_optimizer import TransformOptimizer

__all__ = ["DreamerV3Optimizer", "MixedPrecisionOptimizationStepper", "TransformOptimizer"]
