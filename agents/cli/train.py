"""``tokengym train <algo>``: build env, model and agent from a config, train with progress and checkpoints, resume.

The algorithm comes from the registry (:mod:`tokengym.agents.algorithms.registry`): its config dataclass, the
:class:`RunConfig` fields it takes, its presets and its builder. A builder turns a :class:`RunConfig` (the
run: env, model, batch, checkpoints) and the algorithm's config into a job; every on-policy agent shares
:func:`build_on_policy`, and the offline ones (DPO, SFT, RM, PRM, SPIN) are in ``offline_jobs.py``. Both
configs are filled from defaults, then ``--preset``, then ``--config FILE.toml``, then ``--key value`` flags.

Nothing is written until everything is built: the builder loads the model, env, data and agent and checks
that they fit together (device, position limit, memory); only then is ``runs/<name>/`` created, locked and
given ``config.json``, and the job trains in it. So bad input of any kind leaves no folder behind.

Agents that follow the resume contract (``checkpoint_modules()``, ``state_dict()``, ``load_state_dict()``,
and a ``learn``/``fit`` that continues an interrupted schedule) get checkpoints every ``save_every``
steps and ``--resume``: on CPU with a fixed seed a run killed at any point and resumed ends with the
same parameters and metrics as an uninterrupted one. (Testing hook: the environment variable
``TOKENGYM_SIGKILL_AFTER_STEP=k`` makes the process SIGKILL itself right after logging step ``k``.)
"""


from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from typing import Any

from tokengym.agents.cli.offline_jobs import BUILDERS
from tokengym.agents.cli.runner import (RESUMABLE, WARM_STARTS, RunConfig, algorithms, build_on_policy,
                                        resolve_env_id, run_fields, run_fields_for, use_threads, warn_if_busy)
from tokengym.agents.runtime import runs as R
from tokengym.agents.runtime.config_io import renamed_settings
from tokengym.agents.runtime.session import create_run_folder, jsonable
from tokengym.agents.runtime.trackers import check_report_to, parse_report_to, where

__all__ = ["RunConfig", "algorithms", "train", "resolve", "run_fields", "run_fields_for", "warn_if_busy"]


# ---------------------------------------------------------------------------------------------- entry point
def _new_run_dir(run: RunConfig, algo: str) -> str:
    env = re.sub(r"[^\w.-]+", "-", run.env.split("/")[-1]).lower()  # module:Class -> module-class
    name = run.name or f"{algo}-{env}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = R.run_path(run.runs_dir, name)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise R.UsageError(f"{path} already exists and is not empty; pick another --name or --resume {path}")
    return path


def _saved_config(resume_dir: str, algo: str) -> dict[str, Any]:
    """The ``config.json`` of the run to resume, which must be an ``algo`` run (one-line errors otherwise)."""
    saved = R.read_run_config(resume_dir)
    if saved.get("algorithm") not in algorithms():
        raise R.UsageError(f"{resume_dir}/config.json names no algorithm tokengym knows ({saved.get('algorithm')!r}; "
                           f"known: {', '.join(algorithms())}): the file is damaged or was edited")
    if saved.get("algorithm") != algo:
        raise R.UsageError(f"{resume_dir} is a {saved.get('algorithm')!r} run; resume it with `tokengym train {saved.get('algorithm')}`")
    return saved


