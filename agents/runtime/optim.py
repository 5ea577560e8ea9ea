"""The optimiser step every agent uses, AdamW and the learning-rate schedules (one table for all of them).

They live in :mod:`tokengym.rewards.training`, the lowest package, because reward-model and PRM training
use the same step; this module is their name on the agents' side.
"""

from __future__ import annotations

from tokengym.rewards.training import LR_SCHEDULES, OptimizerStep, adamw, lr_factor

__all__ = ["adamw", "LR_SCHEDULES", "lr_factor", "OptimizerStep"]
