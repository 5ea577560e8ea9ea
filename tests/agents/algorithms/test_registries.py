"""The registries of policy losses, advantage estimators and rollout backends: a toy of each, registered from this
module, trains one GRPO step through the config's name (wiring, and the weights move); unknown names are refused in
one line naming the registered ones; the old name tuples are live views."""

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401
from tokengym.agents.algorithms import advantages as A
from tokengym.agents.algorithms import losses as L
from tokengym.agents.algorithms.critic_free import LOSSES as CRITIC_FREE_LOSSES
from tokengym.agents.algorithms.grpo import LOSSES, GRPOAgent, GRPOConfig
from tokengym.agents.engine import backends as B
from tokengym.agents.engine.generation import SAMPLERS, PolicyGenerator
from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.registry import Registry


def target_env(n=32, g=4):
    return gym.make_vec("tokengym/Target-v0", num_envs=n, vectorization_mode="vector_entry_point", group_size=g,
                        partial_credit=True, target="a", max_new_tokens=2)  # some groups differ


def weights(policy):
    return [p.detach().clone() for p in policy.model.parameters()]


def moved(before, policy):
    return any(not torch.equal(a, p.detach()) for a, p in zip(before, policy.model.parameters()))


def spy(agent, method):
    """Record each call of ``agent.<method>`` with its result."""
    seen, inner = [], getattr(agent, method)

    def wrapper(*args):
        out = inner(*args)
        seen.append((args, out))
        return out

    setattr(agent, method, wrapper)
    return seen


# ---------------------------------------------------------------------------------------------------- a toy loss
def reinforce(x: L.LossInputs):
    """REINFORCE: -(log pi * A), averaged over the mask's tokens."""
    return -(x.logp * x.adv * x.mask).sum() / x.mask.sum().clamp(min=1), {}


@pytest.fixture
def toy_loss():
    L.register_loss("toy-reinforce", reinforce, proportional_to_advantage=True)
    yield "toy-reinforce"
    L.unregister_loss("toy-reinforce")


def test_a_registered_loss_trains_a_grpo_step(toy_loss):
    assert toy_loss in LOSSES and toy_loss in CRITIC_FREE_LOSSES  # the old tuples follow the registry
    policy = Policy.from_pretrained("tiny")
    agent = GRPOAgent(policy, GRPOConfig(loss=toy_loss, steps=1, lr=1e-2, seed=0, skip_zero_advantage=False))
    seen, before = spy(agent, "loss"), weights(policy)
    agent.learn(target_env())
    assert seen and moved(before, policy)
    for (mb, batch), (terms, _) in seen:
        am = mb.take(batch["mask"])
        want = reinforce(L.LossInputs(mb.logp, mb.take(batch["old_logp"]), mb.take(batch["adv"]), am, agent.config))[0]
        assert torch.equal(terms[0][0], want)


def test_the_loss_metadata_drives_the_checks(toy_loss):
    assert L.policy_loss("clip").takes_weights and not L.policy_loss(toy_loss).takes_weights
    with pytest.raises(ValueError, match=f"correction='tis'.*loss='{toy_loss}'"):
        GRPOConfig(loss=toy_loss, correction="tis")
    assert GRPOConfig(loss=toy_loss, async_mode="one-step", correction="auto").correction_mode == "none"
    with L.POLICY_LOSSES.registered("toy-seq", L.PolicyLoss("toy-seq", reinforce, sequence_level=True,
                                                             aggregation="token-mean")):
        with pytest.raises(ValueError, match="takes aggregation='token-mean'"):
            GRPOConfig(loss="toy-seq")
        with pytest.raises(ValueError, match="needs one outcome per episode"):
            GRPOConfig(loss="toy-seq", aggregation="token-mean", advantage="process")
    assert "toy-seq" not in LOSSES


# ---------------------------------------------------------------------------------------- a toy advantage estimator
def centred(x: A.AdvantageInputs):
    """Each episode's return minus the batch's mean return."""
    return x.returns - x.returns.mean()


@pytest.fixture
def toy_advantage():
    A.register_advantage("toy-centred", centred)
    yield "toy-centred"
    A.unregister_advantage("toy-centred")


