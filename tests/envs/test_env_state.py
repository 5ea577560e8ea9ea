"""``TokenVectorEnv.state_dict``: a rebuilt env continues the prompt stream exactly (exact resume)."""

import io

import gymnasium as gym
import pytest
import torch

import tokengym.envs  # noqa: F401


def make(env_id: str, **kw):
    return gym.make_vec(env_id, num_envs=4, vectorization_mode="vector_entry_point", group_size=2, **kw)


def prompts(env) -> list[str]:
    env.reset()
    return [s["prompt"] for s in env.samples] + [int(env.group_id[0])]


@pytest.mark.parametrize("env_id,kw", [
    ("tokengym/Arithmetic-v0", {}),
    ("tokengym/Dataset-v0", {"data": [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)], "shuffle": True}),
])
def test_state_roundtrip_continues_stream(env_id, kw):
    a = make(env_id, **kw)
    a.reset(seed=3)
    prompts(a)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # must survive the checkpoint format
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    expected = [prompts(a) for _ in range(4)]  # crosses a Dataset epoch boundary
    b = make(env_id, **kw)
    b.load_state_dict(state)
    assert [prompts(b) for _ in range(4)] == expected


def test_fresh_env_differs_without_state():
    a = make("tokengym/Arithmetic-v0")
    a.reset(seed=3)
    state = a.state_dict()
    nxt = prompts(a)
    b = make("tokengym/Arithmetic-v0")
    b.reset(seed=4)
    assert prompts(b) != nxt
    b.load_state_dict(state)
    assert prompts(b) == nxt


def test_bad_state_is_named():
    with pytest.raises(ValueError, match="missing"):
        make("tokengym/Arithmetic-v0").load_state_dict({"np_random": {}})
