"""FSDP2 sharding (agents/runtime/sharding.py, ``--sharding fsdp2``): a 2-process gloo run on CPU equals a 1-process one.

As in ``test_distributed.py`` the 2-process run is a real ``torchrun`` launch (every module sharded over both
ranks; rank 0 saves each optimiser step's gradients, gathered from the shards) and the 1-process reference is
an unsharded run in this process, in lockstep with it (``_numerics.Lockstep``). Then a sharded run killed after
a checkpoint and resumed ends exactly where the uninterrupted one did.
"""

import contextlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tokengym.agents.cli import main
from tokengym.agents.runtime import runs as R
from tokengym.agents.runtime import sharding as S

NUMERICS = pathlib.Path(__file__).parents[1] / "_numerics.py"
_spec = importlib.util.spec_from_file_location("_numerics", NUMERICS)
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)
_spec = importlib.util.spec_from_file_location("_processes", pathlib.Path(__file__).parents[2] / "_processes.py")
processes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(processes)

pytestmark = pytest.mark.skipif(S.unsupported_reason() is not None, reason="this torch has no FSDP2")

COMMON = ["--eval-prompts", "0", "--save-every", "1", "--threads", "1", "--progress", "false"]
RUNS = {  # as in test_distributed.py: GRPO with minibatches, batch scaling and token-mean; PPO with its critic,
    # 2 epochs of 2 minibatches and an adaptive KL (so a sharded frozen reference); DPO with a live reference
    "grpo": ["train", "grpo", "--steps", "3", "--prompts", "2", "--group-size", "4", "--minibatches", "2",
             "--scale-rewards", "batch", "--aggregation", "token-mean", *COMMON],
    "ppo": ["train", "ppo", "--steps", "3", "--prompts", "8", "--mu", "2", "--minibatches", "2", "--whiten-advantages", "true",
            "--aggregation", "seq-mean-token-mean", "--kl-target", "0.01", "--kl-horizon", "100", "--entropy-coef", "0.01", *COMMON],
    "dpo": ["train", "dpo", "--steps", "3", "--batch-size", "8", "--num-pairs", "64", *COMMON],
    "rloo": ["train", "rloo", "--steps", "3", "--prompts", "2", "--group-size", "4", *COMMON],
    "reinforce-pp": ["train", "reinforce-pp", "--steps", "3", "--prompts", "8", "--beta", "0.05", *COMMON],  # a KL reference
    "distill": ["train", "distill", "--teacher", "tiny-arithmetic", "--model", "tiny", "--steps", "3", "--prompts", "2",
                "--group-size", "4", "--estimator", "topk", "--top-k", "8", *COMMON],  # an unsharded teacher per rank
    "sft": ["train", "sft", "--steps", "3", "--batch-size", "8", "--warmup-steps", "1", "--log-every", "1", *COMMON,
            "--eval-prompts", "4"],  # a greedy held-out evaluation: a rollout on gathered weights, before and after
}
OPTIMIZER_STEPS = {"grpo": 6, "ppo": 24, "dpo": 3, "rloo": 3, "reinforce-pp": 3, "distill": 3, "sft": 3}
N_TERMS = {"grpo": 4 * 42 * 352, "ppo": 4 * 42 * 352, "dpo": 16 * 42 * 352, "rloo": 8 * 42 * 352, "reinforce-pp": 8 * 42 * 352,
           "distill": 8 * 42 * 352,
           "sft": 8 * 42 * 352}  # see test_distributed
FSDP2 = ["--sharding", "fsdp2"]


def _commands(runs_dir, extra=()) -> list[list[str]]:
    return [argv + [*extra, "--runs-dir", str(runs_dir), "--name", name] for name, argv in RUNS.items()]


