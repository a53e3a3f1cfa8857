"""DCP's `.metadata` read without torch: keys, shapes, dtypes, chunks and where each item lies.

DCP writes `.metadata` with `pickle` (a `torch.distributed.checkpoint.metadata.Metadata`).
Unpickling it with DCP's own classes means importing torch (about 1.6 s, several seconds on a
loaded machine) and trusting the pickle. `read_metadata` unpickles it with plain stand-ins
instead: DCP's metadata records become `Record`s with the same attribute names
(`state_dict_metadata`, `storage_data`, `size`, `chunks`, `properties.dtype`, `relative_path`,
`offset`, `length`, ...), `torch.Size` a tuple, a dtype a `DType` with its name and item size.
A record of another torch version's DCP becomes a `Record` too; any class outside DCP (but
`pathlib` paths and `OrderedDict`) is refused (`MetadataError`): reading a tampered `.metadata`
runs no code. Completeness checks (`manifest.check_checkpoint`) and `fsdprun inspect-checkpoint`
read it this way; loading a checkpoint still goes through DCP.

Never imports torch.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

METADATA_FILE = ".metadata"
DCP_PACKAGE = "torch.distributed.checkpoint"  # its classes become Records
# Bytes per element of torch's dtypes by name; a name not listed takes the bits in its name.
_ITEMSIZE = {"bool": 1, "bfloat16": 2, "half": 2, "float": 4, "double": 8, "cfloat": 8,
             "cdouble": 16, "chalf": 4, "long": 8, "int": 4, "short": 2}  # fmt: skip


class MetadataError(ValueError):
    """`.metadata` is not DCP metadata this reader understands (or was tampered with)."""


class Record:
    """One of DCP's metadata dataclasses: its pickled fields as attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots)
        if not isinstance(state, dict):
            raise MetadataError(f"unexpected state of {type(self).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "args")
        return f"{type(self).__name__}({fields})"


class TensorProperties(Record):
    def __setstate__(self, state: Any) -> None:
        # DCP pickles it as a tuple (its memory_format is not picklable).
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


class DType:
    """A torch dtype by name (`torch.float32`), with its bytes per element."""

    def __init__(self, name: str):
        self.name = name
        bits = re.search(r"(\d+)", name)
        self.itemsize = _ITEMSIZE.get(name) or (-(-int(bits[1]) // 8) if bits else 0)
        if not self.itemsize:
            raise MetadataError(f"unknown dtype torch.{name}")
        if name.startswith("complex"):
            self.itemsize = int(bits[1]) // 8

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


_RECORDS = {
    name: type(name, (Record,), {})
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata",
                 "TensorStorageMetadata", "BytesStorageMetadata", "_StorageInfo")
}  # fmt: skip
_RECORDS["TensorProperties"] = TensorProperties
TensorStorageMetadata = _RECORDS["TensorStorageMetadata"]
Metadata = _RECORDS["Metadata"]


def _size(values: Any = ()) -> tuple[int, ...]:
    return tuple(values)


def _name(value: Any) -> Any:
    return value


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == DCP_PACKAGE or module.startswith(f"{DCP_PACKAGE}."):
            if name == "_MEM_FORMAT_ENCODING":  # an Enum, rebuilt from its value
                return _name
            # A record another torch version adds is kept as one too: inert, and unused here.
            return _RECORDS.get(name) or type(name, (Record,), {})
        elif module == "torch":
            if name == "Size":
                return _size
            if re.fullmatch(r"[a-z]+[a-z0-9_]*", name):
                return DType(name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return _name
        elif (module, name) == ("collections", "OrderedDict"):
            return dict
        elif (module, name) in (("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):
            return PurePosixPath
        elif (module, name) in (("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")):
            return PureWindowsPath
        raise MetadataError(f"{module}.{name} is not part of DCP metadata")


def read_metadata(checkpoint: Path) -> Any:
    """The `Metadata` record of a DCP checkpoint folder.

    Raises:
        OSError: `.metadata` cannot be read.
        MetadataError, pickle.UnpicklingError, EOFError, ...: it is not (whole) DCP metadata.
    """
    with (Path(checkpoint) / METADATA_FILE).open("rb") as f:
        metadata = _Unpickler(f).load()
    if not isinstance(metadata, Metadata) or not hasattr(metadata, "state_dict_metadata"):
        raise MetadataError("not a DCP Metadata record")
    return metadata
