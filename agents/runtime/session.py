"""A training run in its folder, the one place for it: the command line (``tokengym train``) and the Python API
(``agent.learn(env, run_dir=...)``, ``learner.fit(..., run_dir=...)``) both write a folder through here.

* :func:`create_run_folder`: create and lock the folder (refusing one that is not empty) and write ``config.json``.
* :class:`Trainer`: logger, checkpoints every ``save_every`` steps, exact resume, progress, the final ``model/``.
* :func:`run_in_folder`: both for a run started from Python, which records the env it was given
  (:func:`env_record`) so that ``tokengym eval/plot/sample --run`` and ``resume=True`` work on the folder.

See :mod:`tokengym.agents.runtime.runs` for the folder's layout and guarantees.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import warnings
from typing import Any, Callable

from tokengym.agents.runtime import runs as R
from tokengym.agents.runtime.config import resumable_fields
from tokengym.agents.runtime.run_config import RunConfig

__all__ = ["Progress", "Trainer", "save_model", "initial_eval", "summary", "create_run_folder",
           "run_in_folder", "env_record", "python_run", "jsonable"]


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict as ``config.json`` holds it (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def create_run_folder(run_dir: str, config: dict[str, Any]) -> R.RunLock:
    """Create ``run_dir`` and take its lock (the caller releases it), refuse it when another run took it meanwhile,
    and write ``config.json``; a folder that is not empty is a :class:`~tokengym.agents.runtime.runs.UsageError`."""
    lock = R.RunLock(run_dir).acquire()  # creates the folder
    try:
        if set(os.listdir(run_dir)) - {R.LOCK_FILE}:
            raise R.UsageError(f"{run_dir} already exists and is not empty; pick another --name")
        R.clean_stale_tmp(run_dir)
        R.write_json_atomic(os.path.join(run_dir, "config.json"), config)
    except BaseException:
        lock.release()
        raise
    return lock


class Progress:
    """A tqdm bar on a terminal, else a plain line every ~10% of the run; shows the key metrics, each the latest
    logged (``eval_acc`` is the last held-out evaluation, not a live figure), with 3 significant digits."""

    KEYS = {"reward/mean": "reward", "objective/score": "score", "eval/accuracy": "eval_acc", "train/kl": "kl",
            "objective/kl": "kl", "train/loss": "loss", "rewards/accuracies": "pref_acc", "loss": "loss"}

    def __init__(self, total: int, initial: int, enabled: bool, desc: str):
        self.total, self.n, self.enabled, self.desc = total, initial, enabled, desc
        self.bar = None
        self.live: dict[str, float] = {}
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        for k, short in self.KEYS.items():
            if record.get(k) is not None:
                self.live[short] = record[k]
        step = int(record.get("step", self.n))
        text = " ".join(f"{k}={v + 0.0:.3g}" for k, v in self.live.items())  # -3.7e-09 shows as such; -0.0 as 0
        if self.bar is not None:
            self.bar.update(max(0, step - self.n))
            self.bar.set_postfix_str(text, refresh=True)
        elif self.enabled and step > self.n and (step * 10 // max(self.total, 1) > self.n * 10 // max(self.total, 1) or step == self.total):
            print(f"{self.desc} step {step}/{self.total} {text}", file=sys.stderr, flush=True)
        self.n = max(self.n, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()




class Trainer:
    """The part every algorithm shares: logger, checkpoints, resume, progress, kill hook (in a created, locked run folder).

    ``run`` holds the run settings it reads: ``save_every``, ``keep_checkpoints``, ``progress``, ``report_to`` and
    ``sharding``."""

    def __init__(self, run: RunConfig, run_dir: str, resume: bool, total: int, agent: Any, env: Any = None):
        from tokengym.agents.runtime import distributed

        self.run, self.run_dir, self.agent, self.env, self.total = run, run_dir, agent, env, total
        sharding = run.sharding
        if sharding == "none":
            self.dp = distributed.prepare(agent, env)  # under torchrun: shard the env batch, rank 0 writes
        else:  # a checkpoint holds full weights and optimiser state: load them first, then shard (see save)
            self.dp = dataclasses.replace(distributed.DataParallel.current(), sharding=sharding)
        self.start_step = 0
        kill, kill_worker = os.environ.get("TOKENGYM_SIGKILL_AFTER_STEP"), os.environ.get("TOKENGYM_SIGKILL_WORKER_AFTER_STEP")
        self.kill_at = int(kill) if kill else None
        self.kill_worker_at = int(kill_worker) if kill_worker else None  # testing hook: an async run's rollout worker 0
        stop = os.environ.get("TOKENGYM_SIGSTOP_RANK_AFTER_STEP")  # testing hook: "step,rank"
        self.stop_rank_at = tuple(int(x) for x in stop.split(",")) if stop else None
        main = self.dp.is_main
        say = print if main else (lambda *a, **k: None)
        ckpt = None
        if resume:
            ckpt, notes = R.latest_intact_checkpoint(run_dir)
            if ckpt is None and notes:  # checkpoints exist, none intact: starting over would discard the run's metrics
                raise R.UsageError(f"cannot resume {run_dir}: no intact checkpoint ({notes[0]})")
            for note in notes:
                say(f"tokengym: warning: {note}", file=sys.stderr, flush=True)
        if ckpt is not None:
            state = R.load_checkpoint(ckpt, agent.checkpoint_modules())
            agent.load_state_dict(state["agent"])
            if env is not None and state.get("env") is not None:
                env.load_state_dict(state["env"])
            self.start_step = int(state["step"])
            if len(state.get("rank_rng") or []) == self.dp.world_size:  # each rank's own global RNGs
                R.set_rng_state(state["rank_rng"][self.dp.rank])
            say(f"resuming {run_dir} at step {self.start_step} of {total} ({os.path.basename(ckpt)})", flush=True)
        elif resume:
            say(f"{run_dir} has no checkpoint yet: starting it again from step 0", flush=True)
        if sharding != "none":
            self.dp = distributed.prepare(agent, env, sharding=sharding, bf16=bool(getattr(agent.config, "bf16", False)))
        # the first step to (re)do: records and TensorBoard events from it on were lost work, about to be redone
        redo = self.start_step + 1 if ckpt is not None else 0
        kept = []
        if resume and main:
            kept = R.truncate_metrics(run_dir, redo - 1)
            if kept.warning:
                say(f"tokengym: warning: {kept.warning}", file=sys.stderr, flush=True)
        from tokengym.agents.runtime.logger import RunLogger

        agent.logger.close()
        agent.logger = RunLogger(run_dir if main else None, purge_step=redo if resume else None, report_to=run.report_to)
        agent.logger.history.extend(kept)
        self.progress = Progress(total, self.start_step, run.progress and main, os.path.basename(run_dir))

    def callback(self, record: dict[str, Any]) -> bool:
        self.progress.update(record)
        step = int(record["step"])
        if self.run.save_every and step % self.run.save_every == 0 and step < self.total:
            self.save(step)
        if self.kill_at is not None and step == self.kill_at:  # testing hook: killed after the step, checkpoint included
            self.dp.barrier()  # (other ranks return from save() before rank 0 has written it)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop_rank_at is not None and step == self.stop_rank_at[0] and self.dp.rank == self.stop_rank_at[1]:
            os.kill(os.getpid(), signal.SIGSTOP)  # testing hook: this rank stops (as with kill -STOP), the others wait
        if self.kill_worker_at is not None and step == self.kill_worker_at:
            os.kill(self.agent.worker_pids()[0], signal.SIGKILL)
        return True

    def save(self, step: int) -> None:
        state = {"agent": self.agent.state_dict(), "env": self.env.state_dict() if self.env is not None else None}
        modules = self.agent.checkpoint_modules()
        if self.dp.sharding != "none":  # every rank gathers the full weights and optimiser state; rank 0 writes them
            from tokengym.agents.runtime.sharding import FullStateModule, full_state

            modules = {key: FullStateModule(m) for key, m in modules.items()}
            state = full_state(state)
        if self.dp.distributed:  # every rank takes part: check the ranks agree, collect their RNG states
            if (bad := self.dp.all_same(modules)) is not None:
                raise RuntimeError(f"data-parallel ranks diverged at step {step}: {bad} differs from rank 0's")
            state["rank_rng"] = self.dp.all_gather_object(R.rng_state())
            if not self.dp.is_main:
                return
        R.save_checkpoint(self.run_dir, step, modules, state, keep=self.run.keep_checkpoints)

    def finish(self) -> None:
        self.progress.close()
        self.save(self.agent.global_step)
        save_model(self.agent.policy, self.run_dir, self.dp)
        self.agent.logger.close()


def save_model(model: Any, run_dir: str, dp: Any = None) -> None:
    """Write ``run_dir/model`` (``save_pretrained`` format) atomically: a kill mid-write leaves no half-made folder.

    With ``dp`` (every rank calls it) rank 0 writes; a sharded policy's full weights are gathered first."""
    from tokengym.agents.runtime.sharding import full_state, is_sharded, unwrapped

    if dp is not None and is_sharded(model):
        weights = full_state(dict(model.model.state_dict(keep_vars=True)))
        if dp.is_main:
            with unwrapped(model.model):
                R.write_folder_atomic(os.path.join(run_dir, "model"), lambda path: model.save_pretrained(path, state_dict=weights))
        return
    if dp is None or dp.is_main:
        R.write_folder_atomic(os.path.join(run_dir, "model"), model.save_pretrained)


