"""The settings of a training run that every algorithm shares, :class:`RunConfig`: the command line's
``tokengym train`` fills it from its flags and config files, a run started from Python builds one, and the
:class:`~tokengym.agents.runtime.session.Trainer` reads it."""

from __future__ import annotations

from dataclasses import dataclass

from tokengym.agents.runtime.config import resumable

__all__ = ["RunConfig"]


@dataclass
class RunConfig:
    """Settings of a training run shared by every algorithm (the algorithm's own config holds the rest): what
    ``tokengym train`` takes (``--env``, ``--model``, ``--save-every``, ...), and what the ``Trainer`` reads
    (``save_every``, ``keep_checkpoints``, ``progress``, ``report_to``, ``sharding``).

    ``progress`` is on here, as on the command line; a run started from Python (``agent.learn(env, run_dir=...)``,
    ``learner.fit(..., run_dir=...)``) builds its ``RunConfig(progress=False, ...)``: no bar unless asked for.
    The fields a resumed run may change are declared :func:`~tokengym.agents.runtime.config.resumable`."""

    env: str = "tokengym/Arithmetic-v0"
    """Env id (``tokengym envs`` lists them), or your own: ``module:Class`` (a Task class) or ``module:EnvId-v0``."""
    imports: list[str] | None = None
    """Modules to import before the env is made (``--import MODULE``, repeatable), e.g. one that registers env ids."""
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
    judge: dict | None = None
    """PPO/GRPO: an LLM judge behind an OpenAI-compatible URL as the outcome reward instead of the verifier: the
    arguments of tokengym.rewards.JudgeReward as a JSON object or TOML table (base_url and model; template, parser,
    on_error zero/drop, max_concurrency, timeout, retries, api_key_env or api_key_file, ...)."""
    prm_model: str | None = None
    """PPO/GRPO: folder of a learned PRM (tokengym train prm) used as the process reward instead of the rule-based one."""
    eval_prompts: int = 256
    """Held-out prompts for greedy accuracy before and after training (0 = no evaluation)."""
    save_every: int = resumable(10)
    """Checkpoint every this many steps (0 = only at the end)."""
    keep_checkpoints: int = resumable(2)
    """How many of the newest checkpoints to keep."""
    device: str = resumable("cpu")
    """Device of the model and the env buffers (cpu, cuda, cuda:1, ...)."""
    threads: int | None = resumable(None)
    """torch CPU threads (None = torch's default)."""
    progress: bool = resumable(True)
    """Show a progress bar (on a terminal; otherwise a line every 10% of the run)."""
    report_to: str = resumable("tensorboard")
    """Trackers that get the run's metrics, config and final values, a comma list of tensorboard, trackio, wandb,
    mlflow, or none; all offline inside the run folder unless WANDB_MODE / TRACKIO_DIR / MLFLOW_TRACKING_URI say
    otherwise (extras: pip install "tokengym[wandb]", ...). metrics.jsonl is always written."""
    sharding: str = resumable("none")
    """Under torchrun: "none" (every process holds the whole model, gradients all-reduced) or "fsdp2" (policy, critic
    and reference sharded over the processes with PyTorch's FSDP2; see tokengym.agents.runtime.sharding)."""
    dist_timeout: float = resumable(1800.0)
    """Under torchrun: seconds a rank waits for the others in one collective before the run stops with an error
    saying so (a stopped or hung rank; 10 s to 7 days)."""
