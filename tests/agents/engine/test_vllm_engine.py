"""vLLM as a rollout backend on the shipped tiny models (an in-process engine, shared by this module): it stops where
every bundled env stops, matches the fast decoder greedily, runs the Calculator tool env with tokens in = tokens
out, and refuses what it cannot serve in one line. Skipped where vLLM is not installed (``pip install
'tokengym[vllm]'``)."""

import importlib.util

import gymnasium as gym
import pytest
import torch

from tokengym.agents import Policy, collect
from tokengym.agents.engine.backend_check import agent_turns, check_generator
from tokengym.agents.engine.generation import GenerationRequest
from tokengym.envs import ENV_IDS, TokenVectorEnv

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed: pip install 'tokengym[vllm]'"),
              pytest.mark.usefixtures("one_thread")]

# The engine and the fast decoder compute the same fp32 logits with other kernels (vLLM's fused projections and paged
# attention): a logit of these tiny models (4 layers, width 128, logits below ~20) moves by the rounding of sums taken
# in another order, ~sqrt(128) * 2^-24 * 20 * 4 layers ~ 2e-5; a log-softmax moves at most twice that.
LP_TOL = 1e-4


@pytest.fixture(scope="module")
def calc():
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    policy = Policy.from_pretrained("tiny-calculator", seed=4)
    engine = VLLMGenerator(policy, max_model_len=512, max_rows=16, row_len=128)
    yield policy, engine
    engine.close()


@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_the_engine_stops_where_every_bundled_env_stops(env_id, calc, bundled_env_kwargs):
    """Greedily vLLM gives the fast decoder's rollout (tokens, rewards; log-probs within LP_TOL); sampled, its
    generations end exactly where the env ends each turn: nothing dropped, one request per agent turn."""
    policy, engine = calc
    env = gym.make_vec(env_id, num_envs=8, vectorization_mode="vector_entry_point", group_size=2,
                       **bundled_env_kwargs(env_id))
    check_generator(engine, policy, env, atol=LP_TOL, seed=1, greedy=True)
    ro = collect(env, engine, seed=3)
    assert ro.generation_counts["dropped"].sum() == 0
    assert torch.equal(ro.generation_counts["requests"], agent_turns(ro))
    full = policy(ro.tokens, ro.attention_mask, ro.prompt_len, allowed=ro.token_masks).detach()  # (None: no grammar)
    assert float(((full - ro.logprobs) * ro.action_mask).abs().max()) < LP_TOL  # behaviour log-probs = the model's


def test_the_calculator_runs_through_the_engine_tokens_in_tokens_out(calc):
    """Every request is the row's whole token history as the env holds it, and every generated token lands in the
    rollout unchanged: nothing is decoded to text and tokenized again."""
    policy, engine = calc
    seen = []
    generate = engine.generate

    def spy(requests):
        outs = generate(requests)
        seen.extend(zip(requests, outs))
        return outs

    engine.generate = spy
    try:
        env = TokenVectorEnv(16, "calculator")
        ro = collect(env, engine, seed=5)
    finally:
        del engine.generate
    assert ro.turn_stats["replies"] > 0 and len(seen) == int(ro.generation_counts["requests"].sum())
    rows = {tuple(ro.tokens[i][ro.attention_mask[i]].tolist()): i for i in range(16)}
    for req, out in seen:
        history = tuple(req.prompt_ids) + tuple(out.token_ids)
        match = [seq for seq in rows if seq[: len(history)] == history]
        assert len(match) >= 1  # the generation sits in a row's tokens, right after the history it was asked with
    P = ro.prompt_len
    replies = ro.attention_mask[:, P:] & ~ro.action_mask
    assert int(replies.sum()) > 0  # the env's reply tokens are context in the same rows


