"""The GPU bench in one command: decode and update speed of real-shaped models on one CUDA device.

    python bench/gpu.py --json                  # one H100: under 8 minutes (--budget-s), no downloads
    python bench/gpu.py --smoke --json          # tiny sizes on the CPU in a few seconds (what the tests run)

Models: Qwen2.5-0.5B and Qwen3-0.6B, their configs built here from the published sizes, weights random (speed does
not depend on them), the bundled char tokenizer (logits past its vocabulary are masked on every side). On a GPU the
weights are fp32 and every contender runs under bf16 autocast, as ``--bf16 true`` trains.

* ``decode``: the long-tailed GRPO shape of ``bench/longtail.py`` (rows in groups of 8, each row ending after exactly
  its scheduled 4..256 tokens, EOS forced there on both sides) at batch 64 and 256: tokengym's ``collect`` through
  ``Policy`` (``fast_path`` says whether its fast decoder serves the architecture) against HF ``generate`` with its
  static cache and ``torch.compile`` (compiled on the warm-up call). ``tokengym_vs_generate``: tokens/s ratio.
* ``update``: one epoch of a GRPO-style update (minibatches of 16 of 64 long-tailed rows: forward with entropies,
  policy-gradient loss, backward, AdamW) ``padded`` (``packing="off"``) against ``packed`` (``packing="bins"``,
  tokengym's 4D-mask packing) and ``varlen``: all of a minibatch's real tokens in one row through a varlen attention
  kernel (flash-attn's, else torch's ``varlen_attn``; "not installed" where neither is; on the CPU under ``--smoke``
  a per-segment SDPA stand-in that checks the plumbing). ``max_logp_gap``: varlen log-probs against the padded ones.
* ``peak_mib``: ``torch.cuda.max_memory_allocated`` of each contender's process after its model loaded.
* CUDA-graph capture of the decode step is not built yet: reported as "not measured".

Each contender runs in its own fresh process (``bench/_isolate.py``) after a warm-up; the best of ``--repeats`` timed
runs counts. Contenders not started within ``--budget-s`` of the start are reported as skipped. ``--smoke`` runs them
in this process instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

from longtail import Scheduled, force_lengths, schedule

MODELS = {
    "qwen2.5-0.5b": ("Qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768)),
    "qwen3-0.6b": ("Qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)),
}
"""Each model's published sizes (both: rope_theta 1e6, RMSNorm eps 1e-6, tied embeddings)."""
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, max_position_embeddings=1024)
FULL = dict(batches=(64, 256), budget=256, rows=64, minibatch=16)
TINY = dict(batches=(8,), budget=12, rows=8, minibatch=4)
VARLEN = "tokengym_bench_varlen"
NOT_BUILT = "not measured (CUDA-graph capture of the decode step is not built yet)"