def initial_eval(trainer: Trainer, agent: Any, eval_env: Any, samples: Any, evaluate: Callable) -> None:
    """Log held-out greedy metrics at step 0 of a new run (``evaluate`` is the engine's, passed down to this layer)."""
    if trainer.start_step == 0 and eval_env is not None and samples:
        agent.policy.eval()
        res = evaluate(agent.policy, eval_env, samples, greedy=True)
        trainer.progress.update(agent.logger.log(0, {f"eval/{k}": v for k, v in res.items()}))


def summary(history: list[dict[str, Any]], key: str = "eval/accuracy") -> dict[str, Any]:
    values = [r[key] for r in history if r.get(key) is not None]
    calls = [r["eval/replies_per_episode"] for r in history if r.get("eval/replies_per_episode") is not None]
    out = {"start": values[0], "final": values[-1]} if values else {}
    if out and calls:  # a multi-turn env: its replies (a tool env's calls) per episode
        out["replies"] = (calls[0], calls[-1])
    lags = [int(r["async/staleness"]) for r in history if r.get("async/staleness") is not None]
    if lags:  # an async run: how many steps trained on rollouts of each staleness
        out["staleness"] = {k: lags.count(k) for k in sorted(set(lags))}
    return out


# ---------------------------------------------------------------------------------------------- runs from Python
_MADE_BY_THE_RUN = {"task", "num_envs", "vectorization_mode", "group_size", "device", "tokenizer"}
"""Arguments of a run's env that ``config.json`` does not record: the id's own task, and what the run sets itself."""


