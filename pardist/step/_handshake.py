"""The calls of a step: every rank in the same one, or an error naming each one's.

A rank that raises inside a step and goes on (the user caught it, to skip a bad batch)
leaves the others waiting in a collective of that call; its next call's collectives
would then pair with theirs, one step apart: wrong numbers, or ranks waiting in
different collectives until the timeout. So each call of a step is marked with the
step and its count of calls entered:

- through shared memory (CPU ranks of one host, the default there), at no cost: the
  count rides in every collective's signature (calls one step apart never pair: every
  rank raises at once), and a rank waiting in a collective sees another rank begin a
  later call of the step (it raises within a tenth of a second, and shows the others);
- over gloo, every collective pardist runs begins with a header (one all-reduce of two
  numbers) that carries the call, the start of every call included: a rank one call
  ahead meets the others' header of another call, and every rank raises at once,
  naming each one's collective and call (``transport.agree``);
- over a backend of GPU tensors only (NCCL between hosts), a header at the start of
  the first call and, under ``PARDIST_DEBUG=1``, of every call and collective (a check
  on every call would stall the host).
"""

from __future__ import annotations

import contextlib
import hashlib

import torch.distributed as dist

from pardist.runtime import _process, debug_enabled
from pardist.transport import _shmgroups, header, mark_step, name_step

__all__ = ["key", "stepping"]


_keyed: dict[str, int] = {}  # source place -> steps of it keyed so far in this process


def key(where: str, fn) -> int:
    """A new step's 22-bit key, alike on every rank: from its name, its source line and
    how many steps of that line were keyed before it. Two steps of one function (made
    twice, or over two meshes) never share a key: a rank that has left a call of one
    while another waits in the same-numbered call of the other is no rank out of step.
    Keyed at a step's first call over several ranks, which every rank makes in the same
    order (a step only one rank calls, over one rank, takes no key)."""
    code = getattr(fn, "__code__", None)
    place = f"{where}:{getattr(code, 'co_filename', '')}:{getattr(code, 'co_firstlineno', 0)}"
    made = _keyed[place] = _keyed.get(place, -1) + 1
    digest = hashlib.blake2b(f"{place}#{made}".encode(), digest_size=3).digest()
    return int.from_bytes(digest, "little") >> 2


@contextlib.contextmanager
def stepping(group: dist.ProcessGroup, step_key: int, count: int, where: str):
    """Inside: call ``count`` of the step, every rank of ``group`` in it (else an error)."""
    mark = step_key << 41 | count << 1 | 1
    before = mark_step(mark)  # (raises once the ranks were found out of step)
    name_step(step_key, where)
    try:
        if not (_cpu() and _shmgroups.for_collectives(group) is not None):
            if _cpu() or count == 1 or debug_enabled():
                header(f"{where} (the start of a call)", group)
        yield
    finally:  # left: the call's mark without bit 0 (an outer step's mark, if any)
        mark_step(before, before or mark - 1)


def _cpu() -> bool:
    """Whether the ranks compute on the CPU (their collectives then go through gloo or
    shared memory; on GPUs, through the accelerator's backend)."""
    return _process.device().type == "cpu"
