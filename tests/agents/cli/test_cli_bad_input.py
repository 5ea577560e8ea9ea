"""Bad input to ``tokengym train`` / ``eval``: one short line on stderr, exit code 2, and no run folder left behind.

Everything a run needs (model, env, data, agent, device, memory) is built and checked before ``runs/<name>/`` is
created, so the command with the mistake fixed can reuse the same ``--name``.
"""

import importlib.util
import json
import os

import pytest

from tokengym.agents.cli import main

F = ["--eval-prompts", "0", "--progress", "false", "--threads", "1"]  # every algorithm takes these
B = ["--steps", "2", *F]


def _files(root):
    """Input files the cases refer to as ``{root}/<name>``."""
    def jsonl(name, rows):
        with open(os.path.join(root, name), "w") as f:
            f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)

    pair = {"prompt": "1+2\n", "chosen": "1+2=3\nA: 3", "rejected": "1+2=4\nA: 4"}
    jsonl("missing_column.jsonl", [{"prompt": "1+2\n", "chosen": "A: 3"}])
    jsonl("not_json.jsonl", [pair, "{not json"])
    jsonl("no_rows.jsonl", [])
    jsonl("wrong_types.jsonl", [{"prompt": "1+2\n", "chosen": 3, "rejected": 4}])
    jsonl("identical.jsonl", [{"prompt": "1+2\n", "chosen": "A: 3", "rejected": "A: 3"}])
    chat = [{"role": "user", "content": "What is 1+2?"}]
    jsonl("chat.jsonl", [{"prompt": chat, "chosen": [{"role": "assistant", "content": "3"}],
                          "rejected": [{"role": "assistant", "content": "4"}]}])
    jsonl("no_prompt.jsonl", [{"question": "1+2", "answer": "3"}])
    jsonl("long_prompt.jsonl", [{"prompt": "x" * 2000, "answer": "1"}])
    jsonl("long_pairs.jsonl", [{"prompt": "1+2" * 1000 + f"{i}\n", "chosen": f"A: {i}", "rejected": f"A: {i + 1}"}
                               for i in range(4)])  # rows of 3,008 tokens, on a model of 512 positions
    jsonl("bad_labels.jsonl", [{"prompt": "1+2\n", "steps": ["1+2=3"], "labels": [2.0]}])
    jsonl("one_prompt.jsonl", [{"prompt": "1+2\n", "chosen": f"A: 3{'!' * i}", "rejected": f"A: {4 + i}"} for i in range(6)])
    jsonl("one_prompt_labels.jsonl", [{"prompt": "1+2\n", "steps": ["1+2=3", f"A: {3 + i}"], "labels": [1.0, float(i == 0)]}
                                      for i in range(6)])
    with open(os.path.join(root, "not_json.json"), "w") as f:
        f.write('{"lr": 1e-4,')
    with open(os.path.join(root, "bad.toml"), "w") as f:
        f.write("lr = = 1\n")
    with open(os.path.join(root, "list.json"), "w") as f:
        json.dump([1, 2], f)
    with open(os.path.join(root, "bad_env.toml"), "w") as f:
        f.write('env = "tokengym/Arithmetic-v0"\n[env_kwargs]\ndigits = 0\n')
    with open(os.path.join(root, "a_file"), "w") as f:
        f.write("not a folder\n")
    os.makedirs(os.path.join(root, "a_folder"), exist_ok=True)
    os.makedirs(os.path.join(root, "training_run", "checkpoints"))  # a run still training: no model/ yet
    with open(os.path.join(root, "training_run", "config.json"), "w") as f:
        json.dump({"algorithm": "sft", "preset": None, "run": {}, "config": {}}, f)
    os.symlink(os.path.dirname(root), os.path.join(root, "a_link"))  # points out of the runs folder {root}


NAMED = ["train", "grpo", *B, "--runs-dir", "{root}/../runs"]  # the run name comes next

REMOTE = ["train", "grpo", *B, "--async-mode", "one-step", "--rollout-workers", "127.0.0.1:9"]

