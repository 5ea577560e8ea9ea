"""Starting a rollout worker loads no training algorithm: ``tokengym worker`` (the CLI builds ``train``'s per-algorithm
parsers only when ``train`` is the command), ``tokengym serve`` and the local rollout worker's process entry
(``engine.workers``).

Each probe runs in a fresh interpreter and prints the ``tokengym.agents.algorithms*`` modules it left loaded.
"""

import ast
import subprocess
import sys

import pytest

OTHER_COMMANDS = ("eval", "plot", "convert", "worker", "serve", "envs", "sample")
"""Every ``tokengym`` command but ``train``."""


def loaded_algorithms(code: str) -> list[str]:
    """The ``tokengym.agents.algorithms`` modules (the package too) that ``code`` leaves loaded in a fresh interpreter."""
    probe = (f"{code}\nimport sys\n"
             "print([m for m in sorted(sys.modules) if m.startswith('tokengym.agents.algorithms')])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def cli(*argv: str) -> str:
    """Code that runs ``tokengym ARGV`` in-process, its exit (``--help`` exits) caught."""
    return ("from tokengym.agents.cli.command import main\n"
            f"try:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass\n")


def test_the_worker_command_loads_no_algorithm():
    assert loaded_algorithms(cli("worker", "--help")) == []


def test_the_worker_command_run_loads_no_algorithm():
    """Past the parser into the command itself (a bad address: one error line, nothing listens)."""
    assert loaded_algorithms(cli("worker", "--listen", "no-port-here")) == []


def test_the_serve_command_run_loads_no_algorithm():
    """``tokengym serve`` past the parser (a bad address: one error line, nothing listens) and the server's module."""
    code = cli("serve", "--model", "tiny-arithmetic", "--listen", "no-port-here") + "import tokengym.agents.engine.serving\n"
    assert loaded_algorithms(code) == []


def test_the_local_rollout_workers_process_entry_loads_no_algorithm():
    code = "import tokengym.agents.engine.workers as w\nassert callable(w._worker_main)\n"
    assert loaded_algorithms(code) == []


def test_no_command_but_train_loads_an_algorithm():
    code = "".join(cli(command, "--help") for command in OTHER_COMMANDS)
    assert loaded_algorithms(code) == []


@pytest.mark.parametrize("argv", [("train", "--help"), ("--help",)])
def test_train_and_the_overview_still_list_the_algorithms(argv):
    """The probe sees algorithms where they load: ``train``'s parsers and ``tokengym --help`` (which names them)."""
    assert "tokengym.agents.algorithms.grpo" in loaded_algorithms(cli(*argv))


def test_the_overview_lists_exactly_train_and_the_other_commands(capsys):
    from tokengym.agents.cli.command import main

    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.endswith("{" + ",".join(("train", *OTHER_COMMANDS)) + "} ..."), usage
