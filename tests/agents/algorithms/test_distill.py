"""On-policy distillation: the teacher's per-token reward against the pure functions (a hand case and a real model),
the agent's wiring (advantages and loss terms on a fixed rollout, each estimator), the detaches, the guards (a
tokenizer mismatch, too few positions, no teacher) and the command line."""

import math
import warnings

import pytest
import torch

from tokengym.agents import DistillAgent, DistillConfig, Policy, collect
from tokengym.agents import functional as F
from tokengym.agents.algorithms.distill import past_length
from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.rollout import used_slice
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tokenizer import char_tokenizer
from tokengym.rewards import TeacherReward, teacher_token_rewards

G = 4


@pytest.fixture(scope="module")
def rollout():
    """16 episodes in groups of 4 of the random-init ``tiny`` student (long, often cut at the budget) and
    ``tiny-arithmetic`` as the teacher."""
    student = Policy.from_pretrained("tiny", seed=0)
    teacher = Policy.from_pretrained("tiny-arithmetic")
    env = TokenVectorEnv(16, "arithmetic", group_size=G, max_new_tokens=20)
    ro = collect(env, student, seed=5)
    assert bool(ro.terminated.any()) or bool(ro.truncated.any())
    return student, teacher, env, ro


def teacher_logp_padded(teacher, ro, temperature=1.0):
    """The teacher's log-probs of the rollout's tokens by a plain padded forward (an independent path)."""
    ref = Policy(teacher.model, teacher.tokenizer, temperature=temperature)
    with torch.no_grad():
        return ref(ro.tokens, ro.attention_mask, ro.prompt_len) * ro.action_mask


def test_the_hand_computed_reward():
    """Student (1/2, 1/4), teacher (1/4, 1/4) at the sampled tokens, coef 2: rewards -2 log 2 and 0; the second row's
    padding column gets 0 whatever the log-probs there. Full: -(1/4) log 2 per position for (1/2,1/4,1/4) against
    (1/4,1/2,1/4)."""
    s = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.9]]))
    t = torch.log(torch.tensor([[0.25, 0.25], [0.5, 0.1]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    r = teacher_token_rewards(mask, "sampled", student_logp=s, teacher_logp=t, coef=2.0)
    assert torch.allclose(r, torch.tensor([[-2 * math.log(2), 0.0], [0.0, 0.0]]), rtol=0, atol=1e-6)
    sl = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]], dtype=torch.float64))
    tl = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]], dtype=torch.float64))
    full = teacher_token_rewards(torch.ones(1, 1), "full", student_logits=sl, teacher_logits=tl)
    assert float(full) == pytest.approx(-0.25 * math.log(2), abs=1e-12)
    top2 = teacher_token_rewards(torch.ones(1, 1), "topk", student_logits=sl, teacher_logits=tl, top_k=2)
    assert float(top2) == pytest.approx(-math.log(2) / 3, abs=1e-12)


def test_the_teacher_reward_on_a_rollout_is_the_pure_function_of_both_models(rollout):
    student, teacher, _, ro = rollout
    tr = TeacherReward(teacher.model, teacher.tokenizer, temperature=0.7, coef=0.5, packing="bins")
    r = tr(ro.tokens, ro.attention_mask, ro.action_mask, ro.prompt_len, student_logp=ro.logprobs)
    t = teacher_logp_padded(teacher, ro, temperature=0.7)
    want = -0.5 * F.sampled_reverse_kl(ro.logprobs, t) * ro.action_mask
    assert torch.allclose(r, want, rtol=0, atol=1e-4)  # packed against padded: float32 sums in another order
    assert float(r.masked_fill(ro.action_mask.bool(), 0).abs().max()) == 0.0
    with torch.no_grad():
        s_logits = student(ro.tokens, ro.attention_mask, ro.prompt_len, return_logits=True)[1]
        t_logits = Policy(teacher.model, teacher.tokenizer, temperature=1.0)(ro.tokens, ro.attention_mask, ro.prompt_len,
                                                                             return_logits=True)[1]
    full = TeacherReward(teacher.model, teacher.tokenizer, "full", packing="off")
    r_full = full(ro.tokens, ro.attention_mask, ro.action_mask, ro.prompt_len, student_logits=s_logits)
    assert torch.allclose(r_full, -F.reverse_kl(s_logits, t_logits) * ro.action_mask, rtol=0, atol=1e-5)
    assert float(r_full.max()) <= 1e-6  # a KL is never negative: the reward never positive


