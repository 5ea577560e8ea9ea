"""Action masks in the env: MaskablePPO's ``action_masks()`` / ``info["action_mask"]``, forbidden actions refused in one
line, grammars (llguidance) and callables, per-turn grammars in a multi-turn env, the compact record a rollout keeps,
and its exact replay."""

import importlib.util
import pickle
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokengym.envs import TokenEnv, TokenMasks, TokenVectorEnv
from tokengym.envs.masks import ActionMasker, pack_bits, unpack_bits
from tokengym.envs.tasks import CalculatorTask
from tokengym.envs.tasks.tool_call import call_schema, parse_call

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                reason="grammar masks need llguidance: pip install 'tokengym[grammar]'")

DIGITS = {"regex": "-?[0-9]+"}


@settings(max_examples=50)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 40), st.randoms(use_true_random=False))
def test_packed_sets_round_trip_and_select_and_cat_keep_every_row(n, m, V, rnd):
    g = torch.Generator().manual_seed(rnd.randint(0, 2**31))
    allowed = torch.rand(n, m, V, generator=g) < 0.5
    allowed[..., 0] = True  # never empty
    allowed[0, 0] = True  # one unconstrained position
    assert torch.equal(unpack_bits(pack_bits(allowed), V), allowed)
    tm = TokenMasks.from_dense(allowed)
    flat = allowed.reshape(-1, V)
    distinct = len(torch.unique(flat[~flat.all(1)], dim=0)) if not bool(flat.all()) else 0
    assert tm.table.shape == (1 + distinct, -(-V // 8))  # each set stored once, plus row 0: everything allowed
    assert torch.equal(tm.dense(), allowed) and int(tm.index[0, 0]) == 0
    rows = torch.tensor([n - 1, 0])
    assert torch.equal(tm.select(rows).dense(), allowed[rows])
    both = TokenMasks.cat([tm, tm.select(rows)])
    assert torch.equal(both.dense(), torch.cat([allowed, allowed[rows]]))
    assert torch.equal(TokenMasks.from_state(tm.state()).dense(), allowed)


def test_the_single_env_exposes_its_mask_as_maskable_ppo_reads_it_and_refuses_a_forbidden_action():
    env = TokenEnv("arithmetic", grammar=DIGITS)
    tok = env.tokenizer
    _, info = env.reset(seed=0)
    first = {tok.decode([i]) for i in np.flatnonzero(info["action_mask"])}
    assert first == set("-0123456789") and info["action_mask"].dtype == np.int8
    assert np.array_equal(env.action_masks(), info["action_mask"].astype(bool))
    _, _, _, _, info = env.step(tok.convert_tokens_to_ids("4"))
    assert set(np.flatnonzero(info["action_mask"])) == {tok.convert_tokens_to_ids(c) for c in "0123456789"} | {tok.eos_token_id}
    with pytest.raises(ValueError, match=r"^action \d+ \('\+'\) for env 0 is outside its action mask after the prefix '4'$"):
        env.step(tok.convert_tokens_to_ids("+"))
    _, _, term, _, info = env.step(tok.eos_token_id)  # the refused action changed nothing
    assert term and info["completion"] == "4" and "action_mask" not in info


def test_a_callable_mask_and_a_dead_end_name_the_row_and_its_prefix_never_a_nan():
    tok = TokenVectorEnv(1, "arithmetic").tokenizer
    seven, eos = tok.convert_tokens_to_ids("7"), tok.eos_token_id

    def fn(sample, ids):  # "7", then "77", then nothing at all
        return [seven] if len(ids) < 2 else []

    env = TokenVectorEnv(2, "arithmetic", action_mask_fn=fn)
    env.reset(seed=0)
    assert env.action_masks().sum(1).tolist() == [1, 1] and bool(env.action_masks()[:, seven].all())
    env.step(torch.tensor([seven, seven]))
    env.step(torch.tensor([seven, seven]))
    with pytest.raises(ValueError, match=r"^the action mask of env row 0 allows no token after the prefix '77' "
                                         r"\(action_mask_fn is at a dead end\)"):
        env.action_masks()
    with pytest.raises(ValueError, match="action_mask_fn returned token id 999"):
        e = TokenVectorEnv(1, "arithmetic", action_mask_fn=lambda s, ids: [999])
        e.reset(seed=0)
        e.action_masks()
    e = TokenVectorEnv(1, "arithmetic", action_mask_fn=fn)
    e.reset(seed=0)
    with pytest.raises(ValueError, match=r"^action \d+ \('<eos>'\) for env 0 is outside its action mask"):
        e.step(torch.tensor([eos]))  # the callable's mask is enforced: EOS is not "7"


def test_bad_grammars_and_a_missing_library_are_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"^a grammar is a dict with one key of \['json_schema', 'regex', 'lark'\]"):
        TokenVectorEnv(2, "arithmetic", grammar={"pattern": "[0-9]+"})
    with pytest.raises(ValueError, match="pass grammar or action_mask_fn, not both"):
        TokenVectorEnv(2, "arithmetic", grammar=DIGITS, action_mask_fn=lambda s, ids: None)
    with pytest.raises(ValueError, match="does not compile"):
        TokenVectorEnv(2, "arithmetic", grammar={"lark": "start: (("}).reset(seed=0)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=r"^grammar masks need llguidance, which is not installed: pip install "
                                          r"'tokengym\[grammar\]'$"):
        TokenVectorEnv(2, "tool_call")
    assert TokenVectorEnv(2, "tool_call", grammar=False).masker is None  # the task's grammar switched off


