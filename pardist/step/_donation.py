"""Donated arguments (JAX's ``donate_argnums``): what a call gives up, and passing it again.

A step may update a donated input in place (the optimizer writes the parameters and
its state into the donated tensors). A donated tensor that the step did not return
is *consumed*: its memory may hold anything now, so a later call that receives it
again raises, naming the argument path, instead of training on overwritten values.
A consumed tensor is remembered only while it lives: a weakref's callback forgets
it, since a new tensor may then be made at its address.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch

from pardist.runtime import _tree

__all__ = ["Consumed"]


class Consumed:
    """The donated tensors of earlier calls that those calls did not return, by id."""

    def __init__(self, where: str, donate_argnums: tuple[int, ...]):
        self.where, self.donate_argnums = where, donate_argnums
        self.refs: dict[int, weakref.ref] = {}

    def __len__(self) -> int:
        return len(self.refs)

    def mark(self, out: Any, leaves: list, ids: list[int], donated: set[int]) -> None:
        """After a call: the donated ``leaves`` (``ids`` theirs) not among ``out``'s
        leaves are consumed. The donated ones are picked out in C, by id."""
        gone = donated.difference(map(id, _tree.tree_leaves(out)))
        for x in itertools.compress(leaves, map(gone.__contains__, ids)) if gone else ():
            if isinstance(x, torch.Tensor):
                forget = functools.partial(_forget, self.refs, id(x))
                self.refs[id(x)] = weakref.ref(x, forget)

    def check(self, leaves: list, ids: list[int], args: tuple) -> None:
        """Before a call: raise if an input is a tensor an earlier call consumed."""

        def consumed(leaf: Any) -> bool:
            return (ref := self.refs.get(id(leaf))) is not None and ref() is leaf

        # The common case in C: no leaf's id is among the consumed ones.
        if self.refs.keys().isdisjoint(ids) or not any(map(consumed, leaves)):
            return
        for path, leaf in _tree.leaves_with_paths(args, "args"):
            if consumed(leaf):
                raise ValueError(
                    f"{self.where}: {path} was donated to an earlier call "
                    f"(donate_argnums={self.donate_argnums}) and may have been overwritten. "
                    "Pass the value that call returned instead (params, opt_state = "
                    "step(params, opt_state, batch)), or drop it from donate_argnums."
                )


def _forget(refs: dict, key: int, ref: weakref.ref) -> None:
    """A consumed tensor died: its id may now name a new tensor."""
    if refs.get(key) is ref:
        del refs[key]
