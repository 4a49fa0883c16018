"""``functional(module)``: an ordinary nn.Module as a pure function of its tensors.

Nothing is wrapped: pardist keeps a private skeleton of the module (its
parameters on the meta device, so no memory is duplicated) and runs it with
``torch.func.functional_call`` on the tensors you pass. Batch norm writes its
running statistics in place; ``apply`` gives it fresh copies of the buffers and
hands those back, so the caller's tensors are never mutated.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from operator import setitem
from typing import Any

import torch
from torch import nn

from pardist.collectives import _collectives
from pardist.nn import _batchnorm, _frozen, _remat
from pardist.runtime import (
    Compiled,
    Deterministic,
    Eager,
    _lockstep,
    _placement,
    _tree,
    clone_all,
    collective_starts,
    current_step,
    tracing,
)
from pardist.sharding import _apply, _units

__all__ = ["functional"]


def _meta_skeleton(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose tensors live on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


class _Slots:
    """Where each parameter and buffer of the skeleton lives, tied aliases included.

    ``torch.func.functional_call`` does the same swap, with bookkeeping that costs
    about a millisecond per call on a small model; the skeleton is pardist's own,
    so the tensors are put straight into its slots (as torch's ``swap_tensor``
    does) and the meta tensors put back afterwards.
    """

    def __init__(self, skeleton: nn.Module):
        self.skeleton = skeleton
        self.kinds: dict[str, set[str]] = {
            "_parameters": {n for n, _ in skeleton.named_parameters()},
            "_buffers": {n for n, _ in skeleton.named_buffers()},
        }
        self.frozen_names: frozenset[str] = frozenset()
        self.places: list[tuple[dict, str, str, str, torch.Tensor]] = []
        for kind, named in (
            ("_parameters", skeleton.named_parameters(remove_duplicate=False)),
            ("_buffers", skeleton.named_buffers(remove_duplicate=False)),
        ):
            first: dict[int, str] = {}
            for name, t in named:
                owner, _, attr = name.rpartition(".")
                table = getattr(skeleton.get_submodule(owner), kind)
                self.places.append((table, attr, kind, first.setdefault(id(t), name), t))
        self._columns()

    def _columns(self) -> None:
        """The places as columns, per kind, for installing with C loops (``map``)."""
        self.columns = {
            kind: [[place[i] for place in self.places if place[2] == kind] for i in (0, 1, 3, 4)]
            for kind in ("_parameters", "_buffers")
        }

    def frozen(self, names: set[str]) -> None:
        """Frozen parameters (``requires_grad=False``) are passed with the buffers."""
        self.frozen_names = frozenset(names)
        self.kinds["_parameters"] -= names
        self.kinds["_buffers"] |= names
        self.places = [
            (table, attr, "_buffers" if name in names else kind, name, meta)
            for table, attr, kind, name, meta in self.places
        ]
        self._columns()

    def installed(self) -> list:
        """What the slots hold now, for :meth:`install`."""
        return [table[attr] for table, attr, *_ in self.places]

    def install(self, tensors: list) -> None:
        for (table, attr, *_), t in zip(self.places, tensors):
            table[attr] = t

    def put(self, params: dict, buffers: dict) -> None:
        """The given tensors into their slots (tied names share one)."""
        (p_tables, p_attrs, p_names, _) = self.columns["_parameters"]
        (b_tables, b_attrs, b_names, _) = self.columns["_buffers"]
        _put(p_tables, p_attrs, map(params.__getitem__, p_names))
        _put(b_tables, b_attrs, map(buffers.__getitem__, b_names))

    def call(self, params: dict, buffers: dict, inputs: tuple, kwargs: dict, enter) -> Any:
        """The skeleton run on ``params`` and ``buffers`` (updated with replaced buffers).

        ``enter()`` gives the contexts the forward runs in, which a recomputation of a
        checkpointed block (``_remat``) enters again.
        """
        for kind, given in (("_parameters", params), ("_buffers", buffers)):
            if given.keys() != self.kinds[kind]:
                missing = sorted(self.kinds[kind] - given.keys())
                extra = sorted(given.keys() - self.kinds[kind])
                raise KeyError(
                    f"pardist.functional: apply got {kind[1:]} that do not match the module's"
                    + (f"; missing {missing}" if missing else "")
                    + (f"; unexpected {extra}" if extra else "")
                    + ". Pass the dicts that pardist.functional returned (or updates of them)."
                )
        (p_tables, p_attrs, _, p_metas) = self.columns["_parameters"]
        (b_tables, b_attrs, b_names, b_metas) = self.columns["_buffers"]
        calls = _remat.calls()
        try:
            self.put(params, buffers)
            calls.append((self, params, buffers, enter))
            try:
                # The deterministic mode's row groups share the skeleton: each keeps its own.
                with _lockstep.switching(self.installed, self.install):
                    out = self.skeleton(*inputs, **kwargs)
            finally:
                calls.pop()
            # A module may have replaced a buffer: keep its new one.
            buffers.update(zip(b_names, [table[attr] for table, attr in zip(b_tables, b_attrs)]))
        finally:
            _put(p_tables, p_attrs, p_metas)
            _put(b_tables, b_attrs, b_metas)
        return out


def _put(tables: list, attrs: list, values) -> None:
    """``tables[i][attrs[i]] = values[i]`` for each i: by ``map`` over ``setitem`` (in C),
    or the loop dynamo traces inside a compiled step."""
    if tracing():
        for table, attr, value in zip(tables, attrs, values):
            table[attr] = value
    else:
        _tree.each(map(setitem, tables, attrs, values))


def functional(
    module: nn.Module,
    *,
    sync_bn: bool = True,
    fsdp_units: Any = "auto",
    device: Any = "auto",
    remat: Any = None,
) -> tuple[Callable, dict, dict]:
    """Split ``module`` into a pure ``apply`` function and dicts of its tensors.

    Args:
        module: any ``nn.Module``; it is not changed, and later changes to it do
            not affect ``apply``.
        sync_bn: inside a data-parallel step, batch norm uses statistics over the
            whole global batch (fastai's default ``sync_bn=True``), so N ranks
            train exactly as one process on the concatenated batch. With
            ``sync_bn=False`` each rank normalises with its own shard's
            statistics (as DDP does without SyncBatchNorm); the running
            statistics that ``apply`` returns are averaged over the axis by the
            end of the step (in the gradient all-reduce, when ``pardist.grad``
            runs), so that every replica keeps the same buffers.
        fsdp_units: with :func:`pardist.fsdp` params, the modules whose parameters
            are gathered together, just before the module runs: ``'auto'`` (about
            eight units: transformer blocks, ResNet stages, MLP layers), module
            paths (``['h.0', 'h.1']``), module classes (``{Block}``), a function
            ``(path, module) -> bool``, or None (all gathered for the whole apply).
            Parameters outside every unit, and tied ones, stay gathered for the
            whole forward.
        device: where the returned params and buffers live: ``'auto'`` puts those
            on the CPU on :func:`pardist.device` (the local GPU, else the CPU, so
            the same script runs on both); a device moves all of them there;
            None leaves them on the module's device.
        remat: activation checkpointing of the model's blocks (JAX's remat): None (the
            module as it is; checkpoints the module makes itself, torch's or Hugging
            Face's, work either way); a policy name, ``'nothing_saveable'`` (recompute
            everything in the backward) or ``'dots_saveable'`` (keep the outputs of
            matrix products), for every block; or :class:`pardist.Remat` to choose the
            blocks (``every=2``: every other one). Blocks are found as ``'auto'``: the
            longest list of alike modules (transformer layers).

    Modes: ``apply(..., train=True)`` runs every submodule in the mode the module had
    when it was given here, so a backbone put in ``eval()`` (its batch norm using and
    keeping its running statistics) stays so while the rest trains; a module given
    wholly in eval mode (``from_pretrained`` returns it so) trains every submodule.
    ``train=False`` runs every submodule in eval mode.

    Returns:
        ``(apply, params, buffers)``: detached copies of the parameters and
        buffers, keyed by their ``named_parameters`` / ``named_buffers`` names
        (frozen parameters, ``requires_grad=False``, are in ``buffers``: they get
        no gradient and no update, as in plain torch),
        and ``apply(params, buffers, *inputs, train=True, **kwargs) ->
        (outputs, new_buffers)``, which mutates none of its arguments.

    Example:
        >>> import pardist, torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        >>> apply, params, buffers = pardist.functional(net)
        >>> out, new_buffers = apply(params, buffers, torch.randn(4, 3))
        >>> out.shape, bool((buffers['1.running_mean'] == 0).all())
        (torch.Size([4, 2]), True)
    """
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    frozen = _frozen.split(module, params, buffers)  # requires_grad=False: with the buffers
    target, only_cpu = _placement.resolve(device, f"pardist.functional({type(module).__name__})")
    params, buffers = _placement.move((params, buffers), target, only_cpu)
    skeleton = _meta_skeleton(module)
    where = f"pardist.functional({type(module).__name__})"
    _batchnorm.prepare(skeleton, where)
    rematted = _remat.remat_blocks(
        skeleton,
        remat,
        lambda sk, names, at: _units.named_modules(sk, names, at, "remat blocks"),
        where,
    )
    slots = _Slots(skeleton)
    slots.frozen(frozen)
    # The modules apply(train=True) trains: those the user left in training mode; all of
    # them where the whole model was given in eval mode (from_pretrained returns it so).
    trained = [m for m in skeleton.modules() if m.training or not skeleton.training]
    mode = {"train": skeleton.training}
    seen_norms: dict = {}  # whether the model calls batch norm at all (see synchronised)
    units = _units.check_policy(fsdp_units)
    shapes = {name: p.shape for name, p in skeleton.named_parameters()}  # (full, as declared)
    fsdp = _apply.Runner(skeleton, slots, units, f"{where}.apply")

    def apply(params: dict, buffers: dict, *inputs: Any, train: bool = True, **kwargs: Any):
        if mode["train"] != train:
            for m in trained:  # the user's modes: a submodule in eval stays in eval
                m.training = train
            mode["train"] = train
        # Fresh copies for the forward to update in place (batch norm's running statistics).
        names = [name for name in buffers if name not in frozen] if frozen else list(buffers)
        new_buffers = dict(buffers)
        new_buffers.update(zip(names, clone_all(list(map(buffers.__getitem__, names)))))

        # Batch statistics over the step's axis, for every batch norm (see _batchnorm);
        # a checkpointed block's recomputation enters them again (see _remat).
        def enter():
            return _batchnorm.synchronised(
                skeleton if sync_bn else None, train and sync_bn, where, seen_norms
            )

        if rematted and kwargs.get("use_cache"):
            raise ValueError(
                f"{where}.apply: use_cache=True with remat=: the recomputation of a "
                "checkpointed block would write the key-value cache a second time. Pass "
                "use_cache=False (training needs no cache)."
            )
        ctx = current_step()
        if ctx is not None and ctx.call.whole_shards:  # (the deterministic mode's)
            params = {k: v.view(shapes[k]) if k in shapes else v for k, v in params.items()}
        with enter():
            if _apply.has_shards(params):  # pardist.fsdp: each unit gathered as it runs
                out = fsdp.call(params, new_buffers, inputs, kwargs, enter)
            else:
                out = slots.call(params, new_buffers, inputs, kwargs, enter)
        if train and not sync_bn and ctx is not None and (ctx.size > 1 or ctx.mode.groups):
            stats = {
                k: v for k, v in new_buffers.items() if v.is_floating_point() and k not in frozen
            }
            ctx.mode.run("batch_stats", ctx, stats, new_buffers, skeleton, where)
        return out, new_buffers

    apply.__doc__ = f"Pure forward of {type(module).__name__}: (outputs, new_buffers)."
    return apply, params, buffers


# sync_bn=False: each rank's batch statistics, left to average over the step's axis.
@Eager.register("batch_stats")
def _pending(mode, ctx, stats: dict, new_buffers: dict, skeleton, where: str) -> None:
    # Averaged by the end of the step, in place: with the gradients if pardist.grad
    # runs, else on their own (see data_parallel). Ranks that ran different numbers of
    # micro-batches counted different batches: their buffers cannot agree.
    collective_starts("batch norm's running statistics, which the ranks average")
    ctx.call.pending_means.extend(stats.values())


@Compiled.register("batch_stats")
def _averaged(mode, ctx, stats: dict, new_buffers: dict, skeleton, where: str) -> None:
    # A compiled step: averaged here, in its graph.
    new_buffers.update(_collectives.pmean(_tree.tree_map(torch.detach, stats), ctx.axis))


@Deterministic.register("batch_stats")
def _refused(mode, ctx, stats: dict, new_buffers: dict, skeleton, where: str) -> None:
    if _batchnorm._has_norm_modules(skeleton):
        raise ValueError(
            f"{where}: sync_bn=False normalises each rank's rows on their own, which "
            "the deterministic mode cannot make the same at every world size. Use "
            "pardist.functional(model) (sync_bn=True): statistics over the global "
            "batch, added over the row groups in order."
        )
