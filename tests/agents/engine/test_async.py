"""Async training: rollout worker processes, the versioned weight sync, staleness, exact resume and faults.

Every run here uses one torch thread in the learner and in each worker, so that the synchronous run it is compared
with does the same arithmetic (a thread count changes float rounding).
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import gymnasium as gym
import pytest
import torch
from safetensors.torch import load_file

from tokengym.agents import GRPOAgent, GRPOConfig, Policy, PPOAgent, PPOConfig, collect
from tokengym.agents.engine.workers import RolloutWorkers, WorkerError
from tokengym.envs import TokenVectorEnv

FAST = dict(steps=4, lr=1e-3, mu=2, minibatches=2, seed=3)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(cls, cfg_cls, **kw):
    env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12)
    agent = cls(Policy.from_pretrained("tiny-arithmetic"), cfg_cls(**{**FAST, **kw}))
    return agent, agent.learn(env)


def deterministic(history):
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))} for r in history]


@pytest.mark.parametrize("cls,cfg_cls,correction", [(GRPOAgent, GRPOConfig, "tis"), (GRPOAgent, GRPOConfig, "none"),
                                                    (PPOAgent, PPOConfig, "tis")])
def test_max_staleness_0_through_the_workers_is_synchronous_training_bit_for_bit(cls, cfg_cls, correction):
    """K = 0: each rollout is sampled in a worker process by exactly the learner's current weights (sent over the
    weight sync), so every metric and every final weight equals the synchronous run's."""
    sync_agent, sync = train(cls, cfg_cls, correction=correction)
    async_agent, hist = train(cls, cfg_cls, correction=correction, async_mode="bounded", max_staleness=0)
    assert [r["async/staleness"] for r in hist] == [0.0] * FAST["steps"]
    assert [r["async/policy_version"] for r in hist] == [0.0, 1.0, 2.0, 3.0]
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in deterministic(hist)] == deterministic(sync)
    for p, q in zip(sync_agent.policy.parameters(), async_agent.policy.parameters()):
        assert torch.equal(p, q)
    assert async_agent.worker_pids() == []  # learn() stopped its workers


def test_a_multi_turn_tool_env_runs_in_the_workers():
    """The Calculator tool env: each worker holds its own copy and the tool replies run there; with K = 0 the run
    is the synchronous one, tool calls included."""
    import gymnasium as gym

    def run(**kw):
        env = gym.make_vec("tokengym/Calculator-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4)
        agent = GRPOAgent(Policy.from_pretrained("tiny-calculator"), GRPOConfig(**{**FAST, "steps": 3}, **kw))
        return agent, agent.learn(env)

    sync_agent, sync = run()
    async_agent, hist = run(async_mode="bounded", max_staleness=0, correction="none")
    assert any(r["env/replies_per_episode"] > 0 for r in hist)  # the workers' episodes called the tool
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in deterministic(hist)] == deterministic(sync)
    assert all(torch.equal(p, q) for p, q in zip(sync_agent.policy.parameters(), async_agent.policy.parameters()))


SOLUTION_FORMAT = {"regex": r"([0-9]+\+[0-9]+=[0-9]+\n)+A: [0-9]+"}
"""Arithmetic's own solution format as a grammar: the shipped model keeps most of its accuracy under it."""


def test_a_masked_env_runs_in_the_workers_and_its_masks_reach_the_learner():
    """An env with a grammar: the workers sample under their copy's masks and send each rollout's compact masks with
    it, so the learner trains on the masked distribution as in a synchronous run, bit for bit (mask metrics included)."""
    pytest.importorskip("llguidance")

    def run(**kw):
        env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=24, grammar=SOLUTION_FORMAT)
        agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**{**FAST, "steps": 3}, **kw))
        return agent, agent.learn(env)

    sync_agent, sync = run()
    async_agent, hist = run(async_mode="bounded", max_staleness=0, correction="none")
    assert all(r["mask/masked_fraction"] == 1.0 and r["mask/sets"] > 1 for r in hist)
    assert any(r["train/grad_norm"] > 0 for r in hist)  # rewards differed within groups: a real update
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in deterministic(hist)] == deterministic(sync)
    assert all(torch.equal(p, q) for p, q in zip(sync_agent.policy.parameters(), async_agent.policy.parameters()))


