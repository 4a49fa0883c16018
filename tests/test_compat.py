"""pardist.runtime._compat (and its second file, _compat_inductor): the one seam to torch's
private names, and the version floor."""

import ast
import pathlib
import subprocess
import sys

import torch

import pardist
from pardist.runtime._compat import storage_holders

# Simulates torch <= 2.9, whose storage use count does not count the temporary
# storage object made to ask (a lone tensor reads 1 there, 2 on 2.10+).
_OLD_COUNT = """
import torch
_count = torch._C._storage_Use_Count
torch._C._storage_Use_Count = lambda cdata: _count(cdata) - 1
"""

_HOLDERS = """
from pardist.runtime._compat import storage_holders
t = torch.empty(3)
lone = storage_holders(t)
view = t[:1]
print(lone, storage_holders(t))
"""


def test_a_lone_tensor_is_held_once_and_a_view_adds_one():
    t = torch.empty(5)
    assert storage_holders(t) == 1
    view = t[1:3]
    assert storage_holders(t) == 2 and storage_holders(view) == 2
    del view
    assert storage_holders(t) == 1


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_storage_holders_read_alike_where_torch_counts_differently():
    for prelude in ("import torch\n", _OLD_COUNT):
        out = _run(prelude + _HOLDERS)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1", "2"], (prelude, out.stdout)


# Private attributes of public torch classes that pardist reads (DTensor, storages,
# Tensor): named only in the seam, like the private modules.
_PRIVATE_ATTRIBUTES = {"_local_tensor", "_spec", "_cdata", "_make_wrapper_subclass"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_torch_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private torch name a module's code (not its docs) uses."""
    tree = ast.parse(source)
    roots = {"torch"}  # names bound to torch or a torch module/object
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    roots.add(a.asname or "torch")
                    if any(map(_private, a.name.split("."))):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module in _SEAM_MODULES:
            roots.update(a.asname or a.name for a in node.names)  # the seam's torch modules
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                roots.add(a.asname or a.name)
                if any(map(_private, node.module.split("."))) or _private(a.name):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in _PRIVATE_ATTRIBUTES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node.value, ast.Name) and node.value.id in roots and _private(node.attr):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(set(found))


_SEAM_MODULES = ("pardist.runtime._compat", "pardist.runtime._compat_inductor")


def test_no_module_outside_the_seam_names_a_private_torch_api():
    package = pathlib.Path(pardist.__file__).parent
    seam = {package / "runtime" / f"{m.rsplit('.', 1)[1]}.py" for m in _SEAM_MODULES}
    offenders = [
        f"{path.relative_to(package.parent)}:{line}: {name}"
        for path in sorted(package.rglob("*.py"))
        if path not in seam
        for line, name in _private_torch_names(path.read_text())
    ]
    assert not offenders, "private torch names outside the seam:\n" + "\n".join(offenders)


def test_the_check_sees_each_kind_of_private_name():
    source = (
        "import torch\nimport torch.utils._pytree as pytree\n"
        "from torch.distributed.elastic.rendezvous.utils import _matches\n"
        "import torch.distributed as dist\nx = torch._C._functorch\ny = dist._thing\n"
        "z = t._local_tensor\nok = torch.nn.Linear.__call__\n"
    )
    names = [name for _, name in _private_torch_names(source)]
    assert names == [
        "import torch.utils._pytree",
        "from torch.distributed.elastic.rendezvous.utils import _matches",
        "torch._C",
        "dist._thing",
        "._local_tensor",
    ]


_IMPORT_AS = """
import sys
import torch
torch.__version__ = {version!r}
try:
    import pardist
except ImportError as e:
    internals = [m for m in ("torch._dynamo", "torch.distributed._functional_collectives",
                             "torch.distributed.tensor") if m in sys.modules]
    print("refused", internals, str(e))
else:
    print("imported")
"""


def test_an_older_torch_is_refused_in_one_line_naming_both_versions():
    out = _run(_IMPORT_AS.format(version="2.9.1+cu128"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "refused [] pardist needs torch>=2.11, but torch 2.9.1+cu128 is installed: "
        "pip install 'torch>=2.11'"
    )


def test_the_minimum_and_newer_versions_are_accepted():
    for version in ("2.11.0+cu130", "2.15.0", "3.0.0a0"):
        out = _run(_IMPORT_AS.format(version=version))
        assert out.stdout.strip() == "imported", (version, out.stdout, out.stderr)


def test_pyproject_states_the_same_minimum():
    pyproject = pathlib.Path(pardist.__file__).parent.parent / "pyproject.toml"
    assert '"torch>=2.11"' in pyproject.read_text()