CASES = {  # id -> (argv, a piece of the one-line message); {root} is a folder of input files beside the runs folder
    # bad values the configs themselves refuse
    "grpo group of 1": (["train", "grpo", *B, "--group-size", "1"], "group_size=1"),
    "rloo group of 1": (["train", "rloo", *B, "--group-size", "1"], "group_size=1"),
    "gspo with token-sum": (["train", "grpo", *B, "--preset", "gspo", "--aggregation", "seq-mean-token-sum"],
                            "loss='gspo'"),
    "dynamic sampling without groups": (["train", "reinforce-pp", *B, "--dynamic-sampling", "true", "--group-size", "1"],
                                        "dynamic_sampling"),
    "process advantage with rloo's flags": (["train", "rloo", *B, "--advantage", "process"], "--advantage"),
    "clip range": (["train", "grpo", *B, "--clip-eps", "1.5"], "clip_eps must be in [0, 1]"),
    "infinite lr": (["train", "grpo", *B, "--lr", "inf"], "lr must be a finite number"),
    "fractional steps": (["train", "ppo", *B, "--steps", "1.5"], "steps expects int"),
    "no budget": (["train", "grpo", *B, "--env-kwargs", '{"max_new_tokens": 0}'], "max_new_tokens must be None"),
    "fractional budget": (["train", "grpo", *B, "--env-kwargs", '{"max_new_tokens": 2.7}'], "max_new_tokens must be None"),
    # what the run is built from
    "unknown env": (["train", "grpo", *B, "--env", "tokengym/Nope-v0"], "unknown env id"),
    "unknown model": (["train", "grpo", *B, "--model", "huge"], "cannot load model 'huge'"),
    "bad env kwargs": (["train", "grpo", *B, "--env-kwargs", '{"digits": 0}'], "digits must be"),
    "bad env kwargs from toml": (["train", "grpo", *B, "--config", "{root}/bad_env.toml"], "digits must be"),
    "missing data file": (["train", "grpo", *B, "--env", "tokengym/Dataset-v0", "--env-kwargs", '{"data": "/nope.jsonl"}'],
                          "no such JSONL file"),
    "dataset without prompts": (["train", "grpo", *B, "--env", "tokengym/Dataset-v0", "--env-kwargs",
                                 '{"data": "{root}/no_prompt.jsonl"}'], "prompt"),
    "prompt past the model's positions": (["train", "grpo", *B, "--env", "tokengym/Dataset-v0", "--env-kwargs",
                                           '{"data": "{root}/long_prompt.jsonl"}'], "positions"),
    "reasoning gym without a name": (["train", "grpo", *B, "--env", "tokengym/ReasoningGym-v0"], "cannot build env"),
    "reward model not a folder": (["train", "ppo", *B, "--reward-model", "{root}/nope"], "is not a folder"),
    "reward model not a model": (["train", "ppo", *B, "--reward-model", "{root}/a_folder"], "cannot load"),
    "flag of another algorithm": (["train", "grpo", *B, "--pairs", "{root}/identical.jsonl"], "does not apply"),
    "memory": (["train", "grpo", *B, "--prompts", "1000000000"], "GiB free"),
    "no gpu": (["train", "grpo", *B, "--device", "cuda:7"], "not available"),
    # pairs and labels
    "pairs file missing": (["train", "dpo", *B, "--pairs", "{root}/nope.jsonl"], "does not exist"),
    "pairs missing a column": (["train", "dpo", *B, "--pairs", "{root}/missing_column.jsonl"], "no 'rejected' column"),
    "pairs not json": (["train", "dpo", *B, "--pairs", "{root}/not_json.jsonl"], "not valid JSON"),
    "pairs empty": (["train", "dpo", *B, "--pairs", "{root}/no_rows.jsonl"], "empty"),
    "pairs wrong types": (["train", "dpo", *B, "--pairs", "{root}/wrong_types.jsonl"], "must be a string"),
    "chosen equals rejected": (["train", "dpo", *B, "--pairs", "{root}/identical.jsonl"], "chosen and rejected must differ"),
    "chat pairs, plain model": (["train", "dpo", *B, "--pairs", "{root}/chat.jsonl"], "chat messages"),
    "chat pairs, no template": (["train", "dpo", *B, "--pairs", "{root}/chat.jsonl", "--chat-template", "true"],
                                "has no chat template"),
    "dpo pairs past the positions": (["train", "dpo", *B, "--pairs", "{root}/long_pairs.jsonl"],
                                     "is 3008 tokens long, over the model's 512 positions (max_position_embeddings): set "
                                     "max_length (--max-length)"),
    "rm pairs past the positions": (["train", "rm", *F, "--pairs", "{root}/long_pairs.jsonl"],
                                    "the longest row (pair 0: prompt + chosen + EOS) is 3008 tokens long, over the "
                                    "model's 512 positions (max_position_embeddings): set max_length (--max-length)"),
    "rm pairs past the positions, max_length too": (["train", "rm", *F, "--pairs", "{root}/long_pairs.jsonl",
                                                     "--max-length", "600"], "is 600 tokens long"),
    "rm pairs missing a column": (["train", "rm", *F, "--pairs", "{root}/missing_column.jsonl"], "no 'rejected' column"),
    "rm chat pairs": (["train", "rm", *F, "--pairs", "{root}/chat.jsonl"], "chat messages"),
    "step labels missing": (["train", "prm", *F, "--step-labels", "{root}/nope.jsonl"], "does not exist"),
    "step labels out of range": (["train", "prm", *F, "--step-labels", "{root}/bad_labels.jsonl"], "labels must be numbers"),
    # paths
    "name leaves the runs folder": ([*NAMED, "--name", "../../escape"],
                                    "path separator"),
    "runs dir is a file": (["train", "grpo", *B, "--runs-dir", "{root}/a_file"], "is a file"),
    "config is a list": (["train", "grpo", *B, "--config", "{root}/list.json"], "holds a list"),
    "config is a folder": (["train", "grpo", *B, "--config", "{root}/a_folder"], "is a folder"),
    "config does not parse": (["train", "grpo", *B, "--config", "{root}/not_json.json"], "cannot parse config file"),
    "toml does not parse": (["train", "grpo", *B, "--config", "{root}/bad.toml"], "cannot parse config file"),
    "eval on a missing gpu": (["eval", "--model", "tiny", "--device", "cuda:7", "--prompts", "4"], "not available"),
    "name too long": ([*NAMED, "--name", "a" * 300], "300 bytes long, over the filesystem's 255"),
    "name with a newline": ([*NAMED, "--name", "a\nb"], "control character U+000A"),
    "name with a right-to-left override": ([*NAMED, "--name", "a\u202eb"], "control character U+202E"),
    "name like a flag": ([*NAMED, "--name=-x"], "starts with '-'"),
    "name is a link out of the runs folder": (["train", "grpo", *B, "--runs-dir", "{root}", "--name", "a_link"],
                                              "is a symbolic link"),
    "runs dir in /proc": (["train", "grpo", *B, "--runs-dir", "/proc/self", "--name", "p"], "virtual filesystem"),
    "train prompt over the positions": (["train", "grpo", *B, "--env", "tokengym/Reverse-v0", "--env-kwargs",
                                         '{"length": 3000}'], "max_position_embeddings"),
    "eval prompt over the positions": (["eval", "--model", "tiny-arithmetic", "--env", "tokengym/Reverse-v0",
                                        "--env-kwargs", '{"length": 3000}', "--prompts", "2"], "max_position_embeddings"),
    # the learner's remote-worker flags (checked before any worker is called: the address answers nothing)
    "sync dir in /proc": ([*REMOTE, "--sync-dir", "/proc"], "--sync-dir /proc is on a virtual filesystem"),
    "sync dir is a file": ([*REMOTE, "--sync-dir", "{root}/a_file"], "a_file is a file, not a folder"),
    "sync dir missing": ([*REMOTE, "--sync-dir", "{root}/nope"], "nope does not exist"),
    "sync host out of range": ([*REMOTE, "--sync-host", "999.1.1.1"], "--sync-host 999.1.1.1 is not a host name or "
                               "address this machine can resolve"),
    "sync host unknown": ([*REMOTE, "--sync-host", "no.such.host.invalid"], "--sync-host no.such.host.invalid is not"),
    "sync host of another machine": ([*REMOTE, "--sync-host", "192.0.2.1"], "(192.0.2.1) is not an address of this "
                                     "machine"),
    "the same worker twice": (["train", "grpo", *B, "--async-mode", "one-step", "--rollout-workers",
                               "127.0.0.1:9,127.0.0.1:8,127.0.0.1:9"], "remote_workers names 127.0.0.1:9 twice"),
    "workers without an async mode": (["train", "grpo", *B, "--rollout-workers", "2"], "rollout_workers=2 "
                                      "(--rollout-workers) samples in worker processes while the learner updates, which "
                                      "needs an async mode: add --async-mode one-step"),
    "remote workers without an async mode": (["train", "grpo", *B, "--rollout-workers", "127.0.0.1:9"],
                                             "remote_workers='127.0.0.1:9' (--rollout-workers) samples"),
    "teacher still training": (["train", "distill", *B, "--teacher", "{root}/training_run"],
                               "training_run is a run with no model/ yet (still training?): wait for it to finish"),
    "sft rows over the positions, packed": (["train", "sft", *B, "--env", "tokengym/Reverse-v0", "--env-kwargs",
                                             '{"length": 600}', "--packing", "bins"],
                                            "need 1207 positions, but the model has 512 (max_position_embeddings)"),
    "convert a folder": (["convert", "{root}/a_folder"], "is a folder, not a GGUF file"),
    # a held-out split of whole prompts needs two prompts
    "rm pairs all on one prompt": (["train", "rm", *F, "--pairs", "{root}/one_prompt.jsonl"],
                                   "one_prompt.jsonl: all 6 pairs share one prompt, and the held-out split "
                                   "(val_fraction=0.1) holds out whole prompts"),
    "prm labels all on one prompt": (["train", "prm", *F, "--step-labels", "{root}/one_prompt_labels.jsonl"],
                                     "all 6 examples share one prompt"),
    # settings only workers read, in a run without them
    "sync port without remote workers": (["train", "grpo", *B, "--sync-port", "29600"],
                                         "sync_port=29600 (--sync-port) is only read by remote workers"),
    "sync host with local workers": (["train", "grpo", *B, "--async-mode", "one-step", "--sync-host", "127.0.0.1"],
                                     "sync_host='127.0.0.1' (--sync-host) is only read by remote workers"),
    "sync dir without remote workers": (["train", "grpo", *B, "--sync-dir", "{root}/a_folder"], "(--sync-dir) is only"),
    "min workers without remote workers": (["train", "grpo", *B, "--min-workers", "1"], "(--min-workers) is only"),
    "sync timeout without an async mode": (["train", "grpo", *B, "--sync-timeout", "60"],
                                           "sync_timeout=60.0 (--sync-timeout) is only read by rollout workers, which "
                                           "need an async mode"),
    "worker threads without an async mode": (["train", "grpo", *B, "--worker-threads", "2"], "(--worker-threads) is"),
}


