"""Models as pure functions: ``pardist.functional(module)`` and cross-replica batch norm.

May import ``pardist.runtime``, ``pardist.collectives`` and ``pardist.sharding``.
"""
