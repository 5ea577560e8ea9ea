"""MkDocs hook: the CLI reference page is generated from the argparse parsers, so it cannot drift from the command.

``docs/cli.md`` holds the marker below; at build time it becomes one section per command (``tokengym --help``,
``tokengym train ALGO --help`` for every registered algorithm, ``tokengym eval --help``, ...), each the exact text
the command prints, at a fixed width of 100 columns so the page does not depend on the terminal that built it.
"""

from __future__ import annotations

import contextlib
import io
import os

MARKER = "<!-- cli-reference -->"
COMMANDS = ("eval", "sample", "plot", "envs", "serve", "worker", "convert")
"""The commands besides ``train``, in the order the page lists them."""


def command_help(argv: list[str]) -> str:
    """What ``tokengym ARGV`` prints (ARGV ends with ``--help``), captured from the real parser."""
    from tokengym.agents.cli.command import main

    out, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    text = out.getvalue().strip()
    if not text.startswith("usage:"):
        raise RuntimeError(f"tokengym {' '.join(argv)} printed no help: {text[:200]!r}")
    return text


def cli_reference() -> str:
    """The markdown that replaces :data:`MARKER`: a heading and a ``text`` block per command."""
    from tokengym.agents.algorithms.registry import algorithms

    sections = [("tokengym", ["--help"]), ("tokengym train", ["train", "--help"])]
    sections += [(f"tokengym train {name}", ["train", name, "--help"]) for name in algorithms()]
    sections += [(f"tokengym {name}", [name, "--help"]) for name in COMMANDS]
    return "\n".join(f"### `{title}`\n\n```text\n{command_help(argv)}\n```\n" for title, argv in sections)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace the marker of the page that has one with the generated reference."""
    return markdown.replace(MARKER, cli_reference()) if MARKER in markdown else markdown
