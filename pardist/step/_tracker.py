"""Carry each value's varying axes through every torch operation of a tracked step.

A ``torch.overrides.TorchFunctionMode`` active inside every eager step on more than
one process (one process has nothing to type). For each operation it looks up the
axes its tensor operands vary over (``pardist._vma``; an :class:`AxisIndex` in an
operation's arguments varies over its axis); the result varies over their union, as
in JAX.
Where an operand varies over fewer axes than the others and a gradient may flow
through it, it is first lifted with ``pvary`` (identity forward, ``psum``
backward over the missing axes): the psum Megatron's "copy to tensor-parallel
region" does by hand, put where JAX puts it. Operations whose operands vary
over nothing (constants, replicated parameters with replicated data) cost one
dictionary lookup per operand and are left alone.

An in-place operation cannot lift the tensor it writes: writing a varying value
into an invariant tensor that needs a gradient is an error naming the fix.
"""

from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode

from pardist.collectives import AxisIndex, _vma, needs_grad, reduce_groups
from pardist.runtime import _compat, _warnings
from pardist.transport import Pvary

__all__ = ["Tracker"]

_warned: set[str] = set()  # steps told of a gradient summed over the ranks

Tensor = torch.Tensor
_EMPTY = _vma.EMPTY

# Calls that only read metadata: never typed, never lifted.
_PASS = {
    Tensor.shape.__get__,
    Tensor.dtype.__get__,
    Tensor.device.__get__,
    Tensor.ndim.__get__,
    Tensor.requires_grad.__get__,
    Tensor.grad_fn.__get__,
    Tensor.is_leaf.__get__,
    Tensor.layout.__get__,
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.stride,
    Tensor.is_contiguous,
    Tensor.is_floating_point,
    Tensor.is_complex,
    Tensor.element_size,
    Tensor.data_ptr,
    Tensor.untyped_storage,
    Tensor.__len__,
    Tensor.__repr__,
    Tensor.__format__,
    Tensor.register_hook,
    Tensor.requires_grad_,
    Tensor.item,
    Tensor.tolist,
    Tensor.__bool__,
    Tensor.__index__,
    Tensor.__int__,
    Tensor.__float__,
}
_AUTOGRAD = {torch.autograd.grad, torch.autograd.backward, Tensor.backward}
_PLAIN, _METADATA, _INPLACE, _GRAD, _FOREACH = range(5)
_kinds: dict = {}  # func -> kind, worked out once per function


def _kind(func) -> int:
    if func in _PASS:
        return _METADATA
    if func in _AUTOGRAD:
        return _GRAD
    name = getattr(func, "__name__", "")
    if name.startswith(("_foreach_", "_fused_")):
        return _FOREACH
    if name == "__setitem__" or (name.endswith("_") and not name.endswith("__")):
        return _INPLACE
    return _PLAIN


_normals: dict = {}  # a type -> the same without lifted marks it varies over anyway


def _normal(v: frozenset) -> frozenset:
    out = _normals.get(v)
    if out is None:
        out = _normals[v] = _vma.normal(v)
    return out


_grad_sets: dict = {}  # a type -> the axes its gradient varies over


def _grads(v: frozenset) -> frozenset:
    out = _grad_sets.get(v)
    if out is None:
        out = _grad_sets[v] = _vma.grad_axes(v)
    return out


def _element(b, get) -> frozenset | None:
    """The axes an operand that is not itself a tensor varies over (None: it is a constant):
    a tensor in a list, an :class:`AxisIndex`, a slice or index tuple holding one."""
    if isinstance(b, Tensor):
        return get(b)
    if type(b) is AxisIndex:
        return b.vma or None
    if type(b) is slice:
        marks = [p.vma for p in (b.start, b.stop, b.step) if type(p) is AxisIndex and p.vma]
        return _EMPTY.union(*marks) if marks else None
    return None


