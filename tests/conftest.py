"""Shared test set-up: deterministic hypothesis profiles, seeded torch/numpy, and no process left behind."""

import importlib.util
import json
import os
import pathlib
import random
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

# CI profile: no deadline (a loaded 2-core machine is slow), a bounded example count, and a fixed
# example sequence (derandomize) so that a run's pass never depends on luck or wall-clock time.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=60,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The default run is two pytest-xdist workers (``-n 2`` in pyproject.toml), each on one core: one torch thread per
# worker, and the same for the processes tests start (two threads each on two busy cores run many times slower).
# A plain run (``-n 0``) uses two threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


_spec = importlib.util.spec_from_file_location("_processes", pathlib.Path(__file__).parent / "_processes.py")
processes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(processes)


_LEFT_BY_WORKERS: list[str] = []  # (the xdist controller: what its workers reported)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a test left a process behind (a rank, a worker, a server; a stopped one too): each process
    that runs tests (every xdist worker, or the one process of ``-n 0``) lists its live descendants after a short
    grace period and ends them; the run then prints them and exits 1. (An xdist worker's exit status is not the run's:
    it hands its list to the controller, whose own children are the workers.)"""
    if not sys.platform.startswith("linux"):
        return
    controller = not os.environ.get("PYTEST_XDIST_WORKER") and session.config.pluginmanager.has_plugin("dsession")
    left = list(_LEFT_BY_WORKERS) if controller else processes.leftovers(os.getpid())
    if hasattr(session.config, "workeroutput"):  # an xdist worker
        session.config.workeroutput["left_processes"] = left
        return
    if left:
        print(f"\ntests left {len(left)} process(es) behind (now killed):\n  " + "\n  ".join(left), file=sys.stderr)
        session.exitstatus = 1


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(xdist controller) Collect what a finished worker left behind."""
    _LEFT_BY_WORKERS.extend(f"[{node.gateway.id}] {p}" for p in getattr(node, "workeroutput", {}).get("left_processes", []))


# The longest files after the README's (measured with --durations=0), longest first: --dist loadfile hands out whole
# files in this order (--no-loadscope-reorder), so the last to start are short and both workers end together. A file
# missing from the list only runs later; a name that is gone matches nothing.
LONGEST_FIRST = ("test_readme", "test_async", "test_cli_train", "test_remote_workers", "test_vllm_agents",
                 "test_sharding", "test_algorithms", "test_ppo", "test_real_model", "test_dpo_learner", "test_cli_damage",
                 "test_vllm_real", "test_cli_vllm", "test_cli_bad_input", "test_distributed", "test_model_cache",
                 "test_gemma", "test_store_gate", "test_rlhf_pipeline", "test_layers", "test_grpo", "test_rank_lifetime",
                 "test_trackers", "test_spin", "test_sft")


def pytest_collection_modifyitems(session, config, items):
    """The README's blocks first (they run one after another in one worker, the longest file by far, while the other
    worker takes the rest), then the other long files, longest first (:data:`LONGEST_FIRST`)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    they gain nothing from more, and on a busy 2-core machine threads spinning at barriers make every kernel
    10-100x slower. The setting is restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def lines_logged_at_once(capfd):
    """``run(log)``: ``log`` called by 8 threads at once, 300 lines each (``"line {thread}.{n}"``); returns the lines that
    reached stderr (a threaded server's handlers log like this)."""

    def run(log) -> list[str]:
        capfd.readouterr()
        threads = [threading.Thread(target=lambda i=i: [log(f"line {i}.{j}") for j in range(300)]) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return capfd.readouterr().err.splitlines()

    return run


@pytest.fixture
def bundled_env_kwargs(tmp_path):
    """``kwargs(env_id)``: what a bundled env id needs beyond its defaults (a data file, a reasoning-gym dataset)."""

    def kwargs(env_id):
        if env_id == "tokengym/Dataset-v0":
            path = tmp_path / "data.jsonl"
            rows = [{"prompt": f"What is {i}+{i}?\n", "answer": str(2 * i)} for i in range(5)]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            return {"data": str(path)}
        if env_id == "tokengym/ReasoningGym-v0":
            pytest.importorskip("reasoning_gym")
            return {"name": "leg_counting", "size": 20, "max_new_tokens": 8}
        return {}

    return kwargs
