"""Getting a model out: params and buffers as a full ``state_dict`` for the original module.

After training, ``model.load_state_dict(pardist.state_dict(params, buffers, model))``
gives a plain ``nn.Module`` for inference, export or ``save_pretrained``, whatever the
params were: replicated, with sharded optimizer state (ZeRO), or ``pardist.fsdp``
shards (gathered here, on every rank: a collective), at any world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pardist.sharding import _fsdp

__all__ = ["state_dict", "unwrapped"]


def state_dict(
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor] | None = None,
    module: nn.Module | None = None,
    *,
    rank0_only: bool = False,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """A full ``state_dict`` of ``params`` and ``buffers`` that loads with ``strict=True``.

    Args:
        params, buffers: what ``pardist.functional`` returned (trained). FSDP shards are
            gathered (every rank must call this) and given their original shapes.
        module: the module they came from (any copy, even on the meta device): the
            keys are then its own, in its order, with tied weights (GPT-2's
            ``lm_head.weight``) under every name the module has for them, and without
            its non-persistent buffers (BERT's ``position_ids``), as its own
            ``state_dict`` has them; a key the module has and the params lack raises.
        rank0_only: return the tensors on rank 0 and ``{}`` elsewhere (the gather still
            runs on every rank).
        prefix: put before every key, as the original script's wrapped model has them:
            ``'module.'`` for a DDP model's ``state_dict()``, ``'_orig_mod.'`` for a
            ``torch.compile``'d one's (``'_orig_mod.module.'``, DDP's of a compiled model),
            so that the DDP script's own ``model.load_state_dict`` reads the file.

    Returns:
        New tensors (never the params' own memory), detached, on the params' devices.

    Example:
        >>> import pardist, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> apply, params, buffers = pardist.functional(model)
        >>> fresh = torch.nn.Linear(2, 1)
        >>> fresh.load_state_dict(pardist.state_dict(params, buffers, fresh))
        <All keys matched successfully>
    """
    where = "pardist.state_dict"
    out: dict[str, torch.Tensor] = {}
    shapes = {}
    if module is not None:
        shapes = {k: v.shape for k, v in module.state_dict(keep_vars=True).items()}
    for group, tree in (("params", params), ("buffers", buffers or {})):
        if not isinstance(tree, dict):
            raise TypeError(
                f"{where}: {group} must be the dict pardist.functional returned "
                f"(name -> tensor), not a {type(tree).__name__}."
            )
        for name, t in tree.items():
            if isinstance(t, DTensor):  # pardist.fsdp: flat shards of the whole tensor
                full = t.full_tensor()
                shape = shapes.get(name) or _fsdp.recorded_shape(f"[{name!r}]", full.numel())
                if shape is None:
                    raise ValueError(
                        f"{where}: {group}[{name!r}] is a pardist.fsdp shard whose shape "
                        "is not known here; pass the module: pardist.state_dict(params, "
                        "buffers, module)."
                    )
                out[name] = full.view(shape)
            else:
                out[name] = t.detach().clone()
    if module is not None:
        out = _keyed_like(out, module, where)
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {prefix + k: v for k, v in out.items()} if prefix else out


# What wrapping a module puts before its keys: DDP (and DataParallel) 'module.',
# torch.compile '_orig_mod.' (either around the other, or both).
_WRAPPERS = ("module.", "_orig_mod.")


def unwrapped(state: dict) -> dict:
    """``state`` (a ``state_dict``) without the prefixes that DDP (``module.``) and
    ``torch.compile`` (``_orig_mod.``) put before every key, so that a DDP script's
    checkpoint loads into the plain module: ``model.load_state_dict(pardist.unwrapped(
    torch.load(path)['model']))``. Keys without them are left as they are.

    Example:
        >>> import pardist, torch
        >>> sorted(pardist.unwrapped({'module._orig_mod.w': torch.ones(1)}))
        ['w']
    """
    if not isinstance(state, dict):
        raise TypeError(f"pardist.unwrapped: state is a {type(state).__name__}; a state_dict.")
    out = dict(state)
    while out:
        for wrapper in _WRAPPERS:
            if all(isinstance(k, str) and k.startswith(wrapper) for k in out):
                out = {k[len(wrapper) :]: v for k, v in out.items()}
                break
        else:
            return out
    return out


def _keyed_like(out: dict, module: nn.Module, where: str) -> dict:
    """``out`` under the module's keys, in its order, tied tensors under each name."""
    theirs = module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for key, t in theirs.items():
        aliases.setdefault(id(t), []).append(key)
    keyed = {}
    for key, t in theirs.items():
        have = next((k for k in aliases[id(t)] if k in out), None)
        if have is None:
            raise KeyError(
                f"{where}: the module has {key!r} (shape {tuple(t.shape)}) but the params and "
                "buffers do not. Pass the params and buffers pardist.functional returned for "
                "this module."
            )
        keyed[key] = out[have]
    # Non-persistent buffers (BERT's position_ids) are the module's, but not in its
    # state_dict: left out, as torch's own state_dict leaves them.
    transient = {name for name, _ in module.named_buffers(remove_duplicate=False)} - set(theirs)
    extra = sorted(set(out) - set(keyed) - transient)
    if extra:
        raise KeyError(
            f"{where}: {extra[:5]} are not keys of the module's state_dict; pass the module "
            "the params came from."
        )
    return keyed
