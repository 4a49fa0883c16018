"""Named meshes of processes over torch.distributed's DeviceMesh.

An *axis* is a named dimension of the mesh (``'node'``, ``'gpu'``); the names are
labels only, so ``'gpu'`` works on CPU too. Collectives and data-parallel steps
name axes; the mesh turns a name into process groups.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import weakref
from collections.abc import Iterator, Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pardist.runtime import _faults, _process

__all__ = ["Mesh", "current_mesh", "default_mesh", "distributed", "forget_default_mesh", "init"]

AxisName = str | tuple[str, ...]

_default: Mesh | None = None
_stack: list[Mesh] = []
_live: weakref.WeakSet = weakref.WeakSet()  # every Mesh, to let go of at shutdown


class Mesh:
    """A named mesh of processes: ``Mesh({'node': 2, 'gpu': 4})``.

    Axis sizes must multiply to the world size; one axis may be ``-1``, meaning
    "the rest". Ranks are laid out row-major, so the last axis varies fastest:
    with torchrun's numbering, ``{'node': n, 'gpu': k}`` puts the ``k`` ranks of
    one machine on the ``'gpu'`` axis. ``with mesh:`` makes it the mesh that
    collectives use by default.

    Args:
        axes: axis name to size, in order; default ``{'gpu': world_size}``.
        device_type: the DeviceMesh device type; default that of ``pardist.device()``.

    Example:
        >>> import pardist
        >>> _ = pardist.init()
        >>> mesh = pardist.Mesh({'node': 1, 'gpu': -1})
        >>> mesh.shape, mesh.size('gpu'), mesh.index(('node', 'gpu'))
        ({'node': 1, 'gpu': 1}, 1, 0)
        >>> pardist.shutdown()
    """

    def __init__(self, axes: Mapping[str, int] | None = None, *, device_type: str | None = None):
        _process.require_init("Mesh")
        world = dist.get_world_size()
        axes = dict(axes if axes is not None else {"gpu": world})
        _check_names(axes)
        unknown = [name for name, size in axes.items() if size == -1]
        if len(unknown) > 1:
            raise ValueError(f"pardist.Mesh: only one axis may be -1, got {axes}.")
        known = math.prod(size for size in axes.values() if size != -1)
        if unknown:
            if known <= 0 or world % known:
                raise ValueError(
                    f"pardist.Mesh: the sizes {axes} cannot fill the world size {world}: "
                    f"{world} is not a multiple of {known}."
                )
            axes[unknown[0]] = world // known
        if math.prod(axes.values()) != world or any(s < 1 for s in axes.values()):
            raise ValueError(
                f"pardist.Mesh: axis sizes {axes} multiply to {math.prod(axes.values())}, "
                f"but the world size is {world}. Give sizes whose product is {world}, or "
                "use -1 for one axis to mean 'the rest' (e.g. {'node': 2, 'gpu': -1})."
            )
        self.shape: dict[str, int] = axes
        self.device_type = device_type or _process.device().type
        self._device_mesh = init_device_mesh(
            self.device_type, tuple(axes.values()), mesh_dim_names=tuple(axes)
        )
        self._flat: dict[tuple[str, ...], _process.GroupRef] = {}
        self._whole = True  # spans every rank (else a part(): see group)
        for name, size in axes.items():  # so that a failed collective can name its axis
            if size > 1:
                _faults.label_group(self._device_mesh.get_group(name), repr(name))
        _live.add(self)

    def part(self, axis: AxisName) -> Mesh:
        """This rank's part of the mesh along ``axis``: a mesh of those axes only.

        For a step that runs within one slice of the mesh while something else spans the
        other axes: on ``Mesh({'node': 2, 'gpu': 4})``, ``mesh.part('gpu')`` is this node's
        4 ranks, where a :func:`pardist.data_parallel` step is data parallel within the
        node (and ``pardist.diloco(..., axis='node')`` meets across nodes).

        Example:
            >>> import pardist
            >>> _ = pardist.init()
            >>> pardist.Mesh({'node': 1, 'gpu': -1}).part('gpu').shape
            {'gpu': 1}
            >>> pardist.shutdown()
        """
        names = self.axes(axis, "Mesh.part")
        part = object.__new__(Mesh)
        part.shape = {name: self.shape[name] for name in self.shape if name in names}
        part.device_type = self.device_type
        part._device_mesh = self.device_mesh[tuple(part.shape)]
        part._flat = {}
        part._whole = math.prod(part.shape.values()) == dist.get_world_size()
        _live.add(part)
        return part

    @property
    def device_mesh(self):
        """torch's DeviceMesh behind this mesh (valid until ``pardist.shutdown``)."""
        if self._device_mesh is None:
            raise RuntimeError(
                f"pardist.Mesh: {self!r} belonged to a process group that was shut down. "
                "Build the mesh again after pardist.init()."
            )
        return self._device_mesh

    def _release(self) -> None:
        # A DeviceMesh keeps its process groups alive; at shutdown it must let go,
        # or the groups' threads outlive destroy_process_group (see GroupRef).
        self._device_mesh = None
        self._flat.clear()

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.shape)

    def axes(self, axis: AxisName, where: str = "Mesh") -> tuple[str, ...]:
        """``axis`` as a tuple of names, each checked to be in this mesh."""
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        for name in names:
            if name not in self.shape:
                have = ", ".join(f"'{n}' of size {s}" for n, s in self.shape.items())
                raise ValueError(
                    f"pardist.{where}: axis {name!r} is not in the mesh (axes: {have}). "
                    f"Name one of those axes, or build a mesh that has it, e.g. "
                    f"pardist.Mesh({{{name!r}: -1}})."
                )
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"pardist.{where}: axis {axis!r} must name distinct axes.")
        return names

    def size(self, axis: AxisName, where: str = "axis_size") -> int:
        """Number of processes along ``axis`` (the product, for a tuple of axes)."""
        return math.prod(self.shape[name] for name in self.axes(axis, where))

    def index(self, axis: AxisName, where: str = "axis_index") -> int:
        """This process's coordinate along ``axis`` (row-major for a tuple)."""
        index = 0
        for name in self.axes(axis, where):
            coordinate = self.device_mesh.get_local_rank(name)
            index = index * self.shape[name] + coordinate
        return index

    def groups(self, axis: AxisName, where: str = "Mesh") -> list[dist.ProcessGroup]:
        """Process groups to reduce over ``axis`` hierarchically, innermost axis first.

        Axes of size 1 are left out, so an empty list means "nothing to reduce".
        """
        names = self.axes(axis, where)
        return [self.device_mesh.get_group(n) for n in reversed(names) if self.shape[n] > 1]

    def group(self, axis: AxisName, where: str = "Mesh") -> dist.ProcessGroup:
        """One process group spanning ``axis`` (a flattened group for a tuple of axes)."""
        names = self.axes(axis, where)
        if len(names) == 1:
            return self.device_mesh.get_group(names[0])
        if names not in self._flat:
            # The order of names is the order of ranks in the flattened group.
            ordered = tuple(n for n in self.shape if n in names)
            if ordered != names:
                raise ValueError(
                    f"pardist: axes {names} must be given in mesh order {ordered} "
                    "where a single group spanning them is needed."
                )
            if names == self.axis_names and self._whole:
                group = dist.group.WORLD
            else:
                group = self.device_mesh[names]._flatten().get_group()
            _faults.label_group(group, repr(names))
            self._flat[names] = _process.GroupRef(group)
        return self._flat[names].get()

    def submesh(self, axis: AxisName, where: str = "Mesh"):
        """The 1-D DeviceMesh over ``axis`` (flattened, for a tuple), e.g. for DTensors."""
        names = self.axes(axis, where)
        if len(names) == 1:
            return self.device_mesh[names[0]]
        self.group(names, where)  # makes (and checks the order of) the flattened mesh
        return self.device_mesh[names]._flatten()

    def __enter__(self) -> Mesh:
        _stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack.remove(self)

    def __repr__(self) -> str:
        return f"Mesh({self.shape})"


