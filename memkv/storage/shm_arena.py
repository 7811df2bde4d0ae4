"""The warm tier's arena: a POSIX shared-memory segment that readers on the node map
without a copy, owned (and unlinked) by the process that made it."""

from __future__ import annotations

import _posixshmem
import mmap
import os
import weakref
from multiprocessing.shared_memory import SharedMemory

import torch

from memkv.errors import (
    InvalidInputError,
    NotFoundError,
)
from memkv.storage.arena import Arena

__all__ = ["SharedHostArena"]


# Permissions of a new shared-memory segment: the owning user only.
_SHM_MODE = 0o600

# cudaHostRegisterDefault: page-locked, portable flags off.
_CUDA_HOST_REGISTER_DEFAULT = 0


def _map_segment(name: str, nbytes: int) -> torch.Tensor:
    """Map ``nbytes`` of the shared-memory segment ``name`` as a ``uint8`` tensor.

    The segment is opened directly rather than through ``SharedMemory``: on
    Python < 3.13 attaching with ``SharedMemory`` registers the segment with the
    attaching process's resource tracker, which then unlinks it — under the
    owner's feet — when that process exits.

    Lifetime: ``torch.frombuffer`` keeps a *reference* to the object it is
    given, not a buffer export, so closing a mapping that torch reads would
    leave every view dangling (a segfault on the next read). Instead nothing
    here keeps the ``mmap``: the tensor holds a memoryview, the memoryview
    holds the mapping, and the mapping is unmapped exactly when the last
    tensor over it is freed.

    Raises:
        NotFoundError: no segment of that name.
        InvalidInputError: the segment is smaller than ``nbytes``.
    """
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=_SHM_MODE)
    except FileNotFoundError as e:
        raise NotFoundError(f"no shared-memory arena named {name!r}") from e
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise InvalidInputError(
                f"shared-memory segment {name!r} holds {size} bytes, expected {nbytes}"
            )
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor
    return torch.frombuffer(memoryview(mapping), dtype=torch.uint8)


def _cuda_host_unregister(ptr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


def _unlink_segment(shm: SharedMemory) -> None:
    try:
        shm.unlink()
    except FileNotFoundError:
        # Someone unlinked it already (e.g. an operator cleaning /dev/shm);
        # the goal — no segment left behind — holds.
        pass


class SharedHostArena(Arena):
    """An arena in a host shared-memory segment: the warm tier.

    The creating process owns the segment: :meth:`close` (or garbage
    collection of the arena) unlinks it. Other processes on the node map it by
    :attr:`name` (:class:`memkv.shm.same_node.SegmentMaps`) and read blocks
    at the offsets this arena hands out, without a copy.

    Args:
        capacity_bytes: bytes; a positive multiple of ``min_unit_bytes``.
        min_unit_bytes: the buddy unit.
        name: the segment's name; a fresh unique one when None.
        pin: page-lock the segment with CUDA (``cudaHostRegister``) so that
            host<->device copies run at full speed; ignored where CUDA is not
            available (see :attr:`pinned`).
        slab_classes_per_doubling: see :class:`Arena`.

    Raises:
        ConfigError: bad capacity or unit.
        InvalidInputError: a segment called ``name`` exists already.
    """

    def __init__(
        self,
        capacity_bytes: int,
        min_unit_bytes: int,
        name: str | None = None,
        pin: bool = False,
        *,
        slab_classes_per_doubling: int | None = None,
    ) -> None:
        self._validate(capacity_bytes, min_unit_bytes, slab_classes_per_doubling)
        try:
            shm = SharedMemory(name=name, create=True, size=capacity_bytes)
        except FileExistsError as e:
            raise InvalidInputError(f"a shared-memory segment named {name!r} exists") from e
        # Unlink even if the owner forgets close(); close() runs it early.
        self._unlinker = weakref.finalize(self, _unlink_segment, shm)
        try:
            buffer = _map_segment(shm.name, capacity_bytes)
        except BaseException:
            self._unlinker()
            raise
        finally:
            # Our own mapping (above) holds the memory; SharedMemory's is not needed.
            shm.close()
        self._name = shm.name
        self._unpinner: weakref.finalize[[int], SharedHostArena] | None = None
        super().__init__(buffer, min_unit_bytes, slab_classes_per_doubling)
        if pin and torch.cuda.is_available():
            ptr = buffer.data_ptr()
            torch.cuda.check_error(
                torch.cuda.cudart().cudaHostRegister(
                    ptr, capacity_bytes, _CUDA_HOST_REGISTER_DEFAULT
                )
            )
            # Like the unlinker: runs on close(), or when a forgotten arena is
            # collected — before the mapping can go away, since the buffer
            # outlives the arena object's weak-reference callbacks.
            self._unpinner = weakref.finalize(self, _cuda_host_unregister, ptr)

    @property
    def name(self) -> str:
        """The segment's name (``/dev/shm/<name>``), for readers on the node."""
        return self._name

    @property
    def pinned(self) -> bool:
        """Whether the segment is page-locked with CUDA."""
        return self._unpinner is not None and self._unpinner.alive

    def _release(self) -> None:
        try:
            if self._unpinner is not None:
                # CUDA must not keep a registration of memory unmapped later.
                self._unpinner()
        finally:
            # The name goes now; this process's mapping goes with the last view.
            self._unlinker()
