"""Prompt sources (tasks) for tokengym environments, each with its default rewards.

Procedural tasks (:data:`TASKS`): :class:`ArithmeticTask`, :class:`ReverseTask`. Data-backed tasks:
:class:`DatasetTask` (JSONL, list of dicts, ``datasets.Dataset``) and :class:`ReasoningGymTask`
(optional extra ``reasoning``). :class:`TargetTask` (``toy``) is the smallest smoke-test task. Multi-turn tasks, in
which the env answers: :class:`CalculatorTask` (a tool) and :class:`GuessNumberTask` (a game). :class:`ToolCallTask`
declares a grammar: its actions are masked to a JSON schema (:mod:`tokengym.envs.masks`).
A task may bundle training data for learned rewards (:meth:`Task.preference_pairs`, :meth:`Task.step_labels`; ask
:meth:`Task.has_bundled_data`): Arithmetic does (:mod:`~tokengym.envs.tasks.arithmetic_data`).
Each task registers itself in the one task table (:mod:`~tokengym.envs.tasks.registry`) with
:func:`register_task`; a new bundled task is its own file plus its import below.
"""

from .base import Task
from .registry import TASK_SPECS, TASKS, TaskSpec, register_task, unregister_task

# The import order is the registration order, the order in which `tokengym envs` lists the ids.
from .arithmetic import ArithmeticTask
from .reverse import ReverseTask
from .dataset import DatasetTask
from .toy import TargetTask
from .reasoning_gym import ReasoningGymReward, ReasoningGymTask
from .tools import CalculatorTask, GuessNumberTask
from .tool_call import ToolCallTask

__all__ = ["Task", "ArithmeticTask", "ReverseTask", "DatasetTask", "ReasoningGymTask", "ReasoningGymReward", "TargetTask", "CalculatorTask",
           "GuessNumberTask", "ToolCallTask", "TASKS", "TASK_SPECS", "TaskSpec", "register_task", "unregister_task"]