def build(name: str, smoke: bool, device: str):
    """``(model, tokenizer)``: ``name``'s architecture with its real sizes (tiny ones under ``smoke``), random weights."""
    import transformers

    from tokengym.envs.tokenizer import char_tokenizer

    tok = char_tokenizer()
    arch, sizes = MODELS[name]
    if smoke:
        sizes = {**SMOKE, "head_dim": SMOKE["head_dim"] if arch == "Qwen3" else None}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    cfg = getattr(transformers, f"{arch}Config")(**sizes, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                 pad_token_id=tok.pad_token_id, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    return model.eval(), tok


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def sync(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_mib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.startswith("cuda") else None


class Bench(Scheduled):
    """``Scheduled`` (exact per-row lengths) that also never samples past the tokenizer's vocabulary."""

    vocab: int

    def sample(self, logits, greedy=False, ids=None, steps=None):
        logits[:, self.vocab:] = float("-inf")
        return super().sample(logits, greedy, ids=ids, steps=steps)


# ---------------------------------------------------------------------------------------------- decode
def run_decode(side: str, name: str, n: int, smoke: bool, device: str, repeats: int) -> dict:
    """One decode contender's best seconds and tokens/s on the long-tailed batch of ``n`` rows."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from tokengym.agents import collect
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks import ReverseTask

    sizes = TINY if smoke else FULL
    model, tok = build(name, smoke, device)
    policy = Bench(model, tok, seed=0)
    env = TokenVectorEnv(n, ReverseTask(length=(3, 12)), tokenizer=tok, max_new_tokens=sizes["budget"], stop_strings=(),
                         group_size=8, device=device, reward=lambda prompts, completions, **_: [0.0] * len(completions))
    lengths = schedule(n, sizes["budget"])
    policy.lengths, policy.stops, policy.vocab = lengths.to(device), torch.tensor(env.stop_rule().token_ids, device=device), len(tok)
    P, eos = env.max_prompt_len, tok.eos_token_id

    class Vocab(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, len(tok):] = float("-inf")
            return scores

    def once(seed: int) -> tuple[float, torch.Tensor]:
        torch.manual_seed(seed)
        if side == "tokengym":
            t0 = sync(device)
            with autocast(device):
                got = collect(env, policy, seed=seed).lengths
            return sync(device) - t0, got
        env.reset(seed=seed)
        prompts, mask = env.tokens[:, :P].clone(), env.attention_mask[:, :P].long()
        t0 = sync(device)
        with torch.inference_mode(), autocast(device):
            out = model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, max_new_tokens=sizes["budget"], eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id, cache_implementation="static", disable_compile=smoke,
                                 logits_processor=LogitsProcessorList([Vocab(), force_lengths(policy, P)]))
        dt = sync(device) - t0
        hit = out[:, P:] == eos
        return dt, torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full_like(hit[:, 0], hit.shape[1], dtype=torch.long))

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for r in range(repeats + 1):  # round 0 warms up (and compiles generate's forward)
        dt, got = once(r)
        if not torch.equal(got.cpu(), lengths):
            raise RuntimeError(f"{side}: completion lengths {got.tolist()} differ from the schedule {lengths.tolist()}")
        if r:
            times.append(dt)
    best, tokens = min(times), int(lengths.sum())
    return {"seconds": round(best, 4), "tok_s": round(tokens / best, 1), "tokens": tokens, "peak_mib": peak_mib(device),
            "fast_path": policy.fast_path_active if side == "tokengym" else None,
            "compiled": None if side == "tokengym" else not smoke}


# ---------------------------------------------------------------------------------------------- update
def varlen_kernel(device: str) -> str | None:
    """The varlen attention kernel installed for ``device``, or None."""
    if not device.startswith("cuda"):
        return "sdpa per segment (CPU stand-in)"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash-attn"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return None
    return "torch varlen_attn"


def register_varlen(kernel: str) -> None:
    """Register :data:`VARLEN`: causal attention within each segment of a packed row (``cu_seq_lens_q``)."""
    import torch.nn.functional as F
    from transformers import AttentionInterface, AttentionMaskInterface

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        cu, longest = kw["cu_seq_lens_q"], int(kw["max_length_q"])
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
        if kernel == "flash-attn":
            from flash_attn import flash_attn_varlen_func

            out = flash_attn_varlen_func(*(x.to(torch.bfloat16) for x in (q, k, v)), cu, cu, longest, longest,
                                         softmax_scale=scaling, causal=True)
        elif kernel == "torch varlen_attn":
            from torch.nn.attention.varlen import varlen_attn

            out = varlen_attn(*(x.to(torch.bfloat16) for x in (q, k, v)), cu, cu, longest, longest, scale=scaling,
                              window_size=(-1, 0), enable_gqa=True)
        else:
            bounds = cu.tolist()
            out = torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                                            scale=scaling, enable_gqa=True).transpose(0, 1)
                             for a, b in zip(bounds, bounds[1:])])
        return out.to(query.dtype)[None], None

    AttentionInterface.register(VARLEN, attend)
    AttentionMaskInterface.register(VARLEN, lambda *a, **k: None)


def update_batch(tok, rows: int, budget: int, device: str, seed: int = 0):
    """``(tokens, mask, P)``: ``rows`` arithmetic prompts, left padded, then long-tailed random completions."""
    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.tasks import ArithmeticTask

    env = TokenVectorEnv(rows, ArithmeticTask(), tokenizer=tok, max_new_tokens=budget)
    env.reset(seed=seed)
    P = env.max_prompt_len
    lengths = schedule(rows, budget)
    special = set(tok.all_special_ids)
    ok = torch.tensor([i for i in range(len(tok)) if i not in special])
    comp = ok[torch.randint(len(ok), (rows, int(lengths.max())), generator=torch.Generator().manual_seed(seed))]
    cmask = (torch.arange(comp.shape[1])[None] < lengths[:, None]).long()
    tokens = torch.cat([env.tokens[:, :P], comp * cmask], 1)
    mask = torch.cat([env.attention_mask[:, :P].long(), cmask], 1)
    return tokens.to(device), mask.to(device), P


def varlen_logp(model, tokens, mask, P, entropy: bool = True):
    """Log-probs (and entropies) of every real completion token, row-major, from one packed row of all real tokens."""
    keep = mask.bool()
    lens = keep.sum(1)
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    pos = (mask.cumsum(1) - 1)[keep][None]
    hidden = model.model(input_ids=tokens[keep][None], position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                         max_length_q=int(lens.max()), max_length_k=int(lens.max())).last_hidden_state[0]
    target = keep.clone()
    target[:, :P] = False
    flat = keep.flatten().cumsum(0) - 1  # [N * L] -> index in the packed row
    before = torch.zeros_like(target)
    before[:, :-1] = target[:, 1:]  # the position that predicts each target
    logits = model.lm_head(hidden[flat[before.flatten()]]).float()
    logp = logits.log_softmax(-1)
    out = logp.gather(1, tokens[target][:, None])[:, 0]
    return out, (-(logp.exp() * logp).sum(-1) if entropy else None), target


def padded_logp(model, tokens, mask, P):
    """The same log-probs from the padded batch (the reference the varlen ones are checked against)."""
    logits = model(input_ids=tokens, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits.float()
    target = mask.bool().clone()
    target[:, :P] = False
    logp = logits[:, :-1].log_softmax(-1).gather(2, tokens[:, 1:, None])[..., 0]
    return logp[target[:, 1:]]


def run_update(side: str, name: str, smoke: bool, device: str, repeats: int) -> dict:
    """One update contender's best seconds for an epoch over the long-tailed batch (``side``: padded, packed, varlen)."""
    from tokengym.agents import Policy

    sizes = TINY if smoke else FULL
    model, tok = build(name, smoke, device)
    rows, mb = sizes["rows"], sizes["minibatch"]
    tokens, mask, P = update_batch(tok, rows, sizes["budget"], device)
    adv = torch.randn(rows, 1, generator=torch.Generator().manual_seed(1)).to(device)
    gap = None
    if side == "varlen":
        kernel = varlen_kernel(device)
        if kernel is None:
            return {"skipped": "no varlen kernel installed (flash-attn, torch varlen_attn)"}
        register_varlen(kernel)
        model.train()
        with torch.no_grad(), autocast(device):
            ref = padded_logp(model, tokens[:mb], mask[:mb], P)
            model.set_attn_implementation(VARLEN)
            got = varlen_logp(model, tokens[:mb], mask[:mb], P, entropy=False)[0]
        gap = float((ref - got).abs().max())
        params = model.parameters()
    else:
        policy = Policy(model, tok, seed=0, packing="bins" if side == "packed" else "off")
        policy.train()
        params = policy.parameters()
    opt = torch.optim.AdamW(params, lr=1e-6)

    def step(idx: torch.Tensor) -> None:
        t, m = tokens[idx], mask[idx]
        with autocast(device):
            if side == "varlen":
                logp, ent, target = varlen_logp(model, t, m, P)
                a = adv[idx].expand_as(target)[target]
                loss = (-(torch.exp(logp - logp.detach()) * a) - 0.01 * ent).mean()
            else:
                logp, ent = policy(t, m, P, return_entropy=True)
                am = m[:, P:].float()
                loss = ((-(torch.exp(logp - logp.detach()) * adv[idx]) - 0.01 * ent) * am).sum() / am.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    order = torch.randperm(rows, generator=torch.Generator().manual_seed(2)).to(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    step(order[:mb])  # warm-up
    times = []
    for _ in range(repeats):
        t0 = sync(device)
        for idx in order.split(mb):
            step(idx)
        times.append(sync(device) - t0)
    real = int(mask.sum())
    return {"seconds": round(min(times), 4), "real_tokens": real, "padded_tokens": mask.numel(),
            "peak_mib": peak_mib(device), **({"kernel": varlen_kernel(device), "max_logp_gap": gap} if side == "varlen" else {})}


# ---------------------------------------------------------------------------------------------- the parent
def contenders(models: list[str], smoke: bool) -> list[list[str]]:
    """Every contender's ``--one`` arguments, in the order they run."""
    out = []
    for name in models:
        for n in (TINY if smoke else FULL)["batches"]:
            out += [["decode", name, side, str(n)] for side in ("tokengym", "generate")]
        out += [["update", name, side, "0"] for side in ("padded", "packed", "varlen")]
    return out


def run_one(kind: str, name: str, side: str, n: str, smoke: bool, device: str, repeats: int) -> dict:
    if kind == "decode":
        return run_decode(side, name, int(n), smoke, device, repeats)
    return run_update(side, name, smoke, device, repeats)


def summarise(results: dict) -> dict:
    """The results grouped per shape, with each ratio against its peer from the same run."""
    decode, update = {}, {}
    for (kind, name, side, n), r in results.items():
        if kind == "decode":
            decode.setdefault(f"{name}/{n}", {})[side] = r
        else:
            update.setdefault(name, {})[side] = r

    def ratio(group, a, b, key, invert=False):
        x, y = group.get(a, {}).get(key), group.get(b, {}).get(key)
        return round((y / x) if invert else (x / y), 3) if x and y else None

    for g in decode.values():
        g["tokengym_vs_generate"] = ratio(g, "tokengym", "generate", "tok_s")
    for g in update.values():  # speedups: the padded epoch's seconds over each other's
        g["packed_speedup"] = ratio(g, "packed", "padded", "seconds", invert=True)
        g["varlen_speedup"] = ratio(g, "varlen", "padded", "seconds", invert=True)
    return {"decode": decode, "update": update}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, in this process (a few seconds)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per contender (default 2; 1 with --smoke)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no contender after this many seconds")
    ap.add_argument("--one", nargs=4, metavar=("KIND", "MODEL", "SIDE", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    args.repeats = args.repeats or (1 if args.smoke else 2)
    if args.smoke:
        torch.set_num_threads(1)  # tiny models: on a busy machine a second thread only waits at barriers
    if not args.smoke and not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device; use --smoke on CPU", file=sys.stderr)
        sys.exit(2)
    if args.one:
        print(json.dumps(run_one(*args.one, smoke=args.smoke, device=device, repeats=args.repeats)))
        return
    from _isolate import run_child

    t0 = time.perf_counter()
    results = {}
    for argv in contenders(args.models, args.smoke):
        left = args.budget_s - (time.perf_counter() - t0)
        if left <= 0:
            results[tuple(argv)] = {"skipped": f"past --budget-s {args.budget_s:g}"}
        elif args.smoke:
            results[tuple(argv)] = run_one(*argv, smoke=True, device=device, repeats=args.repeats)
        else:
            try:
                results[tuple(argv)] = run_child(__file__, ["--one", *argv, "--repeats", str(args.repeats)], timeout=left + 60)
            except RuntimeError as e:
                results[tuple(argv)] = {"error": str(e).splitlines()[-1][:300]}
        print(json.dumps({"/".join(argv): results[tuple(argv)]}), file=sys.stderr, flush=True)
    out = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
           "smoke": args.smoke, "autocast": "bf16" if device == "cuda" else None, **summarise(results),
           "varlen_kernel": varlen_kernel(device) or "not installed", "cuda_graph_decode": NOT_BUILT,
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
