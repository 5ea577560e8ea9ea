"""Agents that consume token environments: PPO (critic + GAE), GRPO, RLOO, REINFORCE++, on-policy distillation, DPO
(offline, iterative, SPIN), SFT, and the machinery they share (the on-policy skeleton, the algorithm registry).

The pure advantage/loss math lives in :mod:`tokengym.agents.functional` and :mod:`tokengym.agents.variants`.

Each exported name is imported on first use (PEP 562), so importing this package, or any module below it (the engine
a rollout worker runs), loads no training algorithm. ``tokengym train`` finds the algorithms through
:func:`tokengym.agents.algorithms.registry.algorithms`, which imports them all.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Critic": "engine.critic",
    "Generation": "engine.generation", "GenerationRequest": "engine.generation", "Generator": "engine.generation",
    "PolicyGenerator": "engine.generation", "SamplingSettings": "engine.generation",
    "PRESETS": "engine.models", "build_preset": "engine.models", "load_classifier": "engine.models",
    "load_model": "engine.models",
    "Policy": "engine.policy",
    "Rollout": "engine.rollout", "collect": "engine.rollout", "evaluate": "engine.rollout",
    "heldout_samples": "engine.rollout",
    "Sampler": "engine.sampler",
    "VLLMGenerator": "engine.vllm_backend", "VLLMSampler": "engine.vllm_backend",
    "PairData": "data.pairs", "arithmetic_pairs": "data.pairs", "load_pairs": "data.pairs", "mine_pairs": "data.pairs",
    "split_pairs": "data.pairs",
    "CriticFreeConfig": "algorithms.critic_free",
    "DistillAgent": "algorithms.distill", "DistillConfig": "algorithms.distill",
    "DPOConfig": "algorithms.dpo", "DPOLearner": "algorithms.dpo",
    "GRPOAgent": "algorithms.grpo", "GRPOConfig": "algorithms.grpo",
    "SPINConfig": "algorithms.online_dpo", "iterative_dpo": "algorithms.online_dpo", "spin": "algorithms.online_dpo",
    "spin_pairs": "algorithms.online_dpo",
    "OnPolicyAgent": "algorithms.onpolicy",
    "OnPolicyConfig": "algorithms.onpolicy_config",
    "PPOAgent": "algorithms.ppo", "PPOConfig": "algorithms.ppo",
    "ReinforcePPAgent": "algorithms.reinforce_pp", "ReinforcePPConfig": "algorithms.reinforce_pp",
    "RLOOAgent": "algorithms.rloo", "RLOOConfig": "algorithms.rloo",
    "SFTConfig": "algorithms.sft", "evaluate_policy": "algorithms.sft", "train_sft": "algorithms.sft",
}
"""Exported name -> the module (below this package) that defines it."""

_SUBMODULES = frozenset({"functional", "variants", "shared_math", "engine", "algorithms", "data", "runtime", "cli"})
"""Modules and subpackages that ``tokengym.agents.<name>`` imports on first access."""

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
    "VLLMGenerator",
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


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
