"""Compiled steps: ``data_parallel(step, compile=True)`` as one ``torch.compile`` graph.

Graph-safe operators (shared-memory all-reduce as a custom op), collectives a graph
can hold, and the compiled step with its agreed eager fallback.
May import ``pardist.runtime`` and ``pardist.transport``. The traced collectives
(``_traced``) and graph operators (``_ops``) are imported whole, as namespaces.
"""

from pardist.compile._backend import agree
from pardist.compile._step import CompiledStep

__all__ = ["CompiledStep", "agree"]