def test_the_engine_refuses_in_one_line_what_it_cannot_serve(calc):
    policy, engine = calc
    prompt = policy.tokenizer("1+2\n")["input_ids"]
    with pytest.raises(ValueError, match="each needs its string"):
        engine.generate([GenerationRequest(prompt_ids=prompt, max_tokens=4, stop_sequences=((5, 6),))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([GenerationRequest(prompt_ids=[10**6], max_tokens=4)])
    with pytest.raises(ValueError, match="another VLLMGenerator is open"):
        from tokengym.agents.engine.vllm_backend import VLLMGenerator

        VLLMGenerator(policy)


def test_the_engine_samples_only_with_the_version_it_was_given(calc):
    policy, engine = calc
    prompt = policy.tokenizer("1+2\n")["input_ids"]
    engine.llm.collective_rpc("tokengym_mark", args=(7,))  # as if a load had not completed
    try:
        with pytest.raises(RuntimeError, match="holds weights of version 7"):
            engine.generate([GenerationRequest(prompt_ids=prompt, max_tokens=4)])
    finally:
        engine.llm.collective_rpc("tokengym_mark", args=(engine.version,))
    assert engine.generate([GenerationRequest(prompt_ids=prompt, max_tokens=4)])[0].version == engine.version


def test_the_engines_scoring_call_is_the_models_log_probs_and_serves_a_distillation_teacher(calc):
    """``score``: vLLM's prompt log-probs of each sequence from its start equal the model's own (temperature 1, within
    LP_TOL), so an engine serving the teacher gives distillation the in-process teacher's advantages."""
    from tokengym.agents import DistillAgent, DistillConfig
    from tokengym.agents.engine.generation import policy_score

    policy, engine = calc
    seqs = [[1, 5, 9, 12, 30, 7], [1, 40, 41], [1, 22, 23, 24, 25, 26, 27, 28]]
    starts = [2, 1, 5]
    got, want = engine.score(seqs, starts), policy_score(policy, seqs, starts)
    assert [len(g) for g in got] == [len(s) - st for s, st in zip(seqs, starts)] == [len(w) for w in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) < LP_TOL
    student = Policy.from_pretrained("tiny-arithmetic", seed=0)
    ro = collect(TokenVectorEnv(8, "arithmetic", group_size=2, max_new_tokens=16), student, seed=2)
    by_engine, _ = DistillAgent(student, DistillConfig(), teacher=engine).prepare(ro, ro.logprobs, None)
    in_process, _ = DistillAgent(student, DistillConfig(), teacher=policy).prepare(ro, ro.logprobs, None)
    assert torch.allclose(by_engine["adv"], in_process["adv"], rtol=0, atol=LP_TOL)
    with pytest.raises(ValueError, match="start must be in 1..3"):
        engine.score([[1, 2, 3]], [0])


def test_the_engine_samples_inside_the_envs_grammar_with_masked_log_probs(calc):
    """An env with a grammar (ToolCall's JSON schema): vLLM's structured outputs (llguidance, the env's library) keep
    every token inside the env's mask, every call parses, and the log-probs vLLM reports are of the masked,
    renormalised distribution (the trainer's masked forward), not the model's full one."""
    pytest.importorskip("llguidance")
    from tokengym.envs.tasks.tool_call import parse_call

    policy, engine = calc
    env = TokenVectorEnv(8, "tool_call", group_size=2)
    ro = collect(env, engine, seed=2)
    act = ro.action_mask.bool()
    gen = ro.tokens[:, ro.prompt_len:]
    assert bool(ro.token_masks.dense().gather(2, gen[..., None])[..., 0][act].all())
    assert all(parse_call(c) is not None for c in ro.completions)
    assert ro.generation_counts["dropped"].sum() == 0
    masked = policy(ro.tokens, ro.attention_mask, ro.prompt_len, allowed=ro.token_masks).detach()
    full = policy(ro.tokens, ro.attention_mask, ro.prompt_len).detach()
    assert float((masked - ro.logprobs)[act].abs().max()) < LP_TOL
    assert float((full - ro.logprobs)[act].abs().max()) > 1.0


def _calc_agent(client, sample):
    """Calculator-v0 as an OpenAI-client agent (tiny-calculator's tag format: ``<calc>EXPR</calc>``, ``=VALUE``)."""
    import json

    from tokengym.envs.tasks.tools import calculate

    messages = [{"role": "user", "content": sample["prompt"].strip()}]
    for _ in range(6):
        reply = client.chat.completions.create(model="tokengym", messages=messages).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return float((reply.content or "").strip().endswith(f"A: {sample['answer']}"))
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(json.loads(call.function.arguments)["expression"])})
    return 0.0


def test_an_agent_env_runs_through_the_engine(calc):
    """An OpenAI-client agent's episodes sampled by vLLM: the calls and replies land in the rows, no agent errors, and
    the behaviour log-probs are the model's."""
    pytest.importorskip("openai")
    from tokengym.envs import AgentTask, resolve_task
    from tokengym.envs.adapters import PlainFormat, TagTools

    policy, engine = calc
    fmt = PlainFormat(TagTools("<calc>", "</calc>", "calculate", "expression"), prefix={"tool": "="})
    env = TokenVectorEnv(16, AgentTask(_calc_agent, resolve_task("calculator"), format=fmt, max_new_tokens=64),
                         tokenizer=policy.tokenizer, group_size=4)
    ro = collect(env, engine, seed=5)
    assert ro.turn_stats["replies"] > 0 and ro.turn_stats["agent_errors"] == 0
    assert ro.generation_counts["dropped"].sum() == 0
    full = policy(ro.tokens, ro.attention_mask, ro.prompt_len).detach()
    assert float(((full - ro.logprobs) * ro.action_mask).abs().max()) < LP_TOL
