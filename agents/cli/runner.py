"""The run machinery every ``tokengym train`` algorithm shares: the run settings (:class:`RunConfig`, from
``tokengym.agents.runtime.run_config``) and which settings a resume may change (:data:`RESUMABLE`), building the
env, model, evaluation set and learned rewards from them, the progress display, the :class:`Trainer` that
checkpoints and resumes a job, and the on-policy builder. Offline builders (``offline_jobs.py``) use the same
pieces; ``train.py`` resolves configs and runs a job in its folder.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from tokengym.agents.engine.config import EngineConfig
from tokengym.agents.runtime import runs as R
from tokengym.agents.runtime.config import resumable_fields
from tokengym.agents.runtime.run_config import RunConfig
from tokengym.agents.runtime.session import Progress, Trainer, save_model, summary
from tokengym.agents.algorithms.registry import algorithms

__all__ = ["RunConfig", "RESUMABLE", "Job", "Trainer", "Progress", "algorithms", "make_env", "checked_env",
           "load_policy", "eval_setup", "learned_rewards", "phase_progress", "save_model", "initial_eval", "summary", "make_agent",
           "build_on_policy", "run_fields", "run_fields_for", "first_line", "resolve_env_id", "use_threads", "warn_if_busy"]


RESUMABLE = resumable_fields(RunConfig, EngineConfig)
"""The settings a resumed run may change (``--resume`` with other values of them); every other one must match the
saved ``config.json``. Derived from the fields declared :func:`~tokengym.agents.runtime.config.resumable`: where to
run, how often to save and how long to wait. (A checkpoint holds full weights whatever the sharding, so a run
resumes sharded or not, with any process count.)"""


def run_fields_for() -> dict[str, set[str]]:
    """``{field: algorithms}`` of the :class:`RunConfig` fields only some algorithms take (each algorithm's
    ``run_fields`` in the registry); the other fields apply to every algorithm."""
    users: dict[str, set[str]] = {}
    for name, spec in algorithms().items():
        for f in spec.run_fields:
            users.setdefault(f, set()).add(name)
    return users


def run_fields(algo: str) -> set[str]:
    """Names of the :class:`RunConfig` fields that ``tokengym train <algo>`` takes."""
    optional, own = run_fields_for(), algorithms()[algo].run_fields
    return {f.name for f in dataclasses.fields(RunConfig) if f.name not in optional or f.name in own}



Job = Callable[[str, bool], dict[str, Any]]
"""What a builder returns: ``job(run_dir, resume)`` trains in the (created, locked) run folder and returns a summary."""


# ---------------------------------------------------------------------------------------------- building blocks
def env_kwargs(run: RunConfig) -> dict[str, Any]:
    return dict(run.env_kwargs or {})


def resolve_env_id(run: RunConfig) -> str:
    """The Gymnasium id of the run's ``env`` (a registered id, ``module:Class`` or ``module:EnvId-v0``, after its
    ``imports``); a bad one is a :class:`~tokengym.agents.runtime.runs.UsageError`."""
    from tokengym.envs import resolve_env

    try:
        return resolve_env(run.env, run.imports or ())
    except ValueError as e:
        raise R.UsageError(first_line(e)) from None


def make_env(run: RunConfig, num_envs: int, group_size: int = 1, tokenizer: Any = None, **extra: Any):
    """The run's vector env (raises :class:`~tokengym.agents.runtime.runs.UsageError` for a bad id or arguments)."""
    import gymnasium as gym

    env_id = resolve_env_id(run)
    own = ":" in run.env  # the user's env or task: any error it raises is theirs, and is named in one line
    theirs = Exception if own else (TypeError, ValueError, OSError, ImportError)

    def make(n: int):
        return gym.make_vec(env_id, num_envs=n, vectorization_mode="vector_entry_point", group_size=group_size,
                            device=run.device, tokenizer=tokenizer, **env_kwargs(run), **extra)

    try:
        env = make(num_envs)
    except theirs as e:
        raise R.UsageError(f"cannot build env {run.env} with {env_kwargs(run)}: {_named(e)}") from None
    _check_grammar(run, env)
    if own:
        _probe_episode(run, make, group_size)
    return env


