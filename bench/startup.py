"""A command's start-up: ``tokengym eval`` of the shipped model on 2 prompts, as the ``tokengym`` command runs it (which
skips transformers' scikit-learn import, :func:`~tokengym.agents.engine.models.skip_sklearn_import`) against the same
``main([...])`` called from a Python script (which leaves transformers as it is).

    python bench/startup.py --json [--rounds 5]

Each run is its own process, the two alternating (the order flipped every round); wall seconds per run, the median
of ``--rounds`` each. ``skip_vs_keep`` is the command's median over the script's (below 1: the command starts faster).
Where scikit-learn is not installed the two do the same work and the ratio is about 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ARGS = ["eval", "--model", "tiny-arithmetic", "--prompts", "2", "--samples", "0", "--threads", "1"]
SCRIPT = "import sys; from tokengym.agents.cli.command import main; sys.exit(main(sys.argv[1:]))"


def timed(argv: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    command = shutil.which("tokengym") or sys.exit("the tokengym command is not on PATH: pip install -e .")
    sides = {"skip": [command, *ARGS], "keep": [sys.executable, "-c", SCRIPT, *ARGS]}
    times: dict[str, list[float]] = {"skip": [], "keep": []}
    with tempfile.TemporaryDirectory() as cwd:
        timed(sides["keep"], cwd)  # warm-up: the file cache holds both sides' imports
        for r in range(args.rounds):
            for side in (("skip", "keep") if r % 2 == 0 else ("keep", "skip")):
                times[side].append(timed(sides[side], cwd))
    out = {f"{side}_s": round(statistics.median(t), 3) for side, t in times.items()}
    out["skip_vs_keep"] = round(out["skip_s"] / out["keep_s"], 3)
    out["sklearn_installed"] = importlib.util.find_spec("sklearn") is not None
    out["rounds"] = args.rounds
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
