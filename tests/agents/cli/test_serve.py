"""``tokengym serve`` (agents/engine/serving.py): the real ``openai`` client over loopback HTTP against a served policy.

tiny-arithmetic (no chat template) answers text completions, token for token as its own greedy generation, and
refuses chat; every refusal is one line with OpenAI's status. A chat's tool calls are checked end to end with fixed
generated tokens (a chat template given to the tiny tokenizer), and with SmolLM2-135M-Instruct where it is installed.
"""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading

import openai
import pytest
import torch

from tokengym.agents import Policy
from tokengym.agents.cli import main
from tokengym.agents.engine.convert import missing
from tokengym.agents.engine.generation import Generation
from tokengym.agents.engine.serving import PolicyServer, render_chat
from tokengym.envs.openai_api import HermesTools

SECRET = "serve-test-secret"
NAME = "tiny-arithmetic"


def serve(policy, name=NAME):
    """A :class:`PolicyServer` on a free loopback port, serving in a thread."""
    server = PolicyServer(policy, name, secret=SECRET.encode(), quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def client(server, key=SECRET):
    return openai.OpenAI(base_url=f"http://{server.address}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def tiny():
    policy = Policy.from_pretrained(NAME)
    server = serve(policy)
    yield policy, server, client(server)
    server.close()


def greedy_reference(policy, prompt, max_new_tokens):
    """The policy's own greedy continuation of ``prompt`` (transformers' ``generate``, not the server's decoder)."""
    tok = policy.tokenizer
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.inference_mode():
        out = policy.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return ids.shape[1], out[0, ids.shape[1]:].tolist()


def test_models_lists_the_served_model(tiny):
    _, _, c = tiny
    assert [m.id for m in c.models.list()] == [NAME]
    assert c.models.retrieve(NAME).owned_by == "tokengym"


@pytest.mark.parametrize("prompt, max_tokens", [("12+7\n", 32), ("305+68\n", 32), ("12+7\n", 3)])
def test_a_greedy_completion_is_the_policys_own_greedy_generation(tiny, prompt, max_tokens):
    policy, _, c = tiny
    n_prompt, ref = greedy_reference(policy, prompt, max_tokens)
    r = c.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=max_tokens)
    eos = policy.tokenizer.eos_token_id
    assert r.choices[0].text == policy.tokenizer.decode(ref, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref))  # the char tokenizer: 1:1
    assert r.choices[0].finish_reason == ("stop" if ref[-1] == eos else "length")
    assert r.choices[0].finish_reason == ("length" if max_tokens == 3 else "stop")


def test_token_id_prompts_seeds_and_stop_strings(tiny):
    policy, _, c = tiny
    ids = policy.tokenizer("12+7\n")["input_ids"]
    by_ids = c.completions.create(model=NAME, prompt=ids, temperature=0, max_tokens=32)
    assert by_ids.choices[0].text == c.completions.create(model=NAME, prompt="12+7\n", temperature=0,
                                                          max_tokens=32).choices[0].text
    seeded = [c.completions.create(model=NAME, prompt="12+7\n", seed=5, max_tokens=32).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]  # a sampled stream of its own: the same text again
    full = by_ids.choices[0].text
    cut = c.completions.create(model=NAME, prompt="12+7\n", temperature=0, max_tokens=32, stop=["\n"])
    assert cut.choices[0].text == full[: full.index("\n")] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == full.index("\n") + 1  # the tokens up to the one that wrote the stop string


@pytest.mark.parametrize("call, error, says", [
    (lambda c: c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}]),
     openai.BadRequestError, "model 'tiny-arithmetic' has no chat template: it serves /v1/completions only"),
    (lambda c: c.completions.create(model="gpt-4o", prompt="1+1\n"),
     openai.NotFoundError, "model 'gpt-4o' is not served here; this server serves 'tiny-arithmetic'"),
    (lambda c: c.models.retrieve("gpt-4o"), openai.NotFoundError, "model 'gpt-4o' is not served here"),
    (lambda c: c.completions.create(model=NAME, prompt="1+1\n", stream=True),
     openai.BadRequestError, "streaming is not supported here"),
    (lambda c: c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], stream=True),
     openai.BadRequestError, "streaming is not supported here"),
    (lambda c: c.completions.create(model=NAME, prompt="1+1\n", logprobs=2),
     openai.BadRequestError, "logprobs=2 is not supported here"),
    (lambda c: c.completions.create(model=NAME, prompt="1+1\n", extra_body={"top_k": 5}),
     openai.BadRequestError, "unknown parameter 'top_k'"),
    (lambda c: c.completions.create(model=NAME, prompt="1+1\n", max_tokens=10_000),
     openai.BadRequestError, "of the model's 512 positions, fewer than max_tokens=10000"),
    (lambda c: c.completions.create(model=NAME, prompt="1+1\n", temperature=3),
     openai.BadRequestError, "temperature=3 must be a number in [0, 2]"),
])
def test_refusals_are_one_line_with_openais_status(tiny, call, error, says):
    with pytest.raises(error) as e:
        call(tiny[2])
    message = e.value.body["message"]
    assert says in message and "\n" not in message