def resolve(algo: str, values_file: dict[str, Any], values_flags: dict[str, Any], resume_dir: str | None,
            preset: str | None = None):
    """``(run_config, algo_config, run_dir)`` from defaults, the saved run (resume) or the preset, the file, then
    the flags."""
    spec = algorithms()[algo]
    if preset is not None and preset not in spec.presets:
        raise R.UsageError(f"unknown preset {preset!r} for {algo}; presets: {', '.join(sorted(spec.presets)) or 'none'}")
    run, cfg = RunConfig(), None
    saved = _saved_config(resume_dir, algo) if resume_dir is not None else None
    if saved and not spec.resumable:
        raise R.UsageError(f"{algo} runs cannot be resumed; start a new run (they take minutes)")
    if saved:  # a run saved before a setting's rename resumes under the new name
        saved["config"] = renamed_settings(spec.config_cls, saved["config"], f"{resume_dir}/config.json")
    agent_values = dict(saved["config"]) if saved else dict(spec.presets.get(preset or "", {}))
    try:
        types = R.field_types(spec.config_cls)
        unknown = sorted(set(agent_values) - set(types))
        if unknown:
            raise TypeError(f"unknown key {unknown[0]!r}")
        cfg = spec.config_cls(**{k: R.parse_value(k, types[k], v) for k, v in agent_values.items()})
    except (TypeError, ValueError, R.UsageError) as e:
        raise R.UsageError(f"{resume_dir}/config.json: {R.first_line(e)} (the file is damaged or was edited, or was "
                           "written by another version of tokengym)") from None
    if saved:
        try:
            R.apply_overrides({"run": run}, saved["run"], "the saved run config")
        except R.UsageError as e:
            raise R.UsageError(f"{resume_dir}/config.json: {R.first_line(e)} (the file is damaged or was edited)") from None
    configs = {"run": run, "agent": cfg}
    allowed = run_fields(algo) | {f.name for f in dataclasses.fields(spec.config_cls)}
    for source, values in (("the config file", values_file), ("the command line", values_flags)):
        users_of = run_fields_for()
        other = next((k for k in values if k.replace("-", "_") not in allowed and k.replace("-", "_") in users_of), None)
        if other is not None:
            users = ", ".join(sorted(users_of[other.replace("-", "_")]))
            raise R.UsageError(f"{other!r} in {source} does not apply to `tokengym train {algo}` (it is for {users})")
        R.apply_overrides(configs, _worker_addresses(values), source)
    try:  # re-run the dataclass validation on the final values
        cfg = spec.config_cls(**dataclasses.asdict(cfg))
    except (TypeError, ValueError) as e:
        raise R.UsageError(str(e)) from None
    _check_run(run, algo)
    if getattr(cfg, "eval_k", 0) and run.eval_prompts == 0:
        raise R.UsageError(f"eval_k={cfg.eval_k} samples the held-out prompts, and eval_prompts=0 turns held-out "
                           "evaluation off; give eval_prompts >= 1 or drop eval_k")
    _check_sharding(run, algo, cfg, saved, resume_dir)
    _check_engine_processes(cfg)
    if saved:
        changed = [(k, saved[part][k], v) for part, obj in (("run", run), ("config", cfg))
                   for k, v in _jsonable(dataclasses.asdict(obj)).items()
                   if k not in RESUMABLE and k in saved[part] and saved[part][k] != v]
        if changed:
            k, old, new = changed[0]
            raise R.UsageError(f"cannot resume {resume_dir} with a different config: {k} was {old!r}, now {new!r}")
        return run, cfg, resume_dir
    if run.model is None:  # the shipped warm start of the env's task
        run.model = spec.default_model or WARM_STARTS.get(run.env, "tiny-arithmetic")
    return run, cfg, _new_run_dir(run, algo)


def _check_run(run: RunConfig, algo: str) -> None:
    from tokengym.agents.engine.resources import check_device
    from tokengym.rewards.common import check_field_types

    try:
        check_field_types(run)
    except ValueError as e:
        raise R.UsageError(str(e)) from None
    min_group = algorithms()[algo].min_group
    bad = {"prompts": run.prompts is None or run.prompts >= 1,
           "group_size": run.group_size is None or run.group_size >= min_group,
           "eval_prompts": run.eval_prompts >= 0, "save_every": run.save_every >= 0, "num_pairs": run.num_pairs >= 2,
           "dist_timeout": 10 <= run.dist_timeout <= 7 * 24 * 3600,
           "keep_checkpoints": run.keep_checkpoints >= 1, "temperature": run.temperature > 0,
           "threads": run.threads is None or run.threads >= 1}
    why = {"dist_timeout": " (from 10 s to 7 days)",
           "group_size": f" ({algo} compares G >= {min_group} completions of each prompt)" if min_group > 1 else ""}
    for k, ok in bad.items():
        if not ok:
            raise R.UsageError(f"invalid {k}={getattr(run, k)!r}{why.get(k, '')}")
    try:
        check_device(run.device)
        check_report_to(run.report_to)  # an unknown tracker or one not installed: one line, no folder
    except ValueError as e:
        raise R.UsageError(str(e)) from None
    resolve_env_id(run)  # a bad env (module, class, id) is one line before anything loads


