"""The step: ``shard_map`` and ``data_parallel``, partition specs, varying-axes tracking.

Runs a pure function on every rank's blocks and checks what crosses its edge
(specs, replicated values, duplicate batches). May import every package below it:
runtime, transport, compile, collectives, sharding, gradients, nn, optim, data.
"""