def test_a_masked_env_crosses_to_a_process_and_keeps_masking():
    env = gym.make_vec("tokengym/ToolCall-v0", num_envs=2, vectorization_mode="vector_entry_point")
    copy = pickle.loads(pickle.dumps(env))
    env.reset(seed=1)
    copy.reset(seed=1)
    assert torch.equal(env.action_masks(), copy.action_masks()) and int(copy.action_masks().sum()) == 2  # '{"'
    for ch in '{"expression":"1':  # and mid-episode: the copy's grammar goes on from the same place
        env.step(torch.full((2,), env.tokenizer.convert_tokens_to_ids(ch)))
    mid = pickle.loads(pickle.dumps(env))
    assert torch.equal(env.action_masks(), mid.action_masks()) and 10 < int(mid.action_masks()[0].sum()) < 20


def _replay(env_like, ro):
    """The grammar run again over the rollout's own tokens: the allowed set at every action column."""
    N, M, V = ro.action_mask.shape[0], ro.action_mask.shape[1], env_like.vocab_size
    masker = ActionMasker(N, M, V, env_like.tokenizer, torch.device("cpu"), spec_for=env_like.task.grammar_for)
    masker.start(range(N), ro.samples)
    out = torch.ones(N, M, V, dtype=torch.bool)
    gen = ro.tokens[:, ro.prompt_len:]
    for t in range(M):
        live = ro.action_mask[:, t].bool()
        if not live.any():
            break
        out[live, t] = masker.allowed(live)[live]
        masker.take(live, gen[:, t], torch.full((N,), t))
    return out


def test_sampled_tokens_stay_inside_their_masks_and_the_record_replays_exactly():
    from tokengym.agents import Policy, collect
    from tokengym.agents.engine.rollout import collect_episodes

    policy = Policy.from_pretrained("tiny-arithmetic", seed=0)
    env = TokenVectorEnv(16, "tool_call", group_size=4)
    ro = collect(env, policy, seed=0)
    dense = ro.token_masks.dense()
    gen = ro.tokens[:, ro.prompt_len:]
    act = ro.action_mask.bool()
    assert bool(dense.gather(2, gen[..., None])[..., 0][act].all())  # every sampled token inside its own mask
    assert all(parse_call(c) is not None for c in ro.completions)  # so every call parses
    assert torch.equal(dense[act], _replay(env, ro)[act])  # the record is the grammar's own sets, token for token
    assert bool((ro.token_masks.index[~act] == 0).all()) and ro.token_masks.nbytes < dense.numel() // 8
    free = collect(TokenVectorEnv(16, "tool_call", group_size=4, grammar=False), policy, seed=0)
    assert free.token_masks is None and not any(parse_call(c) for c in free.completions)
    # continuous batching: rows refilled mid-rollout keep their own grammar state
    nxt = TokenVectorEnv(4, "tool_call", autoreset_mode="next_step")
    eps = collect_episodes(nxt, policy, n=10)
    gen, act = eps.tokens[:, eps.prompt_len:], eps.action_mask.bool()
    assert bool(eps.token_masks.dense().gather(2, gen[..., None])[..., 0][act].all())
    assert all(parse_call(c) is not None for c in eps.completions)