def env_record(env: Any) -> dict[str, Any]:
    """``{"env", "env_kwargs"}`` for ``config.json``: what makes ``env`` again (its Gymnasium id and arguments, or for
    an env made from a Task instance the task's id or ``module:Class`` and the constructor arguments that make the
    same prompts). What cannot be recorded (arguments that are not JSON, a task class in ``__main__``) is named in a
    warning: an env made from the record goes without it."""
    from tokengym.rewards.common import TokengymWarning

    spec, lost = getattr(env, "spec", None), []
    if spec is not None and spec.id:
        name, kwargs = spec.id, {k: v for k, v in spec.kwargs.items() if k not in _MADE_BY_THE_RUN}
    else:
        name, kwargs, lost = _task_record(env)
    lost += sorted(k for k, v in kwargs.items() if not _is_json(v))
    if lost:
        warnings.warn(f"config.json cannot record {', '.join(lost)} of the run's env; an env made from the run's config "
                      "(tokengym eval --run, resume) goes without it", TokengymWarning, stacklevel=4)
    kwargs = {k: v for k, v in kwargs.items() if _is_json(v)}
    return {"env": name, "env_kwargs": kwargs or None}


def _task_record(env: Any) -> tuple[str, dict[str, Any], list[str]]:
    """``(id or module:Class, arguments, what is lost)`` of a TokenVectorEnv made from a Task instance: the constructor
    arguments read back from the task's attributes, kept when a task made from them draws the same prompts."""
    import inspect

    import numpy as np

    from tokengym.envs.tasks.registry import TASK_SPECS

    task, lost = env.task, []
    cls = type(task)
    name = next((s.env_id for s in TASK_SPECS.values() if s.cls is cls), None) or f"{cls.__module__}:{cls.__qualname__}"
    if cls.__module__ == "__main__":
        lost.append(f"its task class {cls.__qualname__} (defined in __main__; define it in a module)")
    try:
        params = [p for p in inspect.signature(cls).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        params = []
    kwargs = {p.name: getattr(task, p.name) for p in params if _is_json(getattr(task, p.name, object()))}
    try:
        twin = cls(**kwargs)
        same = repr(twin.batch(np.random.default_rng(0), 4)) == repr(task.batch(np.random.default_rng(0), 4))
    except Exception:  # a constructor that wants more than its attributes say
        same = False
    if not same:
        kwargs = {}
        lost.append(f"the arguments of its task {cls.__qualname__} (make the env with gymnasium.make_vec and keyword "
                    "arguments to record them)")
    if env.max_new_tokens != task.default_max_new_tokens:
        kwargs["max_new_tokens"] = env.max_new_tokens
    return name, kwargs, lost


def _is_json(v: Any) -> bool:
    import json

    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def python_run(env: Any, policy: Any, eval_samples: Any, settings: RunConfig, rollout: bool = True) -> dict[str, Any]:
    """The ``run`` section of ``config.json`` for a run started from Python (the :class:`RunConfig` fields it knows).

    ``env``: the env the run trains on (``rollout``: an on-policy run, whose batch it also records) or evaluates on
    (an offline learner's); ``None`` records no env (``tokengym eval/sample --run`` then need ``--env``)."""
    model = getattr(getattr(getattr(policy, "model", None), "config", None), "_name_or_path", None) or None
    run = {**(env_record(env) if env is not None else {}), "imports": None, "model": model}
    if rollout:
        run.update(prompts=env.num_envs // env.group_size, group_size=env.group_size)
    return {**run, "temperature": float(getattr(policy, "temperature", 1.0)), "eval_prompts": len(eval_samples or ()),
            "save_every": settings.save_every, "keep_checkpoints": settings.keep_checkpoints,
            "device": str(env.device if env is not None else policy.device)}


def _as_saved(value: Any) -> Any:
    """``value`` as ``config.json`` holds it (tuples as lists), so a resume compares like with like."""
    return json.loads(json.dumps(value, default=repr))


def run_in_folder(run_dir: str | os.PathLike, resume: bool, config: dict[str, Any], agent: Any, env: Any, total: int,
                  body: Callable[[Trainer], None], settings: RunConfig | None = None) -> list[dict[str, Any]]:
    """Train ``agent`` in ``run_dir`` as ``tokengym train`` does; return the records this call logged.

    ``config`` is the run's ``config.json`` (``algorithm``, ``run``, ``config``); ``body(trainer)`` trains with
    ``trainer.callback`` and ends with ``trainer.finish()``. A folder that exists and is not empty is refused unless
    ``resume``; ``resume=True`` continues the run from its newest intact checkpoint exactly as ``--resume`` does
    (its config must be the same but for its :func:`~tokengym.agents.runtime.config.resumable` settings), and starts
    it when the folder is missing or empty. ``settings``: the run's (default: ``RunConfig(progress=False)``, no
    progress bar from Python). Raises ``ValueError`` (one line) for a refused folder.
    """
    run_dir = os.fspath(run_dir)
    settings = settings if settings is not None else RunConfig(progress=False)
    resuming = resume and R.is_run_dir(run_dir)
    if resuming:
        saved = R.read_run_config(run_dir)
        own = type(getattr(agent, "config", None))
        may_change = resumable_fields(type(settings), *([own] if dataclasses.is_dataclass(own) else []))
        for part in ("algorithm", "config"):
            was, now = saved.get(part), _as_saved(config[part])
            if isinstance(was, dict) and isinstance(now, dict):  # what a resumed run may change, as on the command line
                was, now = ({k: v for k, v in d.items() if k not in may_change} for d in (was, now))
            if was != now:
                raise ValueError(f"cannot resume {run_dir} with a different {part}: {_first_difference(was, now)}")
        was, now = saved.get("run") or {}, _as_saved(config["run"])  # the env it trains on (what either record names)
        keys = [k for k in ("env", "env_kwargs", "prompts", "group_size") if was.get(k) is not None and now.get(k) is not None]
        if any(was[k] != now[k] for k in keys):
            raise ValueError(f"cannot resume {run_dir} on another env than its {was.get('env')!r}: "
                             f"{_first_difference({k: was[k] for k in keys}, {k: now[k] for k in keys})}")
        if os.path.isdir(os.path.join(run_dir, "model")):
            raise ValueError(f"{run_dir} already finished (its trained model is in {run_dir}/model); nothing to resume")
        lock = R.RunLock(run_dir, create=False).acquire()
    else:
        if os.path.exists(run_dir) and (not os.path.isdir(run_dir) or set(os.listdir(run_dir)) - {R.LOCK_FILE}):
            raise ValueError(f"{run_dir} already exists and is not empty; pass resume=True to continue the run in it, "
                             "or another run_dir")
        lock = create_run_folder(run_dir, config)
    start = len(agent.logger.history)
    try:
        with R.storage_errors(run_dir, "the run's logs and checkpoints"):
            R.clean_stale_tmp(run_dir)
            body(Trainer(settings, run_dir, resuming, total, agent, env))
    finally:
        lock.release()
    return agent.logger.history[start:] if len(agent.logger.history) >= start else list(agent.logger.history)


def _first_difference(saved: Any, now: Any) -> str:
    if isinstance(saved, dict) and isinstance(now, dict):
        k = next((k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)), None)
        if k is not None:
            return f"{k} was {saved.get(k)!r}, now {now.get(k)!r}"
    return f"was {saved!r}, now {now!r}"