def _metrics(path) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith(("time/", "perf/"))} for line in f]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """``(fsdp2_dir, one_process_dir, gradient_diffs)``: each run sharded over 2 ranks with its forwards packed
    (``--packing bins``: the sharded ranks still run the same passes), and unsharded and padded in 1 process in
    lockstep with it."""
    root = tmp_path_factory.mktemp("fsdp2")
    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "dist_worker.py")
    diffs = numerics.two_against_one(root, worker, _commands(root / "two", [*FSDP2, "--packing", "bins"]),
                                     _commands(root / "one", ["--packing", "off"]), main)
    return root / "two", root / "one", dict(zip(RUNS, diffs))


@pytest.mark.parametrize("name", list(RUNS))
def test_fsdp2_matches_one_process(sharded, name):
    """Every optimiser step's gradient (FSDP2's reduce-scatter, gathered) equals the 1-process one up to float32
    rounding; AdamW on the shards leaves the same final weights as AdamW on the whole tensors; the logged
    metrics agree up to rounding (the clipping norm is the sharded total norm)."""
    two, one, diffs = sharded
    numerics.assert_gradients_match(diffs[name], OPTIMIZER_STEPS[name], N_TERMS[name], f"{name} fsdp2 vs 1 process")
    a = load_file(str(two / name / "model" / "model.safetensors"))
    b = load_file(str(one / name / "model" / "model.safetensors"))
    init = load_file(str(one / name / "checkpoints" / "step-00000002" / "policy.safetensors"))
    assert a.keys() == b.keys() and max(float((b[k] - init[k]).abs().max()) for k in b) > 1e-5
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name} {k}: max |diff| {float((a[k] - b[k]).abs().max()):.3g}"
    m2, m1 = _metrics(two / name / "metrics.jsonl"), _metrics(one / name / "metrics.jsonl")
    assert [r["step"] for r in m2] == [r["step"] for r in m1]
    assert sorted({r["step"] for r in m2} - {0}) == [1, 2, 3]  # (SFT evaluates at step 0 too)
    for r2, r1 in zip(m2, m1):
        assert r2.keys() == r1.keys()
        for k in r1:
            if k.startswith("mismatch/") and k.endswith("_max"):  # a rounding gap itself: bounded, not reproduced
                assert abs(r2[k]) < 1e-3, (name, r1["step"], k)
                continue
            assert r2[k] == pytest.approx(r1[k], rel=1e-4, abs=1e-5), (name, r1["step"], k)


def test_fsdp2_checkpoints_hold_full_unsharded_state(sharded):
    """A sharded run's checkpoint is an unsharded run's: intact manifest, the same modules (PPO: policy, critic,
    reference) with whole tensors, and optimiser moments of the parameters' full shapes, equal to the reference's."""
    two, one, _ = sharded
    for name, modules in (("ppo", {"policy", "critic", "ref"}), ("dpo", {"policy", "ref"}), ("grpo", {"policy"}),
                          ("reinforce-pp", {"policy", "ref"})):
        ckpt = two / name / "checkpoints" / "step-00000002"
        assert R.verify_checkpoint(str(ckpt)) is None
        for key in modules:
            a, b = load_file(str(ckpt / f"{key}.safetensors")), load_file(str(one / name / ckpt.relative_to(two / name) / f"{key}.safetensors"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, key)
        s2, s1 = (torch.load(str(d / name / "checkpoints" / "step-00000002" / "trainer_state.pt"), weights_only=False)["agent"]
                  for d in (two, one))
        for opt in ("policy_optimizer", "critic_optimizer") if name == "ppo" else ("optimizer",):
            assert s1[opt]["state"] and s2[opt]["state"].keys() == s1[opt]["state"].keys()
            for k, v in s1[opt]["state"].items():
                assert type(s2[opt]["state"][k]["exp_avg"]) is torch.Tensor
                assert torch.equal(s2[opt]["state"][k]["exp_avg_sq"], v["exp_avg_sq"]), (name, opt, k)


def _torchrun(argv: list[str], log, **env) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           f"--rdzv-endpoint=127.0.0.1:{numerics.free_port()}", "--rdzv-backend=c10d", "-m", "tokengym.agents.cli", *argv]
    with open(log, "a") as f:
        return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **env), stdout=f, stderr=subprocess.STDOUT,
                              timeout=600).returncode


