"""Run by ``test_distributed.py`` under ``torchrun``: ``dist_worker.py OUT_DIR '[["train", "grpo", ...], ...]'``.

Joins the gloo process group, checks that :meth:`DataParallel.all_same` notices a rank whose weights
differ (written to ``OUT_DIR/all_same.json`` by rank 0), then runs each ``tokengym`` command line in
turn in the same group (``train`` reuses it) and exits with the first non-zero exit code.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from tokengym.agents.cli import main
from tokengym.agents.runtime.distributed import DataParallel


def check_all_same(out_dir: str) -> None:
    dp = DataParallel.current()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    same = dp.all_same({"m": module})
    with torch.no_grad():
        if dp.rank == 1:
            module[1].bias[0] += 1e-6
    differs = dp.all_same({"m": module})
    if dp.is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(f"{out_dir}/all_same.json", "w") as f:
            json.dump({"same": same, "differs": differs}, f)


if __name__ == "__main__":
    out_dir, commands = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        check_all_same(out_dir)
        for argv in commands:
            rc = main(argv)
            if rc:
                sys.exit(rc)
    finally:
        dist.destroy_process_group()
