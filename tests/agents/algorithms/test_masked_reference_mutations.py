"""Masked training scores the reference under the masks too (issue 52's missed mutation: a reference scored over the
whole vocabulary while pi_old and pi_theta are masked puts the log-mass of the forbidden tokens into every token's
KL, a penalty the policy can never reduce)."""

import pytest
import torch

from tokengym.agents import GRPOAgent, GRPOConfig, Policy
from tokengym.envs import TokenVectorEnv

pytestmark = pytest.mark.usefixtures("one_thread")

# The trainer's forward and the sampler's fast decoder compute a tiny fp32 model's logits in other orders (see
# test_masked_training.py's LP_TOL): a log-prob moves by ~1e-6; what the mutation changes is whole nats.
LP_TOL = 1e-4


def test_the_reference_is_scored_under_the_rollouts_masks():
    """Step 0: the reference is the policy, so under masked training its log-probs are the behaviour (masked)
    log-probs and the KL is 0; the masks (two digits of the random ``tiny``'s whole vocabulary) are far from free."""
    tok = TokenVectorEnv(1, "arithmetic").tokenizer
    two = [tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("8")]
    env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=6, action_mask_fn=lambda sample, prefix: two)
    agent = GRPOAgent(Policy.from_pretrained("tiny", seed=0), GRPOConfig(steps=1, beta=0.1, lr=1e-12, seed=0,
                                                                         mask_training="masked"))
    seen = {}
    prepare = agent.prepare

    def spy(ro, old_logp, ref_logp):
        seen.update(ro=ro, ref_logp=ref_logp)
        return prepare(ro, old_logp, ref_logp)

    agent.prepare = spy
    history = agent.learn(env)
    ro, ref_logp = seen["ro"], seen["ref_logp"]
    act = ro.action_mask.bool()
    assert ro.token_masks is not None and bool(ro.token_masks.masked[act].all())
    assert float((ref_logp - ro.logprobs)[act].abs().max()) < LP_TOL
    assert abs(history[0]["train/kl"]) < LP_TOL
    # the masks matter: the unmasked reference's log-probs of these tokens are whole nats lower
    with torch.no_grad():
        unmasked = agent.ref(ro.tokens, ro.attention_mask, ro.prompt_len)
    assert float((ro.logprobs - unmasked)[act].min()) > 1.0
