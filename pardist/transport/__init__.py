"""Moving bytes between ranks: shared memory on one host, the backend's collectives.

Shared-memory segments and futexes, collective primitives as autograd Functions,
and the bucketed gradient reducers (all-reduce and reduce-scatter, DDP's buckets).
May import ``pardist.runtime`` only.
"""