def test_one_step_trains_each_step_on_the_rollout_of_the_previous_weights():
    """One-step-off: rollout j is sampled by version max(0, j - 1), so the staleness is 0 then 1 on every step; with
    correction auto the update recomputes pi_old and weights the loss (the mismatch is logged over the batch)."""
    agent, hist = train(GRPOAgent, GRPOConfig, async_mode="one-step")
    assert [r["async/staleness"] for r in hist] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/policy_version"] for r in hist] == [0.0, 0.0, 1.0, 2.0]
    seen = []
    take = agent.collect
    agent.collect = lambda env: seen.append(take(env)) or seen[-1]
    agent.config.steps = 2  # a second learn() call: two more steps
    agent.learn(TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12))  # continues the workers' streams
    assert [ro.policy_version for ro in seen] == [3, 4]  # every batch carries the version that sampled it
    assert agent.config.correction_mode == "tis"
    assert all("mismatch/abs_gap_mean" in r for r in hist)
    assert hist[1]["mismatch/abs_gap_mean"] > 0  # stale rollouts: the trainer's pi_old differs from the sampler's


@pytest.mark.parametrize("k", [2, 3])
def test_bounded_staleness_never_exceeds_k(k):
    """Bounded: whatever the timing, no step trains on a rollout more than K versions old, and the versions a
    worker samples with never go back."""
    agent, hist = train(GRPOAgent, GRPOConfig, async_mode="bounded", max_staleness=k, steps=6)
    lags = [r["async/staleness"] for r in hist]
    versions = [r["async/policy_version"] for r in hist]
    assert all(0 <= x <= k for x in lags), lags
    assert versions == sorted(versions)
    assert [r["step"] for r in hist] == list(range(1, 7))


def test_the_learner_refuses_a_rollout_beyond_the_staleness_bound():
    """The invariant is checked where the learner takes a rollout, so a broken schedule cannot train silently."""
    workers = RolloutWorkers.__new__(RolloutWorkers)
    workers.k, workers.next, workers.streams, workers.sync_seconds = 1, 5, [None], 0.0
    workers.received = {5: (None, 3, 0, None, 0.0, b"")}
    with pytest.raises(RuntimeError, match="rollout 5 was sampled by policy version 3: staleness 2 is outside"):
        workers.take(5)


def test_a_bounded_checkpoint_keeps_what_has_arrived_and_waits_for_nothing():
    """Bounded, K = 1000: a checkpoint after step 5 keeps the arrived rollouts 5, 6 (rollout 7 is not there, so 8 is
    dropped too: the kept ones run in order), each worker's stream after its newest kept one, and waits for nothing
    (it used to wait for K rollouts, so a huge K held up every checkpoint and SIGTERM). Exact schedules still wait."""
    import queue

    from tokengym.agents.engine.messages import encode_rollout

    def stream(text):
        return {"env": text, "rng": torch.arange(3, dtype=torch.uint8)}

    def fake(exact, k):
        workers = RolloutWorkers.__new__(RolloutWorkers)
        workers.k, workers.next, workers.exact, workers.total, workers._pending, workers._failed = k, 5, exact, None, None, None
        workers.results, workers.procs, workers.streams = queue.Queue(), [], [stream("s0"), stream("s1")]
        ro = collect(TokenVectorEnv(2, "arithmetic", max_new_tokens=2), Policy.from_pretrained("tiny-arithmetic"), seed=0)
        workers.received = {j: (ro, 4, j % 2, stream(f"after {j}"), 0.0, encode_rollout(ro, {}, stream(f"after {j}")))
                            for j in (5, 6, 8)}
        return workers

    state = fake(exact=False, k=1000).state_dict()
    assert [m["index"] for m in state["queue"]] == [5, 6] and [s["env"] for s in state["streams"]] == ["after 6", "after 5"]
    assert state["next"] == 5 and state["streams"][0]["rng"] == [0, 1, 2]
    state = fake(exact=True, k=1).state_dict()  # one-step: rollout 5, which has arrived
    assert [m["index"] for m in state["queue"]] == [5]


