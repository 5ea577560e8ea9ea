"""Agents and commands on the vLLM backend: GRPO's rollouts come from the engine, which holds each update's weights
(by version) before it samples, with the rollout correction on; PPO, LoRA, bf16, async workers and ``tokengym eval``
run through it; and what cannot run is refused in one line. One engine per test (vLLM runs one engine per process at a
time). Skipped where vLLM is not installed."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tokengym.agents import GRPOAgent, GRPOConfig, Policy, PPOAgent, PPOConfig, collect, heldout_samples
from tokengym.agents import variants as V
from tokengym.agents.engine.models import build_preset
from tokengym.envs import TokenVectorEnv

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed: pip install 'tokengym[vllm]'"),
              pytest.mark.usefixtures("one_thread")]

LP_TOL = 1e-4  # fp32 on the tiny models: test_vllm_engine.py says why


def _gap(policy, ro):
    with torch.no_grad():
        full = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    return float(((full - ro.logprobs) * ro.action_mask).abs().max())


def test_grpo_samples_from_the_engine_which_holds_every_update_weights():
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    env = TokenVectorEnv(16, "arithmetic", group_size=4)
    agent = GRPOAgent(policy, GRPOConfig(steps=3, lr=1e-3, sampler="vllm", skip_zero_advantage=False, seed=0))
    assert agent.config.correction_mode == "tis"  # another engine's log-probs are the behaviour log-probs
    start = Policy.from_pretrained("tiny-arithmetic")
    seen = []
    collect_step = agent.collect
    agent.collect = lambda env: seen.append(collect_step(env)) or seen[-1]
    try:
        history = agent.learn(env)
        engine = agent._engine
        assert [ro.policy_version for ro in seen] == [0, 1, 2]  # each rollout sampled by the weights of its step
        assert all(ro.generation_counts for ro in seen)
        assert all("time/weight_sync" in r for r in history[1:]) and all("mismatch/abs_gap_max" in r for r in history)
        assert max(r["mismatch/abs_gap_max"] for r in history) < LP_TOL  # fp32 engine vs fp32 trainer
        ro = collect(env, agent.rollout_backend(env), seed=3)  # after the last update: loaded before it samples
        assert engine.version == agent.global_step == 3 and ro.policy_version == 3
        assert _gap(policy, ro) < LP_TOL
        assert _gap(start, ro) > 10 * LP_TOL  # the updates moved the log-probs: the check above can fail
    finally:
        agent.close()


def test_the_correction_weights_divide_by_the_engine_log_probs():
    """pi_old is the trainer's recomputed forward, the behaviour log-probs the engine's: the TIS weights the loss uses
    are variants.importance_weights of exactly those."""
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    env = TokenVectorEnv(8, "arithmetic", group_size=4)
    agent = GRPOAgent(policy, GRPOConfig(steps=1, mu=2, sampler="vllm", skip_zero_advantage=False))
    try:
        ro = agent.collect(env)
        old = agent._logprobs(agent.policy, ro)
        batch, _ = agent.frozen_batch(ro, old, None)
        want = V.importance_weights(old, ro.logprobs, ro.action_mask, "tis", "token", agent.config.correction_cap)
        assert torch.equal(batch["weights"], want) and not torch.equal(old, ro.logprobs)
    finally:
        agent.close()


def test_ppo_and_bf16_run_through_the_engine():
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    env = TokenVectorEnv(8, "arithmetic")
    agent = PPOAgent(policy, PPOConfig(steps=2, sampler="vllm", bf16=True))
    try:
        history = agent.learn(env)
        ro = agent.collect(env)
        assert len(history) == 2 and agent._engine.version == 2 and ro.policy_version == 2
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            full = policy(ro.tokens, ro.attention_mask, ro.prompt_len).float()
        # bf16 on both sides, other kernels: a logit |z| < 25 moves by a few bf16 ulps (2^-8 |z|), a log-prob by twice
        z = 25.0
        assert float(((full - ro.logprobs) * ro.action_mask).abs().max()) < 4 * 2**-8 * z
    finally:
        agent.close()


def test_a_lora_policy_is_served_with_its_adapters_merged():
    peft = pytest.importorskip("peft")
    model, tok = build_preset("tiny")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # non-zero deltas, so a lost adapter shows
    policy = Policy(lora, tok, seed=0)
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    env = TokenVectorEnv(8, "arithmetic")
    with VLLMGenerator(policy, max_model_len=256) as engine:
        ro = collect(env, engine, seed=0)
        assert _gap(policy, ro) < LP_TOL
        with policy.model.disable_adapter():
            assert _gap(policy, ro) > 10 * LP_TOL


def test_async_workers_sample_with_engines_of_their_own():
    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    env = TokenVectorEnv(8, "arithmetic", group_size=4)
    agent = GRPOAgent(policy, GRPOConfig(steps=3, sampler="vllm", async_mode="one-step", skip_zero_advantage=False))
    try:
        history = agent.learn(env)
    finally:
        agent.close()
    assert [r["async/staleness"] for r in history] == [0.0, 1.0, 1.0]
    assert [r["async/policy_version"] for r in history] == [0.0, 0.0, 1.0]


def _cli(*args, env=None, code=None):
    return subprocess.run([sys.executable, *(["-c", code] if code else ["-m", "tokengym.agents.cli"]), *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)


def test_eval_on_the_command_line(tmp_path):
    """``tokengym eval --sampler vllm``: greedy, the engine's held-out accuracy is the fast decoder's. (Training with
    ``--sampler vllm`` on the command line: the docs' vLLM first run, whose check reads the config it took.)"""
    out = {}
    for sampler in ("vllm", "tokengym"):
        res = _cli("eval", "--model", "tiny-arithmetic", "--prompts", "48", "--samples", "0", "--sampler", sampler)
        assert res.returncode == 0, res.stderr[-2000:]
        out[sampler] = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("greedy")]
    assert out["vllm"] == out["tokengym"] and out["vllm"]