def test_a_wrong_or_missing_secret_is_refused(tiny):
    _, server, _ = tiny
    with pytest.raises(openai.AuthenticationError, match="wrong or missing secret"):
        client(server, key="not-the-secret").models.list()
    assert raw(server, "GET", "/v1/models", headers={})[0] == 401


def raw(server, method, path, body=b"", headers=None):
    """``(status, error message)`` of a request sent by hand."""
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body, {"Authorization": f"Bearer {SECRET}"} if headers is None else headers)
    reply = conn.getresponse()
    status, out = reply.status, json.loads(reply.read())
    conn.close()
    return status, out.get("error", {}).get("message")


def test_bad_json_and_unknown_paths(tiny):
    _, server, _ = tiny
    status, message = raw(server, "POST", "/v1/completions", b"{not json")
    assert status == 400 and message.startswith("the body is not JSON")
    status, message = raw(server, "POST", "/v1/embeddings", b"{}")
    assert status == 404 and "unknown path POST /v1/embeddings" in message
    assert raw(server, "GET", "/v2/models")[0] == 404
    status, message = raw(server, "POST", "/v1/completions", b"[1, 2]")
    assert status == 400 and message == "the request body must be a JSON object"


@pytest.mark.parametrize("lengths, says", [
    (["+2"], "Content-Length '+2' is not a number of bytes"),  # int() took it, and "1_0" too
    (["1_0"], "Content-Length '1_0' is not a number of bytes"),
    (["2", "3"], "conflicting Content-Length headers (2, 3)"),  # the first one won
])
def test_a_content_length_that_does_not_frame_the_body_is_a_400(tiny, lengths, says):
    """RFC 9112: a length that is not plain digits, or several that differ, must not be guessed at."""
    _, server, _ = tiny
    host, port = server.address.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {SECRET}")
    for n in lengths:
        conn.putheader("Content-Length", n)
    conn.endheaders(b"{}")
    reply = conn.getresponse()
    status, message = reply.status, json.loads(reply.read())["error"]["message"]
    conn.close()
    assert (status, message) == (400, says)


