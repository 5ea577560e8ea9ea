"""An LLM judge as an outcome reward: a model behind an OpenAI-compatible URL reads each (prompt, completion) through a
prompt template and answers a verdict, which a parser turns into a reward.

A judge that cannot answer (a timeout after its retries, an HTTP error, a verdict the parser cannot read) never stops a
run and never hands on a NaN: the episode scores 0 and counts in ``judge/errors``; with ``on_error="drop"`` it is also
flagged :data:`~tokengym.rewards.protocols.DROP`, and the on-policy trainers leave its group out of the update. The
counters (``judge/errors``, ``judge/requests``, ``judge/cache_hits``) travel as per-episode reward components, which the
trainers sum into each step's metrics.
"""

from __future__ import annotations

import math
import re
import string
import warnings
from typing import Any, Callable

from .common import TokengymWarning
from .judge_http import JudgeClient, read_api_key
from .protocols import DROP

__all__ = ["JudgeReward", "judge_reward", "score_verdict", "yes_no_verdict", "JUDGE_TEMPLATE", "JUDGE_REFERENCE_TEMPLATE"]

JUDGE_TEMPLATE = (
    "You are grading an answer to a task.\n\nTask:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Rate the answer from 0 (wrong or useless) to 10 (correct and complete). "
    "End your reply with one line: Score: N"
)
"""The default template: asks for a 0-10 score on a ``Score: N`` line (read by :func:`score_verdict`)."""

JUDGE_REFERENCE_TEMPLATE = (
    "You are grading an answer to a task against the reference answer.\n\nTask:\n{prompt}\n\n"
    "Reference answer:\n{reference}\n\nAnswer:\n{completion}\n\n"
    "Rate the answer from 0 (wrong) to 10 (agrees with the reference and is complete). "
    "End your reply with one line: Score: N"
)
"""A template for tasks with an answer (``{reference}``: the task field ``reference_field``, ``answer`` by default)."""

_SCORE_LINE = re.compile(r"score\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\W*(yes|no)\b", re.IGNORECASE)
ON_ERROR = ("zero", "drop")


def score_verdict(text: str, max_score: float = 10.0) -> float:
    """A verdict's score scaled to [0, 1]: the last ``Score: N`` line, or else a reply that is only a number, with N in
    ``[0, max_score]``. ValueError for anything else (no number, out of range)."""
    found = _SCORE_LINE.findall(text)
    if found:
        raw = found[-1]
    elif _NUMBER.fullmatch(text.strip().rstrip(".")):
        raw = text.strip().rstrip(".")
    else:
        raise ValueError(f"no 'Score: N' line in the verdict {text[:80]!r}")
    value = float(raw)
    if not 0 <= value <= max_score:
        raise ValueError(f"score {raw} is outside [0, {max_score:g}]")
    return value / max_score


def yes_no_verdict(text: str) -> float:
    """1.0 for a verdict that starts with "yes", 0.0 for "no" (any case, after punctuation); ValueError otherwise."""
    m = _YES_NO.match(text)
    if m is None:
        raise ValueError(f"the verdict {text[:80]!r} does not start with yes or no")
    return 1.0 if m.group(1).lower() == "yes" else 0.0


def _template_fields(template: str) -> set[str]:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ValueError(f"template is not a str.format template: {e}") from None
    if "" in names or any(n.isdigit() for n in names):
        raise ValueError("template: use named fields ({prompt}, {completion}, {reference}, a task field), not {} or {0}")
    return {re.split(r"[.\[]", n)[0] for n in names}


