"""JudgeReward (rewards/judge.py, rewards/judge_http.py) against a scripted OpenAI-compatible server on 127.0.0.1: the
verdict parsers, the cache, the concurrency bound, retries then an error, on_error, the API key's sources."""

import importlib.util
import os
import pathlib
import pickle
import warnings

import pytest
from hypothesis import given, strategies as st

from tokengym.rewards import DROP, JudgeReward, score_outcome, score_verdict, weighted_sum, yes_no_verdict
from tokengym.rewards.common import TokengymWarning

_spec = importlib.util.spec_from_file_location("_judge_server", pathlib.Path(__file__).parent / "_judge_server.py")
js = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(js)


def judge(url, **kw):
    kw = {"template": "{completion}", "timeout": 0.5, "retries": 0, "backoff": 0.0, **kw}
    return JudgeReward(url, "scripted", **kw)


@pytest.mark.parametrize("text, value", [
    ("Score: 7", 0.7), ("reasoning...\nScore: 10", 1.0), ("score = 0", 0.0), ("**Score:** 3.5", 0.35),
    ("Score: 2\nOn reflection, Score: 9", 0.9), ("8", 0.8), ("  6.\n", 0.6),
])
def test_score_verdict_table(text, value):
    assert score_verdict(text) == pytest.approx(value, abs=1e-12)


@pytest.mark.parametrize("text", ["Score: 11", "Score: -1", "great answer", "", "7 out of 10", "Score: nan"])
def test_score_verdict_refuses(text):
    with pytest.raises(ValueError):
        score_verdict(text)


@given(st.integers(0, 10), st.text(alphabet="abc \n", max_size=20))
def test_score_verdict_reads_any_score_line(n, before):
    assert score_verdict(f"{before}\nScore: {n}") == pytest.approx(n / 10)


@pytest.mark.parametrize("text, value", [("Yes.", 1.0), ("no, because", 0.0), ("  YES", 1.0), ("**No**", 0.0)])
def test_yes_no_verdict(text, value):
    assert yes_no_verdict(text) == value
    with pytest.raises(ValueError):
        yes_no_verdict("maybe yes")


def test_scores_reach_the_reward_and_identical_requests_are_sent_once():
    comps = ["a", "bbb", "a", "cc", "bbb"]
    with js.ScriptedJudge() as srv:
        j = judge(srv.url)
        total, parts = score_outcome(j, ["p"] * 5, comps)
        assert total.tolist() == pytest.approx([len(c) % 11 / 10 for c in comps])
        assert srv.count == 3 and sorted(srv.texts) == ["a", "bbb", "cc"]  # one request per distinct completion
        assert parts["judge/requests"].tolist() == [1, 1, 0, 1, 0]
        assert parts["judge/cache_hits"].tolist() == [0, 0, 1, 0, 1]
        total2, parts2 = score_outcome(j, ["p"] * 2, ["cc", "dddd"])  # a later batch: "cc" from the cache
        assert srv.count == 4 and total2.tolist() == pytest.approx([0.2, 0.4])
        assert parts2["judge/cache_hits"].tolist() == [1, 0]
        assert j.totals == {"judge/requests": 4, "judge/cache_hits": 3, "judge/errors": 0}
        other = judge(srv.url, template="Q: {prompt} A: {completion}")  # the key is the full request
        other(["p", "q"], ["a", "a"])
        assert srv.count == 6 and srv.texts[-2:] != ["a", "a"]


def test_at_most_max_concurrency_requests_in_flight():
    with js.ScriptedJudge(hold=3) as srv:  # each request waits until 3 are in flight (or 2 s)
        j = judge(srv.url, max_concurrency=3, timeout=5.0)
        j(["p"] * 6, [c * 2 for c in "abcdef"])
        assert srv.count == 6 and srv.max_in_flight == 3
    with js.ScriptedJudge(hold=2, hold_s=0.3) as srv:
        judge(srv.url, max_concurrency=1, timeout=5.0)(["p"] * 3, ["x", "y", "z"])
        assert srv.count == 3 and srv.max_in_flight == 1


def test_retries_then_an_error_counted_as_zero():
    with js.ScriptedJudge(statuses=[503, 503, 200]) as srv:  # two failures, then an answer
        j = judge(srv.url, retries=2)
        total, parts = score_outcome(j, ["p"], ["abcd"])
        assert total.tolist() == pytest.approx([0.4]) and srv.count == 3
        assert parts["judge/requests"].tolist() == [3] and parts["judge/errors"].tolist() == [0]
    with js.ScriptedJudge(hang_every=1, hang_s=1.0) as srv:  # every request times out
        j = judge(srv.url, retries=1, timeout=0.3)
        with pytest.warns(TokengymWarning, match=r"timed out after 0.3 s .*judge/errors"):
            total, parts = score_outcome(j, ["p", "p"], ["a", "b"])
        assert total.tolist() == [0.0, 0.0] and srv.count == 4  # 2 requests x (1 + 1 retry)
        assert parts["judge/errors"].tolist() == [1, 1] and parts["judge/requests"].tolist() == [2, 2]
        assert DROP not in parts  # on_error="zero"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once; a failed request is not cached: it is sent again
            score_outcome(j, ["p"], ["a"])
        assert srv.count == 6
    with js.ScriptedJudge(statuses=[400, 400]) as srv:  # a client error is final: no retry
        j = judge(srv.url, retries=3)
        with pytest.warns(TokengymWarning, match="HTTP 400"):
            assert j(["p"], ["a"]) == [0.0]
        assert srv.count == 1


