"""Every training loop takes its optimiser step through the one step: gradients go through the data-parallel sync
(``agent.dp.sync_gradients``, once per update, every optimiser's parameters at once) before clipping and stepping.

A spy ``dp`` zeroes the gradients it is handed: since AdamW without weight decay moves no weight on a zero
gradient, the weights must stay put and the logged gradient norms be 0. A loop that clipped or stepped
before syncing, or synced only part of its parameters, moves weights or logs a norm. (Mutation seen to fail:
``OptimizerStep.step`` syncing after the clipping.)
"""

from dataclasses import dataclass, field

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents.algorithms.dpo import DPOConfig, DPOLearner
from tokengym.agents.algorithms.ppo import PPOAgent, PPOConfig
from tokengym.agents.algorithms.sft import SFTConfig, SFTLearner
from tokengym.agents.data.pairs import arithmetic_pairs
from tokengym.agents.engine.models import build_preset
from tokengym.agents.engine.policy import Policy
from tokengym.agents.runtime.distributed import DataParallel
from tokengym.envs.tasks import ArithmeticTask

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class ZeroingSync(DataParallel):
    """A plain run whose gradient sync records the parameters it got and zeroes their gradients."""

    calls: list = field(default_factory=list, compare=False)

    def sync_gradients(self, params):
        params = list(params)
        self.calls.append([id(p) for p in params])
        for p in params:
            if p.grad is not None:
                p.grad.zero_()


def snapshot(*modules):
    return [t.detach().clone() for m in modules for t in m.state_dict().values()]


def unchanged(before, *modules):
    return all(torch.equal(a, b) for a, b in zip(before, snapshot(*modules)))


def test_ppo_syncs_policy_and_critic_gradients_in_one_call_before_clipping():
    env = gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=1,
                       partial_credit=True, target="ok", max_new_tokens=2)
    agent = PPOAgent(Policy.from_pretrained("tiny"), PPOConfig(steps=1, minibatches=2, beta=0.0))
    agent.dp = spy = ZeroingSync()
    before = snapshot(agent.policy.model, agent.critic)
    record = agent.learn(env)[0]
    everything = [id(p) for opt in agent.optimizers for g in opt.param_groups for p in g["params"]]
    assert spy.calls == [everything] * (agent.config.mu * 2)  # one call per minibatch, policy and critic together
    assert record["train/grad_norm"] == 0.0 and record["train/critic_grad_norm"] == 0.0
    assert unchanged(before, agent.policy.model, agent.critic)


def test_dpo_and_sft_sync_before_clipping():
    dpo = DPOLearner(Policy(*build_preset("tiny", seed=1)), DPOConfig(batch_size=4, steps=1, log_every=1))
    dpo.dp = spy = ZeroingSync()
    before = snapshot(dpo.policy.model)
    record = dpo.fit(arithmetic_pairs(ArithmeticTask(n_operands=2, digits=1, operators="+"), 8, seed=0))[0]
    assert len(spy.calls) == 1 and record["train/grad_norm"] == 0.0 and unchanged(before, dpo.policy.model)

    sft = SFTLearner(Policy(*build_preset("tiny", seed=0)), ArithmeticTask(n_operands=2, digits=1, operators="+"),
                     SFTConfig(steps=1, batch_size=4, warmup_steps=0, weight_decay=0.0, eval_prompts=4, log_every=1))
    sft.dp = spy = ZeroingSync()
    before = snapshot(sft.policy.model)
    logged = []
    sft.fit(log=lambda step, metrics: logged.append(metrics))
    assert len(spy.calls) == 1 and unchanged(before, sft.policy.model)
    assert [m["train/grad_norm"] for m in logged if "train/grad_norm" in m] == [0.0]
