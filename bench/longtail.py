"""The long-tailed rollout workload of ``bench/rollout.py``: tokengym's ``collect`` against HF ``generate``.

64 Reverse prompts of mixed length; row ``i`` ends with EOS after exactly ``L_i`` tokens, where the ``L_i`` are the
log-uniform quantiles from 4 to the 256-token budget (``4 * 64 ** (q / 63)``, shuffled over the rows, mean ~61): most
rows finish early and a few run to the budget, as reasoning completions do. Both sides sample (T=1, no top-k/p) with
the same schedule: every stop token is masked until the row's length is reached, then EOS is forced (one op per step
on each side: ``Scheduled.sample`` and a ``LogitsProcessor``). Each side's rows are checked to have exactly ``L_i``
tokens. ``generate`` keeps every row in its batch until the longest ends; ``collect`` drops finished rows (compaction).

Each side runs in its own process (``--one``), ``--repeats`` times after a warm-up; the best time counts.
``gflops`` counts the useful work (every row's prompt and its ``L_i`` tokens) over that time, against the 2048^3
matmul that ``bench/rollout.py`` measures in the same run.
"""

from __future__ import annotations

import time

import torch

from tokengym.agents.engine.policy import Policy
from tokengym.agents.engine.rollout import collect
from tokengym.envs import TokenVectorEnv
from tokengym.envs.tasks import ReverseTask

BUDGET = 256


def schedule(n: int, budget: int = BUDGET) -> torch.Tensor:
    """Each row's completion length: log-uniform quantiles from 4 to ``budget``, in a fixed shuffled order."""
    q = torch.arange(n, dtype=torch.float64) / max(n - 1, 1)
    lengths = (4 * (budget / 4) ** q).round().long().clamp(max=budget)
    return lengths[torch.randperm(n, generator=torch.Generator().manual_seed(0))]


class Scheduled(Policy):
    """Masks every stop token until row ``ids[i]`` has ``lengths[ids[i]] - 1`` tokens, then forces EOS."""

    lengths: torch.Tensor
    stops: torch.Tensor

    def sample(self, logits, greedy=False, ids=None, steps=None):
        logits[:, self.stops] = float("-inf")
        end = steps + 1 >= self.lengths[ids]
        logits[end] = float("-inf")
        logits[end, self.tokenizer.eos_token_id] = 0.0
        return super().sample(logits, greedy, ids=ids, steps=steps)


def force_lengths(policy: Scheduled, prompt_len: int):
    """``generate``'s side of :class:`Scheduled`: a ``LogitsProcessor`` masking ``policy.stops`` until each row of a
    batch laid out with ``prompt_len`` prompt columns has ``policy.lengths[row] - 1`` tokens, then forcing EOS."""
    from transformers import LogitsProcessor

    eos = policy.tokenizer.eos_token_id

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, policy.stops] = float("-inf")
            end = input_ids.shape[1] - prompt_len + 1 >= policy.lengths
            scores[end] = float("-inf")
            scores[end, eos] = 0.0
            return scores

    return Force()


def _load(model_name: str):
    if model_name == "real":
        from tokengym.agents.engine.convert import gguf_folder

        return Scheduled.from_pretrained(gguf_folder("smollm2-135m-instruct"), seed=0)
    return Scheduled.from_pretrained(model_name, seed=0)


def flops(model, prompt_lens: list[int], lengths: list[int]) -> float:
    """Useful FLOPs of the batch: ``bench/rollout.py``'s count for each row's real prompt and completion."""
    from _measure import flops_per_rollout

    return sum(flops_per_rollout(model, 1, p, m) for p, m in zip(prompt_lens, lengths))


def run_side(side: str, model_name: str, n: int, repeats: int) -> dict:
    """One contender's best seconds for the long-tailed batch (``side``: ``tokengym``, ``lockstep`` (``collect`` without
    compaction) or ``generate``)."""
    from transformers import LogitsProcessorList

    policy = _load(model_name)
    policy.model.eval()
    tok = policy.tokenizer
    env = TokenVectorEnv(n, ReverseTask(length=(3, 12)), tokenizer=tok, max_new_tokens=BUDGET, stop_strings=(),
                         reward=lambda prompts, completions, **_: [0.0] * len(completions))
    policy.lengths, policy.stops = schedule(n), env._is_stop.nonzero().flatten()
    eos, P = tok.eos_token_id, env.max_prompt_len
    lengths = policy.lengths

    times = []
    for r in range(repeats + 1):  # round 0 warms up
        torch.manual_seed(r)
        if side in ("tokengym", "lockstep"):  # lockstep: the same rollout without compaction (what it saves)
            t0 = time.perf_counter()
            ro = collect(env, policy, seed=r, compact=side == "tokengym")
            dt = time.perf_counter() - t0
            got = ro.lengths
        else:
            from _measure import timed_generate

            out, dt = timed_generate(policy.model, env, r, max_new_tokens=BUDGET, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                                     logits_processor=LogitsProcessorList([force_lengths(policy, P)]))
            gen = out[:, P:]
            hit = gen == eos
            got = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full_like(lengths, gen.shape[1]))
        if not torch.equal(got.cpu(), lengths):
            raise RuntimeError(f"{side}: completion lengths {got.tolist()} differ from the schedule {lengths.tolist()}")
        if r:
            times.append(dt)
    best = min(times)
    prompt_lens = env.attention_mask[:, :P].sum(1).tolist()
    return {"seconds": round(best, 3), "tok_s": round(int(lengths.sum()) / best, 1),
            "gflops": round(flops(policy.model, prompt_lens, lengths.tolist()) / best / 1e9, 2),
            "mean_len": round(float(lengths.float().mean()), 1), "max_len": int(lengths.max()),
            "fast_path": policy.fast_path_active if side != "generate" else None}


def run_prefill(side: str, model_name: str, repeats: int) -> dict:
    """Best seconds of one GRPO batch's prefill (8 chat prompts x 8 rows, ``side``: ``shared`` encodes each prompt once,
    ``each`` all 64 rows), the step that shared group prefixes shorten."""
    from tokengym.envs.tasks import ArithmeticTask

    policy = _load(model_name)
    policy.model.eval()
    chat = model_name == "real"
    env = TokenVectorEnv(64, ArithmeticTask(n_operands=2, digits=(1, 2), chat=chat), tokenizer=policy.tokenizer,
                         group_size=8, max_new_tokens=32)
    obs, _ = env.reset(seed=0)
    P = env.max_prompt_len
    times = []
    with torch.inference_mode():
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            policy.prefill(obs["tokens"][:, :P], obs["mask"][:, :P], max_new_tokens=32, copies=8 if side == "shared" else 1)
            dt = time.perf_counter() - t0
            policy.end_rollout()
            if r:
                times.append(dt)
    return {"seconds": round(min(times), 4), "prompt_tokens": int(obs["mask"][:, :P].sum(1).float().mean())}
