"""Unified (managed) memory for the hot tier, and a CUDA stream per priority session.

Off by default (``device.unified_memory: false``). When on, a GPU device's hot
arena is one ``cudaMallocManaged`` allocation advised to live on that device
(``cudaMemAdviseSetPreferredLocation``) and to be mapped for it
(``cudaMemAdviseSetAccessedBy``), so pages the driver evicts under pressure
come back on touch instead of failing an allocation. Each high-priority session
gets a CUDA stream of its own with its blocks attached to it
(``cudaStreamAttachMemAsync``, single-stream attachment): its copies do not
queue behind other sessions' and the driver may migrate its pages for that
stream alone.

memkv never asks for more managed memory than the device has free
(``cudaMemGetInfo``): oversubscription would turn every hot read into page
faults. Untested on a GPU here (no device is lent to this project); the call
sequence is tested against a fake runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from memkv.errors import CapacityError, ConfigError

__all__ = ["ManagedArena", "PriorityStreams"]


def _runtime() -> Any:
    try:
        import cupy.cuda.runtime as runtime
    except ImportError as e:
        raise ConfigError(
            "device.unified_memory needs CuPy (pip install 'memkv[gpu]') and a CUDA device"
        ) from e
    return runtime


class ManagedArena:
    """``nbytes`` of managed memory preferring ``device``, as a CUDA uint8 tensor.

    Args:
        nbytes: the arena's size.
        device: the CUDA device index.
        runtime: the CUDA runtime API (``cupy.cuda.runtime``; a fake in tests).

    Raises:
        CapacityError: the device has less than ``nbytes`` free.
    """

    def __init__(self, nbytes: int, device: int, *, runtime: Any = None) -> None:
        rt = runtime if runtime is not None else _runtime()
        self._rt = rt
        rt.setDevice(device)
        free, total = rt.memGetInfo()
        if nbytes > free:
            raise CapacityError(
                f"device {device} has {free} bytes free of {total}; a managed hot arena of "
                f"{nbytes} bytes would oversubscribe it (lower device.hot_capacity_bytes)"
            )
        self.device = device
        self.nbytes = nbytes
        self.ptr = int(rt.mallocManaged(nbytes, rt.cudaMemAttachGlobal))
        rt.memAdvise(self.ptr, nbytes, rt.cudaMemAdviseSetPreferredLocation, device)
        rt.memAdvise(self.ptr, nbytes, rt.cudaMemAdviseSetAccessedBy, device)

    def tensor(self) -> torch.Tensor:
        """The arena as a uint8 tensor on ``cuda:<device>`` (no copy; this object owns it)."""
        import cupy

        memory = cupy.cuda.UnownedMemory(self.ptr, self.nbytes, self, self.device)
        array = cupy.ndarray((self.nbytes,), dtype=cupy.uint8,
                             memptr=cupy.cuda.MemoryPointer(memory, 0))
        return torch.from_dlpack(array)

    def close(self) -> None:
        if self.ptr:
            self._rt.free(self.ptr)
            self.ptr = 0


@dataclass
class PriorityStreams:
    """A CUDA stream per high-priority session, with its blocks attached to it.

    ``attach`` is called with each block's place in the managed arena; blocks of
    other sessions stay attached globally (every stream sees them).
    """

    arena: ManagedArena
    runtime: Any = None
    _streams: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.runtime is None:
            self.runtime = self.arena._rt

    def stream(self, session_id: str) -> Any:
        """The session's stream (created on first use)."""
        if session_id not in self._streams:
            self._streams[session_id] = self.runtime.streamCreateWithFlags(
                self.runtime.streamNonBlocking
            )
        return self._streams[session_id]

    def attach(self, session_id: str, offset: int, length: int) -> None:
        """Attach ``[offset, offset + length)`` of the arena to the session's stream alone."""
        if offset < 0 or length <= 0 or offset + length > self.arena.nbytes:
            raise ValueError(f"[{offset}, {offset + length}) is not inside the managed arena")
        rt = self.runtime
        rt.streamAttachMemAsync(self.stream(session_id), self.arena.ptr + offset, length,
                                rt.cudaMemAttachSingle)

    def release(self, session_id: str) -> None:
        """The session is no longer high priority (or is gone): its stream goes."""
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            self.runtime.streamDestroy(stream)

    def sessions(self) -> list[str]:
        return sorted(self._streams)