def _check_sharding(run: RunConfig, algo: str, cfg: Any = None, saved: dict[str, Any] | None = None,
                    resume_dir: str | None = None) -> None:
    """``--sharding``: a known value; fsdp2 only under torchrun with 2+ processes, on a torch with FSDP2, and not
    with a setting it cannot serve (one line each, before anything is built or written). A resumed run's sharding
    may come from its ``config.json``: then the line says how to resume it (checkpoints hold full state, so
    ``--sharding none`` resumes it in one process)."""
    from tokengym.agents.runtime.sharding import SHARDINGS, unsupported_reason

    if run.sharding not in SHARDINGS:
        raise R.UsageError(f"invalid sharding={run.sharding!r}; choose one of {', '.join(SHARDINGS)}")
    if run.sharding == "none":
        return
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 and saved and saved["run"].get("sharding") == run.sharding:
        k = saved.get("processes")
        over = f" over {k} processes" if isinstance(k, int) and k >= 2 else ""
        raise R.UsageError(f"{resume_dir} was trained with --sharding {run.sharding}{over}: resume it under "
                           f"`torchrun --nproc_per_node={k if over else 'K'} -m tokengym.agents.cli train {algo} --resume "
                           f"{resume_dir}`{'' if over else ' (K >= 2)'}, or pass --sharding none to resume it in one "
                           "process (its checkpoints hold the full, unsharded state)")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise R.UsageError(f"--sharding {run.sharding} shards the model over the processes of a torchrun launch, and this "
                           "is a single process: run `torchrun --nproc_per_node=K -m tokengym.agents.cli train ...` with "
                           "K >= 2, or drop --sharding")
    if (why := unsupported_reason()) is not None:
        raise R.UsageError(f"--sharding {run.sharding}: {why}")
    if cfg is not None and getattr(cfg, "reset_ref", False):
        raise R.UsageError(f"--sharding {run.sharding} cannot reset the reference model (reset_ref): its copy of the "
                           "sharded policy is not supported yet; drop --reset-ref or --sharding")
    if cfg is not None and getattr(cfg, "share_trunk", False):
        raise R.UsageError(f"--sharding {run.sharding} cannot share the policy's trunk with the critic (share_trunk): "
                           "the two would be sharded twice; drop --share-trunk or --sharding")


def _check_engine_processes(cfg: Any) -> None:
    """An engine backend (``--sampler vllm``) under torchrun (``WORLD_SIZE`` set): one line before the process group is
    joined, a model loaded or an engine started (the agent's own check runs once the ranks are set up, too late for
    the run folder)."""
    from tokengym.agents.engine.backends import check_one_process

    if getattr(cfg, "sampler", None) is None:  # an offline algorithm: no rollout backend
        return
    try:
        check_one_process(cfg.sampler, "WORLD_SIZE" in os.environ)
    except ValueError as e:
        raise R.UsageError(str(e)) from None


def _worker_addresses(values: dict[str, Any]) -> dict[str, Any]:
    """``rollout_workers`` as ``host:port,...`` (remote workers) becomes ``remote_workers``; a count stays."""
    for key in ("rollout_workers", "rollout-workers"):
        v = values.get(key)
        if isinstance(v, str) and ":" in v:
            values = {k: x for k, x in values.items() if k != key}
            values["remote_workers"] = v
            values["rollout_workers"] = len([a for a in v.split(",") if a.strip()])
    return values


_jsonable = jsonable


def config_line(cfg: Any, preset: str | None, run_dir: str, verbose: bool = False) -> str:
    """The config line a run prints: the fields of ``cfg`` that differ from its class's defaults (a preset's
    included), or with ``verbose`` every field; ``config.json`` holds them all, and the line says so."""
    values = _jsonable(dataclasses.asdict(cfg))
    if not verbose:
        defaults = _jsonable(dataclasses.asdict(type(cfg)()))
        values = {k: v for k, v in values.items() if defaults.get(k) != v}
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    head = f"  {type(cfg).__name__}{f' (preset {preset})' if preset else ''}: "
    if verbose:
        return head + shown
    where = f"full config in {run_dir}/config.json"
    return head + (f"{shown} (the rest default; {where})" if shown else f"defaults ({where})")


def train(algo: str, values_file: dict[str, Any], values_flags: dict[str, Any], resume_dir: str | None = None,
          preset: str | None = None, verbose: bool = False) -> int:
    """Run ``tokengym train <algo>``; return the exit code (bad input raises :class:`UsageError`). ``verbose``:
    print every field of the algorithm's config, not only those that differ from its defaults.

    Under ``torchrun`` (``WORLD_SIZE`` set) the run is data-parallel: see :mod:`tokengym.agents.runtime.distributed`.
    """
    from tokengym.agents.runtime import distributed

    if resume_dir is not None and _finished(algo, resume_dir):
        return 0
    run, cfg, run_dir = resolve(algo, values_file, values_flags, resume_dir, preset)
    use_threads(run.threads)
    dp, device = distributed.init(run.device, run.dist_timeout)
    try:
        code = _train(algo, run, cfg, run_dir, resume_dir is not None, dp, device, preset, verbose)
    except BaseException as e:
        distributed.shutdown()
        if dp.distributed and distributed.is_timeout(e):
            raise distributed.RankTimeout(f"rank {dp.rank}: the other ranks did not join a collective within "
                                          f"{run.dist_timeout:g} s (dist_timeout): is a rank stopped or hung? The run "
                                          "stops; its checkpoints are intact (resume it)") from None
        raise
    distributed.shutdown(done=True)
    return code


