"""Data-parallel training (agents/runtime/distributed.py): a 2-process gloo run equals a 1-process one.

The 2-process run is a real ``torchrun`` launch of ``tokengym train`` (through ``dist_worker.py``, wrapped by
``_numerics.py``, which makes rank 0 save the gradients of every optimizer step); the 1-process reference runs
``tokengym train`` in this process as a 1-process torch.distributed job (same shared prompt and sampling
streams, no communication), in lockstep with the 2-process run: at every optimizer step it records how its own
global gradient differs from the 2-process run's, then steps on the 2-process run's gradient
(``_numerics.Lockstep``). Both runs therefore hold the same weights at every step, and the two computations of
each gradient and logged metric (one batch, or two shards summed over ranks) agree up to float32 rounding.
Comparing the weights of two independent runs instead would amplify that rounding without bound: AdamW's
step is about ``lr * sign(g)`` where ``g`` is at the rounding level, and later steps start from the moved
weights. The 2-process run also checks at every checkpoint that its ranks hold bit-identical weights (it
fails otherwise).
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tokengym.agents.runtime import distributed as D
from tokengym.agents.cli import main
from tokengym.agents.engine.policy import sample_logits
from tokengym.envs.tasks import ArithmeticTask

NUMERICS = pathlib.Path(__file__).parents[1] / "_numerics.py"
_spec = importlib.util.spec_from_file_location("_numerics", NUMERICS)
numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(numerics)

COMMON = ["--eval-prompts", "0", "--save-every", "1", "--threads", "1", "--progress", "false"]
RUNS = {  # name -> command line (GRPO with minibatches, batch scaling and token-mean; PPO with 2 epochs of 2
    # minibatches, whitening, an adaptive KL controller, an entropy bonus and a per-sequence policy loss, so its
    # policy and value losses are weighted by different shares; DPO with a live reference)
    "grpo": ["train", "grpo", "--steps", "3", "--prompts", "2", "--group-size", "4", "--minibatches", "2",
             "--scale-rewards", "batch", "--aggregation", "token-mean", *COMMON],
    "ppo": ["train", "ppo", "--steps", "3", "--prompts", "8", "--mu", "2", "--minibatches", "2", "--whiten-advantages", "true",
            "--aggregation", "seq-mean-token-mean", "--kl-target", "0.01", "--kl-horizon", "100", "--entropy-coef", "0.01", *COMMON],
    # GRPO under a grammar (Arithmetic's own solution format): each rank's rollout masks are gathered with it
    # and the default aggregation (seq-mean-token-mean), whose token statistics (entropy, clip fractions) are combined
    # by each rank's share of the tokens, not of the loss
    "grpo-masked": ["train", "grpo", "--steps", "3", "--prompts", "2", "--group-size", "4", "--minibatches", "2",
                    "--env-kwargs", json.dumps({"grammar": {"regex": r"([0-9]+\+[0-9]+=[0-9]+\n)+A: [0-9]+"}}),
                    *COMMON],
    "dpo": ["train", "dpo", "--steps", "3", "--batch-size", "8", "--num-pairs", "64", *COMMON],
    # SFT's rows split by completion tokens (their lengths differ), a held-out eval before and after (greedy: the
    # same weights score the same on every rank)
    "sft": ["train", "sft", "--steps", "3", "--batch-size", "8", "--warmup-steps", "1", "--log-every", "1", *COMMON,
            "--eval-prompts", "4"],
}


def _commands(runs_dir: str) -> list[list[str]]:
    return [argv + ["--runs-dir", runs_dir, "--name", name] for name, argv in RUNS.items()]


def _metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith(("time/", "perf/"))} for line in f]


# Optimizer steps of each run (GRPO: 3 steps x 2 minibatches; PPO: 3 steps x 2 epochs x 2 minibatches x policy
# and critic optimizers; DPO and SFT: 3 steps), and a bound on the float32 terms summed into one gradient entry:
# the tokens of the largest global minibatch (GRPO 4 rows, PPO 4 rows, DPO 8 pairs = 16 rows, SFT 8 rows; the
# Arithmetic-v0 prompt buffer 11 + 31 completion tokens) times the widest layer of the tiny models (352 features).
OPTIMIZER_STEPS = {"grpo": 6, "grpo-masked": 6, "ppo": 24, "dpo": 3, "sft": 3}
N_TERMS = {"grpo": 4 * 42 * 352, "grpo-masked": 4 * 42 * 352, "ppo": 4 * 42 * 352, "dpo": 16 * 42 * 352, "sft": 8 * 42 * 352}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(two_process_dir, one_process_dir, gradient_diffs)``: the same runs with 2 ranks (torchrun; rank 0
    saves each optimizer step's gradients) and 1 rank (in-process, in lockstep with them; ``gradient_diffs[name]``
    holds, per optimizer step of that run, how its gradients differed, see ``_numerics.Lockstep``)."""
    root = tmp_path_factory.mktemp("dist")
    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "dist_worker.py")
    diffs = numerics.two_against_one(root, worker, _commands(str(root / "two")), _commands(str(root / "one")), main)
    return root / "two", root / "one", dict(zip(RUNS, diffs))


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_match_one(runs, name):
    """Every optimizer step's global gradient (after the all-reduce and clipping) equals the 1-process one up
    to float32 rounding (``_numerics.rounding_tolerance``); the final weights are bit-identical, as both runs'
    AdamW stepped on the same gradients from the same weights; the logged metrics agree up to rounding."""
    two, one, diffs = runs
    numerics.assert_gradients_match(diffs[name], OPTIMIZER_STEPS[name], N_TERMS[name], f"{name} 1 vs 2 processes")
    a = load_file(str(two / name / "model" / "model.safetensors"))
    b = load_file(str(one / name / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    init = load_file(str(one / name / "checkpoints" / "step-00000002" / "policy.safetensors"))
    moved = max(float((b[k] - init[k]).abs().max()) for k in b)
    assert moved > 1e-5  # the last step changed the weights, so the comparison means something
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name} {k}: max |diff| {float((a[k] - b[k]).abs().max()):.3g}"
    m2, m1 = _metrics(str(two / name / "metrics.jsonl")), _metrics(str(one / name / "metrics.jsonl"))
    assert [r["step"] for r in m2] == [r["step"] for r in m1]  # rank 0 alone wrote the log (no duplicates)
    assert sorted({r["step"] for r in m2} - {0}) == [1, 2, 3]  # (SFT evaluates at step 0 too)
    for r2, r1 in zip(m2, m1):
        assert r2.keys() == r1.keys()
        for k in set(r1) - {"train/packed"}:  # packing='auto' decides on each rank's own rows: half the batch here
            assert r2[k] == pytest.approx(r1[k], rel=1e-4, abs=1e-5), (name, r1["step"], k)


def test_ppo_critic_and_kl_controller_match_one_process(runs):
    """The critic's weights are bit-identical (its optimizer stepped on the same gradients in lockstep, checked
    by test_two_processes_match_one), and so is the adaptive KL controller's beta up to rounding of the KL."""
    two, one, _ = runs
    last, before = (f"ppo/checkpoints/step-0000000{k}" for k in (3, 2))
    a, b = load_file(str(two / last / "critic.safetensors")), load_file(str(one / last / "critic.safetensors"))
    init = load_file(str(one / before / "critic.safetensors"))
    assert a.keys() == b.keys() and max(float((b[k] - init[k]).abs().max()) for k in b) > 1e-5
    for k in a:
        assert torch.equal(a[k], b[k]), f"critic {k}: max |diff| {float((a[k] - b[k]).abs().max()):.3g}"
    s2, s1 = (torch.load(str(d / last / "trainer_state.pt"), weights_only=False)["agent"] for d in (two, one))
    assert s1["kl_controller"]["value"] != 0.05  # the adaptive controller moved beta
    assert s2["kl_controller"]["value"] == pytest.approx(s1["kl_controller"]["value"], rel=1e-6)


def test_ppo_global_explained_variance_is_the_one_value_loss_reports():
    from tokengym.agents import functional as F
    from tokengym.agents.algorithms.ppo import global_stats

    g = torch.Generator().manual_seed(0)
    ret, values = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    _, stats = F.value_loss(values, values, ret, am)
    dp = D.DataParallel(0, 1, True)  # a 1-process run: no communication
    out = global_stats(dp, dict(stats, ratio_max=2.0), 1.0, 1.0, values, ret, am)
    assert out["explained_variance"] == pytest.approx(float(stats["explained_variance"]), rel=1e-5)
    assert out["ratio_max"] == 2.0 and out["value_mean"] == pytest.approx(float(stats["value_mean"]))
    same = global_stats(dp, stats, 1.0, 1.0, torch.zeros(4, 5), torch.ones(4, 5), am)
    assert same["explained_variance"] == 0.0  # constant returns: undefined, reported as 0 like value_loss


def test_all_same_spots_a_diverged_rank(runs):
    with open(runs[0] / "all_same.json") as f:
        assert json.load(f) == {"same": None, "differs": "m.1.bias"}


def test_inverse_cdf_sampling_matches_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]])).expand(4000, -1)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    tok, logp = sample_logits(logits, uniform=u)
    freq = torch.bincount(tok, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.03, rtol=0)
    # log(softmax) against log_softmax: each is a few roundings of a probability >= 0.1 (relative 2^-24 each), so
    # they agree to a few 1e-7 in log space
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(1, tok[:, None])[:, 0], atol=1e-6, rtol=0)
    # hand-computed: cumulative [0.1, 0.1, 0.7, 1.0]; a zero-probability token is never returned
    edge = torch.tensor([0.0, 0.0999, 0.1001, 0.7001, 1.0 - 1e-7])
    tok, _ = sample_logits(logits[:5], uniform=edge)
    assert tok.tolist() == [0, 0, 2, 3, 3]
    tok, _ = sample_logits(torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(3, -1), top_k=2, uniform=torch.tensor([0.0, 0.5, 1.0 - 1e-7]))
    assert set(tok.tolist()) <= {0, 1}
    # u * total rounded up to the total (u = 1 here) lands past every column: the last token of probability > 0
    tok, _ = sample_logits(torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]), top_k=2, uniform=torch.ones(2))
    assert tok.tolist() == [1, 3]


