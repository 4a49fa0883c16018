"""One call of a gradient function: what is differentiated, what is the batch, which
micro-batches run, and how their gradients and losses come back together.

Every way a step computes gradients (``_bucketed`` eagerly, ``_nested`` inside another
transform, ``_deterministic``, ``_traced_grad`` in a compiled step) runs the micro-batches
a :class:`Call` yields and hands it what each returned.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from pardist.gradients import _microbatch
from pardist.runtime import _tree, functorch, laid_out_like

__all__ = ["Call", "split_value"]


class Call:
    """One call of a gradient function: what is differentiated, what is the batch.

    ``flat``: every argument's ``(leaves, treedef)``; ``masks``: which leaves are the
    batch; ``split``, ``replicated``: per differentiated leaf; ``rows``: this rank's
    batch rows (-1 if unknown).
    """

    split: list
    replicated: list
    carry_option: Any
    rows: int = -1
    need_value: bool = False
    listed: Any = None  # accumulate='list': the micro-batches' arguments and weights
    counts: Any = None  # mean='tokens' in a traced step: f's aux ends with its count, put here

    def __init__(self, f, nums, has_aux, accumulate, mean, args, kwargs, where, flat, masks, carry):
        self.f, self.nums, self.has_aux, self.args, self.kwargs = f, nums, has_aux, args, kwargs
        self.accumulate, self.mean, self.where = accumulate, mean, where
        self.flat, self.masks, self.carry = flat, masks, carry
        self._aux: Any = None

    def micro_batches(self):
        """``(j, args, leaves of each argument)`` per micro-batch; a carried aux (see
        :meth:`took`) goes into the next."""
        if self.listed is not None:  # each list argument's j-th entry, as it is
            for j in range(self.accumulate):
                margs = self.listed.args(self.args, j)
                if self.carry is not None and j > 0:
                    margs = (*margs[: self.carry], self._aux, *margs[self.carry + 1 :])
                yield j, margs, [leaves for leaves, _ in self.flat]
            return
        if self.accumulate == 1:
            yield 0, self.args, [leaves for leaves, _ in self.flat]
            return
        for j, leaves in enumerate(
            _microbatch.split(self.flat, self.masks, self.accumulate, self.where)
        ):
            margs = [
                _tree.tree_unflatten(part, treedef) for part, (_, treedef) in zip(leaves, self.flat)
            ]
            if self.carry is not None and j > 0:
                margs[self.carry] = self._aux
            yield j, tuple(margs), leaves

    def took(self, j: int, aux: Any) -> None:
        """Micro-batch ``j`` returned ``aux``."""
        if j == 0 and self.has_aux:
            _microbatch.after_micro_batch(
                aux, self.carry_option, self.args, self.nums, self.masks, self.accumulate,
                self.where,
            )  # fmt: skip
        self._aux = aux

    def rank_value(self, values: list[torch.Tensor]) -> torch.Tensor:
        """This rank's loss from its micro-batches' (their mean, or the list's weighing)."""
        if self.listed is not None:
            return self.listed.value(values)
        return values[0] if len(values) == 1 else torch.stack(values).mean()

    def seed(self, j: int, value: torch.Tensor, seed: torch.Tensor | None):
        """Micro-batch ``j``'s backward seed, weighed as the list of micro-batches says."""
        if self.listed is None or self.listed.seeds[j] == 1.0:
            return seed
        return (torch.ones_like(value) if seed is None else seed) * self.listed.seeds[j]

    def aux(self, auxes: list) -> Any:
        return auxes[-1] if self.carry is not None else _microbatch.stack(auxes)

    def combine(self, local: list, parts: list, leaves: list, reduced: list | None = None) -> list:
        """Gradients that were not reduced: summed over micro-batches, or joined if split
        (None where ``reduced`` says the reducer gives them)."""
        k = self.accumulate
        if reduced is not None and all(reduced):
            return [None] * len(leaves)
        # The parameter's strides, as .grad has them (a dense layout: nothing to do)
        dense = k == 1 and all(map(_contiguous, leaves))
        if dense and reduced is None and all(map(_given, local)):
            if all(map(_contiguous, local)):  # one pass, every gradient there: as it is
                return list(local)
        dense = dense and all(g is None or g.is_contiguous() for g in local)
        out = []
        for i, t in enumerate(leaves):
            if reduced is not None and reduced[i]:
                out.append(None)
            elif self.split[i] and k > 1:
                out.append(_microbatch.concat(parts[i], t))
            elif local[i] is None:
                out.append(torch.zeros_like(t))
            else:
                g = local[i] / k if k > 1 else local[i]
                # The parameter's strides, as .grad has them; inside an enclosing
                # transform the tensors are wrapped, and its own call lays them out.
                outer = dense or functorch.peek_interpreter_stack() is not None
                out.append(g if outer else laid_out_like(g, t))
        return out

    def with_inputs(self, margs: tuple, inputs: list) -> list:
        """The arguments of one micro-batch, with ``inputs`` as the differentiated leaves."""
        call, start = list(margs), 0
        for n in self.nums:
            part, treedef = self.flat[n]
            call[n] = _tree.tree_unflatten(inputs[start : start + len(part)], treedef)
            start += len(part)
        return call


_contiguous = torch.Tensor.is_contiguous
_given = functools.partial(operator.is_not, None)


def split_value(out: Any, has_aux: bool, where: str) -> tuple[torch.Tensor, Any]:
    """``f``'s output as (value, aux), with pardist's error for a non-scalar value."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"{where}: with has_aux=True, f must return (value, aux).")
        value, aux = out
    else:
        value, aux = out, None
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()):
        what = (
            f"shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(
            f"{where}: f must return a floating-point scalar tensor to differentiate, got "
            f"{what}. Reduce it first (e.g. loss.mean())."
        )
    return value, aux