class Tracker(TorchFunctionMode):
    """Types every result with the union of its operands' varying axes, lifting as needed.

    Args:
        state: the step's :class:`pardist.collectives._vma.Tracking`.
        where: the step's name, for errors.
    """

    def __init__(self, state: _vma.Tracking, where: str):
        super().__init__()
        self.state, self.where = state, where
        _compat.never_a_frame(Tracker.__torch_function__)  # inline in a graph, never a frame

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        state = self.state
        kind = _kinds.get(func)
        if kind is None:
            kind = _kinds[func] = _kind(func)
        if kind == _METADATA or state.paused:
            return func(*args, **kwargs)
        if kind == _GRAD:
            return self._autograd(func, args, kwargs)
        if kind == _FOREACH:
            return self._foreach(func, args, kwargs)
        # The hot path: most operations, a few tensors each. state.get, inlined.
        tags, get = state.tags, state.get
        union, mixed = None, False
        for a in args:
            if isinstance(a, Tensor):
                entry = tags.get(id(a))
                v = entry[1] if entry is not None and entry[0]() is a else get(a)
            elif type(a) is list or type(a) is tuple:  # cat's tensors, an index (x[:, i])
                vs = [_element(b, get) for b in a]
                vs = [w for w in vs if w is not None]
                if not vs:
                    continue
                v = _EMPTY.union(*vs)
                mixed = mixed or any(w != v for w in vs)
            elif type(a) is AxisIndex or type(a) is slice:  # w * axis_index, x[i:i + k]
                v = _element(a, get)
                if v is None:
                    continue
            else:
                continue
            if union is None:
                union = v
            elif v != union:
                union, mixed = union | v, True
        if kwargs:
            for key, a in kwargs.items():
                if (isinstance(a, Tensor) or type(a) is AxisIndex) and key != "out":
                    v = _element(a, get)
                    if v is None:
                        continue
                    if union is None:
                        union = v
                    elif v != union:
                        union, mixed = union | v, True
        if not union:
            return func(*args, **kwargs)
        inplace = kind == _INPLACE
        if mixed:
            union = _normal(union)  # a lifted mark goes where the axis varies anyway
            want = _grads(union)
            if self._short(want, args, kwargs):  # (a prelifted weight and a batch: none)
                args, kwargs = self._lift(func, inplace, union, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            state.set(out, union)
        elif type(out) is list or isinstance(out, tuple):
            for t in out:
                if isinstance(t, Tensor):
                    state.set(t, union)
        if inplace and args and isinstance(args[0], Tensor):
            state.set(args[0], union)
        if kwargs and isinstance(kwargs.get("out"), Tensor):
            state.set(kwargs["out"], union)
        return out

    def _short(self, want: frozenset, args, kwargs) -> bool:
        """Whether an operand's gradient varies over fewer axes than ``want`` (asked where
        the operands' types differ: most often a prelifted parameter and the batch, whose
        gradients vary alike, so that nothing is to be lifted)."""
        get = self.state.get
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor):
                if _grads(get(a)) != want:
                    return True
            elif type(a) is list or type(a) is tuple:
                if any(isinstance(b, Tensor) and _grads(get(b)) != want for b in a):
                    return True
        return False

    def _lift(self, func, inplace: bool, union: frozenset, args, kwargs):
        """Operands that vary over fewer axes than ``union``, lifted (the written one excepted)."""
        state = self.state
        want = _vma.grad_axes(union)

        def lift(t: Tensor) -> Tensor:
            missing = want - _vma.grad_axes(state.get(t))
            if not missing or not needs_grad(t):
                return t
            state.outside_grads = state.outside_grads or not state.grads
            return state.lifted(
                t, missing, lambda t: Pvary.apply(t, state.groups(missing), reduce_groups)
            )

        if inplace and args and isinstance(args[0], Tensor):
            written = args[0]
            missing = want - _vma.grad_axes(state.get(written))
            if missing and needs_grad(written):
                name = getattr(func, "__name__", func)
                raise ValueError(
                    f"{self.where}: the in-place {name} writes a value that varies over "
                    f"{state.ordered(missing)} into a tensor of shape {tuple(written.shape)} that "
                    "does not, and a gradient flows through it: that gradient would miss its "
                    f"psum over {state.ordered(missing)}. Write it out of place "
                    "(x = x + y instead of x += y)."
                )

        def lift_arg(a):
            if isinstance(a, Tensor):
                return lift(a)
            if type(a) is list or type(a) is tuple:
                return type(a)(lift(b) if isinstance(b, Tensor) else b for b in a)
            return a

        with _vma.paused():
            first = 1 if inplace else 0  # the tensor an in-place operation writes stays itself
            new_args = args[:first] + tuple(lift_arg(a) for a in args[first:])
            new_kwargs = {k: a if k == "out" else lift_arg(a) for k, a in kwargs.items()}
        return new_args, new_kwargs

    def _autograd(self, func, args, kwargs):
        """Gradients vary over what their inputs vary over (a cotangent has its primal's type)."""
        state = self.state
        if not state.grads:  # (the step needs its types for the numbers: every call)
            state.outside_grads = True
            if state.data and self.where not in _warned:
                self._sum_over_ranks(func, args, kwargs)
        with _vma.paused():
            out = func(*args, **kwargs)
        if func is torch.autograd.grad and out is not None:
            inputs = kwargs.get("inputs", args[1] if len(args) > 1 else ())
            inputs = (inputs,) if isinstance(inputs, Tensor) else inputs
            for g, x in zip(out, inputs):
                if g is not None:
                    state.set(g, state.get(x))
        return out

    def _sum_over_ranks(self, func, args, kwargs) -> None:
        """A gradient outside pardist.grad, of a value varying over the data axes with
        respect to one that does not: JAX's rule makes it the sum over the ranks, which a
        user of DDP (or of pardist.grad) would take for the mean. Said once per step."""
        state = self.state
        outputs = kwargs.get("outputs", args[0] if args else ())
        outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        over = state.data & _EMPTY.union(
            *(_vma.grad_axes(state.get(o)) for o in outputs if isinstance(o, Tensor))
        )
        if not over:
            return
        if func is torch.autograd.grad:
            inputs = kwargs.get("inputs", args[1] if len(args) > 1 else ())
            inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
            if all(over <= _vma.grad_axes(state.get(x)) for x in inputs):
                return  # with respect to the batch itself: its own rows' gradient
        _warned.add(self.where)
        axes = state.ordered(over)
        size = math.prod(state.mesh.shape[a] for a in axes)
        _warnings.warn(
            f"{self.where}: a gradient taken outside pardist.grad (torch.func.grad, "
            f"torch.autograd.grad or .backward()) of a value that varies over {axes} with "
            f"respect to one that does not is the sum over the {size} ranks of their "
            "gradients (JAX's rule inside shard_map), not their mean. For the gradient of "
            "the loss averaged over the ranks (one process's on the global batch, DDP's) "
            "use pardist.grad or pardist.value_and_grad; for JAX's sum, pass "
            "warnings.simplefilter('ignore', pardist.GradientSumWarning).",
            _warnings.GradientSumWarning,
        )

    def _foreach(self, func, args, kwargs):
        """``torch._foreach_*`` / fused optimizers: element i's type is the union at index i."""
        state = self.state
        lists = [a for a in args if type(a) is list or type(a) is tuple]
        single = _EMPTY.union(*(state.get(a) for a in args if isinstance(a, Tensor)))
        tags = state.tags
        if not single and not any(id(t) in tags for a in lists for t in a):
            return func(*args, **kwargs)  # nothing typed (replicated state): one lookup each
        count = max((len(a) for a in lists), default=0)
        unions = [
            _vma.normal(
                single.union(
                    *(state.get(a[i]) for a in lists if i < len(a) and isinstance(a[i], Tensor))
                )
            )
            for i in range(count)
        ]
        out = func(*args, **kwargs)
        if not any(unions):
            return out
        if type(out) is list or type(out) is tuple:
            for t, v in zip(out, unions):
                if isinstance(t, Tensor):
                    state.set(t, v)
        if func.__name__.endswith("_"):  # in place: the lists written (moments too) are typed
            for a in lists:
                for t, v in zip(a, unions):
                    if isinstance(t, Tensor) and v:
                        state.set(t, v)
        return out
