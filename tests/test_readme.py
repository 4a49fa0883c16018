"""The README's and the guides' code runs as written, so the docs cannot drift from the library.

Every ```python block of README.md and docs/*.md is a program whose first line names it
(``# train.py: ...``), run here with ``python`` and with ``torchrun
--nproc_per_node=2`` (only ``python`` for one marked ``(python only ...)``, which
starts its own processes), each in a fresh directory; or an excerpt
(``# excerpt of train.py ...``) whose lines must appear, in order, in the program
it names (a README program or a file of the repository; ``# ...`` marks an
elision). Bash blocks are left alone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PROGRAM = re.compile(r"# ([\w./-]+\.py)(?::| \()")
EXCERPT = re.compile(r"# excerpt of ([\w./-]+\.py)")
ELISION = "# ..."


def _blocks() -> list[tuple[str, str]]:
    """(file:line, code) of every ```python block of the README and the guides."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT)
        found += [
            (f"{name}:{text[: m.start()].count(chr(10)) + 2}", m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", text, re.M | re.S)
        ]
    return found


def _parse() -> tuple[dict, list, list]:
    programs, excerpts, problems = {}, [], []
    for line, code in _blocks():
        first = code.splitlines()[0] if code.strip() else ""
        if m := EXCERPT.match(first):
            excerpts.append((line, m.group(1), code))
        elif m := PROGRAM.match(first):
            if m.group(1) in programs:
                problems.append(f"{line}: a second program named {m.group(1)}")
            programs[m.group(1)] = (line, code, "(python only" in first)
        else:
            problems.append(
                f"{line}: a python block must start with '# name.py: ...' (a program) "
                f"or '# excerpt of name.py' (part of one), not {first!r}"
            )
    return programs, excerpts, problems


def test_links_to_guides_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|png|py))\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: {target}"


def test_the_readme_is_short():
    assert len(README.read_text()) <= 15_000  # the rest belongs in docs/


PROGRAMS, EXCERPTS, PROBLEMS = _parse()


def test_every_python_block_is_a_named_program_or_an_excerpt():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert "train.py" in PROGRAMS  # the script at the top
    assert PROGRAMS["train.py"][0].startswith("README.md:")
    assert int(PROGRAMS["train.py"][0].split(":")[1]) < 20


@pytest.mark.parametrize("excerpt", EXCERPTS, ids=[f"line{e[0]}" for e in EXCERPTS])
def test_excerpts_appear_in_their_programs(excerpt):
    line, name, code = excerpt
    if name in PROGRAMS:
        source = PROGRAMS[name][1]
    else:
        assert (ROOT / name).is_file(), f"{line}: no program or file named {name}"
        source = (ROOT / name).read_text()
    chunks: list[list[str]] = [[]]
    for text in code.splitlines()[1:]:
        if text.strip() == ELISION:
            chunks.append([])
        else:
            chunks[-1].append(text)
    position = 0
    for chunk in chunks:
        found = source.find("\n".join(chunk) + "\n", position)
        assert found >= 0, f"{line}: not in {name}, in this order:\n" + "\n".join(chunk)
        position = found + 1


def _run(argv: list, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    + ["--nproc_per_node=2"],
}
RUNS = [
    (name, launcher)
    for name, (_, _, python_only) in PROGRAMS.items()
    for launcher in LAUNCHERS
    if launcher == "python" or not python_only
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, launcher", RUNS, ids=[f"{n}-{launcher}" for n, launcher in RUNS])
def test_readme_programs_run(tmp_path, name, launcher):
    line, code, _ = PROGRAMS[name]
    (tmp_path / name).write_text(code)
    done = _run([*LAUNCHERS[launcher], name], tmp_path)
    report = f"{line}: {name} under {launcher}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    assert done.returncode == 0, report
    assert done.stdout.strip(), report
    for warning in ("DuplicateBatchWarning", "NonFiniteLossWarning"):
        assert warning not in done.stderr, report
    if name == "train.py":  # it learns, in one process and in two alike
        accuracy = re.findall(r"epoch 2: loss [0-9.]+, accuracy ([0-9.]+)", done.stdout)
        assert accuracy and float(accuracy[0]) > 0.9, report
