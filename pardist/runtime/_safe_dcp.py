"""Reading a checkpoint without running anything it holds: data, never code.

torch.distributed.checkpoint keeps its index (``.metadata``) as a pickle and every
non-tensor value as a ``torch.save`` read back with ``torch.load(weights_only=False)``:
a checkpoint folder that someone else could write is a way to run code as whoever
resumes from it. pardist reads both without that power:

- ``.metadata`` through an unpickler that knows only the classes DCP's index is made of
  (its metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) and refuses any
  other global, so a pickle naming ``os.system`` stops at that name;
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

__all__ = ["check_leaf", "planner_class", "reader_class", "read_metadata", "writer_class"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """An unpickler for DCP's index: its own classes and plain values, nothing callable else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_METADATA or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"the checkpoint's index names {module}.{name}, which is no part of "
            "torch.distributed.checkpoint's metadata: it is not read (it could run code)"
        )


def read_metadata(stream) -> Any:
    """DCP's ``Metadata`` from an open ``.metadata`` file, by :class:`_IndexUnpickler`."""
    return _IndexUnpickler(stream).load()


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
