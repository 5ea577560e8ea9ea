"""Agents that consume token environments: PPO (critic + GAE), GRPO, RLOO, REINFORCE++, on-policy distillation, DPO
(offline, iterative, SPIN), SFT, and the machinery they share (the on-policy skeleton, the algorithm registry).

The pure advantage/loss math lives in :mod:`tokengym.agents.functional` and :mod:`tokengym.agents.variants`.
"""

from . import functional, variants
from .engine.critic import Critic
from .engine.generation import Generation, GenerationRequest, Generator, PolicyGenerator, SamplingSettings
from .algorithms.distill import DistillAgent, DistillConfig
from .algorithms.dpo import DPOConfig, DPOLearner
from .algorithms.critic_free import CriticFreeConfig
from .algorithms.grpo import GRPOAgent, GRPOConfig
from .engine.models import PRESETS, build_preset, load_classifier, load_model
from .algorithms.online_dpo import SPINConfig, iterative_dpo, spin, spin_pairs
from .data.pairs import PairData, arithmetic_pairs, load_pairs, mine_pairs, split_pairs
from .algorithms.onpolicy import OnPolicyAgent
from .algorithms.onpolicy_config import OnPolicyConfig
from .engine.policy import Policy
from .algorithms.ppo import PPOAgent, PPOConfig
from .algorithms.reinforce_pp import ReinforcePPAgent, ReinforcePPConfig
from .algorithms.rloo import RLOOAgent, RLOOConfig
from .engine.rollout import Rollout, collect, evaluate, heldout_samples
from .engine.sampler import Sampler
from .engine.vllm_backend import VLLMSampler
from .algorithms.sft import SFTConfig, evaluate_policy, train_sft

__all__ = [
    "Critic",
    "CriticFreeConfig",
    "DPOConfig",
    "DistillAgent",
    "DistillConfig",
    "DPOLearner",
    "GRPOAgent",
    "Generation",
    "GenerationRequest",
    "Generator",
    "GRPOConfig",
    "OnPolicyAgent",
    "OnPolicyConfig",
    "PPOAgent",
    "PPOConfig",
    "PRESETS",
    "PairData",
    "Policy",
    "PolicyGenerator",
    "RLOOAgent",
    "RLOOConfig",
    "ReinforcePPAgent",
    "ReinforcePPConfig",
    "Rollout",
    "SFTConfig",
    "SPINConfig",
    "Sampler",
    "SamplingSettings",
    "VLLMSampler",
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
    "variants",
]
