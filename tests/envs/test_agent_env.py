"""Agents written against the OpenAI client as token envs: the real ``openai`` package over real loopback HTTP.

The tokens of an episode are the prompt the first call rendered, the model's sampled turns, and each later call's
added messages tokenized as a delta; nothing the model generated is re-tokenized. Bad agents end their own episode,
counted, and the batch goes on."""

import json
import math
import time

import numpy as np
import openai
import pytest
import torch

from tokengym.agents import Policy
from tokengym.agents.engine.rollout import collect, trimmed_logprobs, turn_metrics
from tokengym.envs import AgentTask, TokenVectorEnv, char_tokenizer, check_vector_env, resolve_task
from tokengym.envs.adapters import PlainFormat, TagTools, TemplateFormat
from tokengym.envs.openai_api import HermesTools

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALC = {"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tok():
    t = char_tokenizer()
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = CHATML
    t.eos_token = t.pad_token = "<|im_end|>"
    return t


def script(env, turns):
    """Drive a 1-row env with the given token ids as the model's turns; returns the per-turn ids."""
    env.reset(seed=0)
    for ids in turns:
        for a in ids:
            if bool(env.terminated[0] | env.truncated[0]):
                return
            env.step(torch.tensor([a]))


def episode_ids(env):
    P = env.max_prompt_len
    prompt = env.tokens[0, :P][env.attention_mask[0, :P]].tolist()
    gen = env.tokens[0, P:P + int(env.gen_len[0])].tolist()
    acts = env.action_mask[0, P:P + int(env.gen_len[0])].tolist()
    return prompt, gen, acts


def test_every_trained_token_is_the_sampled_token_across_tool_results(tok):
    seen = {}

    def agent(client, sample):
        messages = [{"role": "user", "content": sample["q"]}]
        r = client.chat.completions.create(model="tokengym", messages=messages, tools=[ADD])
        seen["first"] = r
        call = r.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": f"{args['a'] + args['b']} <|im_end|>"}]
        r = client.chat.completions.create(model="tokengym", messages=messages, tools=[ADD])
        seen["second"] = r
        return float(r.choices[0].message.content == "It is 5")

    task = AgentTask(agent, [{"q": "add 2 and 3"}], max_new_tokens=160, transport="http")
    env = TokenVectorEnv(1, task, tokenizer=tok)
    assert isinstance(task.format, TemplateFormat) and not task.format.renders_tools  # tools go to a system message
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    turn1 = tok(call_text, add_special_tokens=False)["input_ids"] + [eot]
    turn2 = tok("It is 5", add_special_tokens=False)["input_ids"] + [eot]
    script(env, [turn1, turn2])
    prompt, gen, acts = episode_ids(env)
    want_prompt = tok.apply_chat_template([{"role": "system", "content": HermesTools().system_text([ADD])},
                                           {"role": "user", "content": "add 2 and 3"}], add_generation_prompt=True,
                                          tokenize=False)
    assert tok.decode(prompt) == want_prompt
    delta = gen[len(turn1):len(gen) - len(turn2)]
    assert gen[:len(turn1)] == turn1 and gen[len(gen) - len(turn2):] == turn2  # the sampled ids, as sampled
    assert acts == [True] * len(turn1) + [False] * len(delta) + [True] * len(turn2)
    assert tok.decode(delta) == "\n<|im_start|>tool\n5 <|im_end|><|im_end|>\n<|im_start|>assistant\n"
    assert delta.count(eot) == 1  # the tool's "<|im_end|>" text stays characters; only the template's is the token
    first, second = seen["first"].choices[0], seen["second"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == [
        ("add", {"a": 2, "b": 3})]
    assert second.finish_reason == "stop" and second.message.content == "It is 5"
    assert seen["second"].usage.completion_tokens == len(turn2) - 1  # its text's tokens (the end-of-turn is not text)
    assert bool(env.terminated[0]) and float(env.rewards[0].sum()) == 1.0


def test_a_history_rewrite_is_refused_naming_the_turn_and_the_trained_tokens_stay_the_sampled_ones(tok):
    got = {}

    def agent(client, sample):
        r = client.chat.completions.create(model="tokengym", messages=[{"role": "user", "content": "hi"}])
        try:  # a summarising agent: it drops the first user message
            client.chat.completions.create(model="tokengym", messages=[
                {"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}])
        except openai.BadRequestError as e:
            got["error"] = e.body["message"] if isinstance(e.body, dict) else str(e)
            raise
        return 1.0

    task = AgentTask(agent, [{}], max_new_tokens=40, transport="http")
    env = TokenVectorEnv(1, task, tokenizer=tok)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = tok("hello", add_special_tokens=False)["input_ids"] + [eot]
    with pytest.warns(Warning, match=r"turn 2: the call's messages do not extend the episode's conversation \(message 0"):
        script(env, [turn1])
    prompt, gen, acts = episode_ids(env)
    assert gen == turn1 and all(acts) and bool(env.terminated[0])  # nothing appended after the refused call
    assert int(env.turn_counts["agent_errors"][0]) == 1 and float(env.rewards[0].sum()) == 0.0
    for _ in range(200):  # the agent's thread takes the refusal on its own time
        if "error" in got:
            break
        time.sleep(0.05)
    assert got["error"].startswith("turn 2: the call's messages do not extend")


def calculator_agent(client, sample):
    """The Calculator task as an OpenAI-client agent with a ``calculate`` tool (tiny-calculator's own format)."""
    messages = [{"role": "user", "content": sample["prompt"].strip()}]
    for _ in range(6):
        r = client.chat.completions.create(model="tokengym", messages=messages, tools=[CALC])
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            try:
                value = str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and + only here
            except Exception:
                value = "error"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
    return float((message.content or "").strip().endswith(f"A: {sample['answer']}"))


CALC_FORMAT = PlainFormat(TagTools("<calc>", "</calc>", "calculate", "expression"), prefix={"tool": "="})


def test_agent_rollout_logprobs_equal_a_trainer_forward_and_the_env_passes_the_checker():
    policy = Policy.from_pretrained("tiny-calculator", seed=0)
    task = AgentTask(calculator_agent, resolve_task("calculator"), format=CALC_FORMAT, max_new_tokens=64)
    env = TokenVectorEnv(8, task, tokenizer=policy.tokenizer, group_size=2)
    ro = collect(env, policy, seed=0)
    full = trimmed_logprobs(policy, ro).detach()
    assert float(((full - ro.logprobs) * ro.action_mask).abs().max()) < 1e-4  # fp32: rounding only
    assert bool((ro.logprobs[ro.action_mask == 0] == 0).all())
    m = turn_metrics(ro)
    assert m["agent/errors"] == 0.0 and m["agent/timeouts"] == 0.0
    check_vector_env(TokenVectorEnv(2, AgentTask(calculator_agent, resolve_task("calculator"), format=CALC_FORMAT,
                                                 max_new_tokens=64), tokenizer=policy.tokenizer))


KINDS = ["ok", "nocall", "raise", "hang", "nan", "str", "model", "overflow"]


def bad_agent(client, sample):
    kind = sample["kind"]
    if kind == "nocall":
        return 1.0
    model = "gpt-4o" if kind == "model" else "tokengym"
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "1+1"}])
    if kind == "raise":
        raise ValueError("the agent's own bug")
    if kind == "hang":
        time.sleep(3600)
    if kind == "overflow":
        client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": "1+1"}, r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "9" * 500}])
    return {"ok": 1.0, "nan": math.nan, "str": "good"}.get(kind, 0.0)


@pytest.mark.parametrize("transport", ["http", "inproc", "auto"])
def test_bad_agents_each_end_their_own_episode_counted_and_the_batch_goes_on(transport):
    policy = Policy.from_pretrained("tiny-calculator", seed=0)
    with pytest.warns(Warning):  # each bad agent warns one line naming what it did
        task = AgentTask(bad_agent, [{"kind": "ok"}], eval_data=[{"kind": k} for k in KINDS], turn_timeout=2.0,
                         transport=transport, max_new_tokens=64)
        env = TokenVectorEnv(len(KINDS), task, tokenizer=policy.tokenizer)
        ro = collect(env, policy, seed=0, samples=task.heldout_batch(len(KINDS), 0))
    counts = {k: v.tolist() for k, v in ro.turn_counts.items()}
    errors = [int(k in ("nocall", "raise", "nan", "str", "model")) for k in KINDS]
    assert counts["agent_errors"] == errors
    assert counts["agent_timeouts"] == [int(k == "hang") for k in KINDS]
    assert counts["reply_overflows"] == [int(k == "overflow") for k in KINDS]
    assert ro.outcome.tolist() == [1.0] + [0.0] * (len(KINDS) - 1)  # the good agent's reward, the rest 0
    m = turn_metrics(ro)
    assert m["agent/errors"] == 5.0 and m["agent/timeouts"] == 1.0 and m["env/reply_overflows"] == 1.0


def test_an_async_agent_runs_on_the_event_loop():
    policy = Policy.from_pretrained("tiny-calculator", seed=0)

    async def agent(client, sample):
        assert isinstance(client, openai.AsyncOpenAI)
        r = await client.chat.completions.create(model="tokengym", messages=[{"role": "user", "content": "2+3"}])
        return float(r.choices[0].message.content.strip().endswith("A: 5"))

    env = TokenVectorEnv(4, AgentTask(agent, [{}], max_new_tokens=32), tokenizer=policy.tokenizer)
    ro = collect(env, policy, seed=0, greedy=True)
    texts = policy.tokenizer.batch_decode([ro.tokens[i, ro.prompt_len:][ro.action_mask[i]] for i in range(4)])
    assert ro.outcome.tolist() == [float(t.strip().endswith("A: 5")) for t in texts]
    assert turn_metrics(ro)["agent/errors"] == 0.0


def test_settings_that_cannot_work_are_refused_in_one_line(tok):
    with pytest.raises(ValueError, match=r"^agent must be a function agent\(client, sample\), got 3$"):
        AgentTask(3, [{}])

    def bad_tools(client, sample):
        client.chat.completions.create(model="tokengym", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {
                                           "type": "array"}}}])

    with pytest.raises(ValueError, match=r"^agent env 'agent/bad_tools': its first call was refused: tools\[0\] \(f\): "
                                         r"parameters must be a JSON schema of type 'object'"):
        TokenVectorEnv(1, AgentTask(bad_tools, [{}]), tokenizer=tok)