def _check_names(axes: dict) -> None:
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"pardist.Mesh: axis names must be strings, got {name!r}.")
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(
                f"pardist.Mesh: axis {name!r} has size {size!r}; sizes are positive "
                "integers, or -1 for 'the rest'."
            )


def default_mesh() -> Mesh:
    """The mesh ``init`` returns: one axis ``'gpu'`` over every rank."""
    global _default
    if _default is None:
        _default = Mesh({"gpu": dist.get_world_size()})
    return _default


def forget_default_mesh() -> None:
    """At shutdown: forget the default mesh and release every mesh's process groups."""
    global _default
    _default = None
    _stack.clear()
    for mesh in list(_live):
        mesh._release()


def current_mesh(where: str) -> Mesh:
    """The innermost ``with mesh:`` (a data-parallel step enters its own), else the default."""
    _process.require_init(where)
    return _stack[-1] if _stack else default_mesh()


def init(backend: str | None = None, *, timeout: float | datetime.timedelta | None = None) -> Mesh:
    """Start the process group from the torchrun environment and return the default mesh.

    Picks nccl (with gloo beside it for CPU tensors) where an accelerator is
    present and gloo otherwise, pins this process to its local device, and sets a
    collective timeout so that a rank that never joins a collective becomes an
    error instead of a hang. Idempotent: a second call returns the same mesh. In
    a plain ``python`` process (no ``RANK``/``WORLD_SIZE``) it starts a group of
    one, so the same script runs with ``python`` and ``torchrun``.

    Args:
        backend: a torch.distributed backend string to use instead of the default.
        timeout: seconds (or a timedelta) before a stuck collective raises;
            defaults to ``$PARDIST_TIMEOUT`` or 600 s.

    Returns:
        The default :class:`pardist.Mesh`: one axis ``'gpu'`` over every rank.

    Example:
        >>> import pardist
        >>> mesh = pardist.init()
        >>> mesh.shape
        {'gpu': 1}
        >>> pardist.shutdown()
    """
    _process.start(backend, timeout=timeout)
    return default_mesh()


@contextlib.contextmanager
def distributed(backend: str | None = None, *, timeout=None) -> Iterator[Mesh]:
    """``with pardist.distributed() as mesh:`` runs the body inside init/shutdown."""
    mesh = init(backend, timeout=timeout)
    try:
        yield mesh
    finally:
        _process.shutdown()


_process.on_shutdown(forget_default_mesh, first=True)  # before the group goes