def test_inverse_cdf_sampling_prints_no_warning():
    """torch warns once per process, on stderr, about strided arguments of searchsorted: a fresh process, then."""
    code = ("import torch; from tokengym.agents.engine.policy import sample_logits; "
            "print(sample_logits(torch.randn(4, 50), uniform=torch.rand(4))[0].shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "torch.Size([4])" and out.stderr == "", out.stderr


def test_sharded_task_keeps_the_global_prompt_stream():
    task = ArithmeticTask(n_operands=2, digits=2, operators="+")
    full = task.batch(np.random.default_rng(3), 6)
    rngs = [np.random.default_rng(3) for _ in range(3)]
    shards = [D.ShardedTask(task, r, 3).batch(rngs[r], 2) for r in range(3)]
    assert [s for shard in shards for s in shard] == full
    assert D.ShardedTask(task, 0, 3).name == task.name  # everything else is the task's


def test_shard_weights_add_up_and_local_is_the_identity():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    idx = torch.tensor([3, 0, 1, 2])
    assert D.LOCAL.shard(idx) == (idx, 1.0)
    for agg, total in (("token-mean", 6), ("seq-mean-token-mean", 3), ("seq-mean-token-sum", 4)):
        w = D.aggregation_weights(mask, agg)
        shares = [D.DataParallel(r, 2, True).shard(idx, w) for r in range(2)]
        assert torch.equal(torch.cat([s for s, _ in shares]), idx)
        assert sum(x for _, x in shares) == pytest.approx(1.0)
        assert shares[0][1] == pytest.approx(float(w[idx[:2]].sum()) / total)
    with pytest.raises(ValueError, match="cannot be split over 3 processes"):
        D.DataParallel(0, 3, True).shard(idx[:2])
    ro = object()
    assert D.LOCAL.gather(ro) is ro and D.LOCAL.weighted({"a": 1}, 0.5) == {"a": 1}
