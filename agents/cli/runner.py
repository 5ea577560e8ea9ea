"""The run machinery every ``tokengym train`` algorithm shares: the run settings (:class:`RunConfig`), building the
env, model, evaluation set and learned rewards from them, the progress display, the :class:`Trainer` that
checkpoints and resumes a job, and the on-policy builder. Offline builders (``offline_jobs.py``) use the same
pieces; ``train.py`` resolves configs and runs a job in its folder.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

from tokengym.agents.runtime import runs as R
from tokengym.agents.algorithms.registry import algorithms

__all__ = ["RunConfig", "Job", "Trainer", "Progress", "algorithms", "make_env", "checked_env",
           "load_policy", "eval_setup", "learned_rewards", "phase_progress", "save_model", "initial_eval", "summary", "make_agent",
           "build_on_policy", "run_fields", "run_fields_for", "first_line"]


@dataclass
class RunConfig:
    """Settings of a training run shared by every algorithm (the algorithm's own config holds the rest)."""

    env: str = "tokengym/Arithmetic-v0"
    """Registered env id (``tokengym envs`` lists them)."""
    env_kwargs: dict | None = None
    """Task/env arguments as a TOML table or JSON object; None = the env's defaults (Arithmetic-v0's are the shipped checkpoint's task: 2-3 operands, 2 digits, '+')."""
    model: str | None = None
    """Preset (tiny, small), shipped checkpoint (tiny-arithmetic, tiny-calculator) or local save_pretrained folder; None = tiny for sft, else the env's shipped warm start (tiny-calculator for Calculator-v0, tiny-arithmetic otherwise)."""
    name: str | None = None
    """Run name; the run writes runs_dir/name (default: <algo>-<env>-<date>-<time>)."""
    runs_dir: str = "runs"
    """Folder holding the runs."""
    prompts: int | None = None
    """Prompts per rollout batch; the env holds prompts * group_size episodes (default: 8 for GRPO, 64 for PPO: 64 episodes per step either way)."""
    group_size: int | None = None
    """Completions per prompt (default: 8 for GRPO, 1 for PPO)."""
    temperature: float = 1.0
    """Sampling temperature of the policy during rollouts."""
    pairs: str | None = None
    """DPO / RM: preference pairs as JSONL (prompt, chosen, rejected); None = bundled Arithmetic pairs; "on-policy" =
    the model's own verifier-correct vs wrong samples of bundled Arithmetic prompts (``reward_data.on_policy_pairs``)."""
    num_pairs: int = 1024
    """DPO / RM: how many bundled Arithmetic pairs to generate when no pairs file is given (prompts, for "on-policy")."""
    rm_kind: str = "sequence"
    """RM: "sequence" (a scalar head on the model's trunk: ``RewardModel``) or "likelihood" (the LM's log-likelihood,
    Bradley-Terry-trained as DPO's implicit reward and saved to score without the reference: ``LikelihoodRewardModel``;
    with ``--pairs on-policy`` the recipe that lifts the verifier under PPO on Arithmetic)."""
    step_labels: str | None = None
    """PRM: step-labelled examples as JSONL (prompt, steps, labels); None = generated Arithmetic examples (num_pairs of them)."""
    reward_model: str | None = None
    """PPO/GRPO: folder of a trained reward model (tokengym train rm) used as the outcome reward instead of the verifier."""
    prm_model: str | None = None
    """PPO/GRPO: folder of a learned PRM (tokengym train prm) used as the process reward instead of the rule-based one."""
    eval_prompts: int = 256
    """Held-out prompts for greedy accuracy before and after training (0 = no evaluation)."""
    save_every: int = 10
    """Checkpoint every this many steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    device: str = "cpu"
    """Device of the model and the env buffers (cpu, cuda, cuda:1, ...)."""
    threads: int | None = None
    """torch CPU threads (None = torch's default)."""
    progress: bool = True
    """Show a progress bar (on a terminal; otherwise a line every 10% of the run)."""
    sharding: str = "none"
    """Under torchrun: "none" (every process holds the whole model, gradients all-reduced) or "fsdp2" (policy, critic
    and reference sharded over the processes with PyTorch's FSDP2; see tokengym.agents.runtime.sharding)."""


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

# Keys that may differ when resuming; everything else must match the saved config.
RESUMABLE = {"save_every", "keep_checkpoints", "threads", "progress", "device", "sharding"}
"""(A checkpoint holds full weights whatever the sharding, so a run resumes sharded or not, with any process count.)"""


Job = Callable[[str, bool], dict[str, Any]]
"""What a builder returns: ``job(run_dir, resume)`` trains in the (created, locked) run folder and returns a summary."""


# ---------------------------------------------------------------------------------------------- building blocks
def env_kwargs(run: RunConfig) -> dict[str, Any]:
    return dict(run.env_kwargs or {})


def make_env(run: RunConfig, num_envs: int, group_size: int = 1, tokenizer: Any = None, **extra: Any):
    """The run's vector env (raises :class:`~tokengym.agents.runtime.runs.UsageError` for a bad id or arguments)."""
    import gymnasium as gym

    import tokengym.envs  # noqa: F401  (registers the ids)

    if run.env not in gym.registry:
        from tokengym.envs import ENV_IDS

        raise R.UsageError(f"unknown env id {run.env!r}; registered: {', '.join(ENV_IDS)}")
    try:
        return gym.make_vec(run.env, num_envs=num_envs, vectorization_mode="vector_entry_point", group_size=group_size,
                            device=run.device, tokenizer=tokenizer, **env_kwargs(run), **extra)
    except (TypeError, ValueError, OSError, ImportError) as e:
        raise R.UsageError(f"cannot build env {run.env} with {env_kwargs(run)}: {first_line(e)}") from None


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


def learned_rewards(run: RunConfig, process: bool) -> dict[str, Any]:
    """Env arguments for the run's rewards: a learned RM (``reward=``; a sequence classifier or a likelihood RM,
    whichever the folder holds) and the process reward when asked for."""
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
    if process and "process_reward" not in out:
        out["process_reward"] = True
    return out


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


class Trainer:
    """The part every algorithm shares: logger, checkpoints, resume, progress, kill hook (in a created, locked run folder)."""

    def __init__(self, run: RunConfig, run_dir: str, resume: bool, total: int, agent: Any, env: Any = None):
        from tokengym.agents.runtime import distributed

        self.run, self.run_dir, self.agent, self.env, self.total = run, run_dir, agent, env, total
        sharded = run.sharding != "none"
        if not sharded:
            self.dp = distributed.prepare(agent, env)  # under torchrun: shard the env batch, rank 0 writes
        else:  # a checkpoint holds full weights and optimiser state: load them first, then shard (see save)
            self.dp = dataclasses.replace(distributed.DataParallel.current(), sharding=run.sharding)
        self.start_step = 0
        kill = os.environ.get("TOKENGYM_SIGKILL_AFTER_STEP")
        self.kill_at = int(kill) if kill else None
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
        if sharded:
            self.dp = distributed.prepare(agent, env, sharding=run.sharding, bf16=bool(getattr(agent.config, "bf16", False)))
        # the first step to (re)do: records and TensorBoard events from it on were lost work, about to be redone
        redo = self.start_step + 1 if ckpt is not None else 0
        kept = []
        if resume and main:
            kept = R.truncate_metrics(run_dir, redo - 1)
            if kept.warning:
                say(f"tokengym: warning: {kept.warning}", file=sys.stderr, flush=True)
        from tokengym.agents.runtime.logger import RunLogger

        agent.logger.close()
        agent.logger = RunLogger(run_dir if main else None, purge_step=redo if resume else None)
        agent.logger.history.extend(kept)
        self.progress = Progress(total, self.start_step, run.progress and main, os.path.basename(run_dir))

    def callback(self, record: dict[str, Any]) -> bool:
        self.progress.update(record)
        step = int(record["step"])
        if self.run.save_every and step % self.run.save_every == 0 and step < self.total:
            self.save(step)
        if self.kill_at is not None and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
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


def initial_eval(trainer: Trainer, agent: Any, eval_env: Any, samples: Any) -> None:
    from tokengym.agents.engine.rollout import evaluate

    if trainer.start_step == 0 and eval_env is not None:
        agent.policy.eval()
        res = evaluate(agent.policy, eval_env, samples, greedy=True)
        trainer.progress.update(agent.logger.log(0, {f"eval/{k}": v for k, v in res.items()}))


def summary(history: list[dict[str, Any]], key: str = "eval/accuracy") -> dict[str, Any]:
    values = [r[key] for r in history if r.get(key) is not None]
    calls = [r["eval/replies_per_episode"] for r in history if r.get("eval/replies_per_episode") is not None]
    out = {"start": values[0], "final": values[-1]} if values else {}
    if out and calls:  # a multi-turn env: its replies (a tool env's calls) per episode
        out["replies"] = (calls[0], calls[-1])
    return out


# ---------------------------------------------------------------------------------------------- algorithms
def make_agent(cls: Any, policy: Any, cfg: Any, env: Any = None) -> Any:
    """``cls(policy, cfg)``, checked against its rollout env (a bad pairing is a :class:`UsageError`)."""
    try:
        agent = cls(policy, cfg)
        if env is not None:
            agent.check_env(env)
    except ValueError as e:
        raise R.UsageError(first_line(e)) from None
    return agent


def on_policy_job(run: RunConfig, cfg: Any, agent: Any, env: Any, total: int) -> Job:
    eval_env, samples = eval_setup(run, agent.policy.tokenizer)

    def job(run_dir: str, resume: bool) -> dict[str, Any]:
        trainer = Trainer(run, run_dir, resume, total, agent, env)
        initial_eval(trainer, agent, eval_env, samples)
        agent.learn(env, eval_env, samples, callback=trainer.callback)
        trainer.finish()
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