def test_without_vllm_the_command_names_the_extra_and_writes_nothing(tmp_path):
    block = "import sys; sys.modules['vllm'] = None; from tokengym.agents.cli import main; sys.exit(main(sys.argv[1:]))"
    res = _cli("train", "grpo", "--sampler", "vllm", "--steps", "1", "--eval-prompts", "0", "--runs-dir",
               str(tmp_path), "--name", "x", code=block)
    lines = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("tokengym: warning:")]  # a busy machine
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "pip install 'tokengym[vllm]'" in lines[0] and not os.path.exists(tmp_path / "x")


def test_what_vllm_cannot_load_or_update_is_one_line(monkeypatch):
    from tokengym.agents.engine import vllm_worker
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    policy = Policy.from_pretrained("tiny-arithmetic")
    with pytest.raises(ValueError, match=r"^vLLM cannot load model .*(memory|cache)") as e:
        VLLMGenerator(policy, engine_kwargs={"kv_cache_memory_bytes": 1 << 16})
    assert "\n" not in str(e.value) and not torch.distributed.is_initialized()  # nothing of the failed start is left
    monkeypatch.setattr(vllm_worker.WeightLoader, "tokengym_check", lambda self: "its worker has no reload_weights()")
    with pytest.raises(ValueError, match="cannot take new weights in place .its worker has no reload_weights"):
        VLLMGenerator(policy, max_model_len=256)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="is more than the 512 positions"):
        VLLMGenerator(policy, max_model_len=4096)


def test_a_restored_agent_reloads_its_engine_and_continues_exactly():
    """Stop after 2 of 4 steps, restore into an agent whose engine holds other weights under the same version: the
    engine takes the restored weights before it samples, and the run ends as the uninterrupted one does."""
    import io

    def roundtrip(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    config = GRPOConfig(steps=4, lr=1e-3, sampler="vllm", skip_zero_advantage=False, seed=5)
    make_env = lambda: TokenVectorEnv(8, "target", group_size=4, partial_credit=True)  # noqa: E731
    strip = lambda recs: [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in recs]  # noqa: E731
    runs = []
    for stop in (None, 2):
        agent = GRPOAgent(Policy.from_pretrained("tiny", seed=0), config)
        env = make_env()
        try:
            runs.append((agent.learn(env, callback=None if stop is None else lambda rec: rec["step"] < stop),
                         {n: roundtrip(m.state_dict()) for n, m in agent.checkpoint_modules().items()},
                         roundtrip(agent.state_dict()), roundtrip(env.state_dict())))
        finally:
            agent.close()
    (full, full_weights, _, _), (part, weights, state, env_state) = runs
    agent = GRPOAgent(Policy.from_pretrained("tiny", seed=99), config)
    with torch.no_grad():  # other weights than the run's
        for p in agent.policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    env = make_env()
    try:  # the engine holds other weights under the version the restore brings back (2)
        agent.learn(make_env(), callback=lambda rec: rec["step"] < 2)
        agent.collect(make_env())
        assert agent._engine.version == 2
        for name, m in agent.checkpoint_modules().items():
            m.load_state_dict(weights[name])
        agent.load_state_dict(state)
        env.load_state_dict(env_state)
        rest = agent.learn(env)
    finally:
        agent.close()
    assert strip(part + rest) == strip(full)
    for name, w in agent.checkpoint_modules()["policy"].state_dict().items():
        assert torch.equal(w, full_weights["policy"][name]), name


def test_a_batch_longer_than_an_engine_step_samples_with_its_seeds():
    """More prompt tokens than one engine step takes (64 x 301), with KV cache room for all of them: vLLM's chunked
    prefill would roll each seeded request's generator back, which its CPU generators cannot do (a RuntimeError); the
    engine prefills whole prompts instead, and the same seeds give the same tokens."""
    from tokengym.agents.engine.generation import GenerationRequest
    from tokengym.agents.engine.vllm_backend import VLLMGenerator

    requests = [GenerationRequest(prompt_ids=[1] + [5 + (i + j) % 90 for j in range(300)], max_tokens=8, seed=i)
                for i in range(64)]
    with VLLMGenerator(Policy.from_pretrained("tiny-calculator"), max_model_len=512, max_rows=64, row_len=512) as engine:
        first, again = engine.generate(requests), engine.generate(requests)
    assert [g.token_ids for g in first] == [g.token_ids for g in again] and all(len(g.token_ids) == 8 for g in first)