def _grammar(spec):
    return ["train", "grpo", *B, "--env-kwargs", json.dumps({"grammar": spec})]


GRAMMARS = {  # checked before the run starts: one line naming the env, not a traceback in the first rollout
    "grammar: a schema of an unknown type": (_grammar({"json_schema": {"type": "strng"}}),
                                             "tokengym/Arithmetic-v0"),
    "grammar: a schema that allows nothing": (_grammar({"json_schema": {"type": "integer", "minimum": 5, "maximum": 3}}),
                                              "tokengym/Arithmetic-v0"),
    "grammar: a regex outside the vocabulary": (_grammar({"regex": "\u20ac+"}), "env tokengym/Arithmetic-v0: its "
                                                "grammar {'regex': '\u20ac+'} allows no token at the start of the answer"),
    "grammar: a grammar that forbids the end": (_grammar({"regex": "[0-9]+\u20ac"}),  # the euro sign: no token
                                                "reaches no accepting state (where EOS is allowed) within max_new_tokens="),
    "grammar: a dead end beside the answers": (_grammar({"regex": "[0-9]+|[a-z]\u20ac"}),  # a letter, then nothing
                                                "can reach a dead end: after '"),
}
CASES.update(GRAMMARS)
NO_LLGUIDANCE = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                   reason="grammar masks need llguidance: pip install 'tokengym[grammar]'")


