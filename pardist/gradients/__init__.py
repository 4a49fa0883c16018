"""``pardist.grad`` and ``value_and_grad``: torch.func's, plus the gradient mean over the step.

Buckets filled during the backward, micro-batches, every rank's loss and rows, and
the traced form inside compiled steps. May import every package above
``pardist.sharding`` (runtime, transport, compile, collectives, sharding).
"""

from pardist.gradients._grad import grad, value_and_grad

__all__ = ["grad", "value_and_grad"]
