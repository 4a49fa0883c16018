"""Frozen parameters (``requires_grad=False``) travel with the buffers, not the params.

A frozen body with a trainable head (fastai's ``fine_tune``) trains in plain
torch with no gradient and no update for the body. ``pardist.grad``
differentiates every leaf of the params it is given, and the optimizers update
(and decay) every leaf, so frozen parameters are kept out of the params:
``functional`` hands them back in ``buffers``, under their parameter names.
``model.load_state_dict({**params, **buffers})`` still matches the module's
state dict exactly, and pardist.fsdp / optim.sharded never see them.
"""

from __future__ import annotations

from torch import nn

__all__ = ["split"]


def split(module: nn.Module, params: dict, buffers: dict) -> set[str]:
    """Move the frozen entries of ``params`` into ``buffers`` (in place); their names.

    They go in the module's order (``named_parameters``), never a set's: a set's order
    follows the process's hash seed, which torchrun gives every rank its own, and the
    ranks would disagree on the layout of ``buffers``.
    """
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    for name in frozen:
        if name in buffers:  # cannot happen in torch (names are unique); guard anyway
            raise ValueError(f"pardist.functional: {name!r} is both a parameter and a buffer.")
        buffers[name] = params.pop(name)
    return set(frozen)
