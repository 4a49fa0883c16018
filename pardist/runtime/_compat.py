"""The one place pardist reaches into torch's private names.

Every private torch name (``torch._...``, ``torch.distributed._...``, ``torch._C``,
private attributes of public classes) that pardist uses is imported or wrapped here,
with why it is needed and since which torch version it behaves as pardist uses it.
Nothing else in pardist names a private torch API (``tests/test_compat.py`` checks),
so a torch release that changes one breaks this module, not pardist's logic.
"""

from __future__ import annotations

import torch

__all__ = ["storage_holders"]

# torch._C._storage_Use_Count(storage._cdata): how many references hold a tensor's
# storage. pardist reuses a buffer it handed out only when no caller still holds a
# view of it. The raw number differs by version: asking makes a temporary storage
# object that counts itself on torch >= 2.10 (a lone tensor reads 2), not on <= 2.9
# (reads 1). So the count of a lone fresh tensor is measured once, here, and
# subtracted, instead of assuming a constant.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _raw_use_count(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


_LONE = _raw_use_count(torch.empty(1)) if _use_count is not None else 1


def storage_holders(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage: 1 for a lone tensor on every torch version.

    Without torch's counter, a number so large that no buffer is ever taken for free.
    """
    if _use_count is None:
        return 1 << 30
    return _raw_use_count(t) - _LONE + 1
