"""One name per setting: OnPolicyConfig's fields are inherited, not redefined, and every renamed setting still works
under its old name (Python keyword and attribute, flag, --config key, saved run folder) with a warning naming the
new one."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest

from tokengym.agents import (CriticFreeConfig, DPOConfig, GRPOConfig, OnPolicyConfig, PPOConfig, ReinforcePPConfig,
                             RLOOConfig, SFTConfig, SPINConfig)
from tokengym.agents.cli import main
from tokengym.agents.cli.train import resolve
from tokengym.agents.runtime.config_io import field_docs
from tokengym.rewards.common import TokengymDeprecationWarning

RENAMES = [  # (config, old name, old value, new name, new value)
    (SFTConfig, "grad_clip", 0.5, "max_grad_norm", 0.5),
    (SFTConfig, "grad_clip", None, "max_grad_norm", 0.0),  # None was "off": 0 now
    (SFTConfig, "warmup", 3, "warmup_steps", 3),
    (SFTConfig, "schedule", "linear", "lr_scheduler_type", "linear"),
    (SFTConfig, "eval_batch", 32, "eval_batch_size", 32),
    (DPOConfig, "schedule", "cosine", "lr_scheduler_type", "cosine"),
    (SPINConfig, "schedule", "cosine", "lr_scheduler_type", "cosine"),
    (GRPOConfig, "lr_schedule", "cosine", "lr_scheduler_type", "cosine"),
    (RLOOConfig, "lr_schedule", "linear", "lr_scheduler_type", "linear"),
    (ReinforcePPConfig, "lr_schedule", "linear", "lr_scheduler_type", "linear"),
    (PPOConfig, "lr_schedule", "cosine", "lr_scheduler_type", "cosine"),
    (PPOConfig, "kl_coef", 0.2, "beta", 0.2),
    (ReinforcePPConfig, "kl_coef", 0.2, "beta", 0.2),
]
ON_POLICY = [CriticFreeConfig, GRPOConfig, RLOOConfig, ReinforcePPConfig, PPOConfig]


def _renamed(cls, old, new):
    return pytest.warns(DeprecationWarning, match=f"{cls.__name__}: '{old}' is renamed '{new}'")


@pytest.mark.parametrize("cls, old, old_value, new, value", RENAMES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_an_old_keyword_and_attribute_work_with_a_warning(cls, old, old_value, new, value):
    with _renamed(cls, old, new):
        cfg = cls(**{old: old_value})
    assert getattr(cfg, new) == value and cfg == cls(**{new: value}) and old not in dataclasses.asdict(cfg)
    with _renamed(cls, old, new):
        assert getattr(cfg, old) == value  # reading the old name gives the new field's value
    with _renamed(cls, old, new):
        setattr(cfg, old, old_value)
    assert getattr(cfg, new) == value
    with pytest.raises(ValueError, match=f"(?=.*{old})(?=.*{new})"):  # both given: an error naming both
        cls(**{old: old_value, new: value})


def test_new_names_do_not_warn_and_unknown_attributes_still_raise():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = SFTConfig(max_grad_norm=0.0, warmup_steps=1)
        assert cfg.max_grad_norm == 0.0
    with pytest.raises(AttributeError, match="no attribute 'grad_clipp'"):
        cfg.grad_clipp
    with pytest.raises(TypeError, match="grad_clipp"):
        SFTConfig(grad_clipp=1.0)


def test_reinforce_pp_old_loss_beta_and_reward_kl_coef_keep_their_meaning():
    """Before the rename REINFORCE++ had beta (a KL term in the loss) beside kl_coef (the KL in the reward)."""
    with pytest.warns(DeprecationWarning):
        saved = ReinforcePPConfig(beta=0.0, kl_coef=0.02)  # what every old config.json holds
    assert (saved.beta, saved.kl_in_reward) == (0.02, True)
    with pytest.warns(DeprecationWarning):
        loss_kl = ReinforcePPConfig(beta=0.04, kl_coef=0.0)
    assert (loss_kl.beta, loss_kl.kl_in_reward) == (0.04, False)
    with pytest.raises(ValueError, match="beta=0.04 .* kl_coef=0.02"):
        ReinforcePPConfig(beta=0.04, kl_coef=0.02)


@pytest.mark.parametrize("cls", ON_POLICY, ids=lambda c: c.__name__)
def test_on_policy_configs_inherit_the_base_fields_and_their_docstrings(cls):
    base = field_docs(OnPolicyConfig)
    assert base and all(base.values())
    docs = field_docs(cls)
    assert {f: docs[f] for f in base} == base  # a subclass may change a default, never the meaning
    assert [f.name for f in dataclasses.fields(cls)][: len(base)] == list(base)


def test_subclass_defaults_are_their_algorithms():
    ppo, rpp, rloo, grpo = PPOConfig(), ReinforcePPConfig(), RLOOConfig(), GRPOConfig()
    assert (ppo.lr, ppo.mu, ppo.minibatches, ppo.beta, ppo.kl_estimator, ppo.aggregation, ppo.eval_every) == \
        (3e-5, 4, 2, 0.05, "k1", "token-mean", 0)
    assert (rpp.beta, rpp.kl_estimator, rpp.aggregation, rpp.kl_in_reward) == (0.01, "k1", "token-mean", True)
    assert rloo.aggregation == "token-mean"
    assert (grpo.lr, grpo.beta, grpo.kl_estimator, grpo.aggregation, grpo.eval_every) == \
        (1e-4, 0.0, "k3", "seq-mean-token-mean", 10)


@pytest.mark.parametrize("cls, bad, field", [
    (PPOConfig, {"beta": -1.0}, "beta"), (GRPOConfig, {"warmup_steps": -1}, "warmup_steps"),
    (PPOConfig, {"lr_scheduler_type": "step"}, "lr_scheduler_type"), (RLOOConfig, {"mu": 0}, "mu"),
    (PPOConfig, {"lam": 2.0}, "lam"), (ReinforcePPConfig, {"gamma": -0.5}, "gamma"),
    (GRPOConfig, {"correction": "nope"}, "correction"), (PPOConfig, {"clip_eps": 1.5}, "clip_eps must be in"),
])
def test_shared_and_own_checks_name_the_config_and_field(cls, bad, field):
    with pytest.raises(ValueError, match=f"^{cls.__name__}[.:].*{field}"):
        cls(**bad)


def test_ppo_help_lists_beta_and_hides_the_old_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "ppo", "--help"])
    out = capsys.readouterr().out
    assert "--beta" in out and "--kl-coef" not in out and "--lr-schedule " not in out


def test_an_old_flag_works_with_one_warning_line(monkeypatch, capsys):
    import tokengym.agents.cli.train as T

    seen = {}
    monkeypatch.setattr(T, "train", lambda algo, file, flags, resume, preset=None, verbose=False: seen.update(flags) or 0)
    assert main(["train", "sft", "--grad-clip", "0.5", "--warmup", "2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tokengym: warning: tokengym train sft: --grad-clip is renamed --max-grad-norm (the old name goes "
                   "in the next release)", "tokengym: warning: tokengym train sft: --warmup is renamed --warmup-steps "
                   "(the old name goes in the next release)"]
    assert seen == {"max_grad_norm": "0.5", "warmup_steps": "2"}
    _, cfg, _ = resolve("sft", {}, seen, None)
    assert (cfg.max_grad_norm, cfg.warmup_steps) == (0.5, 2)
    assert main(["train", "sft", "--grad-clip", "0.5", "--max-grad-norm", "1"]) == 2
    assert "--grad-clip and --max-grad-norm are the same setting" in capsys.readouterr().err


def test_an_old_config_file_key_works_with_a_warning(tmp_path, capsys):
    from tokengym.agents.runtime.config_io import read_config_file

    path = tmp_path / "c.toml"
    path.write_text('kl_coef = 0.2\nlr-schedule = "cosine"\n')
    with pytest.warns(TokengymDeprecationWarning) as caught:
        _, cfg, _ = resolve("ppo", read_config_file(str(path)), {}, None)
    assert sorted(str(w.message).split(" (")[0] for w in caught) == [
        "the config file: 'kl_coef' is renamed 'beta'", "the config file: 'lr-schedule' is renamed 'lr_scheduler_type'"]
    assert (cfg.beta, cfg.lr_scheduler_type) == (0.2, "cosine")
    path.write_text("kl_coef = 0.2\nbeta = 0.1\n")
    assert main(["train", "ppo", "--config", str(path), "--runs-dir", str(tmp_path)]) == 2
    assert "'kl_coef' and 'beta' are the same setting" in capsys.readouterr().err


OLD_KEYS = {"sft": {"max_grad_norm": "grad_clip", "warmup_steps": "warmup", "lr_scheduler_type": "schedule",
                    "eval_batch_size": "eval_batch"},
            "ppo": {"beta": "kl_coef", "lr_scheduler_type": "lr_schedule"},
            "grpo": {"lr_scheduler_type": "lr_schedule"}, "dpo": {"lr_scheduler_type": "schedule"}}


def _write_old_config(run_dir, algo, run, cfg):
    """``config.json`` as a tokengym from before the renames wrote it."""
    old = {OLD_KEYS[algo].get(k, k): v for k, v in dataclasses.asdict(cfg).items()}
    if algo == "sft":
        old["grad_clip"] = old["grad_clip"] or None
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"algorithm": algo, "preset": None, "run": dataclasses.asdict(run), "config": old}, f)


@pytest.mark.parametrize("algo, values", [("sft", {"max_grad_norm": 0.0, "warmup_steps": 2}), ("ppo", {"beta": 0.1}),
                                          ("grpo", {"lr_scheduler_type": "cosine"}), ("dpo", {})])
def test_a_saved_config_with_old_keys_resolves_to_the_same_config(tmp_path, algo, values):
    run, cfg, _ = resolve(algo, {}, values, None)
    _write_old_config(str(tmp_path / "old"), algo, run, cfg)
    with pytest.warns(TokengymDeprecationWarning, match="config.json: "):
        run2, cfg2, run_dir = resolve(algo, {}, {}, str(tmp_path / "old"))
    assert (run2, cfg2, run_dir) == (run, cfg, str(tmp_path / "old"))


def test_an_old_reinforce_pp_run_resolves_with_its_reward_kl(tmp_path):
    run, cfg, _ = resolve("reinforce-pp", {}, {}, None)
    old = {**dataclasses.asdict(cfg), "beta": 0.0, "kl_coef": cfg.beta}
    del old["kl_in_reward"]
    os.makedirs(tmp_path / "old")
    (tmp_path / "old" / "config.json").write_text(json.dumps({"algorithm": "reinforce-pp", "run": dataclasses.asdict(run),
                                                              "config": old}))
    with pytest.warns(TokengymDeprecationWarning):
        assert resolve("reinforce-pp", {}, {}, str(tmp_path / "old"))[1] == cfg


def test_a_killed_sft_run_saved_with_old_keys_resumes(tmp_path, capsys):
    args = ["train", "sft", "--steps", "4", "--batch-size", "8", "--eval-prompts", "8", "--save-every", "2",
            "--threads", "1", "--progress", "false", "--runs-dir", str(tmp_path), "--name", "r"]
    killed = subprocess.run([sys.executable, "-m", "tokengym.agents.cli", *args], capture_output=True, text=True,
                            env=dict(os.environ, TOKENGYM_SIGKILL_AFTER_STEP="3"), timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    path = tmp_path / "r" / "config.json"
    saved = json.loads(path.read_text())
    saved["config"] = {OLD_KEYS["sft"].get(k, k): v for k, v in saved["config"].items()}
    path.write_text(json.dumps(saved))
    assert main(["train", "sft", "--resume", str(tmp_path / "r"), "--progress", "false"]) == 0
    out, err = capsys.readouterr()
    assert "resuming" in out and "at step 2 of" in out and (tmp_path / "r" / "model").is_dir()
    assert "config.json: 'grad_clip' is renamed 'max_grad_norm'" in err


@pytest.mark.parametrize("in_reward", [True, False])
def test_reinforce_pp_beta_goes_to_the_reward_or_to_the_loss(in_reward):
    import gymnasium as gym
    import torch

    import tokengym.envs  # noqa: F401
    from tokengym.agents import Policy, ReinforcePPAgent, collect

    agent = ReinforcePPAgent(Policy.from_pretrained("tiny"), ReinforcePPConfig(beta=0.1, kl_in_reward=in_reward))
    env = gym.make_vec("tokengym/Target-v0", num_envs=8, vectorization_mode="vector_entry_point", partial_credit=True,
                       target="ok", max_new_tokens=2)
    ro = collect(env, agent.policy, seed=0)
    assert agent.ref is not None
    batch, _ = agent.prepare(ro, ro.logprobs, ro.logprobs - 0.5)  # a reference 0.5 nats below: k1 KL 0.5 per token
    assert ("ref_logp" in batch) is not in_reward  # the loss's KL term reads it
    assert (not torch.allclose(batch["adv"], agent.advantages(ro, None))) is in_reward


# ------------------------------------------------------------------ configs by role: each setting declared once
OLD_RESUMABLE = {"save_every", "keep_checkpoints", "threads", "progress", "device", "sharding", "worker_threads",
                 "sync_timeout", "rollout_timeout", "dist_timeout", "remote_workers", "min_workers", "worker_secret_file",
                 "sync_host", "sync_port", "sync_bucket_mb", "sync_dir"}  # the literal set the field metadata replaced
NEW_RESUMABLE = {"report_to",  # trackers may change on --resume (a resumed run logs to a new tracker run)
                 "worker_ca", "worker_fingerprint"}  # how the learner checks its workers' certificates


def test_the_resumable_settings_come_from_the_fields_and_are_the_old_set():
    from tokengym.agents.cli.runner import RESUMABLE
    from tokengym.agents.engine.config import EngineConfig
    from tokengym.agents.runtime.config import resumable_fields
    from tokengym.agents.runtime.run_config import RunConfig

    assert RESUMABLE == OLD_RESUMABLE | NEW_RESUMABLE == resumable_fields(RunConfig, EngineConfig)
    assert resumable_fields(GRPOConfig) == resumable_fields(EngineConfig)  # inherited with their metadata
    assert resumable_fields(DPOConfig) == resumable_fields(SFTConfig) == set()


def test_a_resume_may_change_the_resumable_settings_and_no_other(tmp_path):
    from tokengym.agents.runtime.runs import UsageError

    run, cfg, _ = resolve("grpo", {}, {}, None)
    os.makedirs(tmp_path / "r")
    (tmp_path / "r" / "config.json").write_text(json.dumps({"algorithm": "grpo", "preset": None, "run": dataclasses.asdict(run),
                                                            "config": dataclasses.asdict(cfg)}))
    run2, cfg2, _ = resolve("grpo", {}, {"sync_timeout": "60", "save_every": "3", "progress": "false"}, str(tmp_path / "r"))
    assert (cfg2.sync_timeout, run2.save_every, run2.progress) == (60.0, 3, False)
    for key, value in (("lr", "0.001"), ("rollout_workers", "2"), ("temperature", "0.5"), ("seed", "1")):
        with pytest.raises(UsageError, match=f"cannot resume .* with a different config: {key} was"):
            resolve("grpo", {}, {key: value}, str(tmp_path / "r"))


def test_the_shared_settings_are_declared_once_with_one_docstring():
    from tokengym.rewards.learned_prm import PRMConfig
    from tokengym.rewards.reward_model import RewardModelConfig
    from tokengym.rewards.training import ScheduledOptimConfig, TrainLoopConfig

    shared = {**field_docs(ScheduledOptimConfig), **field_docs(TrainLoopConfig)}
    assert set(shared) == {"lr", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "seed",
                           "eval_every", "packing"} and all(shared.values())
    for cls in [*ON_POLICY, DPOConfig, SPINConfig, SFTConfig, RewardModelConfig, PRMConfig]:
        docs = field_docs(cls)
        assert {f: docs[f] for f in shared if f in docs} == {f: shared[f] for f in shared if f in docs}, cls
        assert {"lr", "weight_decay", "max_grad_norm", "seed", "eval_every", "packing"} <= set(docs), cls


def test_the_engine_settings_are_their_own_config_and_the_source_reads_only_them():
    from tokengym.agents.engine.config import EngineConfig
    from tokengym.agents.engine.sources import InProcess, make_source
    from tokengym.agents.runtime.distributed import LOCAL

    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"sampler", "async_mode", "max_staleness", "rollout_workers", "sync_bucket_mb", "seed", "bf16"} <= engine
    assert engine <= {f.name for f in dataclasses.fields(OnPolicyConfig)}
    with pytest.raises(ValueError, match=r"^EngineConfig\.sync_timeout"):
        EngineConfig(sync_timeout=0.5)
    with pytest.raises(ValueError, match=r"^EngineConfig: async_mode='one-step'"):
        EngineConfig(async_mode="one-step", max_staleness=2)
    assert EngineConfig(remote_workers="a:1, b:2").worker_count == 2
    source = make_source(EngineConfig(seed=3), object(), None, dp=LOCAL, version=0, total=1, state=None,
                         backend=lambda env: None)
    assert isinstance(source, InProcess)
