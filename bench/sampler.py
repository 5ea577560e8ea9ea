"""The sampler's inverse-CDF draw: by blocks (``policy.inverse_cdf``, what ``sample_logits`` runs) against the one-level
search it replaced (a log-softmax, its exp and a cumulative sum over the whole vocabulary). Milliseconds per
``sample_logits`` call at ``[rows, vocab]``, 1 thread, each side in its own process, the order flipped every round;
then how often each picks another token than a float64 inverse CDF on peaked LM-like rows (a few likely tokens over a
long tail), where both are only as exact as fp32 and the 24-bit uniforms allow.

    python bench/sampler.py --json [--rows 64] [--vocab 49152 262144] [--rounds 2]

``one_level_vs_blocks_{vocab}``: the one-level search's milliseconds over the blocks' (above 1: blocks are faster),
the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from tokengym.agents.engine.policy import sample_logits


def one_level(logits: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The search ``sample_logits`` ran before: the first token whose fp32 cumulative probability exceeds u * total."""
    logp = torch.log_softmax(logits, -1)
    cdf = logp.exp().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    tok = torch.minimum(torch.searchsorted(cdf, uniform[:, None] * total, right=True), torch.searchsorted(cdf, total))
    return tok[:, 0], logp.gather(-1, tok)[:, 0]


SIDES = {"blocks": lambda x, u: sample_logits(x, uniform=u), "one_level": one_level}


def peaked(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g) * 2
    x[torch.arange(rows)[:, None], torch.randint(vocab, (rows, 4), generator=g)] += 14 + 2 * torch.rand(rows, 4, generator=g)
    return x


def one(side: str, rows: int, vocab: int, calls: int = 40) -> float:
    """Median milliseconds of ``calls`` draws (after one warm-up), this process only."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, f = peaked(g, rows, vocab), SIDES[side]
    us = [torch.rand(rows, generator=g) for _ in range(calls + 1)]
    f(x, us[0])
    times = []
    for u in us[1:]:
        t0 = time.perf_counter()
        f(x, u)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def off_exact(rows: int, vocab: int, rounds: int = 30) -> dict:
    """Draws where each side's token is not the float64 inverse CDF's, of ``rows * rounds``."""
    g, off = torch.Generator().manual_seed(1), dict.fromkeys(SIDES, 0)
    for _ in range(rounds):
        x, u = peaked(g, rows, vocab), torch.rand(rows, generator=g)
        cdf = torch.softmax(x.double(), -1).cumsum(-1)
        exact = (cdf <= u.double()[:, None] * cdf[:, -1:]).sum(-1)
        for side, f in SIDES.items():
            off[side] += int((f(x, u)[0] != exact).sum())
    return {"draws": rows * rounds, **{f"off_{side}": n for side, n in off.items()}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _isolate import run_child

    out: dict = {"rows": args.rows}
    for vocab in args.vocab:
        ms = {s: [] for s in SIDES}
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else reversed(list(SIDES))):
                ms[side].append(run_child(__file__, ["--one", side, str(args.rows), str(vocab)]))
        med = {s: statistics.median(v) for s, v in ms.items()}
        out[f"ms_{vocab}"] = {s: [round(t, 2) for t in v] for s, v in ms.items()}
        out[f"one_level_vs_blocks_{vocab}"] = round(med["one_level"] / med["blocks"], 2)
        out[f"exactness_{vocab}"] = off_exact(args.rows, vocab)
        print(json.dumps({k: v for k, v in out.items() if str(vocab) in k}), file=sys.stderr)
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