_GRAMMARS_CHECKED: set[str] = set()


def _check_grammar(run: RunConfig, env: Any) -> None:
    """The env's grammar walked to a finished answer (:func:`tokengym.envs.check_grammar`) before anything is
    written: a grammar that does not compile, allows nothing or cannot finish is one line naming the env. Once per
    env, settings and tokenizer."""
    from tokengym.envs import check_grammar

    if getattr(env, "masker", None) is None:
        return
    key = f"{run.env} {env_kwargs(run)} {getattr(env.tokenizer, 'name_or_path', '')} {len(env.tokenizer)}"
    if key in _GRAMMARS_CHECKED:
        return
    try:
        check_grammar(env)
    except (ValueError, ImportError) as e:
        raise R.UsageError(f"env {run.env}: {first_line(e)}") from None
    _GRAMMARS_CHECKED.add(key)


_PROBED: set[str] = set()


def _probe_episode(run: RunConfig, build: Callable[[int], Any], group_size: int) -> None:
    """Draw and score a few episodes of the user's env (random actions, a fresh env of its own) before anything is
    written, so a ``sample()`` or ``reward()`` that raises, returns the wrong thing or a prompt too long for the
    env is one line now, not a traceback after the run folder was made. Once per env and settings."""
    import numpy as np
    import torch

    from tokengym.envs import TokenVectorEnv
    from tokengym.envs.vector_check import within_masks

    key = f"{run.env} {env_kwargs(run)} {group_size}"
    if key in _PROBED:
        return
    try:
        env = build(max(2, group_size))
        if isinstance(env, TokenVectorEnv):
            rng = np.random.default_rng(0)
            env.reset(seed=0)
            for _ in range(env.seq_len):
                acts = torch.as_tensor(rng.integers(0, env.single_action_space.n, size=env.num_envs))
                env.step(within_masks(env, acts) if env.masker is not None else acts)  # a grammar's own tokens
                if env.all_done:
                    break
    except Exception as e:
        raise R.UsageError(f"env {run.env}: a probe episode (random actions, before the run starts) failed: "
                           f"{_named(e)}") from None
    _PROBED.add(key)


def _named(e: BaseException) -> str:
    """``first_line(e)``, after the exception's type unless the message is already a sentence of its own kind."""
    return first_line(e) if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: {first_line(e)}"


first_line = R.first_line


def checked_env(run: RunConfig, policy: Any, num_envs: int, group_size: int = 1, update_rows: int | None = None, **extra: Any):
    """The run's env for ``policy``, refused (:class:`UsageError`) when its rows exceed the model's positions or
    a rollout of ``num_envs`` rows (and an update of ``update_rows``) cannot fit in the device's memory."""
    from tokengym.agents.engine.resources import check_fits, check_memory

    if update_rows is not None:  # before the env allocates its [num_envs, P + M] buffers
        probe = make_env(run, group_size, group_size, tokenizer=policy.tokenizer, **extra)
        try:  # the position limit first: a prompt the model cannot hold is no memory problem
            check_fits(policy, probe)
        except ValueError as e:
            raise R.UsageError(f"{run.env}: {e}") from None
        try:
            check_memory(policy.model, num_envs, probe.seq_len, update_rows, run.device, f"a batch of {num_envs} episodes")
        except ValueError as e:
            raise R.UsageError(str(e)) from None
    env = make_env(run, num_envs, group_size, tokenizer=policy.tokenizer, **extra)
    try:
        check_fits(policy, env)
    except ValueError as e:
        raise R.UsageError(f"{run.env}: {e}") from None
    return env