def _finished(algo: str, resume_dir: str) -> bool:
    """Whether the run to resume has finished (its ``model/`` is written); if so say so (rank 0) and how to train it
    further. Checked before any setting (a finished run needs none: its saved ``--sharding fsdp2`` is no reason to
    refuse it outside torchrun)."""
    _saved_config(resume_dir, algo)  # an algo run (one line otherwise)
    if not os.path.isdir(os.path.join(resume_dir, "model")):
        return False
    if os.environ.get("RANK", "0") == "0":
        print(f"{resume_dir} already finished; nothing to resume (the trained model is in {resume_dir}/model). To train "
              f"it further, start a new run from it: tokengym train {algo} --model {resume_dir}/model --steps N "
              "--name NEW and the run's other settings (a fresh optimiser and schedule)")
    return True


def _train(algo: str, run: RunConfig, cfg: Any, run_dir: str, resume: bool, dp: Any, device: str,
           preset: str | None = None, verbose: bool = False) -> int:
    from tokengym.agents.runtime import distributed

    specs = algorithms()
    if dp.world_size > 1 and not specs[algo].data_parallel:
        parallel = sorted(k for k, v in specs.items() if v.data_parallel)
        raise R.UsageError(f"tokengym train {algo} is not data-parallel yet; run it in one process "
                           f"(torchrun with several processes supports {', '.join(parallel)})")
    run_dir = dp.broadcast_object(run_dir)  # rank 0's (timestamped) name
    say = print if dp.is_main else (lambda *a, **k: None)
    if dp.distributed:
        distributed.seed_rank(getattr(cfg, "seed", 0), dp)
        run = dataclasses.replace(run, device=device)
    with contextlib.ExitStack() as held:
        if resume and dp.is_main:  # another process writing this run: fail before loading anything
            held.enter_context(R.RunLock(run_dir, create=False))
        spec = specs[algo]  # everything loaded and checked; nothing written yet:
        build = spec.build or BUILDERS.get(algo)
        job = build(run, cfg) if build is not None else build_on_policy(spec, run, cfg)
        dp.barrier()  # every rank has built its job before rank 0 creates the folder
        if dp.is_main:
            if resume:
                R.clean_stale_tmp(run_dir)
            else:  # creates and locks the folder (another run may have taken the name meanwhile), writes config.json
                held.callback(create_run_folder(run_dir, {
                    "algorithm": algo, "preset": preset, "run": _jsonable(dataclasses.asdict(run)),
                    "config": _jsonable(dataclasses.asdict(cfg)), "processes": dp.world_size}).release)
        if dp.distributed:
            say(f"data parallel: {dp.world_size} processes, {run.device} (rank 0 writes the run)", flush=True)
        dp.barrier()
        say(f"tokengym train {algo}: {run.env} from {run.model} -> {run_dir}", flush=True)
        for tracker in parse_report_to(run.report_to):
            say(f"  {where(tracker, run_dir, run.runs_dir)}", flush=True)
        say(config_line(cfg, preset, run_dir, verbose), flush=True)
        with R.storage_errors(run_dir, "the run's logs and checkpoints"):  # a full or read-only disk: one line
            result = job(run_dir, resume)
    if not dp.is_main:
        return 0
    if "stopped" in result:  # an early stop (sft's stop_at_accuracy): where and why
        print(result["stopped"])
    if "start" in result:
        print(f"held-out greedy accuracy: {result['start']:.1%} -> {result['final']:.1%}")
        if "replies" in result:
            print("env replies (tool calls) per held-out episode: {:.2f} -> {:.2f}".format(*result["replies"]))
    elif "label" in result:  # an offline job's own metric (an async run without evaluation has only its staleness)
        print(f"{result['label']}: {result['final']:.1%}")
    if "staleness" in result:
        hist = result["staleness"]
        mean = sum(k * n for k, n in hist.items()) / sum(hist.values())
        print(f"rollout staleness (updates behind): mean {mean:.2f}, max {max(hist)}; steps per staleness {hist}")
    print(f"done: model in {run_dir}/model, metrics in {run_dir}/metrics.jsonl")
    return 0

