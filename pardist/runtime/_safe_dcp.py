"""Reading a checkpoint without running anything it holds: data, never code.

torch.distributed.checkpoint keeps its index (``.metadata``) as a pickle and every
non-tensor value as a ``torch.save`` read back with ``torch.load(weights_only=False)``:
a checkpoint folder that someone else could write is a way to run code as whoever
resumes from it. pardist reads both without that power:

- ``.metadata`` by ``_safe_index``: its opcodes checked before anything is built, an
  exact allow-list of the classes DCP's index is made of (its metadata dataclasses,
  ``torch.Size``, dtypes, layouts, paths), and the result checked to be data;
- non-tensor values through ``torch.load(weights_only=True)``: numbers, strings, lists,
  dicts, tensors and the states pardist registers as safe (``add_safe_globals``);
- and :func:`check_leaf` refuses, when saving, a value that such a load could not read
  back, naming it: what pardist writes, it can read.

The checksums of the commit marker (``_integrity``) catch damage, not an attacker, who
can write a matching marker; this is what keeps a crafted checkpoint from running code.
The writer side (:func:`writer_class`) is DCP's, except that a rank with nothing to
write creates no folder.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any

import torch

from pardist.runtime._safe_index import read_index

__all__ = [
    "check_leaf",
    "planner_class",
    "reader_class",
    "read_metadata",
    "restored",
    "writer_class",
]


def read_metadata(stream) -> Any:
    """DCP's ``Metadata`` from an open ``.metadata`` file, read as data (``_safe_index``)."""
    return read_index(stream)


@functools.cache
def reader_class():
    """DCP's file reader, reading its index without running code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = read_metadata(stream)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader


@functools.cache
def planner_class():
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.state_dict[fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise pickle.UnpicklingError(
                    f"{fqn} in the checkpoint is not plain data ({str(e).splitlines()[-1]}); "
                    "it is not read (it could run code)"
                ) from None

    return Planner


def check_leaf(path: str, value: Any, where: str) -> None:
    """Refuse to save a non-tensor value that ``torch.load(weights_only=True)`` cannot read
    back (a Python object of its own class, a function): it would need code to load."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever stops it, the value is refused
        reason = str(e).strip().splitlines()
        found = next(
            (line for line in reason if "Unsupported" in line), reason[-1] if reason else ""
        )
        raise TypeError(
            f"{where}: {path} is a {type(value).__name__}, which a checkpoint cannot hold as "
            f"data ({found.strip()[:200]}): loading it would run code. Save numbers, "
            "strings, lists, dicts and tensors (its state_dict(), its fields), or register "
            "the class with torch.serialization.add_safe_globals if you trust it."
        ) from None


@functools.cache
def writer_class():
    # DCP is imported on first use: it adds about a second to `import pardist`.
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        """DCP's file writer, except that a rank with nothing to write creates nothing.

        Without this every rank creates the directory and an empty data file, which
        on machines without a shared filesystem leaves stray directories on each node.
        """

        def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)
            self._is_coordinator = is_coordinator

        def prepare_local_plan(self, plan):
            # The directory is fresh (save removed any stale one), so there is no
            # old checkpoint to warn about; the coordinator needs it for .metadata.
            if self._is_coordinator:
                self.fs.mkdir(self.path)
            return plan

        def write_data(self, plan, planner):
            if not plan.items:
                done: torch.futures.Future = torch.futures.Future()
                done.set_result([])
                return done
            self.fs.mkdir(self.path)
            return super().write_data(plan, planner)

    return Writer


def _leafless(v: Any) -> bool:
    """A container with nothing in it but empty containers: DCP writes none of it."""
    if isinstance(v, dict):
        return all(_leafless(x) for x in v.values())
    return isinstance(v, (list, tuple)) and all(_leafless(x) for x in v)


def _rebuilt(v: Any) -> Any:
    """A fresh copy of a leafless container (never ``like``'s own objects)."""
    if isinstance(v, dict):
        return {k: _rebuilt(x) for k, x in v.items()}
    return type(v)(_rebuilt(x) for x in v)


def restored(like: Any, loaded: Any) -> Any:
    """``loaded`` (a state_dict read back) in the types ``like`` (the object's own
    ``state_dict()`` now) shows: DCP writes a dict's keys as strings (a MultiStepLR's
    milestones are ints), a Counter as a dict, a tuple as a list, and no empty container
    at all (a torch optimizer that never stepped has ``'state': {}``); its
    ``load_state_dict`` wants them as they were."""
    if isinstance(like, dict) and isinstance(loaded, dict):
        numbered = bool(like) and all(type(k) is int for k in like)
        out = {}
        for k, v in loaded.items():
            key = int(k) if numbered and isinstance(k, str) and k.lstrip("-").isdigit() else k
            out[key] = restored(like.get(key), v)
        for k, v in like.items():
            if k not in out and _leafless(v):  # (LambdaLR's [{}] of a functools.partial)
                out[k] = _rebuilt(v)
        try:
            return type(like)(out) if type(like) is not dict else out
        except TypeError:  # (a mapping type that takes no dict)
            return out
    if isinstance(like, tuple) and isinstance(loaded, list):
        return (
            tuple(restored(a, b) for a, b in zip(like, loaded))
            if len(like) == len(loaded)
            else tuple(loaded)
        )
    if isinstance(like, list) and isinstance(loaded, list) and len(like) == len(loaded):
        return [restored(a, b) for a, b in zip(like, loaded)]
    return loaded
