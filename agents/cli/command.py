"""The ``tokengym`` command.

    tokengym train grpo|ppo|dpo|sft|rm|prm [--config F.toml] [--key value ...] [--resume runs/NAME]
    tokengym eval --run runs/NAME | --model M [--env ID]   held-out accuracy and mean reward, as a table
    tokengym sample [--run R | --env ID] [--model M] [...]  completions with their rewards and step scores
    tokengym plot runs/NAME                                 PNG learning curves from the run's metrics
    tokengym envs [--import MODULE]                         list the registered environment ids
    tokengym convert FILE.gguf|smollm2-135m-instruct|gemma3-270m [--out DIR]   a GGUF model as a save_pretrained folder
    tokengym serve --model M [--listen HOST:PORT] [--secret-file F]   the OpenAI HTTP API on a model

``--env`` takes a registered id, ``module:Class`` (a Task class of your own) or ``module:EnvId-v0``; ``--import
MODULE`` (repeatable) imports modules first. A run records both, so ``--resume``, ``eval --run`` and ``sample --run``
make the same env again.

Bad input (unknown env id, model, config key or run folder, a mistyped value, an incompatible resume)
is one line on stderr and exit code 2; nothing is overwritten.

``sample`` policies: ``reference`` replays each prompt's reference solution token by token (a scripted
policy that should score ~1.0), ``random`` emits uniformly random tokens (scores ~0).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from typing import Any, Sequence

import torch

from tokengym.agents.engine.backends import SAMPLERS

__all__ = ["main"]


def _cmd_envs(args: argparse.Namespace) -> int:
    import numpy as np

    from tokengym.agents.runtime import runs as R
    from tokengym.envs import ENV_GUIDE, ENV_IDS, import_modules, load_entry_points, resolve_task

    try:  # --import: the tasks a module registers are listed too
        import_modules(args.imports)
    except ValueError as e:
        raise R.UsageError(R.first_line(e)) from None
    load_entry_points()  # installed packages' tasks too
    for env_id, (task, desc) in ENV_IDS.items():
        fmt, fits = ENV_GUIDE.get(env_id, ("", ""))
        print(f"{env_id}  {desc}")
        try:  # an example from the task's defaults, where it has them
            s = resolve_task(task).batch(np.random.default_rng(0), 1)[0]
            shown = repr(s["solution"]) if "solution" in s else f"(the env's answer: {s.get('answer')!r})"
            print(f"    e.g.    {s['prompt']!r} -> {shown}")
        except (TypeError, ValueError, ImportError):
            pass
        print(f"    format: {fmt}\n    models: {fits}")
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    from tokengym.agents.runtime import runs as R
    from tokengym.agents.cli.runner import RunConfig, load_policy, make_env, resolve_env_id, use_threads
    from tokengym.envs.task_check import scripted_rollout

    run = RunConfig()
    if args.run is not None:  # the run's env, task arguments and imports; its final model unless --model says otherwise
        saved = R.read_run_config(args.run)["run"]
        R.apply_overrides({"run": run}, {k: saved[k] for k in ("env", "env_kwargs", "imports") if k in saved},
                          f"{args.run}/config.json")
        final = os.path.join(args.run, "model")
        if args.model is None and os.path.isdir(final):
            args.model = final
    run.model = args.model
    if args.env:
        run.env = args.env
    if args.env_kwargs:
        run.env_kwargs = R.parse_value("env_kwargs", dict, args.env_kwargs)
    if args.imports:
        run.imports = [*(run.imports or []), *args.imports]
    resolve_env_id(run)  # a bad env is one line before the model loads
    policies = args.policy or (["model"] if args.model else ["random", "reference"])
    if "model" in policies and not args.model:
        raise R.UsageError("--policy model needs --model (a preset, shipped checkpoint or local folder)")
    use_threads(args.threads)  # after the checks of the input: a busy-machine warning only for work that runs
    model = load_policy(run, args.seed) if args.model else None
    tok = model.tokenizer if model is not None else None
    try:
        env = make_env(run, args.num, tokenizer=tok, **({"process_reward": True} if args.prm else {}))
    except R.UsageError as e:  # the task has no process reward: sample without one
        if "no process reward" not in str(e):
            raise
        args.prm, env = False, make_env(run, args.num, tokenizer=tok)
    gen = torch.Generator().manual_seed(args.seed)
    for policy in policies:
        if policy == "model":
            from tokengym.agents.engine.rollout import collect

            model.eval()
            model.seed(args.seed)
            collect(env, model, greedy=args.greedy, seed=args.seed)
        else:
            env.reset(seed=args.seed)
            scripted_rollout(env, policy, gen)
        name = f"{policy} ({args.model}, {'greedy' if args.greedy else f'T={model.temperature:g}'})" if policy == "model" else policy
        print(f"== policy: {name}   env: {run.env}")
        for i in range(env.num_envs):
            prompt = env.samples[i]["prompt"].strip().replace("\n", " | ")
            completion = (env.completions[i] or "").replace("\n", " | ")
            flag = "terminated" if bool(env.terminated[i]) else "truncated"
            steps = f"  steps={env.step_scores[i]}" if args.prm else ""
            print(f"[{i}] {prompt!r} -> {completion!r}  reward={float(env.outcome[i]):.2f} ({flag}){steps}")
        print(f"mean outcome reward: {env.outcome.mean().item():.3f}\n")
    return 0


def _load_newest_checkpoint(model: Any, run_dir: str) -> str:
    """Load the policy weights of ``run_dir``'s newest intact checkpoint into ``model``; return its path. The run may
    be training now and keep only its newest few: one rotated away between finding and reading it is passed over for
    the next newest."""
    from safetensors.torch import load_model

    from tokengym.agents.runtime import runs as R

    for _ in range(10):
        path = R.latest_checkpoint(run_dir)
        if path is None:
            break
        try:
            load_model(model, os.path.join(path, "policy.safetensors"))
            return path
        except FileNotFoundError:
            continue
    raise R.UsageError(f"{run_dir}'s checkpoints were removed while being read (is the run rotating them faster than "
                       "they load?); try again")


def _saved_run(run_dir: str) -> Any:
    """The run settings a run folder's ``config.json`` recorded (a one-line UsageError when it cannot be read)."""
    from tokengym.agents.runtime import runs as R
    from tokengym.agents.runtime.run_config import RunConfig

    run = RunConfig()
    R.apply_overrides({"run": run}, R.read_run_config(run_dir)["run"], f"{run_dir}/config.json")
    return run


