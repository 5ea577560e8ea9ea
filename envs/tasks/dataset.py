"""Prompts from data: a JSONL file, a list of dicts or a ``datasets.Dataset``."""

from __future__ import annotations

import json
import numbers
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tokengym.rewards import answer_match

from ..chat import check_roles, is_messages, prompt_chars
from .base import Task, check_seed
from .registry import register_task

__all__ = ["DatasetTask", "read_jsonl"]


class _Stream:
    """Where one generator is in its walk over the rows."""

    __slots__ = ("rng", "order", "pos")

    def __init__(self, rng: np.random.Generator):
        self.rng = rng  # a strong reference: the id() key cannot be reused while the stream lives
        self.order: np.ndarray | None = None
        self.pos = 0


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (one JSON object per line, blank lines skipped), with errors naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data: no such JSONL file: {str(path)!r}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _is_hf_dataset_like(data: Any) -> bool:
    return type(data).__module__.split(".")[0] == "datasets"


@register_task(
    "dataset", kind="data", description="prompts from JSONL / list / datasets.Dataset (data=...), any reward",
    prompt_format="prompt: your 'prompt' column as is; reward: the final answer ('A: ...', 'Answer: ...', "
                  "<answer>...</answer> or the last line) against an 'answer' column, or your reward=",
    models="your own model (the char-level presets only know their own tasks)")
