"""Training fingerprints: each bundled training config run through ``tokengym train`` with one thread, then the final
``model/`` weights and ``metrics.jsonl`` (timing keys dropped) hashed. Equal hashes on two commits mean a change left
training bit-identical (what a restructuring must show); run it on both and compare the JSON.

    python bench/fingerprint.py --out after.json [--only grpo ppo]

Each run is its own process (the CLI), on the tiny shipped models, with 16 held-out prompts; the whole set takes
about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

RUNS = {
    "grpo": ["grpo", "--steps", "4"],
    "grpo-process-beta": ["grpo", "--steps", "3", "--advantage", "process", "--beta", "0.04"],
    "dapo": ["grpo", "--steps", "3", "--preset", "dapo"],
    "gspo": ["grpo", "--steps", "3", "--preset", "gspo"],
    "grpo-packed": ["grpo", "--steps", "3", "--packing", "bins"],
    "rloo": ["rloo", "--steps", "3"],
    "reinforce-pp": ["reinforce-pp", "--steps", "3"],
    "ppo": ["ppo", "--steps", "3"],
    "dpo": ["dpo", "--steps", "6", "--num-pairs", "64"],
    "sft": ["sft", "--steps", "6"],
    "spin": ["spin", "--steps", "3", "--rounds", "2", "--prompts-per-round", "16"],
}
"""Fingerprinted configs: ``tokengym train`` arguments (the run's threads, folder and evaluation size are added)."""
TIMING = ("time", "sec", "per_s", "/s", "elapsed", "throughput", "wall")
"""Metric keys holding any of these are timings, left out of the hash."""


def digest(run_dir: str) -> tuple[str, str]:
    """``(weights, metrics)`` hashes of a finished run folder (16 hex digits each)."""
    from safetensors.torch import load_file

    weights = hashlib.sha256()
    model = os.path.join(run_dir, "model")
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(model, name))
            for key in sorted(tensors):
                weights.update(key.encode())
                weights.update(tensors[key].float().numpy().tobytes())
    metrics = hashlib.sha256()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = {k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING)}
            metrics.update(json.dumps(record, sort_keys=True).encode())
    return weights.hexdigest()[:16], metrics.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write {config: [weights, metrics]} here as JSON")
    ap.add_argument("--only", nargs="*", choices=list(RUNS), help="fingerprint only these configs")
    args = ap.parse_args()
    result, base = {}, tempfile.mkdtemp(prefix="tokengym-fingerprint-")
    for name, train in RUNS.items():
        if args.only and name not in args.only:
            continue
        cmd = [sys.executable, "-m", "tokengym.agents.cli", "train", *train, "--threads", "1", "--eval-prompts", "16",
               "--progress", "false", "--runs-dir", base, "--name", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            lines = proc.stderr.strip().splitlines()
            result[name] = ["FAILED", lines[-1] if lines else f"exit {proc.returncode}"]
        else:
            result[name] = list(digest(os.path.join(base, name)))
        print(name, *result[name], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