def test_a_killed_worker_stops_the_run_with_one_line_naming_it():
    env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**{**FAST, "steps": 20}, async_mode="one-step"))
    pids = []

    def kill_worker(record):
        if record["step"] == 2:
            pids.extend(agent.worker_pids())
            os.kill(pids[0], signal.SIGKILL)

    with pytest.raises(WorkerError, match=r"^rollout worker 0 \(pid (\d+)\) died \(signal 9\) before rollout \d+") as e:
        agent.learn(env, callback=kill_worker)
    assert str(pids[0]) in str(e.value) and "\n" not in str(e.value)
    assert agent.global_step < 20 and agent.worker_pids() == []


def test_a_weight_sync_that_times_out_names_the_worker():
    """A worker that stops taking weights (frozen here with SIGSTOP) ends the run after sync_timeout with one line
    naming it, not a silent hang."""
    env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"),
                      GRPOConfig(**{**FAST, "steps": 20}, async_mode="bounded", max_staleness=2, sync_timeout=2.0))

    def freeze_worker(record):
        if record["step"] == 1:
            os.kill(agent.worker_pids()[0], signal.SIGSTOP)

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"weight sync of policy version \d+ failed: rollout worker 0 \(pid \d+\) did "
                                          r"not take it within 2 s \(sync_timeout\)"):
        agent.learn(env, callback=freeze_worker)
    assert time.monotonic() - t0 < 120  # bounded by the timeout (and the close's kill), never a hang
    assert agent.worker_pids() == []


# ---------------------------------------------------------------------------------------------- the command line
ARGS = ["train", "grpo", "--steps", "5", "--prompts", "2", "--group-size", "4", "--lr", "1e-3", "--mu", "2",
        "--minibatches", "2", "--save-every", "2", "--eval-prompts", "8", "--threads", "1", "--progress", "false",
        "--seed", "3", "--async-mode", "one-step"]


def cli(args, env_extra=None, **kw):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "tokengym.agents.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600, **kw)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return deterministic([json.loads(line) for line in f])


