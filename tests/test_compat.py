"""pardist.runtime._compat: the one seam to torch's private names, and the version floor."""

import subprocess
import sys

import torch

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
