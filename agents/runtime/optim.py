"""The optimiser step every agent uses, AdamW, the learning-rate schedules (one table for all of them) and the
settings every trainer's config shares (the optimiser's, the training loop's).

They live in :mod:`tokengym.rewards.training`, the lowest package, because reward-model and PRM training
use the same step and settings; this module is their name on the agents' side.
"""

from __future__ import annotations

from tokengym.rewards.training import (LR_SCHEDULES, OptimConfig, OptimizerStep, ScheduledOptimConfig, SeedConfig,
                                       TrainLoopConfig, adamw, lr_factor)

__all__ = ["adamw", "LR_SCHEDULES", "lr_factor", "OptimizerStep", "OptimConfig", "ScheduledOptimConfig", "SeedConfig",
           "TrainLoopConfig"]