def same_model(a, b):
    x, y = (load_file(os.path.join(d, "model", "model.safetensors")) for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def marked_processes(mark):
    """Live processes started with ``TOKENGYM_TEST_MARK=mark`` in their environment (the CLI and its workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if f"TOKENGYM_TEST_MARK={mark}".encode() in env.split(b"\0") and not zombie:
            found.append(int(pid))
    return found


def no_orphans(mark, within=15.0):
    deadline = time.monotonic() + within
    while marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return marked_processes(mark) == []


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    r = cli([*ARGS, "--runs-dir", str(root), "--name", "full"])
    assert r.returncode == 0, r.stderr[-2000:]
    return str(root / "full")


def test_one_step_sigkill_then_resume_equals_uninterrupted_and_leaves_no_orphans(tmp_path, full_run):
    """The learner SIGKILLs itself after step 3 (its checkpoint at step 2 holds rollout 2, sampled by version 1, and
    the worker's stream after it): no worker outlives it, and the resumed run ends as the uninterrupted one did."""
    mark = uuid.uuid4().hex
    killed = cli([*ARGS, "--runs-dir", str(tmp_path), "--name", "killed"],
                 {"TOKENGYM_SIGKILL_AFTER_STEP": "3", "TOKENGYM_TEST_MARK": mark})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert no_orphans(mark)
    run = os.path.join(str(tmp_path), "killed")
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == "step-00000002"
    resumed = cli(["train", "grpo", "--resume", run, "--progress", "false"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert metrics(run) == metrics(full_run)
    assert [r.get("async/staleness") for r in metrics(run)] == [None, 0.0, 1.0, 1.0, 1.0, 1.0, None]
    assert same_model(run, full_run)


def test_a_killed_worker_ends_the_cli_with_one_line_and_the_run_resumes(tmp_path, full_run):
    run = os.path.join(str(tmp_path), "w")
    r = cli([*ARGS, "--runs-dir", str(tmp_path), "--name", "w"], {"TOKENGYM_SIGKILL_WORKER_AFTER_STEP": "2"})
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tokengym: error: rollout worker 0 (pid ") and "died (signal 9)" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    resumed = cli(["train", "grpo", "--resume", run, "--progress", "false"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert metrics(run) == metrics(full_run) and same_model(run, full_run)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_stops_the_learner_and_every_worker(tmp_path, sig):
    """SIGTERM to the learner, or Ctrl-C (SIGINT to the whole process group, as a terminal sends it): the learner
    exits, stopping its workers, and no process of the run is left."""
    mark = uuid.uuid4().hex
    run = os.path.join(str(tmp_path), "long")
    env = dict(os.environ, TOKENGYM_TEST_MARK=mark)
    # --steps 500; a short sync timeout bounds how long the stop can wait on a weight sync a busy worker has not reached
    args = [a if a != "5" else "500" for a in ARGS] + ["--sync-timeout", "20"]
    # Ctrl-C as a terminal delivers it: a test run started in the background of a non-interactive shell inherits
    # SIGINT ignored, and the learner would keep ignoring it (POSIX background jobs do)
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.agents.cli", *args, "--runs-dir", str(tmp_path),
                             "--name", "long"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            path = os.path.join(run, "metrics.jsonl")
            if os.path.exists(path) and sum(1 for _ in open(path)) >= 3:  # training, workers running
                break
            time.sleep(0.2)
        assert proc.poll() is None and len(marked_processes(mark)) >= 2
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=120)  # at most two 20-s syncs (the one in flight, then the stop message) and the joins
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = proc.stderr.read().decode()
    assert proc.returncode == 128 + sig, err[-2000:]
    if sig == signal.SIGINT:
        assert err.strip().splitlines()[-1] == "tokengym: interrupted" and "Traceback" not in err, err[-2000:]
    assert no_orphans(mark)


@pytest.mark.parametrize("extra,env_extra,message", [
    (["--max-staleness", "2"], {}, "async_mode='one-step' samples each rollout exactly one update behind"),
    (["--dynamic-sampling", "true"], {}, "dynamic_sampling draws extra rollouts within a step"),
    (["--rollout-workers", "0"], {}, "rollout_workers"),
    (["--rollout-workers", "1000"], {}, "rollout_workers=1000 is more worker processes than the"),
    (["--async-mode", "sometimes"], {}, "async_mode"),
    (["--sync-timeout", "0.000001"], {}, "sync_timeout"),  # the store's own connect would fail with a traceback
    (["--sync-timeout", "1e300"], {}, "sync_timeout"),  # an OverflowError in the process group's timedelta
    (["--rollout-workers", "127.0.0.1:99999"], {}, "remote_workers: '127.0.0.1:99999' is not host:port"),
    (["--rollout-workers", "127.0.0.1:9", "--min-workers", "2"], {"TOKENGYM_SECRET": "x"}, "min_workers"),
    (["--rollout-workers", "127.0.0.1:9"], {"TOKENGYM_SECRET": ""}, "rollout workers need a shared secret"),
    (["--rollout-workers", "127.0.0.1:9"], {"TOKENGYM_SECRET": "x"}, "rollout worker 127.0.0.1:9 cannot be reached"),
])
def test_bad_async_settings_are_one_line_and_write_nothing(tmp_path, extra, env_extra, message):
    r = cli([*ARGS, *extra, "--runs-dir", str(tmp_path), "--name", "bad"], env_extra)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("tokengym: error: ") and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not os.path.exists(os.path.join(str(tmp_path), "bad"))


def test_an_async_run_without_evaluation_ends_with_its_summary(tmp_path):
    """No held-out evaluation: the command still prints the staleness line and "done", and exits 0."""
    args = [a if a != "8" else "0" for a in ARGS[:ARGS.index("--eval-prompts") + 2]] + ARGS[ARGS.index("--eval-prompts") + 2:]
    res = cli([*args, "--steps", "2", "--runs-dir", str(tmp_path), "--name", "q"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "rollout staleness (updates behind)" in res.stdout and "done: model in" in res.stdout, res.stdout


def test_a_staleness_bound_beyond_the_run_ends_like_any_run(tmp_path):
    """``--max-staleness 1000000`` with 2 steps: the bound is capped at the run's rollouts, so the final checkpoint
    waits for none past the end (it used to wait forever) and the command ends with its summary."""
    args = [a for a in ARGS if a != "one-step"]
    args[args.index("--async-mode") + 1:args.index("--async-mode") + 1] = ["bounded"]
    res = cli([*args, "--max-staleness", "1000000", "--steps", "2", "--runs-dir", str(tmp_path), "--name", "k"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "done: model in" in res.stdout and os.path.isdir(tmp_path / "k" / "model")


def test_the_bundled_target_env_runs_async():
    """Target's ``reward()`` returns a nested function, which pickle cannot send to a worker: the env sends its task
    and asks it for the reward again. With K = 0 the async run is the synchronous one, rewards included."""
    def run(**kw):
        env = gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", group_size=4,
                           partial_credit=True, target="ok", max_new_tokens=2)
        agent = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(**{**FAST, "steps": 2}, **kw))
        return agent.learn(env)

    sync, hist = run(), run(async_mode="bounded", max_staleness=0, correction="none")
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in deterministic(hist)] == deterministic(sync)


def test_an_env_that_cannot_cross_to_a_worker_is_refused_before_any_worker_starts():
    """An env holding a lock cannot be pickled: one line naming the env and the reason, before the workers spawn
    (the CLI turns it into exit 2 before the run folder is made, as for every agent.check_env refusal)."""
    import threading

    env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12)
    env.lock = threading.Lock()
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**FAST, async_mode="one-step"))
    started = []
    agent.make_source = lambda env: started.append(env)
    with pytest.raises(ValueError, match=r"^async training sends the env .* TokenVectorEnv cannot be pickled \(TypeError: "
                                         r"cannot pickle '_thread.lock' object\)"):
        agent.learn(env)
    assert not started


def test_more_workers_than_the_machine_holds_are_refused_before_any_starts(monkeypatch):
    """More worker processes than cores, or more weight copies than free memory: one line each, nothing spawned."""
    import tokengym.agents.engine.resources as resources

    env = TokenVectorEnv(8, "arithmetic", group_size=4, max_new_tokens=12)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**FAST, async_mode="one-step"))
    started = []
    agent.make_source = lambda env: started.append(env)
    cores = len(os.sched_getaffinity(0))
    agent.config.rollout_workers = 1000
    with pytest.raises(ValueError, match=rf"^rollout_workers=1000 is more worker processes than the {cores} CPU cores"):
        agent.learn(env)
    agent.config.rollout_workers = 1
    weights = sum(p.numel() * p.element_size() for p in agent.policy.model.parameters())
    monkeypatch.setattr(resources, "available_memory_bytes", lambda device: weights)  # not even one more copy fits
    with pytest.raises(ValueError, match=r"^rollout_workers=1 need at least .* GiB .* free; use fewer workers"):
        agent.learn(env)
    assert not started


