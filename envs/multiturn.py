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
is counted (``TokenVectorEnv.turn_counts``, per row), never a crash of the batch. A reply that contains the task's
end-of-turn marker, or token ids outside the vocabulary, is the env's bug: a ``ValueError`` naming the task.
"""

from __future__ import annotations

import concurrent.futures as cf
import numbers
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tokengym.rewards.common import F32_MAX, finite32

__all__ = ["TURN_EVENTS", "Reply", "BadReply", "DaemonPool", "MultiTurnMixin", "answer_one", "ask_all", "check_reply",
           "chat_reply_wrapper", "timed_out"]


TURN_EVENTS = ("turns", "replies", "tool_errors", "tool_timeouts", "reply_overflows", "max_turns")
"""Per-row counts an env keeps: agent turns ended, replies appended, replies that raised or were not text, replies
past ``reply_timeout``, replies longer than the remaining budget (episode truncated), truncations at ``max_turns``."""


@dataclass
class Reply:
    """What :meth:`Task.respond` may return instead of a plain string.

    Attributes:
        text: the reply appended to the episode (``None`` with ``done``: nothing is appended).
        ids: token ids to append instead of ``text`` (already tokenized by the env's tokenizer).
        done: the episode ends after this turn (terminated); the outcome reward is scored then.
        reward: a reward for the turn just ended, placed on the agent token that ended it.
        event: a count this reply adds to the row (one of the task's ``turn_events``, or a :data:`TURN_EVENTS` name).
    """

    text: str | None = None
    ids: Sequence[int] | None = None
    done: bool = False
    reward: float = 0.0
    event: str | None = None


def _is_int(i: Any) -> bool:
    """An integer (Python, NumPy or a 0-d integer tensor), not a bool or a float that would be truncated."""
    if isinstance(i, torch.Tensor):
        return i.ndim == 0 and not i.dtype.is_floating_point and not i.dtype.is_complex and i.dtype != torch.bool
    return isinstance(i, numbers.Integral) and not isinstance(i, bool)


class BadReply(ValueError):
    """A :class:`Reply` of the wrong form: a bug of the task, raised (naming it) rather than shown to the agent."""


def check_reply(task: Any, rep: Reply) -> Reply:
    """``rep`` if its fields have the types and values the env can use, else :class:`BadReply` naming the task."""
    def bad(what: str) -> BadReply:
        return BadReply(f"task {getattr(task, 'name', type(task).__name__)!r}: respond() returned {what}")

    if rep.text is not None and not isinstance(rep.text, str):
        raise bad(f"Reply(text={rep.text!r}): text must be a str (or None)")
    if rep.ids is not None:
        if isinstance(rep.ids, (str, bytes)) or not hasattr(rep.ids, "__iter__"):
            raise bad(f"Reply(ids={rep.ids!r}): ids must be a sequence of integer token ids")
        wrong = next((i for i in rep.ids if not _is_int(i)), None)
        if wrong is not None:
            raise bad(f"Reply(ids=[..., {wrong!r}, ...]): token ids must be integers")
    if isinstance(rep.reward, bool) or not isinstance(rep.reward, numbers.Real):
        raise bad(f"Reply(reward={rep.reward!r}): the turn reward must be a number")
    if not finite32(float(rep.reward)):  # rewards are kept in float32: 1e308 would be inf there
        raise bad(f"Reply(reward={rep.reward!r}): the turn reward must be finite in float32 (|reward| <= {F32_MAX:.3g})")
    if not isinstance(rep.done, bool):
        raise bad(f"Reply(done={rep.done!r}): done must be a bool")
    events = (*TURN_EVENTS, *getattr(task, "turn_events", ()))
    if rep.event is not None and rep.event not in events:
        raise bad(f"Reply(event={rep.event!r}): event must be one of {', '.join(events)}")
    return rep


def _normalise(task: Any, out: Any) -> tuple[Reply, str | None]:
    """``(Reply, error kind or None)`` of what ``respond`` returned."""
    if out is None:
        return Reply(done=True), None
    if isinstance(out, str):
        return Reply(text=out), None
    if isinstance(out, Reply):
        check_reply(task, out)
        if not out.done and out.text is None and out.ids is None:
            return Reply(text="error: the reply had no text"), "tool_errors"
        return out, None
    return Reply(text=f"error: the reply was a {type(out).__name__}, not text"), "tool_errors"


def answer_one(task: Any, sample: dict, history: list[str]) -> tuple[Reply, str | None]:
    """``task.respond(sample, history)`` as a :class:`Reply`, and the kind of error it was (``None`` if none).

    A tool that raises, ``sys.exit`` included, is an observation for the agent, not a crash of the batch; so is a
    ``KeyboardInterrupt`` raised in a pool thread (Ctrl-C reaches only the main thread: there it stops the run). A
    :class:`Reply` of the wrong form is the task's bug and raises :class:`BadReply`."""
    try:
        out = task.respond(sample, history)
    except (Exception, SystemExit) as e:
        return Reply(text=f"error: {type(e).__name__}: {str(e)[:160]}"), "tool_errors"
    except KeyboardInterrupt as e:
        if threading.current_thread() is threading.main_thread():
            raise
        return Reply(text=f"error: KeyboardInterrupt: {str(e)[:160]}"), "tool_errors"
    return _normalise(task, out)


def timed_out(task: Any) -> tuple[Reply, str]:
    return Reply(text=f"error: no reply within {task.reply_timeout:g} s"), "tool_timeouts"


class DaemonPool:
    """A small thread pool for tool replies whose workers are daemon threads. ``ThreadPoolExecutor`` joins its workers
    when the interpreter exits, so one ``respond()`` that never returns (its timeout already turned into an error
    message for the agent) would keep the finished run's process alive forever; a daemon worker cannot."""

    def __init__(self, max_workers: int, name: str = "tokengym-reply"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._workers: list[threading.Thread] = []
        self._max, self._name = max_workers, name

    def submit(self, fn: Any, *args: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        self._jobs.put((future, fn, args))
        if not self._idle.acquire(blocking=False) and len(self._workers) < self._max:
            worker = threading.Thread(target=self._work, name=f"{self._name}_{len(self._workers)}", daemon=True)
            worker.start()
            self._workers.append(worker)
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits on the future
                    future.set_exception(e)
            self._idle.release()

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop the workers once their current job ends (a hung one never does: it is a daemon); ``cancel_futures``
        cancels the jobs not started yet."""
        while cancel_futures:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._workers:
            self._jobs.put(None)
        if wait:
            for w in self._workers:
                w.join()


def ask_all(task: Any, pool: DaemonPool | None, jobs: list[tuple[dict, list[str]]]
            ) -> list[tuple[Reply, str | None]]:
    """``task.respond(sample, history)`` for every job, concurrently under ``task.reply_timeout`` seconds (inline when
    it is ``None``); returns each reply with the kind of error it is (``"tool_errors"``, ``"tool_timeouts"``, ``None``)."""
    if pool is None or task.reply_timeout is None:
        return [answer_one(task, s, h) for s, h in jobs]
    futures = [pool.submit(answer_one, task, s, list(h)) for s, h in jobs]
    done, _ = cf.wait(futures, timeout=task.reply_timeout)
    return [f.result() if f in done else timed_out(task) for f in futures]


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


class MultiTurnMixin:
    """The reply side of :class:`~tokengym.envs.TokenVectorEnv` (its buffers, tokenizer and task), kept apart from the
    single-turn step: ``step`` calls :meth:`_answer_turns` when agent turns end or replies are still out (a turn's
    process reward is :class:`~tokengym.envs.scoring.ScoringMixin`'s)."""

    def _answer_turns(self, ended: torch.Tensor | None, term_now: torch.Tensor, trunc_now: torch.Tensor,
                      active: torch.Tensor, reward: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Ask the task to answer the rows whose agent turn just ended (``ended``) and collect replies still out;
        append each reply, or end (terminated) or truncate the episode. Returns the updated ``(term_now, trunc_now)``
        and whether an episode ended."""
        P, M = self.max_prompt_len, self.max_new_tokens
        rows = ended.nonzero().flatten().tolist() if ended is not None else []
        if rows:
            starts, ends = self.turn_start[rows].tolist(), self.gen_len[rows].tolist()
            buf = self.tokens[rows, P:].tolist()
            said = self.tokenizer.batch_decode([b[s:e] for b, s, e in zip(buf, starts, ends)], skip_special_tokens=True)
            for s, text in zip(rows, said):
                self.history[s].append(text)
            self.turn_counts["turns"][rows] += 1
            if self._turn_steps:
                self._score_turn_steps(rows, reward)
        if self._pool is None and self.task.reply_timeout is not None:
            self._pool = DaemonPool(max_workers=min(32, self.num_envs))
        term, trunc = term_now.clone(), trunc_now.clone()
        if self.task.reply_grace is None or self._pool is None:  # every reply of this step, now
            answers = ask_all(self.task, self._pool, [(self.samples[s], self.history[s]) for s in rows])
            results = [(s, rep, err) for s, (rep, err) in zip(rows, answers)]
        else:  # a slow reply leaves its row waiting while the other rows go on
            now = time.monotonic()
            for s in rows:
                self._pending[s] = (self._pool.submit(answer_one, self.task, self.samples[s], list(self.history[s])),
                                    now + float(self.task.reply_timeout))
            if rows:
                self.waiting[rows] = True
                term[rows] = False
            live = bool((active & ~term & ~trunc & ~self.waiting).any())
            results = self._collect_pending(self.task.reply_grace if live else None)
        count, any_end = self.turn_counts, False
        ends, lasts = self.gen_len.tolist(), self.last_action.tolist()
        ids_of = dict(zip([s for s, rep, _ in results if not rep.done],
                          self._reply_ids([(rep, err) for _, rep, err in results if not rep.done])))
        for s, rep, err in results:
            end, last = ends[s], lasts[s]
            if err:
                count[err][s] += 1
            if rep.event:
                count[rep.event][s] += 1
            if rep.reward:
                self.turn_rewards[s, last] += float(rep.reward)
                self.rewards[s, last] += float(rep.reward)
                reward[s] += float(rep.reward)
            if rep.done:
                term[s], any_end = True, True
                if rep.text:
                    self.history[s].append(rep.text)
                continue
            term[s] = False
            ids = ids_of[s]
            if self.task.max_turns is not None and len(self.history[s]) // 2 + 1 >= self.task.max_turns:
                trunc[s], any_end = True, True
                count["max_turns"][s] += 1
            elif len(ids) >= M - end:  # no room for the reply and one more agent token
                trunc[s], any_end = True, True
                count["reply_overflows"][s] += 1
            else:
                cols = torch.arange(P + end, P + end + len(ids), device=self.device)
                self.tokens[s, cols] = torch.tensor(ids, dtype=torch.long, device=self.device)
                self.attention_mask[s, cols] = True
                self.gen_len[s] = end + len(ids)
                self.turn_start[s] = end + len(ids)
                if self.masker is not None:  # the next agent turn starts under its own grammar
                    self.masker.next_turn([s], [int(self.turn_counts["turns"][s])])
                self.reply_len[s] = len(ids)
                count["replies"][s] += 1
                self.replied.append(s)
                self.history[s].append(rep.text if rep.text is not None else self.tokenizer.decode(ids, skip_special_tokens=True))
        return term, trunc, any_end

    def _collect_pending(self, wait: float | None) -> list[tuple[int, Reply, str | None]]:
        """Replies still out that are in (after up to ``wait`` seconds; ``None``: until one is in or past its time limit,
        because no row could act meanwhile), and those past ``reply_timeout`` as error messages."""
        if not self._pending:
            return []
        futures = [f for f, _ in self._pending.values()]
        if wait is None:
            soonest = min(d for _, d in self._pending.values())
            cf.wait(futures, timeout=max(soonest - time.monotonic(), 0.0), return_when=cf.FIRST_COMPLETED)
        else:
            cf.wait(futures, timeout=wait)
        now, results = time.monotonic(), []
        for s, (f, deadline) in sorted(self._pending.items()):
            if f.done():
                rep, err = f.result()
            elif now >= deadline:
                rep, err = timed_out(self.task)
            else:
                continue
            del self._pending[s]
            self.waiting[s] = False
            results.append((s, rep, err))
        return results

    def _reply_ids(self, replies: list[tuple[Reply, bool]]) -> list[list[int]]:
        """The token ids of each ``(reply, its error kind or None)`` (between the chat template's role markers in chat
        tasks), checked; the texts go through the tokenizer in one call."""
        out: list[list[int] | None] = []
        texts: list[str] = []
        for rep, err in replies:
            if rep.ids is not None:
                ids = [int(i) for i in rep.ids]
                bad = [i for i in ids if not 0 <= i < self.vocab_size]
                if bad:
                    raise ValueError(f"task {self.task.name!r} replied with token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
                out.append(ids)
                continue
            text = str(rep.text)
            for m in self._markers:
                if m in text:
                    if not err:
                        raise ValueError(f"task {self.task.name!r} replied {text[:60]!r}, which contains the end-of-turn "
                                         f"marker {m!r}: the agent's next turn would look ended; escape or drop it in respond()")
                    text = text.replace(m, "")  # an error message quoting the agent
            texts.append(text)
            out.append(None)
        if not texts:
            return out
        # the env's own text (the chat template's role markers) may hold special tokens; the task's text never does:
        # a tool echoing "<eos>" or a role marker appends those characters, not the tokens
        before, after = self._wrap_ids
        encoded = iter(self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        return [ids if ids is not None else before + list(next(encoded)) + after for ids in out]