def test_fsdp2_kill_and_resume_equals_the_uninterrupted_run(sharded, tmp_path):
    """SIGKILL after step 2's checkpoint, then ``--resume`` with 2 sharded ranks: the final weights, the last
    checkpoint (optimiser included) and every logged record equal those of the uninterrupted sharded run."""
    two = sharded[0]
    argv = RUNS["grpo"] + FSDP2 + ["--packing", "bins", "--runs-dir", str(tmp_path), "--name", "grpo"]  # as the fixture's
    log = tmp_path / "log.txt"
    assert _torchrun(argv, log, TOKENGYM_SIGKILL_AFTER_STEP="2") != 0
    assert not (tmp_path / "grpo" / "model").exists() and (tmp_path / "grpo" / "checkpoints" / "step-00000002").is_dir()
    assert _torchrun(["train", "grpo", "--resume", str(tmp_path / "grpo"), "--threads", "1", "--progress", "false"], log) == 0, \
        log.read_text()[-3000:]
    a, b = load_file(str(tmp_path / "grpo" / "model" / "model.safetensors")), load_file(str(two / "grpo" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s_resumed, s_whole = (torch.load(str(d / "grpo" / "checkpoints" / "step-00000003" / "trainer_state.pt"), weights_only=False)
                          for d in (tmp_path, two))
    for k, v in s_whole["agent"]["optimizer"]["state"].items():
        assert torch.equal(s_resumed["agent"]["optimizer"]["state"][k]["exp_avg"], v["exp_avg"])
    assert _metrics(tmp_path / "grpo" / "metrics.jsonl") == _metrics(two / "grpo" / "metrics.jsonl")


def test_a_sharded_checkpoint_resumes_in_one_unsharded_process(sharded, tmp_path):
    """Resuming with another process count works (checkpoints hold full state): the killed 2-rank run resumes in
    this process, and its step-3 rollout (sampled with the restored weights and generator) is the 2-rank run's."""
    import shutil

    two = sharded[0]
    shutil.copytree(two / "grpo", tmp_path / "grpo")
    shutil.rmtree(tmp_path / "grpo" / "model")
    shutil.rmtree(tmp_path / "grpo" / "checkpoints" / "step-00000003")
    os.remove(tmp_path / "grpo" / "checkpoints" / "latest")
    assert main(["train", "grpo", "--resume", str(tmp_path / "grpo"), "--sharding", "none", "--threads", "1",
                 "--progress", "false"]) == 0
    last = _metrics(tmp_path / "grpo" / "metrics.jsonl")[-1]
    whole = _metrics(two / "grpo" / "metrics.jsonl")[-1]
    assert last["step"] == whole["step"] == 3
    rollout = [k for k in whole if k.startswith(("reward", "rollout/", "completions/"))]
    assert rollout and all(last[k] == whole[k] for k in rollout), rollout


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, env, message", [
    (["train", "grpo", "--sharding", "fsdp2"], {}, "this is a single process"),
    (["train", "grpo", "--sharding", "zero3"], {}, "invalid sharding='zero3'; choose one of none, fsdp2"),
    (["train", "ppo", "--sharding", "fsdp2", "--share-trunk", "true"], {"WORLD_SIZE": "2"}, "share_trunk"),
    (["train", "grpo", "--sharding", "fsdp2", "--reset-ref", "true", "--beta", "0.1"], {"WORLD_SIZE": "2"}, "reset_ref"),
    (["train", "spin", "--sharding", "fsdp2"], {}, "does not apply to `tokengym train spin`"),
    (["train", "grpo", "--dist-timeout", "1"], {}, "dist_timeout"),
])
def test_bad_sharding_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(argv + ["--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_a_torch_without_fsdp2_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(S, "unsupported_reason", lambda: "torch 2.0 has no FSDP2")
    assert main(["train", "dpo", "--sharding", "fsdp2", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().endswith("--sharding fsdp2: torch 2.0 has no FSDP2")
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------- the pieces, 1 rank
@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(numerics.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_shard_points_the_optimiser_and_its_state_at_the_shards(one_rank):
    """A resumed optimiser's moments follow their parameters into the shards; clipping and stepping then act on
    the sharded parameters, and the whole weights equal an unsharded copy's step (one rank: the same arithmetic)."""
    from torch.distributed.tensor import DTensor

    from tokengym.agents.engine.models import build_preset
    from tokengym.rewards.training import OptimizerStep

    def make():
        model, _ = build_preset("tiny", seed=1)
        return model, OptimizerStep.adamw(model.parameters(), 1e-2, max_grad_norm=0.5)

    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(0))

    def train_step(model, step):
        step.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return step.step()

    ref, ref_step = make()
    model, step = make()
    for m, s in ((ref, ref_step), (model, step)):
        train_step(m, s)  # optimiser state to carry over
    S.shard({"policy": model}, [step])
    params = [p for g in step.optimizers[0].param_groups for p in g["params"]]
    assert all(isinstance(p, DTensor) for p in params) and step.params == params
    assert set(step.optimizers[0].state) == set(params)
    assert all(isinstance(s["exp_avg"], DTensor) for s in step.optimizers[0].state.values())
    norm_ref, norm = train_step(ref, ref_step)["grad_norm"], train_step(model, step)["grad_norm"]
    assert float(norm) == pytest.approx(float(norm_ref), rel=1e-6)
    full = S.full_state(dict(model.state_dict()))
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6)


def test_full_weights_gathers_for_the_block_and_keeps_ties(one_rank):
    from torch.distributed.tensor import DTensor

    from tokengym.agents.engine.models import build_preset

    model, _ = build_preset("tiny", seed=1, tie_word_embeddings=True)
    S.shard({"policy": model})
    w = lambda: model.model.layers[0].self_attn.q_proj.weight  # noqa: E731
    assert isinstance(w(), DTensor) and S.is_sharded(model)
    with torch.inference_mode(), S.full_weights(model):  # as in a rollout
        assert type(w()) is torch.nn.Parameter and w().shape == (128, 128)
    assert isinstance(w(), DTensor)
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()  # gathered buffers are no inference tensors
    full = S.full_state(dict(model.state_dict(keep_vars=True)))
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]  # one tensor: saved once, as unsharded
    with S.unwrapped(model):
        assert type(model).__name__ == "LlamaForCausalLM"
    assert type(model).__name__ == "FSDPLlamaForCausalLM"


def test_a_stopped_rank_stops_the_run_after_dist_timeout_in_one_line(tmp_path):
    """Rank 1 SIGSTOPs itself after step 1: rank 0 waits ``--dist-timeout`` seconds in the next collective, not
    torch's 30 minutes, then says so in one line (exit 1); the checkpoint of step 1 stays intact."""
    import signal
    import time

    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           f"--rdzv-endpoint=127.0.0.1:{numerics.free_port()}", "--rdzv-backend=c10d", "-m", "tokengym.agents.cli",
           "train", "grpo", "--steps", "3", "--prompts", "2", "--group-size", "2", "--eval-prompts", "0", "--save-every",
           "1", "--threads", "1", "--progress", "false", "--dist-timeout", "10", "--runs-dir", str(tmp_path), "--name", "s"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", TOKENGYM_SIGSTOP_RANK_AFTER_STEP="1,1"),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    want = "tokengym: error: rank 0: the other ranks did not join a collective within 10 s (dist_timeout)"
    try:
        for _ in range(600):  # (a bound on a hang, not a timing assertion)
            if want in log.read_text() or proc.poll() is not None:
                break
            time.sleep(0.5)
        text = log.read_text()
    finally:  # torchrun and its ranks (each in a session of its own): the stopped one continued, then killed
        ranks = processes.descendants(proc.pid)
        for pid in [proc.pid, *ranks]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        proc.wait()
    assert want in text, text[-3000:]
    assert "Traceback" not in text.split(want)[0][-2000:]  # rank 0's own error is the one line
    assert R.verify_checkpoint(str(tmp_path / "s" / "checkpoints" / "step-00000001")) is None
