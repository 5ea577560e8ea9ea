"""``tokengym train rm`` and ``tokengym train prm``: reward models and learned PRMs, trained by
:mod:`tokengym.rewards` (their configs and fit loops live there, beside the models they train)."""

from tokengym.agents.algorithms.registry import register
from tokengym.rewards import PRMConfig, RewardModelConfig

register("rm", RewardModelConfig, "Bradley-Terry reward model on preference pairs (a sequence-classification head, or a "
         "causal LM's likelihood)", run_fields=frozenset({"temperature", "pairs", "num_pairs", "rm_kind"}), resumable=False)
register("prm", PRMConfig, "learned process reward model on step labels (a token-classification head)",
         run_fields=frozenset({"num_pairs", "step_labels"}), resumable=False)
