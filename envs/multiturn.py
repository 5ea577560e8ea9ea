"""Environments that answer: the reply side of multi-turn token episodes.

A multi-turn task overrides :meth:`Task.respond`. When an agent turn ends (a stop token or stop string, or one of the
task's ``turn_stop_strings`` such as ``"</calc>"``), the env calls ``respond(sample, history)`` for that row, where
``history`` alternates the agent's turns and the env's earlier replies as text (``history[-1]`` is the turn just
ended). It returns the reply text (appended to the episode as context), ``None`` (the episode ends: terminated), or
a :class:`Reply` for a turn reward, token ids or a last message. The reply is tokenized once, by the env (between
the chat template's role markers for chat tasks), and nothing already in the buffer is ever re-tokenized.

Replies of the rows whose turns end in the same step run concurrently, each under the task's ``reply_timeout``. By
default the step waits for all of them; with the task's ``reply_grace`` (seconds) it waits that long, and rows whose
reply is still out then wait (``env.waiting``: their actions are ignored) while the others go on, and their reply is
appended at a later step, as soon as it is there. A
reply that raises, times out or is not a str/Reply/None becomes an ``error: ...`` message in the observation and
is counted (:attr:`TokenVectorEnv.turn_stats`), never a crash of the batch. A reply that contains the task's
end-of-turn marker, or token ids outside the vocabulary, is the env's bug: a ``ValueError`` naming the task.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Reply", "answer_one", "ask_all", "chat_reply_wrapper", "timed_out"]


@dataclass
class Reply:
    """What :meth:`Task.respond` may return instead of a plain string.

    Attributes:
        text: the reply appended to the episode (``None`` with ``done``: nothing is appended).
        ids: token ids to append instead of ``text`` (already tokenized by the env's tokenizer).
        done: the episode ends after this turn (terminated); the outcome reward is scored then.
        reward: a reward for the turn just ended, placed on the agent token that ended it.
    """

    text: str | None = None
    ids: Sequence[int] | None = None
    done: bool = False
    reward: float = 0.0


def _normalise(out: Any) -> tuple[Reply, str | None]:
    """``(Reply, error kind or None)`` of what ``respond`` returned."""
    if out is None:
        return Reply(done=True), None
    if isinstance(out, str):
        return Reply(text=out), None
    if isinstance(out, Reply):
        if not out.done and out.text is None and out.ids is None:
            return Reply(text="error: the reply had no text"), "tool_errors"
        return out, None
    return Reply(text=f"error: the reply was a {type(out).__name__}, not text"), "tool_errors"


def answer_one(task: Any, sample: dict, history: list[str]) -> tuple[Reply, str | None]:
    """``task.respond(sample, history)`` as a :class:`Reply`, and the kind of error it was (``None`` if none)."""
    try:
        return _normalise(task.respond(sample, history))
    except Exception as e:  # a tool that raises is an observation, not a crash of the batch
        return Reply(text=f"error: {type(e).__name__}: {str(e)[:160]}"), "tool_errors"


def timed_out(task: Any) -> tuple[Reply, str]:
    return Reply(text=f"error: no reply within {task.reply_timeout:g} s"), "tool_timeouts"


def ask_all(task: Any, pool: cf.ThreadPoolExecutor | None, jobs: list[tuple[dict, list[str]]]
            ) -> tuple[list[Reply], list[bool], dict[str, int]]:
    """``task.respond(sample, history)`` for every job, concurrently under ``task.reply_timeout`` seconds (inline when
    it is ``None``); returns the replies in order, whether each is an error message, and the counts of errors and
    timeouts."""
    counts = {"tool_errors": 0, "tool_timeouts": 0}
    replies: list[Reply] = []
    if pool is None or task.reply_timeout is None:
        results = [answer_one(task, s, h) for s, h in jobs]
    else:
        futures = [pool.submit(answer_one, task, s, list(h)) for s, h in jobs]
        done, _ = cf.wait(futures, timeout=task.reply_timeout)
        results = [f.result() if f in done else timed_out(task) for f in futures]
    for reply, err in results:
        replies.append(reply)
        if err:
            counts[err] += 1
    return replies, [err is not None for _, err in results], counts


def chat_reply_wrapper(tokenizer: Any, role: str) -> tuple[str, str]:
    """``(before, after)``: the text a chat template writes around a ``role`` message that follows an assistant turn
    the model closed with its end-of-turn token, up to the next assistant turn's opening (its generation prompt)."""
    from tokengym.envs.chat import END_OF_TURN

    mark = "\x00tokengym-reply\x00"
    said = "zqxjv-said"
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": said}]
    full = tokenizer.apply_chat_template(base + [{"role": role, "content": mark}], add_generation_prompt=True, tokenize=False)
    head, _, tail = full.partition(mark)
    cut = head.rfind(said) + len(said)  # the model wrote the assistant's content and its end-of-turn token
    eot = next((e for e in END_OF_TURN if head.startswith(e, cut)), None)
    if cut < len(said) or eot is None:
        raise ValueError(f"cannot find where the assistant turn ends in the chat template's rendering {head!r}")
    return head[cut + len(eot):], tail
