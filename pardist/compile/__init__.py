"""Compiled steps: ``data_parallel(step, compile=True)`` as one ``torch.compile`` graph.

Graph-safe operators (shared-memory all-reduce as a custom op), collectives a graph
can hold, and the compiled step with its agreed eager fallback.
May import ``pardist.runtime`` and ``pardist.transport``.
"""
