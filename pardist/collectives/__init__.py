"""Collectives over named mesh axes, with JAX's transposes: psum, all_gather, all_to_all...

Each is differentiable under autograd and torch.func; ``_vma`` tracks which axes a
value varies over. May import ``pardist.runtime``, ``pardist.transport`` and
``pardist.compile``'s traced collectives.
"""
