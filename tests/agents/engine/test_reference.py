"""Reference models: a frozen copy, or the policy with its LoRA adapter disabled (peft)."""

import pytest
import torch

from tokengym.agents import Policy, collect
from tokengym.agents.engine.policy import AdapterDisabledReference, make_reference
from tokengym.envs import TokenVectorEnv


def rollout(policy):
    return collect(TokenVectorEnv(4, "arithmetic", max_new_tokens=8), policy, seed=0)


def test_frozen_copy_reference_stays_put_while_the_policy_trains():
    policy = Policy.from_pretrained("tiny")
    ref = make_reference(policy)
    ro = rollout(policy)
    before = ref(ro.tokens, ro.attention_mask, ro.prompt_len)
    assert torch.allclose(before, policy(ro.tokens, ro.attention_mask, ro.prompt_len).detach(), atol=1e-5)
    assert not any(p.requires_grad for p in ref.model.parameters())
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    (policy(ro.tokens, ro.attention_mask, ro.prompt_len) * ro.action_mask).sum().backward()
    opt.step()
    with torch.no_grad():
        after_policy = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    assert torch.equal(ref(ro.tokens, ro.attention_mask, ro.prompt_len), before)
    assert not torch.allclose(after_policy, before)


def test_lora_reference_is_the_base_model_with_the_adapter_disabled():
    peft = pytest.importorskip("peft")
    base = Policy.from_pretrained("tiny")
    ro = rollout(base)
    with torch.no_grad():
        base_logp = base(ro.tokens, ro.attention_mask, ro.prompt_len)
    lora = peft.get_peft_model(base.model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    policy = Policy(lora, base.tokenizer)
    ref = make_reference(policy)
    assert isinstance(ref, AdapterDisabledReference)
    with torch.no_grad():
        adapted = policy(ro.tokens, ro.attention_mask, ro.prompt_len)
    assert not torch.allclose(adapted, base_logp, atol=1e-4), "a random LoRA adapter should change the policy"
    assert torch.allclose(ref(ro.tokens, ro.attention_mask, ro.prompt_len), base_logp, atol=1e-5)
    # the policy itself still acts with the adapter on, through the generic decode path
    ro2 = rollout(policy)
    with torch.no_grad():
        recomputed = policy(ro2.tokens, ro2.attention_mask, ro2.prompt_len)
    assert ((recomputed - ro2.logprobs) * ro2.action_mask).abs().max() < 1e-4
