"""DCP's checkpoint index (``.metadata``, a pickle) read as data: nothing in it runs.

A pickle is a small program: its opcodes look up names (``GLOBAL``, ``STACK_GLOBAL``) and
call what they find (``REDUCE``, ``NEWOBJ``, ``BUILD`` through ``__setstate__``). The index
of torch.distributed.checkpoint needs a dozen names, all of them records: DCP's metadata
dataclasses, ``torch.Size``, a dtype, a layout, a path. So a pickle is read in three
steps, each of which refuses, naming what it found:

1. **Its opcodes, before anything is built** (``pickletools.genops``, pure Python): the
   ones a data pickle uses, and memo indices no larger than the pickle itself. No
   ``PERSID``, no extension codes, no ``INST``/``OBJ``, and no allocation an opcode's
   argument could make huge.
2. **Each name, exactly**: ``(module, name)`` in :data:`_CLASSES` (or a dtype of
   ``torch``), taken from the module's own namespace; never a module prefix and never a
   dotted name, which protocol 4 would look up attribute by attribute (the way
   ``os.system`` was once reached through DCP's metadata module, which imports ``os``).
3. **What was built**: every object, walked without recursion, is a plain value, a
   container, or a record of the allowed classes, and the top is DCP's ``Metadata``
   with its fields of the types DCP writes. What passes is data; calling the allowed
   classes with unexpected arguments raises inside them, and becomes the same refusal.

``CRC-32`` checksums (``_integrity``) catch damage, not an attacker, who can write a
matching marker; this module is what keeps a crafted index from running code.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import pickletools
from pathlib import PurePath
from typing import Any

import torch

from pardist.runtime._compat import dcp_storage_info

__all__ = ["UnsafeIndex", "read_index"]

_DCP = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_RECORDS = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
)
_CLASSES = frozenset(
    {(_DCP, name) for name in (*_RECORDS, "_MEM_FORMAT_ENCODING")}
    | {
        (_FS, "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup in a dict of torch's layouts
        ("collections", "OrderedDict"),
        *(("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    }
)
_DTYPES = frozenset(name for name, v in vars(torch).items() if isinstance(v, torch.dtype))

# The opcodes of a pickle of data and records (protocols 0-5): no PERSID/BINPERSID (a
# loader's hook), no EXT1/2/4 (the copyreg registry), no INST/OBJ (protocol 0's calls).
_OPCODES = frozenset(
    """PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1
    BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE
    BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8
    EMPTY_LIST APPEND APPENDS LIST EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT
    SETITEM SETITEMS EMPTY_SET ADDITEMS FROZENSET GET BINGET LONG_BINGET PUT BINPUT
    LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL REDUCE BUILD NEWOBJ NEWOBJ_EX""".split()
)
_MEMO = {"GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT"}
_PLAIN = (str, bytes, bytearray, int, float, complex, type(None))
_PLAIN += (torch.dtype, torch.layout, torch.memory_format)  # (TensorProperties holds each)
_CONTAINERS = (dict, list, tuple, set, frozenset)  # (OrderedDict and torch.Size: subclasses)


class UnsafeIndex(pickle.UnpicklingError):
    """The index holds something other than DCP's metadata: it is not read."""


def _refuse(what: str) -> UnsafeIndex:
    return UnsafeIndex(
        f"the checkpoint's index {what}, which is no part of torch.distributed.checkpoint's "
        "metadata: it is not read (it could run code)"
    )


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _class(module, name)
        if module == "torch" and name in _DTYPES:
            return vars(torch)[name]
        raise _refuse(f"names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse("asks for a persistent object")


def _scan(data: bytes) -> None:
    """Step 1: only a data pickle's opcodes, memo indices within the pickle's size."""
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name not in _OPCODES:
                raise _refuse(f"has the opcode {op.name} at byte {pos}")
            if op.name in _MEMO and isinstance(arg, int) and arg > len(data):
                raise _refuse(f"has a memo index of {arg} at byte {pos}")
    except UnsafeIndex:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle: refused, named
        raise UnsafeIndex(f"the checkpoint's index is not a whole pickle ({e})") from None


def _class(module: str, name: str) -> Any:
    """An allowed class, from its module's own namespace (what ``find_class`` returns)."""
    return vars(importlib.import_module(module))[name]


def _records() -> tuple[type, ...]:
    return (*(_class(_DCP, n) for n in _RECORDS), dcp_storage_info())


def _check(found: Any) -> None:
    """Step 3: every object built is data, and the top is DCP's ``Metadata``."""
    import torch.distributed.checkpoint.metadata as md

    info = dcp_storage_info()
    records = _records()
    stack, seen = [found], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, _CONTAINERS):
            stack.extend(x)
        elif type(x) in records:
            stack.extend(vars(x).values())
        elif not isinstance(x, (*_PLAIN, PurePath, enum.Enum)):
            raise _refuse(f"holds a {type(x).__module__}.{type(x).__qualname__}")
    if type(found) is not md.Metadata or not isinstance(found.state_dict_metadata, dict):
        raise _refuse(f"is a {type(found).__name__}, not DCP's Metadata of a state dict")
    kinds = (md.TensorStorageMetadata, md.BytesStorageMetadata)
    for key, value in found.state_dict_metadata.items():
        if not isinstance(key, str) or type(value) not in kinds:
            raise _refuse(f"describes {key!r} as a {type(value).__name__}")
        if type(value) is md.TensorStorageMetadata and (
            type(value.size) is not torch.Size
            or type(value.properties) is not md.TensorProperties
            or not isinstance(value.chunks, list)
            or any(type(c) is not md.ChunkStorageMetadata for c in value.chunks)
        ):
            raise _refuse(f"describes the tensor {key!r} with fields DCP does not write")
    storage = getattr(found, "storage_data", None)
    if storage is not None and (
        not isinstance(storage, dict)
        or any(type(k) is not md.MetadataIndex or type(v) is not info for k, v in storage.items())
    ):
        raise _refuse("has storage entries DCP does not write")


def read_index(stream) -> Any:
    """DCP's ``Metadata`` from an open ``.metadata`` file, read as data (see the module);
    :class:`UnsafeIndex` names the first thing that is not."""
    data = stream.read()
    _scan(data)
    try:
        found = _Unpickler(io.BytesIO(data)).load()
    except UnsafeIndex:
        raise
    except Exception as e:  # noqa: BLE001 - an allowed class refused its arguments
        raise UnsafeIndex(
            f"the checkpoint's index does not build DCP's metadata ({type(e).__name__}: "
            f"{str(e)[:200]}): it is not read"
        ) from None
    _check(found)
    return found