def test_no_gradient_reaches_the_teacher():
    """The reward is a constant: no graph even from student logits that require grad; the teacher's weights are
    frozen and its logits carry no graph."""
    s = torch.randn(2, 3, 5, requires_grad=True)
    r = teacher_token_rewards(torch.ones(2, 3), "full", student_logits=s, teacher_logits=torch.randn(2, 3, 5))
    assert not r.requires_grad
    policy = Policy.from_pretrained("tiny")
    tr = TeacherReward(policy.model, policy.tokenizer)
    assert not any(p.requires_grad for p in policy.model.parameters()) and not policy.model.training
    tokens = torch.tensor([[5, 6, 7, 8]])
    assert not tr.logits(tokens, torch.ones_like(tokens), 2).requires_grad


@pytest.mark.parametrize("outcome_coef, penalty", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.1)])
def test_sampled_advantages_are_the_teachers_reward_plus_the_mixed_terms(rollout, outcome_coef, penalty):
    student, teacher, _, ro = rollout
    cfg = DistillConfig(distill_coef=0.5, teacher_temperature=0.7, outcome_coef=outcome_coef, length_penalty=penalty,
                        length_penalty_after=6)
    agent = DistillAgent(student, cfg, teacher=teacher)
    batch, _ = agent.prepare(ro, ro.logprobs, None)
    t = teacher_logp_padded(teacher, ro, temperature=0.7)
    want = -0.5 * F.sampled_reverse_kl(ro.logprobs, t) * ro.action_mask
    want = want + outcome_coef * F.group_advantages(ro.returns, G)[:, None] * ro.action_mask
    want = want - penalty * past_length(ro.action_mask, ro.terminated, 6) * ro.action_mask
    assert torch.allclose(batch["adv"], want, rtol=0, atol=1e-4)
    assert not batch["adv"].requires_grad


def _minibatch(ro, student, need_logits):
    from tokengym.agents.algorithms.onpolicy import Minibatch

    tokens, mask, p, m = used_slice(ro)
    out = student(tokens, mask, p, return_entropy=True, return_logits=need_logits)
    logp, ent, logits = (*out, None) if not need_logits else out
    return Minibatch(torch.arange(ro.num_episodes), m, ro.action_mask[:, :m], logp, ent, {}, logits), (tokens, mask, p, m)


@pytest.mark.parametrize("estimator", ["sampled", "topk", "full"])
def test_loss_terms_are_the_pure_functions(rollout, estimator):
    """sampled: exactly GRPO's clipped surrogate on the teacher's advantages; topk / full: that surrogate (of zero
    advantages here) plus distill_coef * KL(pi_theta || teacher) over the student's logits, whose gradient reaches
    the student and not the teacher."""
    student, teacher, _, ro = rollout
    cfg = DistillConfig(estimator=estimator, top_k=5, distill_coef=0.3)
    agent = DistillAgent(student, cfg, teacher=teacher)
    assert agent.needs_logits == (estimator != "sampled")
    batch, _ = agent.prepare(ro, ro.logprobs, None)
    batch.setdefault("old_logp", ro.logprobs)
    mb, (tokens, mask, p, m) = _minibatch(ro, student, agent.needs_logits)
    mb.extra.update(agent.forward_extra(tokens, mask, p, m))
    terms, stats = agent.loss(mb, batch)
    am = mb.take(batch["mask"])
    pg, _ = F.policy_loss(mb.logp, mb.take(ro.logprobs), mb.take(batch["adv"]), am, cfg.clip_eps, cfg.clip_eps_high,
                          cfg.aggregation)
    assert torch.equal(terms[0][0], pg)
    if estimator == "sampled":
        assert len(terms) == 1
        want_kl = F.masked_aggregate(mb.take(ro.logprobs - teacher_logp_padded(teacher, ro)), am, cfg.aggregation)
        assert float(stats["reverse_kl"]) == pytest.approx(float(want_kl), abs=1e-4)
        return
    with torch.no_grad():
        t_logits = Policy(teacher.model, teacher.tokenizer)(tokens, mask, p, return_logits=True)[1]
    kl = F.reverse_kl(mb.logits, t_logits, 5 if estimator == "topk" else None)
    want = 0.3 * F.masked_aggregate(kl, am, cfg.aggregation)
    assert len(terms) == 2 and float(terms[1][0].detach()) == pytest.approx(float(want), rel=1e-4)
    assert not mb.extra["teacher_logits"].requires_grad
    terms[1][0].backward()
    assert any(p.grad is not None for p in student.model.parameters())
    assert all(p.grad is None for p in teacher.model.parameters())
    student.model.zero_grad(set_to_none=True)