class _FirstTurnCall(CalculatorTask):
    """The Calculator, whose first agent turn must be one well-formed call; later turns are free."""

    def grammar_for(self, sample, turn):
        return {"regex": r"<calc>[0-9]+[+*-][0-9]+</calc>"} if turn == 0 else None


def test_a_multi_turn_env_can_constrain_only_its_tool_call_turns():
    from tokengym.agents import Policy, collect

    policy = Policy.from_pretrained("tiny-calculator", seed=0)
    env = TokenVectorEnv(8, _FirstTurnCall(), max_new_tokens=40)
    ro = collect(env, policy, seed=0)
    P = ro.prompt_len
    texts = [env.tokenizer.decode(r[P:][m[P:].bool()]) for r, m in zip(ro.tokens, ro.attention_mask)]
    assert all(t.startswith("<calc>") and "</calc>=" in t for t in texts), texts  # every episode called, and got an answer
    masked = ro.token_masks.masked
    first_turn = torch.zeros_like(masked)
    for i, t in enumerate(texts):
        first_turn[i, : t.index("</calc>") + len("</calc>")] = True
    assert bool(masked[first_turn & ro.action_mask.bool()].sum() > 0)
    assert not bool(masked[~first_turn].any())  # the reply and the answer turn: unconstrained


def test_masking_logits_in_place_and_through_the_bool_sets_agree():
    """``mask_logits``: llguidance's bitmask kernel (CPU, float32) and the unpacked sets (elsewhere) forbid the same
    tokens, and a head wider than the tokenizer gets -inf on its extra ids."""
    env = TokenVectorEnv(4, "tool_call")
    env.reset(seed=0)
    for tok in "{\"expression\":\"1":  # into the string, where the sets are wide
        env.step(torch.full((4,), env.tokenizer.convert_tokens_to_ids(tok)))
    rows = torch.tensor([2, 0])
    logits = torch.randn(2, env.vocab_size + 3)
    fast = env.mask_logits(logits.clone(), rows)
    slow = env.mask_logits(logits.double(), rows)
    allowed = env.action_masks()[rows]
    assert torch.equal(torch.isfinite(fast), torch.isfinite(slow))
    assert torch.equal(torch.isfinite(fast[:, : env.vocab_size]), allowed) and not bool(torch.isfinite(fast[:, -3:]).any())
    assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])
    assert 10 < int(allowed[0].sum()) < env.vocab_size


def test_a_rollouts_masks_survive_an_async_checkpoint_and_a_gather_stores_each_set_once(tmp_path):
    """What a bounded async run saves (loaded back with ``weights_only=True``), and what concatenating two ranks'
    rollouts gives: the same sets at every position, each distinct set once."""
    from tokengym.agents import Policy, collect
    from tokengym.agents.engine.rollout import concat_rollouts
    from tokengym.agents.engine.messages import decode_rollout, encode_rollout

    ro = collect(TokenVectorEnv(8, "tool_call", group_size=4), Policy.from_pretrained("tiny-arithmetic", seed=0), seed=0)
    data = encode_rollout(ro, {}, {"env": None, "rng": torch.zeros(1, dtype=torch.uint8)})  # a worker's message
    torch.save({"rollout": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, tmp_path / "ro.pt")  # as kept
    back, _, _ = decode_rollout(torch.load(tmp_path / "ro.pt", weights_only=True)["rollout"].numpy().tobytes())
    assert torch.equal(back.token_masks.dense(), ro.token_masks.dense())
    both = concat_rollouts([ro, ro.select([3, 1])])
    assert torch.equal(both.token_masks.dense(), torch.cat([ro.token_masks.dense(), ro.token_masks.dense()[[3, 1]]]))
    assert both.token_masks.table.shape == ro.token_masks.table.shape