def use_threads(threads: int | None) -> None:
    """``--threads N`` (train, eval, sample): torch's CPU threads; left out, torch's default stays, with a warning
    when the machine is busy (:func:`warn_if_busy`). Fewer than 1 is a :class:`UsageError`."""
    import torch

    if threads is not None and threads < 1:
        raise R.UsageError(f"--threads must be at least 1, got {threads}")
    if threads:
        torch.set_num_threads(threads)
    else:
        warn_if_busy(torch.get_num_threads())


def warn_if_busy(threads: int) -> None:
    """A warning when other processes already keep the cores busy: torch's threads then wait on each other, and a
    run can be many times slower than with ``--threads 1`` (seen 10x on a loaded 2-core machine). The default stays
    torch's, so that results do not depend on the load at start (a thread count changes float rounding)."""
    import warnings

    from tokengym.rewards.common import TokengymWarning

    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if threads > 1 and load >= cores:
        warnings.warn(f"the machine is busy (load {load:.1f} on {cores} cores) and torch will use {threads} threads: "
                      "--threads 1 can be several times faster here", TokengymWarning, stacklevel=2)


def load_policy(run: RunConfig, seed: int):
    from tokengym.agents.engine.policy import Policy

    assert run.model is not None  # resolve() fills the algorithm's default
    try:
        return Policy.from_pretrained(run.model, device=run.device, temperature=run.temperature, seed=seed)
    except Exception as e:  # a missing folder, a damaged or truncated weights file (safetensors' own error), ...
        raise R.UsageError(f"cannot load model {run.model!r}: {first_line(e)}") from None


WARM_STARTS = {"tokengym/Calculator-v0": "tiny-calculator"}
"""Envs whose default model is not ``tiny-arithmetic``: the shipped warm start made for their task."""


def rollout_batch(run: RunConfig, algo: str) -> tuple[int, int]:
    """``(num_envs, group_size)`` of the env this process rolls out: its ``prompts / K`` prompts under torchrun
    with K processes (whole groups per process) times the group size; the run's settings or the algorithm's
    registered ``rollout`` defaults."""
    from tokengym.agents.runtime.distributed import DataParallel

    default_prompts, default_group = algorithms()[algo].rollout
    k, prompts, g = DataParallel.current().world_size, run.prompts or default_prompts, run.group_size or default_group
    if prompts % k:
        raise R.UsageError(f"prompts={prompts} is not divisible by the {k} processes (each owns prompts / {k} whole groups)")
    return prompts // k * g, g


def eval_setup(run: RunConfig, tokenizer: Any):
    """``(eval_env, samples)`` for greedy held-out accuracy, or ``(None, None)`` when ``eval_prompts`` is 0."""
    from tokengym.agents.engine.rollout import heldout_samples

    if run.eval_prompts <= 0:
        return None, None
    env = make_env(run, min(run.eval_prompts, 256), tokenizer=tokenizer)
    try:
        return env, heldout_samples(env.task, run.eval_prompts)
    except ValueError as e:  # e.g. a dataset with fewer rows than eval_prompts
        raise R.UsageError(f"held-out evaluation: {e}") from None


def initial_eval(trainer: Trainer, agent: Any, eval_env: Any, samples: Any) -> None:
    """Held-out greedy metrics at step 0 of a new run (:func:`tokengym.agents.runtime.session.initial_eval`)."""
    from tokengym.agents.engine.rollout import evaluate
    from tokengym.agents.runtime import session

    session.initial_eval(trainer, agent, eval_env, samples, evaluate)


