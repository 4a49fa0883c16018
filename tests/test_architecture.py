"""The house's rules, read from the source: layers, interfaces, private names.

docs/design.md draws pardist as subpackages stacked in layers, each offering its
names from its ``__init__``. These tests parse every module (no import) and check
that the drawing is the code: imports go only downwards, a package reaches another
only through that package's interface (or a module of it imported whole as a
namespace), never through a name with a leading underscore, and the step decides
how gradients arrive from the state it is given, without importing an optimizer.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "pardist"
# Bottom to top: a module may import the packages before its own, never after.
LAYERS = [
    "runtime",
    "transport",
    "compile",
    "collectives",
    "sharding",
    "gradients",
    "nn",
    "optim",
    "data",
    "step",
    "amp",
    "checkpoint",
    "launch",
]
PACKAGES = [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()]


def owner(path: pathlib.Path) -> str:
    """The subpackage (or top-level module) a source file belongs to."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def imports(path: pathlib.Path):
    """``(module, names, line)`` for every ``from pardist...`` / ``import pardist...``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pardist"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pardist"):
                    yield a.name, [], node.lineno


def sources():
    return [p for p in sorted(ROOT.rglob("*.py")) if p != ROOT / "__init__.py"]


def test_every_package_has_a_layer():
    tops = {p.name for p in ROOT.iterdir() if p.suffix == ".py" and p.stem != "__init__"}
    assert set(PACKAGES) | {t[:-3] for t in tops} == set(LAYERS)


def test_imports_go_only_downwards():
    upward = []
    for path in sources():
        me = owner(path)
        for module, names, line in imports(path):
            parts = module.split(".")
            targets = [parts[1]] if len(parts) > 1 else names  # "from pardist import optim"
            for other in targets:
                if other in LAYERS and other != me and LAYERS.index(other) > LAYERS.index(me):
                    upward.append(f"{path.relative_to(ROOT)}:{line} imports pardist.{other}")
    assert not upward, "\n".join(upward)


def test_the_step_imports_no_optimizer():
    # A sharded optimizer state says itself that its gradients arrive reduce-scattered
    # (runtime.ShardsGradients); the step asks the state, not the optimizer.
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in (ROOT / "step").glob("*.py")
        for module, names, line in imports(p)
        if module.startswith("pardist.optim") or (module == "pardist" and "optim" in names)
    ]
    assert not found


def test_packages_meet_only_at_their_interfaces():
    # By name, another package's names come from its __init__; a module of another
    # package may be imported whole (``from pardist.runtime import _tree``), but no
    # name with a leading underscore is taken from it, by import or by attribute.
    bad = []
    for path in sources():
        me = owner(path)
        tree = ast.parse(path.read_text())
        namespaces = set()
        for module, names, line in imports(path):
            parts = module.split(".")
            if len(parts) < 2 or parts[1] == me:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            if len(parts) > 2:
                bad.append(f"{where} imports by name from {module}, not from pardist.{parts[1]}")
            for n in names:
                if n.startswith("_") and (ROOT / parts[1] / f"{n}.py").exists():
                    namespaces.add(n)
                elif n.startswith("_"):
                    bad.append(f"{where} imports the private {module}.{n}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in namespaces
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}"
                )
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_package_offers_its_names(package):
    mod = importlib.import_module(f"pardist.{package}")
    offered = getattr(mod, "__all__", None)
    assert offered, f"pardist.{package} exports nothing from its __init__"
    assert all(hasattr(mod, name) for name in offered)
    assert mod.__doc__ and "import" in mod.__doc__  # says what it may import


@pytest.mark.parametrize(
    "path", sorted((ROOT.parent / "examples").rglob("*.py")), ids=lambda p: p.name
)
def test_every_example_reads_in_one_sitting(path):
    """An example is read whole, top to bottom: under 200 lines (a model of its own lives in
    a module beside it, as examples/xresnet.py does for imagenette.py)."""
    lines = len(path.read_text().splitlines())
    assert lines < 200, f"{path.relative_to(ROOT.parent)} has {lines} lines: 199 at most"


def test_import_pardist_loads_no_compiler():
    """``import pardist`` brings neither dynamo nor inductor (a second of every process's
    start): they come with the first step that compiles."""
    import subprocess
    import sys

    code = (
        "import sys, pardist\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
        "step = pardist.data_parallel(lambda w, b: w, compile=True)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    assert out[0] == "[]", out
    assert out[1] == "True"  # a compiled step asked for it
