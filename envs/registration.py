"""Gymnasium registration: every id has a single-env and a vector entry point."""

from __future__ import annotations

import gymnasium as gym

__all__ = ["ENV_IDS", "ENV_GUIDE", "register_envs"]

# id -> (task name, one-line description). Each id works with gymnasium.make and gymnasium.make_vec.
ENV_IDS: dict[str, tuple[str, str]] = {
    "tokengym/Arithmetic-v0": ("arithmetic", "multi-step integer arithmetic, one step per line; verifier + rule-based PRM"),
    "tokengym/Reverse-v0": ("reverse", "reverse a string of letters; exact-match reward"),
    "tokengym/Dataset-v0": ("dataset", "prompts from JSONL / list / datasets.Dataset (data=...), any reward"),
    "tokengym/Target-v0": ("target", "emit a fixed target string; the smallest learnable task, for agent smoke tests"),
    "tokengym/ReasoningGym-v0": ("reasoning_gym", "a reasoning-gym dataset (name=...), scored by its score_answer"),
    "tokengym/Calculator-v0": ("calculator", "multi-turn: Arithmetic with a calculator tool, <calc>38+87</calc> is answered =125"),
    "tokengym/GuessNumber-v0": ("guess_number", "multi-turn: find a hidden number from the env's higher/lower replies"),
}


ENV_GUIDE: dict[str, tuple[str, str]] = {
    "tokengym/Arithmetic-v0": ("completion: one reduction per line, then 'A: <answer>'; reward 1 iff the answer is right",
                               "tiny-arithmetic was trained on this default task (64.5% held-out greedy): GRPO/PPO lift it; "
                               "from the tiny or small preset, SFT first"),
    "tokengym/Reverse-v0": ("completion: the letters in reverse order; reward 1 iff exact",
                            "the presets start at 0%: SFT first (tokengym train sft --env tokengym/Reverse-v0), then GRPO"),
    "tokengym/Dataset-v0": ("prompt: your 'prompt' column as is; reward: the final answer ('A: ...', 'Answer: ...', "
                            "<answer>...</answer> or the last line) against an 'answer' column, or your reward=",
                            "your own model (the char-level presets only know their own tasks)"),
    "tokengym/Target-v0": ("completion: the fixed target (target='ok'); reward 1 iff exact, or partial_credit=True",
                           "the untrained tiny preset learns it with GRPO or PPO in seconds (agent smoke tests)"),
    "tokengym/ReasoningGym-v0": ("prompt: the dataset's English question; answer in <answer>...</answer> or on the last "
                                 "line, scored by the dataset", "a local instruct model that reads English: the bundled "
                                 "char-level models score 0 on these"),
    "tokengym/Calculator-v0": ("completion: '<calc>EXPR</calc>' calls (the env writes '=VALUE' and a newline), then "
                               "'A: <answer>'; reward 1 iff right, minus call_cost per call",
                               "tiny-calculator (the default model of tokengym train for this env) knows the syntax, "
                               "not when calling pays: GRPO learns that (59.8% -> 98.4%)"),
    "tokengym/GuessNumber-v0": ("each turn: a number and '?', answered higher/lower/correct; reward 1 - 0.1 per "
                                "extra guess when found", "a demo of interaction without a tool; chat=True for an instruct model"),
}
"""id -> (prompt and answer format, which models it fits); ``tokengym envs`` prints them."""


def register_envs() -> None:
    """Register all tokengym ids (idempotent)."""
    for env_id, (task, _) in ENV_IDS.items():
        if env_id in gym.registry:
            continue
        gym.register(
            id=env_id,
            entry_point="tokengym.envs.token_env:TokenEnv",
            vector_entry_point="tokengym.envs.vector_env:TokenVectorEnv",
            kwargs={"task": task},
        )
