"""The benchmarks name only what pardist has.

No test runs them (they time things; CI must not), so a name moved in pardist would
break one silently until someone runs it: ``benchmarks/vs_ddp.py`` called
``transport._shm.for_collectives`` after it had moved to ``transport._shmgroups``.
Every ``pardist.…`` name a benchmark reads, through ``import pardist`` or a
``from pardist… import module``, must exist.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

BENCHMARKS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def _pardist_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> the pardist module it is bound to, for the module's imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "pardist":
                    names[a.asname or a.name.split(".")[0]] = a.asname and a.name or "pardist"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pardist"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                try:
                    importlib.import_module(full)
                except ImportError:
                    continue  # a name, not a module: checked by the import itself
                names[a.asname or a.name] = full
    return names


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ['a', 'b', 'c'], or None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_every_pardist_name_a_benchmark_reads_exists(path):
    tree = ast.parse(path.read_text())
    modules = _pardist_modules(tree)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pardist"):
            module = importlib.import_module(node.module)
            missing += [
                f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
            ]
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in modules:
            obj = importlib.import_module(modules[chain[0]])
            for i, attr in enumerate(chain[1:], 1):
                if not hasattr(obj, attr):
                    try:  # a submodule not imported by its package
                        obj = importlib.import_module(
                            ".".join([modules[chain[0]], *chain[1 : i + 1]])
                        )
                        continue
                    except ImportError:
                        missing.append(".".join([modules[chain[0]], *chain[1 : i + 1]]))
                        break
                obj = getattr(obj, attr)
                if not hasattr(obj, "__dict__") or isinstance(obj, type):
                    break  # a value or a class: attributes of instances are not checked
    assert not missing, f"{path.name} reads names pardist does not have: {sorted(set(missing))}"


def test_a_missing_plotting_package_skips_the_plot_with_a_line(tmp_path, monkeypatch, capsys):
    # vs_ddp.py raised at its plot without matplotlib, after printing its table.
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS[0].parent))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails
    vs_ddp = importlib.import_module("vs_ddp")
    vs_ddp.plot([], str(tmp_path / "plot.png"))
    assert "no plot: matplotlib is not installed" in capsys.readouterr().out
