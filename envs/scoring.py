"""Scoring of token episodes: outcome and process rewards placed on the tokens that earned them.

The outcome reward lands on an episode's last agent token when it ends. A process reward (PRM) scores reasoning
steps: a step ends on a token holding the task's ``step_delimiter`` (or, in a multi-turn task without one, each agent
turn is a step), and its score lands on that token. Each kind is scored in one batched call per env step, for every
slot that needs it, so a reward model sees batches, not single texts.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from tokengym.envs.chat import prompt_texts
from tokengym.rewards.protocols import score_outcome, score_process

__all__ = ["ScoringMixin", "delimiter_tokens"]


def delimiter_tokens(tokenizer: Any, delimiter: str, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bool ``[V]``: the tokens whose text holds ``delimiter`` (those end a reasoning step)."""
    texts = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    pieces = [tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in texts]
    return torch.tensor([delimiter in p for p in pieces], dtype=torch.bool, device=device)


class ScoringMixin:
    """The reward side of :class:`~tokengym.envs.TokenVectorEnv` (its reward functions, task and per-token reward
    buffers): ``step`` calls :meth:`_score_events` when episodes or reasoning steps end, and the multi-turn reply side
    :meth:`_score_turn_steps` when agent turns end."""

    def _place_process_reward(self) -> None:
        """Where process-reward scores go: ``_is_delim`` (bool ``[V]``, the step-ending tokens) or ``_turn_steps`` (each
        agent turn of a multi-turn task is a step); neither without a process reward."""
        self._is_delim = None
        delim = self.task.step_delimiter
        self._turn_steps = self.process_reward_fn is not None and not delim and self.multi_turn  # each agent turn is a step
        if self.process_reward_fn is not None and not self._turn_steps:
            if not delim:
                raise ValueError(f"task {self.task.name!r} has no step_delimiter (and is not multi-turn, where each agent "
                                 "turn would be a step), so a process reward cannot be placed")
            self._is_delim = delimiter_tokens(self.tokenizer, delim, self.vocab_size, self.device)

    def _fields(self, slots: Sequence[int]) -> tuple[list[str], dict[str, list]]:
        prompts = prompt_texts(self.tokenizer, [self.samples[s]["prompt"] for s in slots])
        keys = [k for k in self.samples[slots[0]] if k != "prompt"]
        return prompts, {k: [self.samples[s].get(k) for s in slots] for k in keys}

    def _score_events(self, done_now, delim_now, reward: torch.Tensor, info: dict[str, Any]) -> None:
        """Score, in one batched call each, the slots that ended a step and those that ended an episode."""
        events = done_now if delim_now is None else done_now | delim_now
        slots = events.nonzero().flatten().tolist()
        if not slots:  # only agent turns that the env answered
            return
        done_set = set(done_now.nonzero().flatten().tolist())
        texts = self.tokenizer.batch_decode(self.generated_ids(slots), skip_special_tokens=True)
        last = self.last_action  # the newest agent token (env replies are not actions)
        if self._is_delim is not None:
            self._score_steps(slots, texts, done_set, last, reward)
        ended = [s for s in slots if s in done_set]
        if ended:
            by_slot = dict(zip(slots, texts))
            completions = [by_slot[s] for s in ended]
            prompts, fields = self._fields(ended)
            total, comps = score_outcome(self.reward_fn, prompts, completions, fields)
            idx = torch.tensor(ended, device=self.device)
            total = total.to(self.device)
            self.outcome[idx] = total
            self.rewards[idx, last[idx]] += total
            reward[idx] += total
            for j, s in enumerate(ended):
                self.completions[s] = completions[j]
                self.reward_components[s] = {k: float(v[j]) for k, v in comps.items()}
            mask = np.zeros(self.num_envs, dtype=bool)
            mask[ended] = True
            completion_arr = np.array([self.completions[i] for i in range(self.num_envs)], dtype=object)
            info.update(
                completion=completion_arr,
                _completion=mask,
                episode_return=self.rewards.sum(1),
                _episode_return=mask,
                reward_components={k: self._scatter(idx, v) for k, v in comps.items()},
                _reward_components=mask,
            )

    def _scatter(self, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.num_envs, dtype=torch.float32, device=self.device)
        out[idx] = values.to(self.device)
        return out

    def _score_steps(self, slots, texts, done_set, last, reward) -> None:
        delim = self.task.step_delimiter
        todo, steps_todo, new_counts = [], [], []
        for s, text in zip(slots, texts):
            pieces = text.split(delim)
            steps = [p for p in pieces[:-1] if p.strip()]
            if s in done_set and pieces[-1].strip():
                steps.append(pieces[-1])
            if len(steps) > len(self.step_scores[s]):
                todo.append(s)
                steps_todo.append(steps)
                new_counts.append(len(steps) - len(self.step_scores[s]))
        if not todo:
            return
        prompts, fields = self._fields(todo)
        scores = score_process(self.process_reward_fn, prompts, steps_todo, fields)
        values = []
        for s, row, k in zip(todo, scores, new_counts):
            self.step_scores[s] = row
            values.append(sum(row[-k:]))
        idx = torch.tensor(todo, device=self.device)
        v = torch.tensor(values, dtype=torch.float32, device=self.device)
        pos = last[idx]
        self.process_rewards[idx, pos] += v
        self.rewards[idx, pos] += v
        self.step_end[idx, pos] = True
        reward[idx] += v

    def _score_turn_steps(self, rows: list[int], reward: torch.Tensor) -> None:
        """A process reward on a multi-turn task without a step delimiter: each agent turn is a step, scored (one batched
        call) when it ends and placed on the token that ended it, as a PRM step score is."""
        prompts, fields = self._fields(rows)
        scores = score_process(self.process_reward_fn, prompts, [self.history[s][::2] for s in rows], fields)
        idx = torch.tensor(rows, device=self.device)
        last = self.last_action[idx]
        v = torch.tensor([float(row[-1]) if len(row) else 0.0 for row in scores], dtype=torch.float32, device=self.device)
        for s, row in zip(rows, scores):
            self.step_scores[s] = list(row)
        self.process_rewards[idx, last] += v
        self.rewards[idx, last] += v
        self.step_end[idx, last] = True
        reward[idx] += v