class JudgeReward:
    """An outcome reward scored by an LLM judge behind an OpenAI-compatible ``base_url`` (see the module docstring).

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is added).
        model: the judge's model name.
        template: a ``str.format`` template with ``{prompt}``, ``{completion}`` and optionally ``{reference}`` or any
            task field (``{answer}``); default :data:`JUDGE_TEMPLATE`.
        parser: the verdict's reward: ``"score"`` (:func:`score_verdict`, 0-10 -> [0, 1]), ``"yes_no"``
            (:func:`yes_no_verdict`) or a callable ``str -> float`` that raises ValueError (or returns None) for a
            verdict it cannot read.
        on_error: ``"zero"`` (a failed episode scores 0) or ``"drop"`` (it scores 0 and is flagged :data:`DROP`: the
            on-policy trainers leave its group out of the update). Either way it counts in ``judge/errors``.
        reference_field: the task field that fills ``{reference}``.
        api: ``"chat"`` (``/chat/completions``, the template as one user message) or ``"completions"`` (text).
        max_tokens: the judge's reply length.
        temperature: the judge's sampling temperature (greedy by default: the cache assumes it).
        max_concurrency: requests in flight at once.
        timeout: seconds per request.
        retries: further tries of a request that timed out, lost its connection or got 408/409/429/5xx, after
            ``backoff * 2**k`` seconds.
        backoff: the first retry's wait in seconds.
        api_key_env: the environment variable holding the API key (unset: no key).
        api_key_file: a file holding the key instead (refused when every user may read it).
        cache_size: answered requests kept (0: no cache); a cached request is not sent again.
        name: the reward's name in logs.
    """

    def __init__(self, base_url: str, model: str, *, template: str = JUDGE_TEMPLATE, parser: str | Callable = "score",
                 on_error: str = "zero", reference_field: str = "answer", api: str = "chat", max_tokens: int = 256,
                 temperature: float = 0.0, max_concurrency: int = 8, timeout: float = 60.0, retries: int = 2,
                 backoff: float = 0.5, api_key_env: str | None = "OPENAI_API_KEY", api_key_file: str | None = None,
                 cache_size: int = 100_000, name: str = "judge"):
        if not isinstance(base_url, str) or not re.match(r"https?://", base_url):
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be the judge's model name, got {model!r}")
        if not isinstance(template, str):
            raise TypeError(f"template must be a str.format string, got {type(template).__name__}")
        fields = _template_fields(template)
        if not {"completion"} <= fields:
            raise ValueError("template must contain {completion} (what is judged)")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {api!r}")
        parsers = {"score": score_verdict, "yes_no": yes_no_verdict}
        if isinstance(parser, str) and parser not in parsers:
            raise ValueError(f"parser must be one of {sorted(parsers)} or a callable str -> float, got {parser!r}")
        if not isinstance(parser, str) and not callable(parser):
            raise TypeError(f"parser must be a name or a callable str -> float, got {type(parser).__name__}")
        for what, v, ok in (("max_concurrency", max_concurrency, max_concurrency >= 1 if _is_int(max_concurrency) else False),
                            ("retries", retries, retries >= 0 if _is_int(retries) else False),
                            ("max_tokens", max_tokens, max_tokens >= 1 if _is_int(max_tokens) else False),
                            ("cache_size", cache_size, cache_size >= 0 if _is_int(cache_size) else False),
                            ("timeout", timeout, _is_num(timeout) and timeout > 0),
                            ("backoff", backoff, _is_num(backoff) and backoff >= 0),
                            ("temperature", temperature, _is_num(temperature) and temperature >= 0)):
            if not ok:
                raise ValueError(f"{what} has an invalid value: {v!r}")
        if api_key_file is not None and api_key_env not in (None, "OPENAI_API_KEY"):
            raise ValueError("give api_key_env or api_key_file, not both")
        self.model, self.template, self.template_fields = model, template, fields
        self.parser = parsers[parser] if isinstance(parser, str) else parser
        self.on_error, self.reference_field, self.api, self.name = on_error, reference_field, api, name
        self.max_tokens, self.temperature = max_tokens, float(temperature)
        url = base_url.rstrip("/") + ("/chat/completions" if api == "chat" else "/completions")
        self.client = JudgeClient(url, api_key=read_api_key(api_key_env, api_key_file), timeout=float(timeout),
                                  retries=retries, backoff=float(backoff), max_concurrency=max_concurrency,
                                  cache_size=cache_size)
        self.totals = {"judge/requests": 0, "judge/cache_hits": 0, "judge/errors": 0}
        """Counts since the reward was made (the per-batch ones are its components)."""
        self._warned = False

    def __repr__(self) -> str:
        return f"JudgeReward({self.client.url!r}, model={self.model!r}, on_error={self.on_error!r})"

    def request(self, prompt: str, completion: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The request body judging one completion (the cache's key, with the URL)."""
        values = dict(fields, prompt=prompt, completion=completion)
        if "reference" in self.template_fields:
            if fields.get(self.reference_field) is None:
                raise ValueError(f"template uses {{reference}} but the task has no {self.reference_field!r} field "
                                 f"(its fields: {sorted(fields)}); set reference_field")
            values["reference"] = fields[self.reference_field]
        try:
            text = self.template.format(**values)
        except (KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"template field {e} is not a task field (fields: prompt, completion, reference, "
                             f"{', '.join(sorted(fields))})") from None
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    def _verdict(self, text: str) -> tuple[float, str | None]:
        try:
            value = self.parser(text)
            if value is None:
                raise ValueError(f"the parser could not read the verdict {text[:80]!r}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"the parser returned {value} for the verdict {text[:80]!r}")
            return value, None
        except (ValueError, TypeError) as e:
            return 0.0, f"unparseable verdict: {e}"

    def components(self, prompts: list[str], completions: list[str], **fields: Any) -> dict[str, list[float]]:
        """Per episode: the reward (under :attr:`name`), the counters ``judge/errors``, ``judge/requests`` (tries
        sent), ``judge/cache_hits``, and with ``on_error="drop"`` the :data:`DROP` flag."""
        n = len(completions)
        rows = [{k: v[i] for k, v in fields.items()} for i in range(n)]
        answers = self.client.ask([self.request(p, c, f) for p, c, f in zip(prompts, completions, rows)])
        scores, errors, first_error = [], [], None
        for a in answers:
            value, err = self._verdict(a.text) if a.error is None else (0.0, a.error)
            scores.append(value)
            errors.append(float(err is not None))
            first_error = first_error or err
        out = {self.name: scores, "judge/errors": errors, "judge/requests": [float(a.requests) for a in answers],
               "judge/cache_hits": [float(a.cached) for a in answers]}
        for k in self.totals:
            self.totals[k] += int(sum(out[k]))
        if self.on_error == "drop":
            out[DROP] = list(errors)
        if first_error and not self._warned:
            self._warned = True
            warnings.warn(f"judge {self.client.url}: {first_error} (such episodes score 0"
                          f"{' and leave the update' if self.on_error == 'drop' else ''}; counted in judge/errors, "
                          "this warning is not repeated)", TokengymWarning, stacklevel=2)
        return out

    def combine(self, components: dict[str, Any]) -> Any:
        """The reward of :meth:`components` (the counters are not part of it)."""
        return components[self.name]

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        return self.components(prompts, completions, **fields)[self.name]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def judge_reward(base_url: str, model: str, **kwargs: Any) -> JudgeReward:
    """An LLM judge as an outcome reward; see :class:`JudgeReward`."""
    return JudgeReward(base_url, model, **kwargs)
