"""The documentation site builds under ``mkdocs build --strict`` (no broken link, anchor or API reference), its CLI
reference is the parsers' own ``--help``, and its API reference documents every exported name.

The code blocks of the pages run in ``tests/test_readme.py``.
"""

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "rewards", "agents")


def documented(package: str) -> dict[str, str]:
    """Exported name -> the dotted path its ``::: path`` line on ``docs/api/<package>.md`` names."""
    text = (ROOT / "docs" / "api" / f"{package}.md").read_text()
    return {path.rsplit(".", 1)[1]: path for path in re.findall(r"^::: (\S+)$", text, re.M)}


def resolve(path: str):
    """The module or the attribute a dotted path names."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        parent, attr = path.rsplit(".", 1)
        return getattr(importlib.import_module(parent), attr)


@pytest.mark.parametrize("package", PACKAGES)
def test_api_reference_documents_every_exported_name(package):
    """Each name of ``tokengym.<package>.__all__`` has an entry whose path is where that very object lives."""
    module = importlib.import_module(f"tokengym.{package}")
    paths = documented(package)
    missing = sorted(set(module.__all__) - set(paths))
    assert not missing, f"docs/api/{package}.md documents no {missing}"
    for name in module.__all__:
        assert resolve(paths[name]) is getattr(module, name), \
            f"docs/api/{package}.md: {paths[name]} is not tokengym.{package}.{name}"


def test_api_check_catches_a_missing_name(tmp_path, monkeypatch):
    """The check above reads the page: a page without an entry for an exported name fails it."""
    (tmp_path / "docs" / "api").mkdir(parents=True)
    page = (ROOT / "docs" / "api" / "rewards.md").read_text().replace("::: tokengym.rewards.verifiers.parse_int\n", "")
    (tmp_path / "docs" / "api" / "rewards.md").write_text(page)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"documents no \['parse_int'\]"):
        test_api_reference_documents_every_exported_name("rewards")


@pytest.mark.slow  # 8-10 s of CPU, but 27 s on a loaded 2-core machine: .ci/run builds the site itself
def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict`` into a temporary folder; the CLI page holds every command's real ``--help``."""
    if any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings_handlers.python")):
        pytest.skip("the docs tools are not installed: pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cli = (tmp_path / "cli" / "index.html").read_text()
    assert "usage: tokengym train grpo" in cli and "--clip-eps-high" in cli and "usage: tokengym serve" in cli
    assert "cli-reference" not in cli  # the marker was replaced
    assert "GRPOAgent" in (tmp_path / "api" / "agents" / "index.html").read_text()