def test_a_masked_tool_call_always_parses_against_its_schema():
    """Under ``constrain_tools`` each turn is text without ``<`` or calls of ``add`` whose arguments are exactly the
    schema's (two integers, nothing else): actions drawn at random from the env's masks (leaning to ``<`` and to the
    end of turn, so that calls start and finish), 24 episodes. A rollout keeps the masks for the trainer."""
    pytest.importorskip("llguidance")
    policy = Policy.from_pretrained("tiny", seed=3)
    tok = policy.tokenizer
    calls = []

    def agent(client, sample):
        r = client.chat.completions.create(model="tokengym", messages=[{"role": "user", "content": "add"}], tools=[ADD])
        calls.extend(r.choices[0].message.tool_calls or [])
        return 0.0

    task = AgentTask(agent, [{}], format=PlainFormat(HermesTools()), constrain_tools=True, max_new_tokens=160)
    assert collect(TokenVectorEnv(2, task, tokenizer=tok), policy, seed=0).token_masks is not None
    env = TokenVectorEnv(24, task, tokenizer=tok)
    rng, lt, eos = np.random.default_rng(0), tok.convert_tokens_to_ids("<"), tok.eos_token_id
    env.reset(seed=1)
    while not bool((env.terminated | env.truncated).all()):
        allowed = env.action_masks().numpy()
        acts = []
        for row in allowed:
            ids = np.flatnonzero(row)
            lean = [i for i in (lt, eos) if row[i]]
            acts.append(int(rng.choice(lean)) if lean and rng.random() < 0.5 else int(rng.choice(ids)))
        env.step(torch.tensor(acts))
    texts = [tok.decode(env.tokens[i][env.action_mask[i]].tolist(), skip_special_tokens=True) for i in range(24)]
    assert sum("<tool_call>" in t for t in texts) >= 4 and all("<" not in t for t in texts if "<tool_call>" not in t)
    assert len(calls) >= 2  # finished calls (the others ran out of budget mid-call)
    for c in calls:
        args = json.loads(c.function.arguments)
        assert c.function.name == "add" and set(args) == {"a", "b"} and all(type(v) is int for v in args.values())