def test_unparseable_verdicts_and_drop():
    verdicts = {"a": "Score: 4", "b": "I cannot decide", "c": "Score: 12", "d": "nan"}
    with js.ScriptedJudge(verdict=lambda t: verdicts[t]) as srv:
        j = judge(srv.url, on_error="drop", parser=lambda v: float(v.split(":")[-1]) / 10)
        with pytest.warns(TokengymWarning, match="unparseable verdict"):
            total, parts = score_outcome(j, ["p"] * 4, ["a", "b", "c", "d"])
        assert total.tolist() == pytest.approx([0.4, 0.0, 1.2, 0.0])  # its own parser: 12 is its business; nan is not
        assert parts["judge/errors"].tolist() == [0, 1, 0, 1] and parts[DROP].tolist() == [0, 1, 0, 1]
        j2 = judge(srv.url, on_error="drop")
        with pytest.warns(TokengymWarning):
            assert j2(["p"] * 4, ["a", "b", "c", "d"]) == pytest.approx([0.4, 0.0, 0.0, 0.0])


def test_weighted_sum_carries_the_judges_counters():
    with js.ScriptedJudge() as srv:
        r = weighted_sum({"judge": judge(srv.url, on_error="drop"), "len": lambda p, c, **_: [len(x) for x in c]},
                         weights={"judge": 10.0})
        total, parts = score_outcome(r, ["p"] * 2, ["abc", "abc"])
        assert total.tolist() == pytest.approx([6.0, 6.0])
        assert parts["judge/requests"].tolist() == [1, 0] and parts["judge/cache_hits"].tolist() == [0, 1]
        assert parts[DROP].tolist() == [0, 0] and parts["judge"].tolist() == pytest.approx([0.3, 0.3])


def test_reference_template_and_task_fields():
    with js.ScriptedJudge(verdict=lambda t: "Yes" if t.startswith("ref=3") else "No") as srv:
        j = judge(srv.url, template="ref={reference} q={prompt} a={completion}", parser="yes_no")
        assert j(["1+2", "1+1"], ["3", "3"], answer=[3, 2]) == [1.0, 0.0]
        assert sorted(srv.texts) == ["ref=2 q=1+1 a=3", "ref=3 q=1+2 a=3"]
        with pytest.raises(ValueError, match=r"no 'answer' field \(its fields: \['label'\]\); set reference_field"):
            j(["q"], ["a"], label=[1])
        assert judge(srv.url, template="{label}:{completion}", parser="yes_no")(["q"], ["a"], label=["x"]) == [0.0]
        with pytest.raises(ValueError, match="'nope' is not a task field"):
            judge(srv.url, template="{nope} {completion}")(["q"], ["a"])


@pytest.mark.parametrize("kw, match", [
    ({"on_error": "nan"}, "on_error must be one of"), ({"parser": "stars"}, "parser must be one of"),
    ({"template": "{prompt}"}, r"must contain \{completion\}"), ({"template": "{} {completion}"}, "named fields"),
    ({"max_concurrency": 0}, "max_concurrency"), ({"timeout": -1}, "timeout"), ({"retries": 1.5}, "retries"),
    ({"api": "responses"}, "api must be"),
])
def test_bad_settings_are_one_line(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        judge("http://127.0.0.1:9/v1", **kw)
    with pytest.raises(ValueError, match="base_url must be an http"):
        JudgeReward("127.0.0.1:8000", "m")


def test_api_key_from_env_or_private_file_never_shown(tmp_path, monkeypatch):
    secret = "sk-test-7f3a"
    monkeypatch.setenv("JUDGE_KEY", secret)
    with js.ScriptedJudge(statuses=[401]) as srv:
        j = judge(srv.url, api_key_env="JUDGE_KEY")
        with pytest.warns(TokengymWarning) as rec:
            j(["p"], ["a"])
        assert srv.auth == [f"Bearer {secret}"]
        copy = pickle.loads(pickle.dumps(j))  # what a rollout worker process gets: the key, not the cache
        assert copy.client._key == secret and copy.client._cache == {} and j.client._cache == {}
        shown = repr(j) + repr(j.client) + "".join(str(w.message) for w in rec) + repr(vars(copy))
        assert "401" in shown and secret not in shown
    f = tmp_path / "key"
    f.write_text(secret + "\n")
    os.chmod(f, 0o644)
    with pytest.raises(ValueError, match=r"readable by every user \(mode 644\); chmod 600 it"):
        judge("http://127.0.0.1:9/v1", api_key_file=str(f))
    os.chmod(f, 0o600)
    assert judge("http://127.0.0.1:9/v1", api_key_file=str(f)).client._key == secret
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert judge("http://127.0.0.1:9/v1").client._key is None  # unset: no Authorization header
    with pytest.raises(ValueError, match="cannot be read"):
        judge("http://127.0.0.1:9/v1", api_key_file=str(tmp_path / "missing"))
