"""On-policy preference pairs: the policy's own correct vs wrong samples of one prompt."""

import torch

from tokengym.agents import Policy, heldout_samples
from tokengym.agents.data.reward_data import on_policy_pairs
from tokengym.envs.tasks import ArithmeticTask
from tokengym.rewards import arithmetic_correct, solve_expression


def test_on_policy_pairs_rank_a_correct_sample_above_a_wrong_one_of_the_same_prompt():
    task = ArithmeticTask(n_operands=(2, 3), digits=2, operators="+")
    policy = Policy.from_pretrained("tiny-arithmetic")
    held = {s["prompt"] for s in heldout_samples(task, 64)}
    state = policy.generator.get_state()
    pairs = on_policy_pairs(policy, task, 48, group_size=4, pairs_per_prompt=3, seed=0, exclude_prompts=held, num_envs=64)
    assert torch.equal(policy.generator.get_state(), state)  # sampling leaves the policy's stream alone
    assert pairs == on_policy_pairs(policy, task, 48, group_size=4, pairs_per_prompt=3, seed=0, exclude_prompts=held, num_envs=64)
    prompts = [p["prompt"] for p in pairs]
    assert not held & set(prompts) and len(set(prompts)) <= 48
    assert all(prompts.count(p) <= 3 for p in set(prompts))
    assert len({(p["prompt"], p["chosen"], p["rejected"]) for p in pairs}) == len(pairs)  # no repeated pair
    answers = [p["answer"] for p in pairs]
    assert arithmetic_correct(prompts, [p["chosen"] for p in pairs], answer=answers) == [1.0] * len(pairs)
    assert arithmetic_correct(prompts, [p["rejected"] for p in pairs], answer=answers) == [0.0] * len(pairs)
    sources = {p["chosen_source"] for p in pairs}
    assert sources == {"sample", "reference"}  # the warm start solves some prompts in a group of 4, not all
    for p in pairs:
        if p["chosen_source"] == "reference":
            steps, answer = solve_expression(p["prompt"].strip())
            assert p["chosen"] == "\n".join([*steps, f"A: {answer}"])
    assert all(p["kind"] == "on_policy" for p in pairs)


def test_on_policy_pair_mining_reports_its_progress(capsys):
    """Mining runs before training and can take minutes: it says how far it is (the CLI prints these calls)."""
    from tokengym.agents.cli.runner import RunConfig, phase_progress

    calls = []
    on_policy_pairs(Policy.from_pretrained("tiny"), ArithmeticTask(), 10, group_size=4, num_envs=16,
                    progress=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 10), (4, 10), (8, 10), (10, 10)]
    show = phase_progress(RunConfig(progress=True), "mining on-policy pairs", "prompts sampled")
    for done, total in calls:
        show(done, total)
    assert capsys.readouterr().err.splitlines()[-1] == "mining on-policy pairs: 10/10 prompts sampled"