def test_the_calculator_as_an_agent_is_the_native_env_token_for_token():
    """Same samples in the same order (the agent env draws from the env's generator through the task), the same
    prompt and reply tokens, so a sampled rollout of tiny-calculator (seeded alike) is the native Calculator-v0's,
    token for token, calls and replies included, with the same rewards."""
    policy = Policy.from_pretrained("tiny-calculator", seed=0)
    native = TokenVectorEnv(48, "calculator")
    a = collect(native, policy, seed=0)
    policy = Policy.from_pretrained("tiny-calculator", seed=0)  # its sampler's stream from the start again
    agent = TokenVectorEnv(48, AgentTask(calculator_agent, resolve_task("calculator"), format=CALC_FORMAT,
                                         max_new_tokens=native.max_new_tokens, max_turns=6), tokenizer=policy.tokenizer,
                           max_prompt_len=native.max_prompt_len)  # the same padding: the same float rounding
    b = collect(agent, policy, seed=0)
    assert [s["prompt"] for s in native.samples] == [s["prompt"] for s in agent.samples]
    P, Q = a.prompt_len, b.prompt_len
    for i in range(48):
        want = a.tokens[i, P:][a.attention_mask[i, P:]]
        assert torch.equal(b.tokens[i, Q:][b.attention_mask[i, Q:]], want), i
        assert torch.equal(b.action_mask[i][b.action_mask[i]], a.action_mask[i][a.action_mask[i]])
    assert a.turn_stats["replies"] > 0 and torch.equal(a.outcome, b.outcome)