def learned_rewards(run: RunConfig, process: bool) -> dict[str, Any]:
    """Env arguments for the run's rewards: a learned RM or an LLM judge (``reward=``; an RM is a sequence classifier
    or a likelihood RM, whichever the folder holds) and the process reward when asked for."""
    from tokengym.rewards import LearnedPRM, RewardModel

    out: dict[str, Any] = {}
    for key, path, cls, cmd in (("reward", run.reward_model, RewardModel, "rm"), ("process_reward", run.prm_model, LearnedPRM, "prm")):
        if path is None:
            continue
        if not os.path.isdir(path):
            raise R.UsageError(f"{cmd} model {path!r} is not a folder (train one with `tokengym train {cmd}`)")
        try:
            out[key] = cls.from_pretrained(path, device=run.device)
        except (OSError, ValueError) as e:
            raise R.UsageError(f"cannot load {cls.__name__} from {path!r}: {first_line(e)}") from None
    if run.judge is not None:
        if "reward" in out:
            raise R.UsageError("judge and reward_model both replace the outcome reward; give one of them")
        out["reward"] = judge_from_settings(run.judge)
    if process and "process_reward" not in out:
        out["process_reward"] = True
    return out


def judge_from_settings(settings: dict[str, Any]) -> Any:
    """The run's :class:`~tokengym.rewards.JudgeReward` from its ``judge`` table; a bad one is a one-line UsageError."""
    import inspect

    from tokengym.rewards import JudgeReward

    known = [p for p in inspect.signature(JudgeReward).parameters]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise R.UsageError(f"judge: unknown settings {unknown}; the settings are {known}")
    missing = [k for k in ("base_url", "model") if k not in settings]
    if missing:
        raise R.UsageError(f"judge needs {' and '.join(missing)}, e.g. '{{\"base_url\": \"http://127.0.0.1:8000/v1\", "
                           f"\"model\": \"judge\"}}'")
    try:
        return JudgeReward(**settings)
    except (ValueError, TypeError) as e:
        raise R.UsageError(f"judge: {first_line(e)}") from None


def phase_progress(run: RunConfig, label: str, unit: str) -> Callable[[int, int], None]:
    """``update(done, total)`` for a phase before training (data mining, reference passes) that can take minutes: a
    line on stderr about every 10% of it (none with ``--progress false``), so no long phase is silent."""
    shown = [-1]

    def update(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if run.progress and (tenth > shown[0] or done == total):
            shown[0] = tenth
            print(f"{label}: {done}/{total} {unit}", file=sys.stderr, flush=True)

    return update


# ---------------------------------------------------------------------------------------------- algorithms
def make_agent(cls: Any, policy: Any, cfg: Any, env: Any = None) -> Any:
    """``cls(policy, cfg)``, checked against its rollout env (a bad pairing is a :class:`UsageError`)."""
    try:
        agent = cls(policy, cfg)
        if env is not None:
            agent.check_env(env)
    except (ValueError, ImportError) as e:  # ImportError: a rollout backend that is not installed
        raise R.UsageError(first_line(e)) from None
    return agent


def on_policy_job(run: RunConfig, cfg: Any, agent: Any, env: Any, total: int) -> Job:
    eval_env, samples = eval_setup(run, agent.policy.tokenizer)

    def job(run_dir: str, resume: bool) -> dict[str, Any]:
        agent.train_in_folder(Trainer(run, run_dir, resume, total, agent, env), env, eval_env, samples)
        return summary(agent.logger.history)

    return job


def build_on_policy(spec: Any, run: RunConfig, cfg: Any) -> Job:
    """The job of any :class:`~tokengym.agents.algorithms.onpolicy.OnPolicyAgent`: the run's env (with its learned or
    process rewards), checked against the policy's positions and the device's memory, and the agent."""
    policy = load_policy(run, cfg.seed)
    n, g = rollout_batch(run, spec.name)
    cls = spec.agent
    env = checked_env(run, policy, n, g, update_rows=cls.update_passes * -(-n // cfg.minibatches),
                      **learned_rewards(run, cls.needs_process_reward(cfg)))
    agent = make_agent(cls, policy, cfg, env)
    return on_policy_job(run, cfg, agent, env, agent.total_steps)
