"""A checkpoint's tensors read from a local file straight into the tensors they load into.

DCP's ``FileSystemReader`` reads each tensor item as a ``torch.save`` record on its own (the
item's bytes in the file): ``torch.load`` of the record (its storage's bytes copied out of the
file into a new tensor), narrowed to the part asked for, then copied into the tensor it loads
into. :func:`read_direct` reads an item whose record holds the whole of a contiguous tensor
that lands whole in a contiguous CPU tensor of the same dtype and shape with one ``readinto``
of the storage's bytes into that tensor's memory: the record's pickle is read as ``torch.load``
reads it onto the meta device (no storage read), which says where the storage's bytes lie
(:func:`hapt_hf.compat.torch_api.saved_tensor_layout`). Every other item (bytes, a part of a
saved tensor or of the tensor it loads into, another dtype or shape, a non-contiguous tensor on
either side, a record DCP wrote through a transform, bytes in the other byte order) is left to
DCP's own path. The bytes are the same either way: ``torch.load`` copies the storage's bytes as
they are, ``copy_`` between tensors of one dtype copies them as they are.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from hapt_hf.compat.torch_api import saved_tensor_layout
from hapt_hf.errors import CheckpointError

__all__ = ["read_direct"]


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable stream of their own."""

    def __init__(self, f: io.FileIO, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.length - self.pos))
        if not n:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(out[:n]) or 0
        self.pos += got
        return got


def _bytes_of(target: Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as a writable byte buffer."""
    return memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _read_one(f: io.FileIO, path: Path, req: ReadItem, info: Any, planner: LoadPlanner) -> int | None:
    """Read ``req`` straight into its tensor; the bytes read, or None where it is not for this path."""
    if req.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None):
        return None
    try:
        layout = saved_tensor_layout(_Slice(f, info.offset, info.length))
    except Exception:  # noqa: BLE001 - DCP's own path reads the record (or says what is wrong with it)
        return None
    if layout is None:
        return None
    saved, start = layout
    if not saved.is_contiguous() or saved.is_conj() or saved.is_neg():
        return None
    if any(req.storage_offsets) or tuple(req.lengths) != tuple(saved.shape):
        return None  # a part of the saved tensor
    size = saved.numel() * saved.element_size()
    first = start + saved.storage_offset() * saved.element_size()
    if first + size > min(info.length, start + saved.untyped_storage().nbytes()):
        return None
    target = planner.resolve_tensor(req).detach()
    if (type(target) is not Tensor or target.device.type != "cpu" or target.dtype != saved.dtype
            or target.shape != saved.shape or not target.is_contiguous()):
        return None
    if size:
        out, done = _bytes_of(target), 0
        f.seek(info.offset + first)
        while done < size:
            n = f.readinto(out[done:])
            if not n:
                raise CheckpointError(f"{str(path)!r} ends at byte {info.offset + first + done}, inside "
                                      f"the tensor of item {req.storage_index.fqn!r}; the checkpoint's "
                                      "metadata names bytes the file lacks: use its remote copy")
            done += n
    planner.commit_tensor(req, target)
    return size


def read_direct(path: str | os.PathLike, items: list[ReadItem], storage_data: dict[Any, Any],
                planner: LoadPlanner) -> tuple[list[ReadItem], int]:
    """Read each of ``items`` (of the local file ``path``; ``storage_data``: where DCP's
    metadata says each lies) that can go straight into its tensor, in the order they lie in the
    file; returns the items left for DCP's own path and the bytes read here."""
    path = Path(path)
    left: list[ReadItem] = []
    direct = 0
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):  # read ahead further: the items are read in file order
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for req in sorted(items, key=lambda r: storage_data[r.storage_index].offset):
            size = _read_one(f, path, req, storage_data[req.storage_index], planner)
            if size is None:
                left.append(req)
            else:
                direct += size
    return left, direct