def test_a_turn_cut_by_the_budget_returns_finish_reason_length_with_its_text(tok):
    got = {}

    def agent(client, sample):
        r = client.chat.completions.create(model="tokengym", messages=[{"role": "user", "content": "go"}])
        got["choice"] = r.choices[0]
        return 0.5

    env = TokenVectorEnv(1, AgentTask(agent, [{}], max_new_tokens=4), tokenizer=tok)
    script(env, [tok("abcdefgh", add_special_tokens=False)["input_ids"]])
    for _ in range(200):
        if "choice" in got:
            break
        time.sleep(0.05)
    assert bool(env.truncated[0]) and got["choice"].finish_reason == "length"
    assert got["choice"].message.content == "abcd"


def test_an_agent_in_another_process_reaches_its_episode_by_base_url():
    """The endpoint is real HTTP (by default the agent's own client skips the socket, and its ``base_url`` is the
    endpoint's): the agent function hands ``base_url`` and the key to a program in another process (any language with
    an HTTP client), whose calls are the episode's turns as an in-process agent's are."""
    import subprocess
    import sys

    program = ("import sys, openai\n"
               "c = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2])\n"
               "r = c.chat.completions.create(model='tokengym', messages=[{'role': 'user', 'content': sys.argv[3]}])\n"
               "print(r.choices[0].message.content)\n")

    def agent(client, sample):
        out = subprocess.run([sys.executable, "-c", program, str(client.base_url), client.api_key, sample["prompt"]],
                             capture_output=True, text=True, check=True).stdout
        return float(out.strip().endswith(f"A: {sample['answer']}"))

    policy = Policy.from_pretrained("tiny-calculator", seed=0)
    task = AgentTask(agent, [{"prompt": "2+3", "answer": 5}, {"prompt": "40+2", "answer": 42}], max_new_tokens=24)
    env = TokenVectorEnv(2, task, tokenizer=policy.tokenizer)
    ro = collect(env, policy, seed=0, greedy=True, samples=task.batch(np.random.default_rng(0), 2))
    texts = policy.tokenizer.batch_decode([ro.tokens[i, ro.prompt_len:][ro.action_mask[i]] for i in range(2)],
                                          skip_special_tokens=True)
    answers = [s["prompt"] for s in env.samples]
    assert ro.outcome.tolist() == [float(t.strip().endswith(f"A: {eval(p)}")) for t, p in zip(texts, answers)]
    assert turn_metrics(ro)["agent/errors"] == 0.0