@pytest.mark.parametrize("case", [pytest.param(c, marks=NO_LLGUIDANCE if c in GRAMMARS else ()) for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_no_folder(tmp_path, capsys, case):
    root, runs = tmp_path / "in", tmp_path / "runs"
    root.mkdir()
    _files(str(root))
    argv, message = CASES[case]
    argv = [a.replace("{root}", str(root)) for a in argv]
    if argv[0] == "train" and "--runs-dir" not in argv:
        argv += ["--runs-dir", str(runs), "--name", "x"]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if not ln.startswith("tokengym: warning:")]
    assert len(lines) == 1 and lines[0].startswith("tokengym: error: ") and message in lines[0], err
    assert not runs.exists() or os.listdir(runs) == [], os.listdir(runs)


def test_an_address_where_another_http_server_answers_is_not_a_worker(tmp_path, capsys, monkeypatch):
    """A plain HTTP server at a --rollout-workers address: one line saying it is not a tokengym worker (not the first
    line of its HTML page), exit 2, no run folder."""
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # (its request log would be on this process's stderr)
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("TOKENGYM_SECRET", "x")
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        code = main(["train", "grpo", *B, "--async-mode", "one-step", "--rollout-workers", address,
                     "--runs-dir", str(tmp_path / "runs"), "--name", "x"])
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"tokengym: error: {address} answered but is not a tokengym worker (HTTP 501); is the "
                                 "address right, and is `tokengym worker` running there?"), err
    assert not (tmp_path / "runs").exists()


