"""Prompt sources (tasks) for tokengym environments, each with its default rewards.

Procedural tasks (:data:`TASKS`): :class:`ArithmeticTask`, :class:`ReverseTask`. Data-backed tasks:
:class:`DatasetTask` (JSONL, list of dicts, ``datasets.Dataset``) and :class:`ReasoningGymTask`
(optional extra ``reasoning``). :class:`TargetTask` (``toy``) is the smallest smoke-test task. Multi-turn tasks, in
which the env answers: :class:`CalculatorTask` (a tool) and :class:`GuessNumberTask` (a game).
A task may bundle training data for learned rewards (:meth:`Task.preference_pairs`, :meth:`Task.step_labels`; ask
:meth:`Task.has_bundled_data`): Arithmetic does (:mod:`~tokengym.envs.tasks.arithmetic_data`).
"""

from .arithmetic import ArithmeticTask
from .base import Task
from .dataset import DatasetTask
from .reasoning_gym import ReasoningGymReward, ReasoningGymTask
from .reverse import ReverseTask
from .tools import CalculatorTask, GuessNumberTask
from .toy import TargetTask

TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "reverse": ReverseTask, "calculator": CalculatorTask,
                                "guess_number": GuessNumberTask}
"""The procedural tasks by name."""

__all__ = ["Task", "ArithmeticTask", "ReverseTask", "DatasetTask", "ReasoningGymTask", "ReasoningGymReward", "TargetTask", "CalculatorTask",
           "GuessNumberTask", "TASKS"]
