"""Arenas: one flat byte buffer carved by a buddy allocator, blocks as views into it.

* :class:`~memkv.storage.device_arena.DeviceArena` — the hot tier: ``torch.empty``
  on a device (``cuda:N`` on a GPU node, ``cpu`` where there is none).
* :class:`~memkv.storage.shm_arena.SharedHostArena` — the warm tier: a POSIX
  shared-memory segment (pinned for fast device copies on GPU hosts) that other
  processes on the node map without a copy (:class:`memkv.shm.same_node.SegmentMaps`).

This module holds what both share: :class:`Arena` (allocation, slabs, views,
prefault) and its records.

Large requests (more than half a buddy unit) get a buddy extent of their own.
Small ones — a 256-token block of a small model is often under 1 MiB while a
unit is 4 MiB — are packed into *slabs*: one buddy unit cut into equal slots of
one size class. A slab whose slots are all free goes back to the buddy
allocator. Every offset an arena hands out is a multiple of
:data:`ALIGNMENT_BYTES`, so any dtype can be viewed there.

Views returned by :meth:`Arena.view` and :meth:`Arena.write` alias the arena's
memory: they are valid until the allocation is freed, and must not outlive the
arena. (Memory stays mapped while a view is alive — a late read never crashes —
but after :meth:`Arena.close` its contents belong to no one.)
"""

from __future__ import annotations

import abc
import enum
import itertools
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeGuard

import torch

from memkv.errors import (
    AllocatorMisuseError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    LayoutMismatchError,
)
from memkv.storage.arena_stats import ArenaStats
from memkv.storage.buddy import BuddyAllocator

__all__ = ["ALIGNMENT_BYTES", "Allocation", "Arena", "ArenaState", "ArenaStats"]

#: Every offset an arena hands out is a multiple of this: the widest alignment
#: CUDA kernels and vectorised copies ask for.
ALIGNMENT_BYTES = 256

# Requests up to this share of a unit go into slabs: at most half, so a slab
# always has at least two slots and packing beats a unit of its own.
_SLAB_MAX_DIVISOR = 2

# Distinguishes allocations of different arenas in one process.
_ARENA_IDS = itertools.count(1)

#: Pages are populated this many bytes at a time (the arena lock is held per chunk).
PREFAULT_CHUNK_BYTES = 32 << 20
_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux >= 5.14
_PAGE = mmap.PAGESIZE