def test_the_fixed_command_reuses_the_name(tmp_path, capsys):
    """A typo leaves nothing behind, so the corrected command runs under the same name."""
    args = ["train", "grpo", *B, "--group-size", "2", "--prompts", "1", "--runs-dir", str(tmp_path), "--name", "r"]
    assert main([*args, "--env", "tokengym/Arithmetc-v0"]) == 2
    assert main(args) == 0
    assert os.path.isdir(tmp_path / "r" / "model")


def test_one_pair_trains_without_an_eval_split(tmp_path, capsys):
    """Fewer than 20 pairs: every pair trains (none is set aside for held-out preference accuracy)."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "1+2\n", "chosen": "1+2=3\nA: 3", "rejected": "1+2=4\nA: 4"}) + "\n")
    assert main(["train", "dpo", *B, "--pairs", str(path), "--runs-dir", str(tmp_path), "--name", "d"]) == 0
    with open(tmp_path / "d" / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert max(steps) >= 1


@pytest.mark.parametrize("config, message", [
    ("{not json", "cannot read"),
    (json.dumps({"algorithm": "grpo", "config": {}}), "it needs an 'algorithm' name and 'run' and 'config' sections"),
    (json.dumps({"algorithm": "grpo", "run": {}, "config": {"lrr": 1}}), "unknown key 'lrr'"),
    (json.dumps([1, 2]), "it needs an 'algorithm' name"),
])
def test_a_damaged_saved_config_is_one_line_and_changes_nothing(tmp_path, capsys, config, message):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(config)
    assert main(["train", "grpo", "--resume", str(run), "--progress", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert sorted(os.listdir(run)) == ["config.json"] and (run / "config.json").read_text() == config


def test_a_read_only_runs_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """Root ignores file modes, so the read-only file system is simulated where the run folder is created."""
    import errno

    from tokengym.agents.runtime import runs as R

    makedirs = os.makedirs

    def read_only(path, *a, **k):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return makedirs(path, *a, **k)

    monkeypatch.setattr(R.os, "makedirs", read_only)
    assert main(["train", "grpo", *B, "--prompts", "1", "--group-size", "2", "--runs-dir", str(tmp_path / "ro"),
                 "--name", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not writable (read-only file system)" in err, err


@pytest.mark.parametrize("argv", [["worker", "--listen", "127.0.0.1:0", "--secret-file"],
                                  ["serve", "--model", "tiny", "--listen", "127.0.0.1:0", "--secret-file"],
                                  ["train", "grpo", "--async-mode", "one-step", "--rollout-workers", "127.0.0.1:9",
                                   "--threads", "1", "--worker-secret-file"]])
def test_a_secret_file_every_user_may_read_is_refused_as_ssh_does(tmp_path, capsys, argv):
    """The worker's, the server's and the learner's secret files go through the judge's one reader: mode 644 is one
    line naming the file and its mode, exit 2, and nothing made; mode 600 gets past the check."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    os.chmod(secret, 0o644)
    code = main([*argv, str(secret), *(["--runs-dir", str(tmp_path / "runs")] if argv[0] == "train" else [])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{str(secret)!r} is readable by every user (mode 644); chmod 600 it" in err and "s3cret" not in err
    assert not os.path.exists(tmp_path / "runs")
    from tokengym.agents.engine.remote import read_secret

    os.chmod(secret, 0o600)
    assert read_secret(str(secret)) == b"s3cret"


@NO_LLGUIDANCE
def test_a_dead_end_met_in_a_rollout_stops_the_run_in_one_line(tmp_path, capsys):
    """A dead end deeper than the shortest answer (a digit finishes; three letters lead where no token may follow)
    passes the check before the run; the untrained model then samples letters, and the run stops with one line
    naming the prefix (exit 1; the run folder stays, as for any run that stops midway)."""
    code = main([*_grammar({"regex": "[0-9]|[a-z]{3}\u20ac"}), "--model", "tiny", "--runs-dir", str(tmp_path / "runs"),
                 "--name", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("tokengym: error: the action mask of env row ") and "its grammar is at a dead end" in err, err
