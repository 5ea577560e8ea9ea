"""What every training loop stands on: run folders and checkpoints, config text I/O, the metrics logger, the
optimiser step and its schedules, and data-parallel process groups. Imports only ``envs`` and ``rewards``."""
