"""The training algorithms: the on-policy skeleton and the agents on it (GRPO family, RLOO, REINFORCE++, PPO), the
offline learners (DPO, iterative DPO / SPIN, SFT), and the registry ``tokengym train`` reads.

Imports :mod:`~tokengym.agents.data`, :mod:`~tokengym.agents.engine` and :mod:`~tokengym.agents.runtime`, never the CLI.
"""
