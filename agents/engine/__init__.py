"""The rollout engine: models and their loading, the policy and its fast KV-cached decoder, the critic, the two seams
a rollout backend implements, and ``collect`` / ``collect_episodes`` that drive an env with either.

Words, one per concept:

- **backend** (rollout backend): what makes the rollouts, registered by name in :mod:`.backends`
  (``register_backend``) and chosen by the ``sampler`` setting (``sampler=`` in a config, ``--sampler``); the agent's
  ``rollout_backend(env)`` returns it and the rollout sources take it as ``backend=``.
- **Sampler**: only the token-level protocol (:mod:`.sampler`: prefill, decode, capabilities), what ``Policy`` is.
- **Generator**: the generation-level protocol (:mod:`.seam`, :mod:`.generation`: whole requests in, whole
  generations out), what an inference engine serves (:class:`~.vllm_backend.VLLMGenerator`, ``PolicyGenerator``).
- **engine**: a backend holding its own copy of the weights, loaded by name after each update.

:mod:`.backend_check` checks a new backend against a trusted one on either seam.

Imports only :mod:`tokengym.agents.runtime`, the pure math, ``envs`` and ``rewards``.
"""