def _run_model(run_dir: str, run: Any) -> tuple[str, str | None]:
    """``(model, checkpoint)`` of a run folder (``run``: its saved settings): its final ``model/`` folder, else its
    base model and its newest checkpoint, whose weights go on top (:func:`_load_newest_checkpoint`)."""
    from tokengym.agents.runtime import runs as R

    if os.path.isdir(os.path.join(run_dir, "model")):
        return os.path.join(run_dir, "model"), None
    checkpoint = R.latest_checkpoint(run_dir)
    if checkpoint is None:
        raise R.UsageError(f"{run_dir} has neither a final model nor a checkpoint yet")
    return run.model, checkpoint


def _cmd_eval(args: argparse.Namespace) -> int:
    from tokengym.agents.runtime import runs as R
    from tokengym.agents.engine.resources import check_device
    from tokengym.agents.engine.backends import make_backend
    from tokengym.agents.engine.rollout import evaluate, evaluate_at_k, heldout_samples
    from tokengym.agents.cli.runner import RunConfig, checked_env, load_policy, resolve_env_id, use_threads

    run, model = RunConfig(), args.model
    if args.run is None and args.model is None:
        raise R.UsageError("pass --run RUN_DIR or --model MODEL")
    checkpoint = None
    if args.run is not None:
        run = _saved_run(args.run)
        if model is None:
            model, checkpoint = _run_model(args.run, run)
    run.model, run.device = model, args.device
    try:
        check_device(args.device)
    except ValueError as e:
        raise R.UsageError(str(e)) from None
    if args.env:
        run.env = args.env
    if args.env_kwargs:
        run.env_kwargs = R.parse_value("env_kwargs", dict, args.env_kwargs)
    if args.imports:
        run.imports = [*(run.imports or []), *args.imports]
    resolve_env_id(run)  # a bad env is one line before the model loads
    if args.prompts < 1 or args.samples < 0:
        raise R.UsageError("--prompts must be >= 1 and --samples >= 0")
    if args.k is not None and not 1 <= args.k <= args.samples:
        raise R.UsageError(f"--k {args.k} needs 1 <= k <= --samples (the n sampled completions per prompt that "
                           f"pass@k, maj@k and mean@k are estimated from; --samples is {args.samples})")
    use_threads(args.threads)  # after the checks of the input: a busy-machine warning only for work that runs
    policy = load_policy(run, args.seed)
    if checkpoint is not None:
        checkpoint = _load_newest_checkpoint(policy.model, args.run)
    # continuous batching (same results) where the fast decode path runs the model: a finished slot takes the next prompt
    # (an inference engine batches whole generations itself: lockstep batches)
    mode = "next_step" if args.sampler == "tokengym" and policy.capabilities().refill else "disabled"
    env = checked_env(run, policy, min(args.prompts, 256), autoreset_mode=mode)  # positions checked: one line
    samples = heldout_samples(env.task, args.prompts)
    policy.eval()
    try:
        sampler = make_backend(args.sampler, policy, rows=env.num_envs, row_len=env.seq_len)
    except (ValueError, ImportError) as e:
        raise R.UsageError(str(e)) from None
    rows = [("greedy", evaluate(sampler, env, samples, greedy=True))]
    at_k = None
    if args.samples:
        policy.seed(args.seed)
        if args.k is not None:  # the same sampled episodes, kept per prompt
            at_k = evaluate_at_k(sampler, env, samples, n=args.samples, k=args.k)
            sampled = at_k["sampled"]
        else:
            sampled = evaluate(sampler, env, samples * args.samples, greedy=False)
        rows.append((f"sampled x{args.samples} (T={policy.temperature:g})", sampled))
    print(f"{checkpoint or model} on {run.env} ({args.prompts} held-out prompts, sampler {args.sampler})")
    print(f"{'decoding':<24} {'accuracy':>9} {'reward':>8} {'length':>8} {'truncated':>10}")
    for name, r in rows:
        print(f"{name:<24} {r['accuracy']:>9.1%} {r['mean_reward']:>8.3f} {r['mean_length']:>8.1f} {r['truncated']:>10.1%}")
    if at_k is not None:
        k = args.k
        print(f"k={k} of n={args.samples} samples per prompt: pass@{k} {at_k[f'pass@{k}']:.1%}  "
              f"maj@{k} {at_k[f'maj@{k}']:.1%}  mean@{k} {at_k[f'mean@{k}']:.1%}")
    if args.out:
        result = {"model": checkpoint or model, "env": run.env, "prompts": args.prompts,
                  **{name.split(" ")[0]: r for name, r in rows}, **({"at_k": at_k} if at_k is not None else {})}
        R.write_json_atomic(args.out, result)
        print(f"results in {args.out}")
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    import signal

    from tokengym.agents.runtime import config_io as R
    from tokengym.agents.engine.remote import PROTOCOL, WorkerServer, parse_address, read_secret

    from tokengym.agents.engine.tls import certificate_fingerprint, server_context

    tls, how = None, ""
    try:
        host, port = parse_address(args.listen)
        secret = read_secret(args.secret_file)
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both (a PEM certificate and its private key) "
                             "or neither")
        if args.tls_cert:
            tls = server_context(args.tls_cert, args.tls_key)
            how = f", TLS, certificate SHA-256 {certificate_fingerprint(args.tls_cert)}"
    except ValueError as e:
        raise R.UsageError(f"tokengym worker: {e}") from None
    if args.threads is not None and args.threads < 1:
        raise R.UsageError(f"--threads must be at least 1, got {args.threads}")
    try:
        server = WorkerServer(host, port, secret=secret, model=args.model, threads=args.threads, tls=tls)
    except OSError as e:
        raise R.UsageError(f"tokengym worker: cannot listen on {args.listen}: {e.strerror or e}") from None
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"tokengym worker: listening on {server.address} (protocol {PROTOCOL}{how}); waiting for a learner",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("tokengym worker: stopped", file=sys.stderr, flush=True)
    finally:
        server.close()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal

    from tokengym.agents.runtime import runs as R
    from tokengym.agents.engine.policy import Policy
    from tokengym.agents.engine.remote import parse_address, read_secret
    from tokengym.agents.engine.resources import check_device
    from tokengym.agents.engine.serving import PolicyServer

    try:
        host, port = parse_address(args.listen)
        secret = read_secret(args.secret_file, "the server needs a secret: --secret-file PATH")
        check_device(args.device)
    except ValueError as e:
        raise R.UsageError(f"tokengym serve: {e}") from None
    if args.threads is not None:
        if args.threads < 1:
            raise R.UsageError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    model, checkpoint = args.model, None
    if R.is_run_dir(args.model):  # a run folder: its final model, else its newest checkpoint (as eval --run)
        model, checkpoint = _run_model(args.model, _saved_run(args.model))
    try:
        policy = Policy.from_pretrained(model, device=args.device, seed=args.seed)
    except Exception as e:  # a missing folder, a damaged weights file, ...
        raise R.UsageError(f"cannot load model {model!r}: {R.first_line(e)}") from None
    if checkpoint is not None:
        checkpoint = _load_newest_checkpoint(policy.model, args.model)
    try:
        server = PolicyServer(policy, args.name or args.model, host, port, secret=secret)
    except OSError as e:
        raise R.UsageError(f"tokengym serve: cannot listen on {args.listen}: {e.strerror or e}") from None
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"tokengym serve: {checkpoint or model} as model {server.name!r} on http://{server.address}/v1 (OpenAI API; "
          "every request needs the secret as its bearer token)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("tokengym serve: stopped", file=sys.stderr, flush=True)
    finally:
        server.close()
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    import time

    from tokengym.agents.runtime import runs as R
    from tokengym.agents.engine.convert import convert_gguf, describe, gguf_folder, gguf_path

    t0 = time.perf_counter()
    try:
        if args.out:
            source = gguf_path(args.source)
            R.write_folder_atomic(args.out, lambda tmp: convert_gguf(source, tmp), what="converted model")
            folder = args.out
        else:
            folder = gguf_folder(args.source)
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise R.UsageError(str(e)) from None
    print(folder)
    print(f"  {describe(folder)} ({time.perf_counter() - t0:.0f} s); use it as --model {folder}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from tokengym.agents.runtime import runs as R
    from tokengym.agents.cli.plot import plot_run

    if not R.is_run_dir(args.run):
        raise R.UsageError(f"{args.run!r} is not a run folder (no config.json)")
    for path in plot_run(args.run, args.out):
        print(path)
    return 0


def _add_fields(parser: argparse.ArgumentParser, cls: type, title: str, seen: set[str], only: set[str] | None = None) -> None:
    from tokengym.agents.runtime.runs import field_docs

    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in seen or f.name == "run_dir" or (only is not None and f.name not in only):
            continue
        seen.add(f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        flag = "--" + f.name.replace("_", "-")
        text = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if f.name == "imports":  # a list given one flag at a time
            _add_import_flag(group, default=argparse.SUPPRESS)
            continue
        if f.type in ("bool", bool):
            kw.update(nargs="?", const="true", metavar="BOOL")
        else:
            kw.update(metavar=str(f.type).replace(" ", "").upper()[:16])
        group.add_argument(flag, **kw)
        for old, rename in getattr(cls, "renames", {}).items():  # hidden: _cmd_train warns and renames them
            if rename.new == f.name and old not in seen:
                seen.add(old)
                group.add_argument("--" + old.replace("_", "-"), **{**kw, "dest": old, "help": argparse.SUPPRESS})


def _add_import_flag(parser: Any, **kw: Any) -> None:
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE", help="import MODULE before the "
                        "env is made, e.g. one that registers env ids or tasks (repeatable)", **kw)


def _train_parser(sub: Any, full: bool = True) -> None:
    """``tokengym train`` with a subcommand per registered algorithm (importing every algorithm); with ``full`` False
    (another command runs) just its name, for the usage line, so that e.g. a rollout worker loads no algorithm."""
    if not full:
        sub.add_parser("train", help="train a model; writes runs/<name>/")
        return
    from tokengym.agents.cli.runner import RunConfig, algorithms, run_fields

    specs = algorithms()
    p = sub.add_parser("train", help=f"train a model ({', '.join(specs)}); writes runs/<name>/")
    tsub = p.add_subparsers(dest="algo", required=True, metavar="ALGO")
    for name, spec in specs.items():
        ap = tsub.add_parser(name, help=spec.help, description=f"{spec.help}. Every setting below can also come from "
                             "--config FILE.toml (keys as below, with underscores); flags win over the file.",
                             allow_abbrev=False)
        ap.add_argument("--config", help="TOML or JSON file with settings")
        ap.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
        if spec.presets:
            ap.add_argument("--preset", choices=sorted(spec.presets), help="a published recipe: its settings over the "
                            "defaults (--config and flags still win); the settings it changes are printed")
        ap.add_argument("--verbose", action="store_true", help=f"print every field of {spec.config_cls.__name__} at "
                        "the start (default: those that differ from the defaults; config.json holds them all)")
        seen: set[str] = set()
        _add_fields(ap, RunConfig, "run settings", seen, run_fields(name))
        _add_fields(ap, spec.config_cls, f"{name} settings ({spec.config_cls.__name__})", seen)
        ap.set_defaults(fn=_cmd_train)


def _cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from tokengym.agents.runtime import config_io as R
    from tokengym.agents.cli.train import algorithms, train

    if extra:
        flag = next((e for e in extra if e.startswith("-")), extra[0])
        raise R.UsageError(_unknown_flag(flag, args))
    flags = {k: v for k, v in vars(args).items()
             if k not in ("fn", "command", "algo", "config", "resume", "preset", "verbose")}
    flags = R.renamed_settings(algorithms()[args.algo].config_cls, flags, f"tokengym train {args.algo}", flags=True)
    file_values = R.read_config_file(args.config) if args.config else {}
    return train(args.algo, file_values, flags, args.resume, preset=getattr(args, "preset", None), verbose=args.verbose)


def _unknown_flag(flag: str, args: argparse.Namespace) -> str:
    import difflib

    from tokengym.agents.cli.runner import algorithms, run_fields, run_fields_for

    key = flag.lstrip("-").split("=")[0].replace("-", "_")
    users = run_fields_for()
    if key in users:
        return f"--{key.replace('_', '-')} does not apply to `tokengym train {args.algo}` (it is for {', '.join(sorted(users[key]))})"
    names = sorted(run_fields(args.algo)) + [f.name for f in dataclasses.fields(algorithms()[args.algo].config_cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else f"; see tokengym train {args.algo} --help"
    return f"unknown option {flag!r}{hint}"


_NOT_TRAIN = frozenset({"eval", "plot", "convert", "worker", "serve", "envs", "sample"})
"""The commands besides ``train`` (the subparsers below): one of them as the first argument builds ``train``'s parser
without its algorithms (see :func:`_train_parser`); anything else builds it in full, as ``tokengym --help`` shows it."""


def main(argv: Sequence[str] | None = None) -> int:
    from tokengym.agents.engine.workers import WorkerError
    from tokengym.agents.runtime.distributed import RankTimeout
    from tokengym.agents.runtime.runs import UsageError
    from tokengym.rewards.common import TokengymDeprecationWarning

    own_process, argv = argv is None, sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="tokengym", description="RL post-training of language models as Gymnasium envs")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub, full=not argv or argv[0] not in _NOT_TRAIN)
    p = sub.add_parser("eval", help="greedy and sampled held-out accuracy and mean reward of a run or model")
    p.add_argument("--run", help="a run folder (its final model, else its latest checkpoint; env from its config)")
    p.add_argument("--model", help="preset, shipped checkpoint or local folder (instead of --run)")
    p.add_argument("--env", help="env id or module:Class (default: the run's, else tokengym/Arithmetic-v0)")
    p.add_argument("--env-kwargs", help="task arguments as JSON (default: the run's)")
    _add_import_flag(p)
    p.add_argument("--prompts", type=int, default=256, help="held-out prompts (default: 256)")
    p.add_argument("--samples", type=int, default=4, help="sampled completions per prompt for sampled accuracy (0 = skip)")
    p.add_argument("--k", type=int, default=None, help="also pass@k (unbiased, from the --samples completions per prompt), "
                   "maj@k (the majority answer's correctness) and mean@k of the first k; needs k <= --samples")
    p.add_argument("--out", help="also write the results as JSON to this file (with --k: each prompt's answers and "
                   "correctness)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sampler", choices=tuple(SAMPLERS), default="tokengym", help="rollout backend: tokengym (the fast "
                   "decoder), vllm (an in-process vLLM engine: pip install 'tokengym[vllm]', or [vllm-cuda] on a GPU) or another registered one")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; on a busy "
                   "machine --threads 1 can be several times faster)")
    p.set_defaults(fn=_cmd_eval)
    p = sub.add_parser("plot", help="write PNG learning curves (reward, accuracy, KL, loss) of a run")
    p.add_argument("run", help="the run folder")
    p.add_argument("--out", help="output folder (default: RUN/plots)")
    p.set_defaults(fn=_cmd_plot)
    p = sub.add_parser("convert", help="convert a GGUF model (a .gguf file, smollm2-135m-instruct or gemma3-270m) to a save_pretrained folder")
    p.add_argument("source", help="a .gguf file, or the name of a GGUF shipped in Python wheels (smollm2-135m-instruct, gemma3-270m)")
    p.add_argument("--out", help="the folder to write (default: the cache, $TOKENGYM_CACHE or ~/.cache/tokengym, "
                   "which --model NAME.gguf also uses)")
    p.set_defaults(fn=_cmd_convert)
    p = sub.add_parser("worker", help="serve rollouts to an async learner on another machine (or this one)",
                       description="A rollout worker: it waits for an async learner (tokengym train ... --async-mode "
                       "one-step|bounded --rollout-workers HOST:PORT,...), samples rollouts for it, and goes back to "
                       "waiting when the learner ends. Every request must carry the shared secret; with --tls-cert and "
                       "--tls-key the worker speaks HTTPS.")
    p.add_argument("--listen", default="127.0.0.1:7960", metavar="HOST:PORT",
                   help="where to listen (default: 127.0.0.1:7960, this machine only; 0.0.0.0:PORT for every interface; "
                   "port 0: a free one, printed)")
    p.add_argument("--secret-file", help="a file whose first line is the shared secret (default: $TOKENGYM_SECRET)")
    p.add_argument("--model", help="the model folder or preset to build (default: the one the learner names)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for sampling (default: torch's)")
    p.add_argument("--tls-cert", metavar="CERT", help="serve HTTPS (TLS 1.2+) with this PEM certificate (chain); the "
                   "learner then needs --worker-ca or --worker-fingerprint (printed at start)")
    p.add_argument("--tls-key", metavar="KEY", help="the certificate's unencrypted PEM private key")
    p.set_defaults(fn=_cmd_worker)
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (chat and text completions)",
                       description="An OpenAI-compatible endpoint on a model: GET /v1/models, POST /v1/chat/completions "
                       "(chat models; tool calls parsed) and POST /v1/completions, one request at a time. Every request "
                       "must carry the secret as its bearer token (the openai client's api_key).")
    p.add_argument("--model", required=True, help="preset, shipped checkpoint, local folder or run folder (runs/NAME: "
                   "its final model, else its newest checkpoint)")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="where to listen (default: "
                   "127.0.0.1:8000, this machine only; 0.0.0.0:PORT for every interface; port 0: a free one, printed)")
    p.add_argument("--secret-file", help="a file whose first line is the secret (default: $TOKENGYM_SECRET)")
    p.add_argument("--name", help="the model name clients ask for (default: --model as given)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seeds sampling for requests without a seed of their own")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(fn=_cmd_serve)
    p = sub.add_parser("envs", help="list registered environment ids")
    _add_import_flag(p)
    p.set_defaults(fn=_cmd_envs)
    p = sub.add_parser("sample", help="roll out a scripted policy and print completions with their rewards")
    p.add_argument("--run", help="a run folder: its env (and task arguments and imports) and its final model")
    p.add_argument("--env", help="env id or module:Class (default: the run's, else tokengym/Arithmetic-v0)")
    p.add_argument("--num", type=int, default=4, help="number of episodes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="sample from this model (preset, shipped checkpoint or local folder, e.g. runs/NAME/model)")
    p.add_argument("--env-kwargs", help="task arguments as JSON (default: the run's; Arithmetic-v0 uses the shipped "
                   "checkpoint's task)")
    _add_import_flag(p)
    p.add_argument("--greedy", action="store_true", help="greedy decoding for --model (default: sample)")
    p.add_argument("--policy", nargs="+", choices=["model", "reference", "random"], default=None,
                   help="default: model with --model, else random then reference")
    p.add_argument("--no-prm", dest="prm", action="store_false", help="turn the process reward off")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; on a busy "
                   "machine --threads 1 can be several times faster)")
    p.set_defaults(fn=_cmd_sample)
    args, extra = parser.parse_known_args(argv)
    if extra and args.fn is not _cmd_train:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if own_process and args.fn not in (_cmd_envs, _cmd_plot):  # the commands that load a model
        from tokengym.agents.engine.models import skip_sklearn_import

        skip_sklearn_import()
    failures: tuple[type[BaseException], ...] = (WorkerError, RankTimeout)
    if args.fn is _cmd_train:  # only training meets a non-finite loss (and only it loads the algorithms)
        from tokengym.agents.algorithms.onpolicy import NonFiniteLoss
        from tokengym.envs.masks import GrammarDeadEnd

        failures += (NonFiniteLoss, GrammarDeadEnd)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        warnings.simplefilter("default", TokengymDeprecationWarning)  # old setting names: one line each
        try:
            return args.fn(args, extra) if args.fn is _cmd_train else args.fn(args)
        except UsageError as e:
            print(f"tokengym: error: {e}", file=sys.stderr)
            return 2
        except failures as e:  # a worker or rank died or timed out, a loss went NaN, a grammar's dead end: one line
            print(f"tokengym: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (a run's checkpoints stay as they were)
            print("tokengym: interrupted", file=sys.stderr)
            return 130


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """tokengym's own warnings as one ``tokengym: warning: ...`` line; others as Python shows them."""
    from tokengym.rewards.common import TokengymWarning

    if issubclass(category, TokengymWarning):
        print(f"tokengym: warning: {message}", file=sys.stderr, flush=True)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


if __name__ == "__main__":
    sys.exit(main())