# ---------------------------------------------------------------------------------------------- tool calls
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A chat template that ignores ``tools`` (as SmolLM2's does), for the tiny char tokenizer."""


def test_hermes_tool_call_text_parses_into_openai_tool_calls():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = HermesTools().parse(text, "call_x")
    assert content == "Let me add."
    assert calls == [{"id": "call_x_0", "type": "function",
                      "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    assert HermesTools().parse("<tool_call>not json</tool_call>", "c") == ("<tool_call>not json</tool_call>", [])


def test_a_template_that_ignores_tools_gets_them_in_the_system_message_and_earlier_calls_as_text():
    tok = Policy.from_pretrained(NAME).tokenizer
    tok.chat_template = CHATML
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    text = render_chat(tok, messages, TOOLS)
    system = HermesTools().system_text(TOOLS)
    assert text == (f"<|system|>{system}\n\nBe brief.\n<|user|>1+2?\n<|assistant|><tool_call>\n"
                    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<|tool|>3\n<|assistant|>')


def test_a_generated_tool_call_comes_back_as_tool_calls(monkeypatch):
    """End to end through the client, with the generator's tokens fixed (what a model that calls would write)."""
    policy = Policy.from_pretrained(NAME)
    policy.tokenizer.chat_template = CHATML
    tok = policy.tokenizer
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    fixed = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seen = []

    def generate(requests):
        seen.extend(requests)
        return [Generation(list(fixed), [0.0] * len(fixed), "stop")]

    server = serve(policy, "tiny-chat")
    monkeypatch.setattr(server.generator, "generate", generate)
    monkeypatch.setattr(server, "positions", 4096)  # the tools' declaration is longer than the tiny model's positions
    try:
        r = client(server).chat.completions.create(model="tiny-chat", tools=TOOLS, temperature=0,
                                                   messages=[{"role": "user", "content": "What is 1+2?"}])
    finally:
        server.close()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "add", {"a": 1, "b": 2})
    assert r.usage.completion_tokens == len(fixed) and r.usage.prompt_tokens == len(seen[0].prompt_ids)
    prompt = tok.decode(seen[0].prompt_ids)
    assert "<tools>" in prompt and '"name": "add"' in prompt and seen[0].greedy


SMOL_MISSING = missing("smollm2-135m-instruct")


@pytest.mark.skipif(SMOL_MISSING is not None, reason=str(SMOL_MISSING))
def test_smollm2_calls_a_tool_it_was_shown_how_to_call():
    """Greedy SmolLM2, two worked examples of the call in the history, then a new city: it answers with a call (where
    it writes one; its structure is checked) or text."""
    weather = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

    def turn(i, city, answer):
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        return [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": answer},
                {"role": "assistant", "content": f"It is {answer} in {city}."}]

    messages = turn(1, "London", "rainy") + turn(2, "Berlin", "sunny") + [
        {"role": "user", "content": "What is the weather in Paris?"}]
    server = serve(Policy.from_pretrained("smollm2-135m-instruct"), "smollm2")
    try:
        r = client(server).chat.completions.create(model="smollm2", messages=messages, tools=weather, temperature=0,
                                                   max_tokens=40)
    finally:
        server.close()
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert 0 < r.usage.completion_tokens <= 40


# ---------------------------------------------------------------------------------------------- the command
def test_serve_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--listen" in out and "--secret-file" in out and "/v1/chat/completions" in out


@pytest.mark.parametrize("argv, env, says", [
    (["--model", NAME, "--listen", "no-port-here"], {"TOKENGYM_SECRET": "s"}, "'no-port-here' is not host:port"),
    (["--model", NAME], {"TOKENGYM_SECRET": ""}, "the server needs a secret: --secret-file PATH or TOKENGYM_SECRET"),
    (["--model", "no-such-model", "--listen", "127.0.0.1:0"], {"TOKENGYM_SECRET": "s"},
     "cannot load model 'no-such-model'"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, env, says, capsys, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokengym: error: ") and says in err and "\n" not in err


def test_a_run_folder_without_a_model_or_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"algorithm": "grpo", "run": {"model": NAME}, "config": {}}))
    monkeypatch.setenv("TOKENGYM_SECRET", "s")
    assert main(["serve", "--model", str(tmp_path), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tokengym: error: {tmp_path} has neither a final model nor a checkpoint yet"


def test_the_command_serves_a_run_folders_final_model(tmp_path):
    """``tokengym serve --model runs/NAME`` in a process of its own: it prints where it listens, answers the client,
    and stops on SIGTERM."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algorithm": "grpo", "run": {"model": NAME}, "config": {}}))
    Policy.from_pretrained(NAME).save_pretrained(str(run / "model"))
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", "serve", "--model", str(run), "--listen",
                             "127.0.0.1:0", "--name", "mine", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TOKENGYM_SECRET=SECRET))
    try:
        line = proc.stdout.readline()
        found = re.search(r"on (http://\S+/v1) ", line)
        assert found and f"{run}/model as model 'mine'" in line, line + proc.stderr.read()
        c = openai.OpenAI(base_url=found.group(1), api_key=SECRET, max_retries=0)
        assert [m.id for m in c.models.list()] == ["mine"]
        r = c.completions.create(model="mine", prompt="2+2\n", temperature=0, max_tokens=4)
        assert r.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0 and "tokengym serve: stopped" in proc.stderr.read()


def test_lines_logged_by_many_handler_threads_at_once_stay_whole(tiny, lines_logged_at_once, monkeypatch):
    _, server, _ = tiny
    monkeypatch.setattr(server, "quiet", False)
    lines = lines_logged_at_once(server.log)
    assert len(lines) == 8 * 300 and all(re.fullmatch(r"tokengym serve: line \d\.\d+", x) for x in lines)
