"""Training data made from tasks and rollouts: preference pairs (files, datasets, mined from env groups) and
reward-model / PRM data. Imports the engine (to sample), never the algorithms."""
