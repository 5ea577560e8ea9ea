"""The rollout's record of action masks keeps every generated column's set, the last column of the budget included
(issue 52's missed mutation: a record that stops one column short lets the trainer score an episode's last token
over the whole vocabulary although it was sampled under a mask)."""

import torch

from tokengym.envs import TokenVectorEnv

DIGITS = "0123456789"


def test_every_generated_column_keeps_its_own_set_up_to_the_budgets_last():
    """Column ``c`` allows the digits ``c`` and ``c + 1`` only (a different set per column, never EOS), so each
    episode runs to its budget; the record's set at every column, the last included, is that column's."""
    M = 4
    tok = TokenVectorEnv(1, "arithmetic").tokenizer
    ids = [tok.convert_tokens_to_ids(d) for d in DIGITS]
    env = TokenVectorEnv(2, "arithmetic", max_new_tokens=M, action_mask_fn=lambda sample, prefix: ids[len(prefix):len(prefix) + 2])
    env.reset(seed=0)
    for c in range(M):
        assert not bool(env.done.any())
        env.step(torch.tensor([ids[c], ids[c + 1]]))
    assert bool(env.done.all()) and bool(env.truncated.all())
    rec = env.record()
    assert rec["action_mask"].sum(1).tolist() == [M, M]
    dense = rec["token_masks"].dense()
    for c in range(M):
        allowed = torch.zeros(env.vocab_size, dtype=torch.bool)
        allowed[ids[c:c + 2]] = True
        assert torch.equal(dense[0, c], allowed) and torch.equal(dense[1, c], allowed), f"column {c}"
    assert bool((rec["token_masks"].index != 0).all())  # no column fell back to "everything allowed"
