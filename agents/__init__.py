"""Agents that consume token environments: PPO (critic + GAE), GRPO, DPO (offline, iterative, SPIN), SFT, and the machinery they share.

The pure advantage/loss math lives in :mod:`tokengym.agents.functional`.
"""

from . import functional
from .critic import Critic
from .dpo import DPOConfig, DPOLearner
from .grpo import GRPOAgent, GRPOConfig
from .models import PRESETS, build_preset, load_classifier, load_model
from .online_dpo import SPINConfig, iterative_dpo, spin, spin_pairs
from .pairs import PairData, arithmetic_pairs, load_pairs, mine_pairs, split_pairs
from .policy import Policy
from .ppo import PPOAgent, PPOConfig
from .rollout import Rollout, collect, evaluate, heldout_samples
from .sft import SFTConfig, evaluate_policy, train_sft

__all__ = [
    "Critic",
    "DPOConfig",
    "DPOLearner",
    "GRPOAgent",
    "GRPOConfig",
    "PPOAgent",
    "PPOConfig",
    "PRESETS",
    "PairData",
    "Policy",
    "Rollout",
    "SFTConfig",
    "SPINConfig",
    "arithmetic_pairs",
    "build_preset",
    "collect",
    "evaluate",
    "evaluate_policy",
    "functional",
    "heldout_samples",
    "iterative_dpo",
    "load_classifier",
    "load_model",
    "load_pairs",
    "mine_pairs",
    "spin",
    "spin_pairs",
    "split_pairs",
    "train_sft",
]
