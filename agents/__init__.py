"""Agents that consume token environments: PPO (critic + GAE), GRPO, and the machinery they share.

The pure advantage/loss math lives in :mod:`tokengym.agents.functional`.
"""

from . import functional
from .critic import Critic
from .grpo import GRPOAgent, GRPOConfig
from .models import PRESETS, build_preset, load_model
from .policy import Policy
from .ppo import PPOAgent, PPOConfig
from .rollout import Rollout, collect, evaluate, heldout_samples
from .sft import SFTConfig, evaluate_policy, train_sft

__all__ = [
    "Critic",
    "GRPOAgent",
    "GRPOConfig",
    "PPOAgent",
    "PPOConfig",
    "PRESETS",
    "Policy",
    "Rollout",
    "SFTConfig",
    "build_preset",
    "collect",
    "evaluate",
    "evaluate_policy",
    "functional",
    "heldout_samples",
    "load_model",
    "train_sft",
]