class DatasetTask(Task):
    """A task whose prompts (and reference answers, and any other columns) come from data.

    Every column other than ``prompt_key`` becomes a task field passed to the rewards, e.g. ``answer``. Prompts are
    strings, or (all of them) lists of ``{"role", "content"}`` chat messages, TRL's conversational format, which
    the env renders with the tokenizer's chat template.

    **Order.** ``sample(rng)`` walks the rows epoch by epoch and cycles forever. With ``shuffle=True``
    each epoch is a permutation drawn from ``rng`` when the epoch starts (``rng.permutation(len)``);
    with ``shuffle=False`` the rows come in order and ``rng`` is not consumed. The position is kept per
    generator object, so a freshly created generator (what ``env.reset(seed=...)`` makes) starts a fresh
    walk, and :meth:`on_seed` (which the env calls on ``reset(seed=...)``) restarts every walk: re-seeding
    replays the same prompts. Independent generators walk independently.

    Args:
        data: a JSONL path (``str`` or ``Path``, one JSON object per line, blank lines skipped), a list
            of dicts, or a ``datasets.Dataset`` (the ``datasets`` package is only imported for it).
        prompt_key: the column holding the prompt text (renamed ``"prompt"`` in samples).
        shuffle: shuffle each epoch (see above) instead of walking rows in order.
        reward: the outcome reward. Default: :func:`tokengym.rewards.answer_match` (exact match of the
            extracted final answer) against an ``"answer"`` column, which must then exist.
        process_reward: an optional process reward (needs ``step_delimiter``).
        step_delimiter: the text that ends a reasoning step, or ``None``.
        stop_strings: texts that end an episode besides EOS.
        max_new_tokens: the default generation budget.
        name: the task's name in logs.
        seed: seeds a private generator used only when :meth:`sample` gets no generator.

    Raises:
        ValueError: empty data, a missing prompt column (the message lists the columns), rows with
            different keys, a non-string prompt, or no reward and no ``"answer"`` column.

    Examples:
        >>> task = DatasetTask([{"prompt": "2+2=", "answer": 4}, {"prompt": "3+3=", "answer": 6}], shuffle=False)
        >>> rng = np.random.default_rng(0)
        >>> [s["prompt"] for s in task.batch(rng, 3)]
        ['2+2=', '3+3=', '2+2=']
        >>> task.reward()(["2+2="], ["Answer: 4"], answer=[4])
        [1.0]
    """

    _MAX_STREAMS = 256

    def __init__(
        self,
        data: str | os.PathLike | Sequence[Mapping[str, Any]] | Any,
        prompt_key: str = "prompt",
        shuffle: bool = True,
        reward: Callable | None = None,
        process_reward: Callable | None = None,
        step_delimiter: str | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 64,
        name: str = "dataset",
        seed: int | None = None,
    ):
        if not isinstance(prompt_key, str) or not prompt_key:
            raise ValueError(f"prompt_key must be a non-empty string, got {prompt_key!r}")
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        if reward is not None and not callable(reward):
            raise ValueError(f"reward must be an outcome reward (callable) or None, got {reward!r}")
        if process_reward is not None and not callable(process_reward):
            raise ValueError(f"process_reward must be a process reward (callable) or None, got {process_reward!r}")
        if step_delimiter is not None and (not isinstance(step_delimiter, str) or not step_delimiter):
            raise ValueError(f"step_delimiter must be None or a non-empty string, got {step_delimiter!r}")
        if process_reward is not None and step_delimiter is None:
            raise ValueError("process_reward needs step_delimiter (the text that ends a reasoning step, e.g. '\\n')")
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop_strings must be a sequence of non-empty strings, got {stop_strings!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")

        self._hf = None
        if isinstance(data, (str, os.PathLike)):
            rows: Sequence[Mapping[str, Any]] = read_jsonl(Path(data))
            columns = self._check_rows(rows)
        elif _is_hf_dataset_like(data):
            columns = self._check_hf(data)
            rows = data
            self._hf = data
        elif isinstance(data, Sequence) and not isinstance(data, (bytes, bytearray)):
            rows = list(data)
            columns = self._check_rows(rows)
        else:
            raise TypeError(
                f"data must be a JSONL path, a list of dicts or a datasets.Dataset, got {type(data).__name__}"
            )
        if prompt_key not in columns:
            raise ValueError(f"prompt_key {prompt_key!r} is not a column of the data; the columns are {columns}")
        if prompt_key != "prompt" and "prompt" in columns:
            raise ValueError(f"the data has a 'prompt' column and prompt_key={prompt_key!r}; rename one of them")

        prompts = self._hf[prompt_key] if self._hf is not None else [row[prompt_key] for row in rows]
        self.chat = is_messages(prompts[0])
        for i, p in enumerate(prompts):
            if not (is_messages(p) if self.chat else isinstance(p, str)):
                kind = "list of chat messages, like row 0's" if self.chat else "string, like row 0's"
                raise ValueError(f"row {i}: the prompt ({prompt_key!r}) must be a {kind}, got {type(p).__name__}: {p!r:.80}")
            check_roles(p, f"row {i}")

        self._rows = rows
        self._len = len(prompts)
        self.prompt_key = prompt_key
        self.columns = list(columns)
        self.field_names = [c for c in columns if c != prompt_key]
        self.shuffle = shuffle
        if reward is None:
            if "answer" not in columns:
                raise ValueError(
                    f"no reward given and the data has no 'answer' column (columns: {columns}); "
                    "pass reward=<outcome reward (prompts, completions, **fields) -> list[float]>"
                )
            reward = answer_match
        self._reward = reward
        self._process_reward = process_reward
        self.step_delimiter = step_delimiter
        self.stop_strings = tuple(stop_strings)
        self.max_prompt_chars = max(prompt_chars(p) for p in prompts)
        self.default_max_new_tokens = int(max_new_tokens)
        self.name = name
        self.seed = check_seed(seed)
        self._rng = np.random.default_rng(self.seed)
        self._streams: OrderedDict[int, _Stream] = OrderedDict()

    @staticmethod
    def _check_rows(rows: Sequence[Any]) -> list[str]:
        if len(rows) == 0:
            raise ValueError("data is empty: a DatasetTask needs at least one row")
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(f"row {i} must be a dict, got {type(row).__name__}: {row!r}")
        columns = list(rows[0].keys())
        first = set(columns)
        for i, row in enumerate(rows):
            if set(row.keys()) != first:
                missing, extra = sorted(first - set(row)), sorted(set(row) - first)
                raise ValueError(
                    f"rows have inconsistent keys: row {i} has {sorted(row)} but row 0 has {sorted(first)} "
                    f"(missing {missing}, extra {extra}); every row needs the same keys"
                )
        return columns

    @staticmethod
    def _check_hf(data: Any) -> list[str]:
        import datasets  # optional extra, imported only for datasets inputs

        if isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            raise ValueError(f"data is a DatasetDict; pick a split, e.g. data[{next(iter(data), 'train')!r}] (splits: {list(data)})")
        if not isinstance(data, datasets.Dataset):
            raise TypeError(f"data must be a datasets.Dataset (map-style, with a length), got {type(data).__name__}")
        if len(data) == 0:
            raise ValueError("data is empty: a DatasetTask needs at least one row")
        return list(data.column_names)

    def __len__(self) -> int:
        return self._len

    def row(self, index: int) -> dict[str, Any]:
        """Row ``index`` as a sample: ``{"prompt": ..., **other columns}``."""
        if not 0 <= index < self._len:
            raise IndexError(f"row index {index} out of range for {self._len} rows")
        raw = self._rows[int(index)]
        sample = {"prompt": raw[self.prompt_key]}
        for key in self.field_names:
            sample[key] = raw[key]
        return sample

    def next_index(self, rng: np.random.Generator | None = None) -> int:
        """The next row index of ``rng``'s walk (see the class docstring), advancing it."""
        rng = self._rng if rng is None else rng
        key = id(rng)
        stream = self._streams.get(key)
        if stream is None or stream.rng is not rng:
            stream = self._streams[key] = _Stream(rng)
        self._streams.move_to_end(key)
        while len(self._streams) > self._MAX_STREAMS:
            self._streams.popitem(last=False)
        if stream.pos >= self._len:  # epoch over: start the next one
            stream.order, stream.pos = None, 0
        if self.shuffle and stream.order is None:
            stream.order = rng.permutation(self._len)
        index = int(stream.order[stream.pos]) if stream.order is not None else stream.pos
        stream.pos += 1
        return index

    def sample(self, rng: np.random.Generator | None = None) -> dict[str, Any]:
        """The next row of ``rng``'s walk over the data, as a sample dict."""
        return self.row(self.next_index(rng))

    def state_dict(self, rng: np.random.Generator) -> dict[str, Any]:
        """``rng``'s position in its walk: ``{"order": list[int] | None, "pos": int}`` (``{}`` before it starts)."""
        stream = self._streams.get(id(rng))
        if stream is None or stream.rng is not rng:
            return {}
        return {"order": None if stream.order is None else [int(i) for i in stream.order], "pos": int(stream.pos)}

    def load_state_dict(self, state: dict[str, Any], rng: np.random.Generator) -> None:
        self._streams.pop(id(rng), None)
        if state:
            stream = self._streams[id(rng)] = _Stream(rng)
            stream.order = None if state["order"] is None else np.asarray(state["order"], dtype=np.int64)
            stream.pos = int(state["pos"])

    def on_seed(self, seed: int | None) -> None:
        """Restart every walk: after ``env.reset(seed=s)`` the prompts replay from the beginning."""
        self._streams.clear()

    def reward(self) -> Callable:
        return self._reward

    def process_reward(self) -> Callable | None:
        return self._process_reward

    def __repr__(self) -> str:
        return f"DatasetTask(name={self.name!r}, rows={self._len}, columns={self.columns}, shuffle={self.shuffle})"