SCRIPT = """
from tokengym.envs import Task, TokenVectorEnv
from tokengym.agents import GRPOAgent, GRPOConfig, Policy


class Echo(Task):  # defined in the script: the workers must import the script to unpickle the env
    name = "echo"
    max_prompt_chars = 4
    default_max_new_tokens = 4

    def sample(self, rng):
        d = str(int(rng.integers(10)))
        return {"prompt": d + "\\n", "solution": d}

    def reward(self):
        def exact(prompts, completions, solution, **_):
            return [float(c.strip() == s) for c, s in zip(completions, solution)]
        return exact


env = TokenVectorEnv(8, Echo(), group_size=4)
agent = GRPOAgent(Policy.from_pretrained("tiny"), GRPOConfig(steps=2, async_mode="one-step"))
"""


@pytest.mark.parametrize("how", ["unguarded", "stdin", "guarded"])
def test_a_task_class_in_the_script_itself(tmp_path, how):
    """The task class lives in ``__main__``. Without a guard the workers' re-run of the script trains again: one line
    saying to add the guard (it used to hang). From stdin no worker can import it: refused before any starts. With
    the guard it trains."""
    body = SCRIPT + ('if __name__ == "__main__":\n    print("steps", len(agent.learn(env)))\n' if how == "guarded"
                     else 'print("steps", len(agent.learn(env)))\n')
    path = tmp_path / "train_echo.py"
    path.write_text(body)
    cmd = [sys.executable, "-"] if how == "stdin" else [sys.executable, str(path)]
    res = subprocess.run(cmd, input=body if how == "stdin" else None, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
    if how == "guarded":
        assert res.returncode == 0 and "steps 2" in res.stdout, res.stderr[-2000:]
    elif how == "unguarded":
        assert res.returncode == 1 and "put its training under `if __name__ == \"__main__\":`" in last, res.stderr[-2000:]
    else:
        assert res.returncode == 1 and "defined in __main__ without a file (stdin" in last, res.stderr[-2000:]


STUCK_TASK = """
import multiprocessing, time
from tokengym.envs.tasks import ArithmeticTask


class StuckInWorkers(ArithmeticTask):
    def sample(self, rng):
        if multiprocessing.parent_process() is not None:  # a rollout worker: never returns
            time.sleep(10 ** 6)
        return super().sample(rng)
"""


def test_a_rollout_that_never_comes_stops_the_run_naming_its_worker(tmp_path, monkeypatch):
    """A task whose sample() never returns in the worker: after rollout_timeout seconds without the rollout the
    learner needs, one line naming the worker (the learner used to wait forever; sync_timeout does not apply)."""
    (tmp_path / "stuck_task.py").write_text(STUCK_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get the learner's sys.path
    from stuck_task import StuckInWorkers

    env = TokenVectorEnv(8, StuckInWorkers(), group_size=4, max_new_tokens=12)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(**FAST, async_mode="one-step",
                                                                            rollout_timeout=3))
    with pytest.raises(WorkerError, match=r"^rollout worker 0 \(pid \d+\) sent no rollout 0 for 3 s \(rollout_timeout\)"):
        agent.learn(env)
    with pytest.raises(ValueError, match="rollout_timeout"):
        GRPOConfig(rollout_timeout=0.5)


def test_a_sync_broken_by_a_dying_worker_names_the_worker_once_its_exit_shows():
    """The weight sync can see a killed worker's connection reset before its exit is reaped: the learner gives the
    exit a moment to show, so the one line says which worker died and how (not the socket error)."""
    import multiprocessing as mp
    import types

    from tokengym.agents.engine.workers import RolloutWorkers
    from tokengym.agents.runtime.weight_sync import WeightSyncError

    proc = mp.get_context("spawn").Process(target=time.sleep, args=(0.5,))
    proc.start()
    pool = types.SimpleNamespace(procs=[proc], next=3, _failed=WeightSyncError("the connection broke (reset by peer)"))
    pool._failed.lost = "RuntimeError: reset by peer"
    pool._check_alive = lambda wait=0.0: RolloutWorkers._check_alive(pool, wait)
    with pytest.raises(WorkerError, match=r"^rollout worker 0 \(pid \d+\) died \(exit code 0\) before rollout 3"):
        RolloutWorkers._raise_failed(pool)
    proc.join()
