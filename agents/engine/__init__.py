"""The rollout engine: models and their loading, the policy and its fast KV-cached decoder, the critic, the two seams
a rollout backend implements (the token-level ``Sampler``, the generation-level ``Generator`` that an inference
engine such as vLLM serves), and ``collect`` / ``collect_episodes`` that drive an env with either.

Imports only :mod:`tokengym.agents.runtime`, the pure math, ``envs`` and ``rewards``.
"""