def test_a_registered_advantage_estimator_trains_a_grpo_step(toy_advantage):
    policy = Policy.from_pretrained("tiny")
    agent = GRPOAgent(policy, GRPOConfig(advantage=toy_advantage, steps=1, lr=1e-2, seed=0, skip_zero_advantage=False))
    assert not GRPOAgent.needs_process_reward(agent.config)
    seen, before = spy(agent, "prepare"), weights(policy)
    agent.learn(target_env())
    assert len(seen) == 1 and moved(before, policy)
    (ro, _, _), (batch, _) = seen[0]
    want = (ro.returns - ro.returns.mean())[:, None].expand(-1, ro.action_mask.shape[1]) * ro.action_mask
    assert torch.equal(batch["adv"], want) and batch["adv"].abs().sum() > 0


def test_an_estimator_that_needs_a_process_reward_says_so():
    with A.ADVANTAGE_ESTIMATORS.registered("toy-steps", A.AdvantageEstimator("toy-steps", centred, True, False)):
        config = GRPOConfig(advantage="toy-steps")
        assert GRPOAgent.needs_process_reward(config)
        with pytest.raises(ValueError, match="advantage='toy-steps' needs an env with a process reward"):
            GRPOAgent(Policy.from_pretrained("tiny"), config).check_env(target_env(8, 4))
        with pytest.raises(ValueError, match="overlong_buffer needs one outcome per episode"):
            GRPOConfig(advantage="toy-steps", overlong_buffer=0.2)
    assert "toy-steps" not in A.ADVANTAGES


# ---------------------------------------------------------------------------------------------- a toy backend
class CountingGenerator(PolicyGenerator):
    """The policy behind the generation seam, counting the requests it serves."""

    def __init__(self, policy, version=None):
        super().__init__(policy)
        self.version, self.requests, self.loads, self.closed = version, 0, 0, False

    def generate(self, requests):
        self.requests += len(requests)
        return super().generate(requests)

    def load_weights(self, state_dict=None, version=None):
        self.loads += 1
        super().load_weights(state_dict, version)

    def close(self):
        self.closed = True


@pytest.fixture
def toy_backend():
    made = []

    @B.register_backend("toy-counting")
    def counting(policy, *, rows, row_len, bf16, version):
        made.append(CountingGenerator(policy, version))
        return made[-1]

    yield made
    B.unregister_backend("toy-counting")


def test_a_registered_backend_samples_a_grpo_step(toy_backend):
    assert "toy-counting" in SAMPLERS
    policy, env = Policy.from_pretrained("tiny"), target_env()
    agent = GRPOAgent(policy, GRPOConfig(sampler="toy-counting", steps=1, lr=1e-2, seed=0, skip_zero_advantage=False))
    before = weights(policy)
    agent.learn(env)
    assert len(toy_backend) == 1 and toy_backend[0].requests == env.num_envs and moved(before, policy)
    agent.close()
    assert toy_backend[0].closed


# ---------------------------------------------------------------------------------------------- unknown names
def test_unknown_names_are_refused_in_one_line_naming_the_registered_ones():
    for make, field in [(lambda: GRPOConfig(loss="nope"), "loss"), (lambda: GRPOConfig(advantage="nope"), "advantage"),
                        (lambda: GRPOConfig(sampler="nope"), "sampler")]:
        with pytest.raises(ValueError) as e:
            make()
        assert "\n" not in str(e.value) and f"GRPOConfig.{field}='nope'" in str(e.value)
    with pytest.raises(ValueError) as e:
        B.make_backend("nope", None)
    assert str(e.value) == "unknown rollout backend sampler='nope'; registered: tokengym, vllm"
    with pytest.raises(ValueError, match="^unknown policy loss loss='nope'; registered: clip, gspo, kl-cov, clip-cov$"):
        L.policy_loss("nope")
    with pytest.raises(ValueError, match="^unknown advantage estimator advantage='nope'; registered: outcome, process"):
        A.advantage_estimator("nope")


def test_the_bundled_names_and_the_views():
    assert LOSSES == ("clip", "gspo", "kl-cov", "clip-cov") and tuple(SAMPLERS) == ("tokengym", "vllm")
    assert SAMPLERS is B.SAMPLERS and list(A.ADVANTAGES)[:3] == ["outcome", "process", "rloo"]
    r = Registry("thing")
    with r.registered("a", 1):
        assert r.get("a") == 1
        with r.registered("a", 2):
            assert r.get("a") == 2
        assert r.get("a") == 1
    assert r.names() == ()
