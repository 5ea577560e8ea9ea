"""Prompt sources (tasks) for tokengym environments, each with its default rewards.

Procedural tasks (:data:`TASKS`): :class:`ArithmeticTask`, :class:`ReverseTask`. Data-backed tasks:
:class:`DatasetTask` (JSONL, list of dicts, ``datasets.Dataset``) and :class:`ReasoningGymTask`
(optional extra ``reasoning``). :class:`TargetTask` (``toy``) is the smallest smoke-test task.
"""

from .arithmetic import ArithmeticTask
from .base import Task
from .dataset import DatasetTask
from .reasoning_gym import ReasoningGymReward, ReasoningGymTask
from .reverse import ReverseTask
from .toy import TargetTask

TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "reverse": ReverseTask}
"""The procedural tasks by name."""

__all__ = ["Task", "ArithmeticTask", "ReverseTask", "DatasetTask", "ReasoningGymTask", "ReasoningGymReward", "TargetTask", "TASKS"]
