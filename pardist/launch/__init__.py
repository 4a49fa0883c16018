"""Launching: ``python -m pardist.launch`` (fastai.launch over torchrun) and ``pardist.spawn``.

The command line, port checks, the one-line report of a failed job, and the
notebook launcher's worker groups. May import ``pardist.runtime`` and
``pardist.transport``.
"""

from pardist.launch._cli import DEFAULT_JOIN_TIMEOUT_S, main, prepare
from pardist.launch._spawn import SpawnError, spawn

__all__ = ["DEFAULT_JOIN_TIMEOUT_S", "SpawnError", "main", "prepare", "spawn"]
