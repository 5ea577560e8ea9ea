"""Procedural reasoning tasks from `reasoning-gym` (optional extra: ``pip install tokengym[reasoning]``)."""

from __future__ import annotations

from typing import Any, Sequence

from tokengym.rewards import extract_answer

from ..chat import user_prompt
from .dataset import DatasetTask
from .registry import register_task

__all__ = ["ReasoningGymTask", "ReasoningGymReward"]


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "ReasoningGymTask needs the reasoning-gym package: pip install tokengym[reasoning]"
        ) from e
    return reasoning_gym


class ReasoningGymReward:
    """Outcome reward that scores completions with a reasoning-gym dataset's own ``score_answer``.

    The answer is extracted with :func:`tokengym.rewards.extract_answer` (the last
    ``<answer>...</answer>`` block when there is one, else the last answer line, else the last non-empty
    line); the entry it is judged against is looked up by the ``index`` task field. A completion with no
    answer scores 0.0, and so does one whose answer makes the dataset's scorer raise (model output is
    arbitrary text).

    Args:
        dataset: the reasoning-gym dataset (``score_answer(answer=..., entry=...)``).
        entries: its entries, indexed like the ``index`` field.
        name: the reward's name in logs.
    """

    def __init__(self, dataset: Any, entries: Sequence[dict[str, Any]], name: str = "reasoning_gym"):
        self.dataset = dataset
        self.entries = entries
        self.name = name

    def __call__(self, prompts: list[str], completions: list[str], index: Sequence[int] | None = None, **_: Any) -> list[float]:
        if index is None or len(index) != len(completions):
            got = "no 'index' field" if index is None else f"{len(index)} indices"
            raise ValueError(f"{self.name}: needs the task field 'index' (one per completion), got {got} for {len(completions)} completions")
        scores = []
        for completion, i in zip(completions, index):
            answer = extract_answer(completion)
            if answer is None:
                scores.append(0.0)
                continue
            entry = self.entries[int(i)]
            try:
                score = float(self.dataset.score_answer(answer=answer, entry=entry))
            except Exception:  # noqa: BLE001 - a scorer choking on arbitrary model output means a wrong answer
                score = 0.0
            scores.append(score)
        return scores

    def __repr__(self) -> str:
        return f"ReasoningGymReward({self.name!r})"


@register_task(
    "reasoning_gym", kind="data", description="a reasoning-gym dataset (name=...), scored by its score_answer",
    prompt_format="prompt: the dataset's English question; answer in <answer>...</answer> or on the last line, "
                  "scored by the dataset",
    models="a local instruct model that reads English: the bundled char-level models score 0 on these")
class ReasoningGymTask(DatasetTask):
    """Questions of a reasoning-gym dataset, scored by the dataset's own verifier.

    ``reasoning_gym.create_dataset(name, size=size, seed=seed, **config)`` generates the entries once at
    construction; they are walked like :class:`DatasetTask` rows (epoch-wise permutations drawn from the
    env's generator, restarted on ``reset(seed=...)``).

    Samples: ``{"prompt": <question>, "answer": <reference answer str>, "solution":
    "<answer>{answer}</answer>", "index": <entry index>}``; the reward reads ``index``.

    Args:
        name: a reasoning-gym dataset name, e.g. ``"leg_counting"``.
        size: number of entries to generate.
        seed: the reasoning-gym generation seed (which questions exist, not the order they come in).
        shuffle: shuffle each epoch (see :class:`DatasetTask`).
        max_new_tokens: the default generation budget.
        chat: pose each question as a chat user message (rendered by the tokenizer's chat template).
        system_prompt: an optional system message for the chat form.
        **config: dataset-specific options passed to ``create_dataset``.

    Raises:
        ImportError: reasoning-gym is not installed (``pip install tokengym[reasoning]``).
        ValueError: unknown dataset name or invalid configuration.
    """

    def __init__(self, name: str, size: int = 1000, seed: int = 0, *, shuffle: bool = True, max_new_tokens: int = 256,
                 chat: bool = False, system_prompt: str | None = None, **config: Any):
        rg = _import_reasoning_gym()
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        try:
            dataset = rg.create_dataset(name, size=size, seed=seed, **config)
        except (ValueError, TypeError, AssertionError) as e:
            raise ValueError(f"reasoning-gym could not create dataset {name!r} with size={size}, seed={seed}, config={config}: {e}") from e
        entries = [dataset[i] for i in range(len(dataset))]
        if not isinstance(chat, bool) or (system_prompt is not None and not (chat and isinstance(system_prompt, str))):
            raise ValueError(f"chat must be true or false and system_prompt a string with chat=True, got {chat!r}, {system_prompt!r}")
        rows = [
            {"prompt": user_prompt(e["question"], system_prompt) if chat else e["question"], "answer": str(e["answer"]),
             "solution": f"<answer>{e['answer']}</answer>", "index": i}
            for i, e in enumerate(entries)
        ]
        self.dataset = dataset
        self.entries = entries
        self.dataset_name = name
        self.config = dict(config)
        super().__init__(
            rows,
            shuffle=shuffle,
            reward=ReasoningGymReward(dataset, entries, name=f"reasoning_gym/{name}"),
            max_new_tokens=max_new_tokens,
            name=f"reasoning_gym/{name}",
        )

    def entry(self, index: int) -> dict[str, Any]:
        """The reasoning-gym entry (``question``, ``answer``, ``metadata``) of row ``index``."""
        return self.entries[index]

    def extract_answer(self, completion: str | None) -> str | None:
        """The answer the dataset's verifier scores (:func:`tokengym.rewards.extract_answer`), ``None`` without one."""
        return extract_answer(completion)

    def __repr__(self) -> str:
        return f"ReasoningGymTask({self.dataset_name!r}, size={len(self)}, config={self.config})"