def _populate_write(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) over whole pages of ``[address, address + nbytes)``."""
    import ctypes

    libc = _libc()
    if libc is None:
        return False
    first = address - address % _PAGE
    length = address + nbytes - first
    return (
        int(libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_POPULATE_WRITE))
        == 0
    )


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name or "libc.so.6", use_errno=True)
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _LIBC.append(lib)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ArenaState(enum.Enum):
    """Lifecycle of an arena or a mapping."""

    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Allocation:
    """A live piece of an arena, as :meth:`Arena.allocate` hands it out.

    Attributes:
        offset: byte offset in the arena's buffer (a multiple of :data:`ALIGNMENT_BYTES`).
        nbytes: the requested size (the piece reserved may be larger).

    The private fields let the arena recognise its own live allocations: a
    copy from another arena, or one already freed, is refused.
    """

    offset: int
    nbytes: int
    _slab: int | None = field(default=None, repr=False)  # base of its slab; None: own extent
    _serial: int = field(default=0, repr=False)
    _arena: int = field(default=0, repr=False)


@dataclass(slots=True)
class _Slab:
    """One buddy unit cut into ``nslots`` slots of ``slot_bytes``."""

    base: int
    slot_bytes: int
    nslots: int
    live: int = 0
    # Slots below next_unused have been handed out at least once; freed ones
    # wait in free_slots. This keeps a new slab O(1) to set up.
    next_unused: int = 0
    free_slots: list[int] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.live == self.nslots

    def take(self) -> int:
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot = self.next_unused
            self.next_unused += 1
        self.live += 1
        return self.base + slot * self.slot_bytes

    def give_back(self, offset: int) -> None:
        self.free_slots.append((offset - self.base) // self.slot_bytes)
        self.live -= 1


def _check_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if not isinstance(shape, Sequence) or isinstance(shape, str | bytes):
        raise InvalidInputError(f"shape must be a sequence of ints, got {shape!r}")
    dims = tuple(shape)
    if not all(_is_int(d) and d >= 0 for d in dims):
        raise InvalidInputError(f"shape must hold non-negative ints, got {shape!r}")
    return dims


def _typed_view(
    buffer: torch.Tensor, offset: int, nbytes: int, shape: object, dtype: object
) -> torch.Tensor:
    """``buffer[offset:offset + nbytes]`` seen as ``shape`` of ``dtype``, without a copy."""
    if not isinstance(dtype, torch.dtype):
        raise InvalidInputError(f"dtype must be a torch.dtype, got {dtype!r}")
    dims = _check_shape(shape)
    numel = 1
    for d in dims:
        numel *= d
    if numel * dtype.itemsize != nbytes:
        raise LayoutMismatchError(
            f"shape {dims} of {dtype} is {numel * dtype.itemsize} bytes, but the "
            f"allocation holds {nbytes} bytes"
        )
    if (buffer.data_ptr() + offset) % dtype.itemsize:
        raise LayoutMismatchError(
            f"offset {offset} is not aligned for {dtype} ({dtype.itemsize}-byte elements)"
        )
    return buffer[offset : offset + nbytes].view(dtype).view(dims)


class Arena(abc.ABC):
    """A flat ``uint8`` buffer carved by a :class:`BuddyAllocator`, with a slab layer.

    Use :class:`DeviceArena` or :class:`SharedHostArena`. Methods are
    thread-safe; copies into views run outside the lock.

    Args:
        buffer: the 1-d ``uint8`` memory to carve.
        min_unit_bytes: the buddy unit; a power of two >= ``2 * ALIGNMENT_BYTES``.
        slab_classes_per_doubling: ``None`` (default) gives every 256-byte-aligned
            small size its own slab class. A power of two ``k`` instead rounds
            small sizes to ``k`` classes per doubling (at most ``1/k`` rounding
            waste), so many distinct sizes — the partial last blocks of many
            sessions — share a few slabs instead of holding one each.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        min_unit_bytes: int,
        slab_classes_per_doubling: int | None = None,
    ) -> None:
        capacity = buffer.numel()
        self._allocator = BuddyAllocator(capacity, min_unit_bytes)
        self._buffer: torch.Tensor | None = buffer
        self._capacity = capacity
        self._unit = min_unit_bytes
        self._slab_max = min_unit_bytes // _SLAB_MAX_DIVISOR
        self._classes_per_doubling = slab_classes_per_doubling
        self._uid = next(_ARENA_IDS)
        self._serials = itertools.count(1)
        self._lock = threading.Lock()
        self._state = ArenaState.OPEN
        self._live: dict[int, Allocation] = {}
        self._slabs: dict[int, _Slab] = {}
        # size class -> slabs of that class with a free slot, by base offset.
        self._partial: dict[int, dict[int, _Slab]] = {}
        self._used = 0

    @staticmethod
    def _validate(
        capacity_bytes: int, min_unit_bytes: int, slab_classes_per_doubling: int | None
    ) -> None:
        """Check the constructor arguments before a subclass allocates any memory."""
        if not _is_int(min_unit_bytes) or min_unit_bytes < 2 * ALIGNMENT_BYTES:
            raise ConfigError(
                f"min_unit_bytes must be a power of two >= {2 * ALIGNMENT_BYTES}, "
                f"got {min_unit_bytes!r}"
            )
        if slab_classes_per_doubling is not None and (
            not _is_int(slab_classes_per_doubling)
            or slab_classes_per_doubling <= 0
            or slab_classes_per_doubling & (slab_classes_per_doubling - 1)
        ):
            raise ConfigError(
                f"slab_classes_per_doubling must be None or a positive power of two, "
                f"got {slab_classes_per_doubling!r}"
            )
        # Raises ConfigError for the remaining capacity/unit mistakes.
        BuddyAllocator(capacity_bytes, min_unit_bytes)

    # -- lifecycle -----------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._state is ArenaState.CLOSED

    def _check_open(self) -> torch.Tensor:
        if self._buffer is None:
            raise ClosedError(f"{type(self).__name__} is closed")
        return self._buffer

    @property
    def buffer(self) -> torch.Tensor:
        """The whole arena as a 1-d ``uint8`` tensor.

        Raises:
            ClosedError: the arena is closed.
        """
        return self._check_open()

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the buffer."""
        return self._capacity

    @property
    def min_unit_bytes(self) -> int:
        """The buddy unit, which is also the size of a slab."""
        return self._unit

    @property
    def max_alloc_bytes(self) -> int:
        """The largest request that can ever succeed."""
        return self._allocator.max_alloc_bytes

    def close(self) -> None:
        """Release the buffer; idempotent.

        Views must not be used afterwards. Memory a view still refers to is
        released when the last such view is freed, never under it.
        """
        with self._lock:
            if self._state is ArenaState.CLOSED:
                return
            try:
                self._release()
            finally:
                self._state = ArenaState.CLOSED
                self._buffer = None
                self._live.clear()
                self._slabs.clear()
                self._partial.clear()

    def prefault(self, *, chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> int:
        """Populate the buffer's pages (``MADV_POPULATE_WRITE``) without changing its bytes.

        Safe while blocks are being written: populating maps pages, it writes
        nothing. Works in chunks and stops early when the arena is closed.
        Only CPU buffers; a no-op elsewhere or on kernels without the advice
        (Linux < 5.14).

        Returns:
            Bytes populated.
        """
        with self._lock:
            buffer = self._buffer
            if self._state is ArenaState.CLOSED or buffer is None:
                return 0
            if buffer.device.type != "cpu":
                return 0
            start, total = buffer.data_ptr(), buffer.numel()
        done = 0
        # Without the lock: populating writes nothing, and a range that close()
        # unmapped meanwhile makes madvise fail (ENOMEM), which ends the loop.
        while done < total and self._state is not ArenaState.CLOSED:
            n = min(chunk_bytes, total - done)
            if not _populate_write(start + done, n):
                break
            done += n
        del buffer
        return done

    @abc.abstractmethod
    def _release(self) -> None:
        """Subclass hook, called once by :meth:`close` while the buffer is still set."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- allocation ----------------------------------------------------------

    def _slab_class(self, nbytes: int) -> int:
        size = _round_up(nbytes, ALIGNMENT_BYTES)
        if self._classes_per_doubling is None:
            return size
        # k classes between consecutive powers of two: steps of 2**floor(log2 n) / k.
        step = max(ALIGNMENT_BYTES, (1 << (size.bit_length() - 1)) // self._classes_per_doubling)
        return _round_up(size, step)

    def allocate(self, nbytes: int) -> Allocation | None:
        """Reserve ``nbytes`` bytes.

        Args:
            nbytes: bytes wanted.

        Returns:
            The allocation, or None when the arena has no room (expected: the
            caller evicts and retries).

        Raises:
            AllocatorMisuseError: ``nbytes`` is not a positive int, or larger
                than :attr:`max_alloc_bytes`.
            ClosedError: the arena is closed.
        """
        if not _is_int(nbytes) or nbytes <= 0:
            raise AllocatorMisuseError(f"allocation size must be a positive int, got {nbytes!r}")
        with self._lock:
            self._check_open()
            slab: int | None
            if nbytes <= self._slab_max:
                offset = self._take_slot(self._slab_class(nbytes))
                if offset is None:
                    return None
                slab = offset - offset % self._unit  # slabs are unit-aligned
            else:
                offset = self._allocator.alloc(nbytes)
                if offset is None:
                    return None
                slab = None
            allocation = Allocation(offset, nbytes, slab, next(self._serials), self._uid)
            self._live[offset] = allocation
            self._used += nbytes
            return allocation

    def _take_slot(self, slot_bytes: int) -> int | None:
        partial = self._partial.get(slot_bytes)
        if partial:
            slab = next(iter(partial.values()))
        else:
            base = self._allocator.alloc(self._unit)
            if base is None:
                return None
            slab = _Slab(base, slot_bytes, self._unit // slot_bytes)
            self._slabs[base] = slab
            partial = self._partial.setdefault(slot_bytes, {})
            partial[base] = slab
        offset = slab.take()
        if slab.full:
            del partial[slab.base]
            if not partial:
                del self._partial[slot_bytes]
        return offset

    def owns(self, allocation: Allocation) -> bool:
        """Whether ``allocation`` is a live allocation of this arena."""
        with self._lock:
            return self._live.get(allocation.offset) == allocation

    def _check_live(self, allocation: object, action: str) -> Allocation:
        if not isinstance(allocation, Allocation):
            raise AllocatorMisuseError(
                f"cannot {action}: expected an Allocation, got {type(allocation).__name__}"
            )
        if self._live.get(allocation.offset) != allocation:
            raise AllocatorMisuseError(
                f"cannot {action} {allocation!r}: not a live allocation of this arena "
                f"(already freed, or from another arena)"
            )
        return allocation

    def release_free(self, min_bytes: int, release: Callable[[int, int], None]) -> int:
        """Hand each free extent of at least ``min_bytes`` to ``release(address, nbytes)``
        (its address in this process), holding the arena's lock so nothing is allocated
        in it meanwhile; return the bytes handed over."""
        with self._lock:
            base = self._check_open().data_ptr()
            total = 0
            for offset, nbytes in self._allocator.free_blocks():
                if nbytes >= min_bytes:
                    release(base + offset, nbytes)
                    total += nbytes
            return total

    def free(self, allocation: Allocation) -> None:
        """Return an allocation to the arena.

        Raises:
            AllocatorMisuseError: double free, or an allocation of another arena.
            ClosedError: the arena is closed.
        """
        with self._lock:
            self._check_open()
            self._check_live(allocation, "free")
            del self._live[allocation.offset]
            self._used -= allocation.nbytes
            if allocation._slab is None:
                self._allocator.free(allocation.offset)
                return
            slab = self._slabs[allocation._slab]
            was_full = slab.full
            slab.give_back(allocation.offset)
            if slab.live == 0:
                # Empty slabs go back at once, so the unit can merge with its buddies.
                del self._slabs[slab.base]
                partial = self._partial.get(slab.slot_bytes)
                if partial is not None:
                    partial.pop(slab.base, None)
                    if not partial:
                        del self._partial[slab.slot_bytes]
                self._allocator.free(slab.base)
            elif was_full:
                self._partial.setdefault(slab.slot_bytes, {})[slab.base] = slab

    # -- data ----------------------------------------------------------------

    def view(
        self,
        allocation: Allocation,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        prefix: bool = False,
    ) -> torch.Tensor:
        """The allocation's bytes as a ``shape`` tensor of ``dtype``; no copy.

        Args:
            prefix: view only the first ``shape``-worth of bytes. A partial KV
                block reserves a full block's slot (it grows into it on the next
                turn, and one size class per layout keeps slabs dense), so its
                data fills just the front of the allocation.

        Raises:
            AllocatorMisuseError: ``allocation`` is not live in this arena.
            LayoutMismatchError: ``shape`` and ``dtype`` do not make ``allocation.nbytes``
                (with ``prefix``: need more than it holds).
            InvalidInputError: ``shape`` or ``dtype`` is malformed.
            ClosedError: the arena is closed.
        """
        with self._lock:
            buffer = self._check_open()
            self._check_live(allocation, "view")
        nbytes = allocation.nbytes
        if prefix and isinstance(dtype, torch.dtype):
            numel = 1
            for d in _check_shape(shape):
                numel *= d
            if numel * dtype.itemsize > nbytes:
                raise LayoutMismatchError(
                    f"shape {tuple(shape)} of {dtype} needs {numel * dtype.itemsize} bytes, "
                    f"but the allocation holds {nbytes} bytes"
                )
            nbytes = numel * dtype.itemsize
        return _typed_view(buffer, allocation.offset, nbytes, shape, dtype)

    def write(
        self,
        allocation: Allocation,
        tensor: torch.Tensor,
        *,
        non_blocking: bool = False,
        prefix: bool = False,
    ) -> torch.Tensor:
        """Copy ``tensor`` (from any device) into the allocation; return the view.

        Args:
            allocation: a live allocation of exactly ``tensor``'s byte size.
            tensor: the data; any shape, dtype, device and strides.
            non_blocking: passed to ``copy_`` (overlaps pinned-host/device copies).
            prefix: the tensor may be smaller than the allocation (see :meth:`view`).

        Returns:
            The allocation viewed with ``tensor``'s shape and dtype.

        Raises:
            AllocatorMisuseError: ``allocation`` is not live in this arena.
            LayoutMismatchError: the byte sizes differ.
            InvalidInputError: ``tensor`` is not a tensor.
            ClosedError: the arena is closed.
        """
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        dst = self.view(allocation, tensor.shape, tensor.dtype, prefix=prefix)
        # The arena is storage, not part of any autograd graph.
        with torch.no_grad():
            dst.copy_(tensor, non_blocking=non_blocking)
        return dst

    def stats(self) -> ArenaStats:
        """Occupancy and fragmentation now.

        Raises:
            ClosedError: the arena is closed.
        """
        with self._lock:
            self._check_open()
            b = self._allocator.stats()
            reserved = b.allocated_bytes
            return ArenaStats(
                capacity_bytes=self._capacity,
                used_bytes=self._used,
                reserved_bytes=reserved,
                free_bytes=b.free_bytes,
                largest_free_bytes=b.largest_free_bytes,
                live_allocations=len(self._live),
                slabs=len(self._slabs),
                internal_fragmentation=1.0 - self._used / reserved if reserved else 0.0,
                external_fragmentation=b.external_fragmentation,
                occupancy=b.occupancy,
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity_bytes={self._capacity}, "
            f"min_unit_bytes={self._unit}, state={self._state.value})"
        )
