"""Rewards for tokengym: protocols, verifiers, a rule-based arithmetic PRM, reward combinators, and learned
reward models (a Bradley-Terry outcome reward model on a sequence head or on a causal LM's likelihood, a
token-classification PRM) with their training, and an LLM judge behind an OpenAI-compatible URL.

Outcome reward: ``fn(prompts, completions, **task_fields) -> list[float] | Tensor[N]``.
Process reward: ``fn(prompts, steps, **task_fields) -> list[list[float]]``.
See :mod:`tokengym.rewards.protocols`.
"""

from .arithmetic_prm import ArithmeticStepReward, arithmetic_step_reward, next_reduction, parse_expression, solve_expression
from .combinators import FormatReward, LengthPenalty, WeightedSum, format_reward, length_penalty, weighted_sum
from .judge import JUDGE_REFERENCE_TEMPLATE, JUDGE_TEMPLATE, JudgeReward, judge_reward, score_verdict, yes_no_verdict
from .learned_prm import LearnedPRM, PRMConfig, train_prm
from .protocols import DROP, OutcomeReward, ProcessReward, is_counter, reward_name, score_outcome, score_process
from .reward_model import LikelihoodRewardModel, RewardModel, RewardModelConfig, train_reward_model
from .teacher import TeacherReward, teacher_token_rewards
from .verifiers import (
    answer_match,
    arithmetic_correct,
    char_accuracy,
    exact_match,
    extract_answer,
    extract_final_answer,
    extract_number,
    number_match,
    parse_int,
)

__all__ = [
    # protocols
    "OutcomeReward",
    "ProcessReward",
    "score_outcome",
    "score_process",
    "reward_name",
    "DROP",
    "is_counter",
    # verifiers
    "parse_int",
    "extract_final_answer",
    "extract_answer",
    "extract_number",
    "arithmetic_correct",
    "number_match",
    "exact_match",
    "answer_match",
    "char_accuracy",
    # arithmetic process reward
    "ArithmeticStepReward",
    "arithmetic_step_reward",
    "parse_expression",
    "next_reduction",
    "solve_expression",
    # combinators
    "WeightedSum",
    "weighted_sum",
    "FormatReward",
    "format_reward",
    "LengthPenalty",
    "length_penalty",
    # an LLM judge
    "JudgeReward",
    "judge_reward",
    "score_verdict",
    "yes_no_verdict",
    "JUDGE_TEMPLATE",
    "JUDGE_REFERENCE_TEMPLATE",
    # learned rewards
    "RewardModel",
    "LikelihoodRewardModel",
    "TeacherReward",
    "teacher_token_rewards",
    "RewardModelConfig",
    "train_reward_model",
    "LearnedPRM",
    "PRMConfig",
    "train_prm",
]