def test_past_length_by_hand():
    """After 2 agent tokens: the third and later, but not a terminated row's stop token; a truncated row's last
    token is penalised."""
    am = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    term = torch.tensor([True, False, True])
    want = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(past_length(am, term, 2), want)


def heldout_kl(student, teacher):
    """The exact per-token KL(student || teacher) over the vocabulary on 64 fixed held-out rollouts of the student."""
    ro = collect(TokenVectorEnv(64, "arithmetic", max_new_tokens=32), student, seed=99)
    with torch.no_grad():
        s = student(ro.tokens, ro.attention_mask, ro.prompt_len, return_logits=True)[1]
        t = Policy(teacher.model, teacher.tokenizer)(ro.tokens, ro.attention_mask, ro.prompt_len, return_logits=True)[1]
    return float(F.masked_aggregate(F.reverse_kl(s, t), ro.action_mask, "token-mean"))


def test_distillation_lowers_the_heldout_kl_and_leaves_the_teacher_untouched(rollout):
    """The student is the teacher's weights sampled at temperature 1.5 (so its distribution is flatter than the
    teacher's): 20 default steps of the sampled estimator bring the exact held-out KL down (measured 0.036 -> 0.024),
    the teacher's weights stay bit-equal, and no "no learning signal" warning comes although the env's rewards are
    not what trains."""
    _, teacher, _, _ = rollout
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    student = Policy.from_pretrained("tiny-arithmetic", seed=0, temperature=1.5)
    kl0 = heldout_kl(student, teacher)
    env = TokenVectorEnv(64, "arithmetic", group_size=4, max_new_tokens=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = DistillAgent(student, DistillConfig(steps=20, seed=0), teacher=teacher).learn(env)
    kl1 = heldout_kl(student, teacher)
    assert kl1 < 0.8 * kl0, (kl0, kl1)
    assert all(torch.equal(v, teacher.model.state_dict()[k]) for k, v in before.items())
    assert {"train/reverse_kl", "train/teacher_logp", "completion/length_mean"} <= set(history[-1])


def test_a_teacher_with_another_vocabulary_is_refused_naming_both():
    tok = char_tokenizer()
    tok.add_tokens(["<tool>"])
    model, tok = build_preset("tiny", tokenizer=tok)
    with pytest.raises(ValueError) as e:
        DistillAgent(Policy.from_pretrained("tiny"), DistillConfig(), teacher=Policy(model, tok))
    msg = str(e.value)
    assert "\n" not in msg and "102 tokens" in msg and "101 tokens" in msg and "same vocabulary" in msg


def test_a_teacher_with_too_few_positions_is_refused_before_training():
    model, tok = build_preset("tiny", max_position_embeddings=16)
    agent = DistillAgent(Policy.from_pretrained("tiny"), DistillConfig(steps=1), teacher=Policy(model, tok))
    env = TokenVectorEnv(4, "arithmetic", group_size=1, max_new_tokens=20)
    with pytest.raises(ValueError, match=r"^the teacher: .* need \d+ positions, but the model has 16"):
        agent.learn(env)
    assert agent.global_step == 0


@pytest.mark.parametrize("kw, message", [
    ({}, "distillation needs a teacher"),
    ({"teacher": "no/such/folder"}, "cannot load teacher 'no/such/folder'"),
    ({"teacher": "tiny-arithmetic", "estimator": "forward"}, "estimator"),
    ({"teacher": "tiny-arithmetic", "loss": "gspo", "clip_eps": 3e-4, "clip_eps_high": 4e-4}, "loss='gspo'"),
])
def test_bad_settings_are_one_line(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        DistillAgent(Policy.from_pretrained("tiny"), DistillConfig(**kw))
    assert "\n" not in str(e.value)


def test_the_student_cannot_be_its_own_teacher():
    policy = Policy.from_pretrained("tiny")
    with pytest.raises(ValueError, match="the teacher is the student's own model"):
        DistillAgent(policy, DistillConfig(), teacher=policy)
    assert all(p.requires_grad for p in policy.model.parameters())  # refused before anything was frozen


def test_the_command_refuses_a_missing_teacher_in_one_line(tmp_path, monkeypatch, capsys):
    from tokengym.agents.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "distill", "--model", "tiny", "--steps", "1", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--teacher RUN_OR_MODEL" in err[0]
    assert not (tmp_path / "runs").exists()


def test_a_teacher_behind_the_scoring_call_gives_the_in_process_rewards(rollout):
    """The generation seam's scoring call (here the in-process PolicyGenerator; vLLM's in test_vllm_engine) serves the
    sampled estimator: the same teacher log-probs, so the same advantages; it refuses what it cannot serve."""
    from tokengym.agents import PolicyGenerator

    student, teacher, _, ro = rollout
    scored = TeacherReward(PolicyGenerator(teacher), teacher.tokenizer).logprobs(ro.tokens, ro.attention_mask, ro.prompt_len)
    assert torch.allclose(scored * ro.action_mask, teacher_logp_padded(teacher, ro), rtol=0, atol=1e-4)
    by_score, _ = DistillAgent(student, DistillConfig(), teacher=PolicyGenerator(teacher)).prepare(ro, ro.logprobs, None)
    in_process, _ = DistillAgent(student, DistillConfig(), teacher=teacher).prepare(ro, ro.logprobs, None)
    assert torch.allclose(by_score["adv"], in_process["adv"], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="estimator='sampled' and temperature 1"):
        DistillAgent(student, DistillConfig(estimator="full"), teacher=PolicyGenerator(teacher))


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    """Interrupt a run folder after 2 of 4 steps, then resume it with a fresh student and teacher (the teacher is the
    config's name, loaded again): the same records and final weights as 4 steps in one go."""
    from safetensors.torch import load_file

    def run(name, stop=None, resume=False):
        cfg = DistillConfig(steps=4, lr=1e-3, seed=3, teacher="tiny-arithmetic", estimator="topk", top_k=8)
        env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12)
        agent = DistillAgent(Policy.from_pretrained("tiny", seed=0), cfg)
        def crash(record):  # the process dies after step `stop` (its checkpoint written)
            if stop is not None and record["step"] >= stop:
                raise KeyboardInterrupt

        try:
            agent.learn(env, run_dir=str(tmp_path / name), resume=resume, save_every=1, callback=crash)
        except KeyboardInterrupt:
            assert not (tmp_path / name / "model").exists()
        return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))}
                for r in map(__import__("json").loads, open(tmp_path / name / "metrics.jsonl"))]

    whole = run("whole")
    run("parts", stop=2)
    parts = run("parts", resume=True)
    assert parts == whole and [r["step"] for r in whole if "train/reverse_kl" in r] == [1, 2, 3, 4]
    a, b = (load_file(str(tmp_path / n / "model" / "model.safetensors")) for n in ("whole", "parts"))
    assert all(torch.equal(a[k], b[k]) for k in a)
