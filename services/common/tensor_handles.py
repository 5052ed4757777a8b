"""Handles that let one process map a tensor another process owns.

The cachemgr owns the KV pool and the swap pool; the worker maps them at attach time. A handle is a
plain msgspec struct (no pickle crosses a socket):

- `shm`: a file in POSIX shared memory (`/dev/shm`), mapped with `MAP_SHARED` by both sides.
- `cuda_ipc`: a CUDA allocation exported with `cudaIpcGetMemHandle` (torch's own IPC reduction), so
  that the worker reads and writes the cachemgr's device memory in place.

Owners hold a shared `flock` on their shm files for their lifetime; `remove_stale_shm` deletes files
whose owner died (the lock is free), so a crashed cachemgr does not leak /dev/shm. A lock works
across PID namespaces (containers), where a PID check would not.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path
from typing import Literal

import msgspec
import torch

from services.common.precision import dtype_name

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "cbserve-"


class TensorHandle(msgspec.Struct, frozen=True):
    kind: Literal["shm", "cuda_ipc"]
    shape: list[int]
    dtype: str  # torch dtype name without the "torch." prefix
    path: str = ""  # shm
    ipc: list[bytes | int | bool | None] = []  # cuda_ipc: torch's reduction arguments, flattened


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype in tensor handle: {name!r}")
    return dtype


def _numel(shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class SharedTensor:
    """An owner's tensor plus what it must release: the shm file and its lock, if any."""

    def __init__(self, tensor: torch.Tensor, handle: TensorHandle, lock_fd: int | None = None) -> None:
        self.tensor = tensor
        self.handle = handle
        self._lock_fd = lock_fd

    def close(self) -> None:
        self.tensor = torch.empty(0)
        if self.handle.kind == "shm":
            Path(self.handle.path).unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def shm_dir() -> Path:
    return SHM_DIR if SHM_DIR.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def create_shm_tensor(shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> SharedTensor:
    """A zero-filled-on-touch tensor in shared memory; untouched pages cost nothing (sparse file)."""
    path = shm_dir() / f"{SHM_PREFIX}{uuid.uuid4().hex[:12]}-{tag}"
    numel = _numel(shape)
    tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    handle = TensorHandle("shm", list(shape), dtype_name(dtype), path=str(path))
    return SharedTensor(tensor, handle, fd)


def remove_stale_shm() -> list[str]:
    """Delete cbserve shm files whose owner is gone; returns their paths."""
    removed = []
    for path in shm_dir().glob(f"{SHM_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        removed.append(str(path))
    return removed


def share_cuda_tensor(tensor: torch.Tensor) -> TensorHandle:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    # (cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes, offset_bytes,
    #  requires_grad, refcount_handle, refcount_offset, event_handle, event_sync_required)
    ipc = [
        int(args[3]),
        int(args[6]),
        args[7],
        int(args[8]),
        int(args[9]),
        args[11],
        int(args[12]),
        args[13],
        bool(args[14]),
    ]
    return TensorHandle("cuda_ipc", list(tensor.shape), dtype_name(tensor.dtype), ipc=ipc)


def open_tensor(handle: TensorHandle) -> torch.Tensor:
    """Map a tensor another process owns. The mapping stays valid while the returned tensor lives."""
    dtype = _dtype(handle.dtype)
    if handle.kind == "shm":
        path = Path(handle.path)
        if path.parent != shm_dir() or not path.name.startswith(SHM_PREFIX):
            raise ValueError(f"refusing to map a file outside cbserve's shared memory: {handle.path!r}")
        numel = _numel(handle.shape)
        size, need = path.stat().st_size, numel * dtype.itemsize
        if size < need:
            raise ValueError(f"{path} holds {size} bytes, the handle needs {need}")
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(handle.shape)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    offset, device, ipc_handle, size_bytes, offset_bytes, rc_handle, rc_offset, event, sync = handle.ipc
    shape = torch.Size(handle.shape)
    stride = torch.empty(0).new_empty(shape, device="meta").stride()
    return rebuild_cuda_tensor(
        torch.Tensor,
        shape,
        stride,
        offset,
        torch.storage.TypedStorage,
        dtype,
        device,
        ipc_handle,
        size_bytes,
        offset_bytes,
        False,
        rc_handle,
        rc_offset,
        event,
        sync,
    )
