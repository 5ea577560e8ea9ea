"""The rollout engine: models and their loading, the policy and its fast KV-cached decoder, the critic, the
sampler protocol every rollout backend implements, and ``collect`` / ``collect_episodes`` that drive an env with it.

Imports only :mod:`tokengym.agents.runtime`, the pure math, ``envs`` and ``rewards``.
"""
