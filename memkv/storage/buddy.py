"""A binary buddy allocator over one arena of bytes.

The arena is ``capacity_bytes`` long, a whole number of *units*
(``min_unit_bytes``, a power of two). Every extent handed out is a
power-of-two number of units, aligned to its own size, so the *buddy* of a
block of ``2**k`` units is found by flipping one bit of its offset
(``offset ^ (unit << k)``) and two free buddies merge back into their parent.

Capacities that are not a power-of-two number of units are split into maximal
power-of-two *top-level blocks*, largest first (13 units -> 8 + 4 + 1). Blocks
never merge across top-level blocks (see :meth:`BuddyAllocator.free`).

Cost: ``alloc`` and ``free`` touch at most one free list per order, so both are
O(log n) in the number of units; nothing ever scans the live allocations or a
whole free list. The allocator only keeps offsets: it owns no memory (an
:class:`~memkv.storage.arena.Arena` puts it over a buffer). It is not
thread-safe; its owner serialises calls.

Example:
    >>> buddy = BuddyAllocator(capacity_bytes=16 << 20, min_unit_bytes=4 << 20)
    >>> a = buddy.alloc(5 << 20)  # rounded up to 2 units (8 MiB)
    >>> buddy.size_of(a) == 8 << 20
    True
    >>> buddy.free(a)
    >>> buddy.stats().largest_free_bytes == 16 << 20
    True
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TypeGuard

from memkv.errors import AllocatorMisuseError, ConfigError

__all__ = ["BuddyAllocator", "BuddyStats"]

# Each free list is a set (O(1) membership test and removal of a buddy) plus a
# min-heap of the same offsets, so an allocation takes the lowest free address
# of its order. Low-address-first keeps live extents packed at the front and
# large runs free at the back, which measurably lowers external fragmentation
# compared with taking an arbitrary free block. Removing a buddy from the set
# leaves a stale heap entry that is skipped lazily; once stale entries
# outnumber live ones by this factor the heap is rebuilt from its set.
_HEAP_STALE_FACTOR = 2
# Below this heap size a rebuild is not worth it.
_HEAP_REBUILD_MIN = 64


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but True as a size or offset is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class BuddyStats:
    """A snapshot of a :class:`BuddyAllocator`'s occupancy.

    Attributes:
        capacity_bytes: bytes managed.
        allocated_bytes: bytes of the live extents (requests rounded up).
        requested_bytes: bytes the callers asked for.
        free_bytes: ``capacity_bytes - allocated_bytes``.
        largest_free_bytes: the largest extent one ``alloc`` can hand out now.
        live_allocations: extents allocated and not yet freed.
        external_fragmentation: ``1 - largest_free / free`` (0 when nothing is free):
            the share of free memory unusable by a request as large as all of it.
        occupancy: ``allocated / capacity``.
        internal_fragmentation: ``1 - requested / allocated`` (0 when nothing is
            allocated): the share of allocated bytes lost to rounding.
    """

    capacity_bytes: int
    allocated_bytes: int
    requested_bytes: int
    free_bytes: int
    largest_free_bytes: int
    live_allocations: int
    external_fragmentation: float
    occupancy: float
    internal_fragmentation: float


@dataclass(slots=True)
class _FreeList:
    """The free blocks of one order: a set for membership, a heap for the lowest."""

    members: set[int]
    heap: list[int]

    def push(self, offset: int) -> None:
        self.members.add(offset)
        heapq.heappush(self.heap, offset)

    def discard(self, offset: int) -> bool:
        """Remove ``offset`` if it is free; its heap entry goes stale."""
        if offset not in self.members:
            return False
        self.members.remove(offset)
        if len(self.heap) > _HEAP_REBUILD_MIN and len(self.heap) > _HEAP_STALE_FACTOR * (
            len(self.members) + 1
        ):
            self.heap = list(self.members)
            heapq.heapify(self.heap)
        return True

    def pop_lowest(self) -> int:
        """The lowest free offset, removed; only called when ``members`` is non-empty."""
        while True:
            offset = heapq.heappop(self.heap)
            # A heap entry is live only if the set still holds it; an offset
            # that was merged away and later freed again has a fresh entry.
            if offset in self.members:
                self.members.remove(offset)
                return offset


class BuddyAllocator:
    """Power-of-two extents of ``min_unit_bytes`` units, split and merged as buddies.

    Args:
        capacity_bytes: bytes to manage; a positive multiple of ``min_unit_bytes``.
        min_unit_bytes: the smallest extent; a power of two. See
            :data:`memkv.storage.config.UNIT_PROFILES` for the per-hardware values.

    Raises:
        ConfigError: ``min_unit_bytes`` is not a power of two, or
            ``capacity_bytes`` is not a positive multiple of it.
    """

    __slots__ = (
        "_allocated",
        "_capacity",
        "_free",
        "_live",
        "_max_order",
        "_requested",
        "_unit",
        "_unit_shift",
    )

    def __init__(self, capacity_bytes: int, min_unit_bytes: int) -> None:
        if not _is_int(min_unit_bytes) or not _is_power_of_two(min_unit_bytes):
            raise ConfigError(f"min_unit_bytes must be a power of two, got {min_unit_bytes!r}")
        if not _is_int(capacity_bytes) or capacity_bytes <= 0 or capacity_bytes % min_unit_bytes:
            raise ConfigError(
                f"capacity_bytes must be a positive multiple of min_unit_bytes "
                f"({min_unit_bytes}), got {capacity_bytes!r}"
            )
        self._capacity = capacity_bytes
        self._unit = min_unit_bytes
        self._unit_shift = min_unit_bytes.bit_length() - 1
        units = capacity_bytes >> self._unit_shift
        self._max_order = units.bit_length() - 1
        self._free = [_FreeList(set(), []) for _ in range(self._max_order + 1)]
        # Top-level blocks, largest first: each starts at a multiple of its own
        # size (the sum of the larger powers of two before it), so the buddy
        # arithmetic holds inside every one of them.
        offset = 0
        for order in range(self._max_order, -1, -1):
            if units >> order & 1:
                self._free[order].push(offset)
                offset += self._unit << order
        # offset -> (order, requested bytes) of every live extent.
        self._live: dict[int, tuple[int, int]] = {}
        self._allocated = 0
        self._requested = 0

    @property
    def capacity_bytes(self) -> int:
        """Bytes managed."""
        return self._capacity

    @property
    def min_unit_bytes(self) -> int:
        """The smallest extent, in bytes."""
        return self._unit

    @property
    def max_alloc_bytes(self) -> int:
        """The largest request that can ever succeed: the largest top-level block."""
        return self._unit << self._max_order

    def _order_for(self, nbytes: object) -> int:
        if not _is_int(nbytes):
            raise AllocatorMisuseError(f"allocation size must be an int, got {nbytes!r}")
        if nbytes <= 0:
            raise AllocatorMisuseError(f"allocation size must be positive, got {nbytes}")
        if nbytes > self.max_alloc_bytes:
            # Not "full": no amount of freeing could ever satisfy it.
            raise AllocatorMisuseError(
                f"cannot allocate {nbytes} bytes: the largest extent this allocator "
                f"can hand out is {self.max_alloc_bytes} bytes (capacity {self._capacity})"
            )
        units = (nbytes + self._unit - 1) >> self._unit_shift
        return (units - 1).bit_length()

    def alloc(self, nbytes: int) -> int | None:
        """Allocate an extent of at least ``nbytes`` bytes.

        Args:
            nbytes: bytes wanted; rounded up to a power-of-two number of units.

        Returns:
            The extent's byte offset (a multiple of its own size), or None when
            no free extent is large enough (expected: the caller evicts and retries).

        Raises:
            AllocatorMisuseError: ``nbytes`` is not an int, not positive, or larger
                than :attr:`max_alloc_bytes`.
        """
        order = self._order_for(nbytes)
        found = order
        while found <= self._max_order and not self._free[found].members:
            found += 1
        if found > self._max_order:
            return None
        offset = self._free[found].pop_lowest()
        # Split down to the wanted order; keep the low half, free the high half.
        while found > order:
            found -= 1
            self._free[found].push(offset + (self._unit << found))
        self._live[offset] = (order, nbytes)
        self._allocated += self._unit << order
        self._requested += nbytes
        return offset

    def _live_entry(self, offset: object, action: str) -> tuple[int, int]:
        if not _is_int(offset):
            raise AllocatorMisuseError(f"cannot {action} offset {offset!r}: not an int")
        if not 0 <= offset < self._capacity or offset % self._unit:
            raise AllocatorMisuseError(
                f"cannot {action} offset {offset}: not a unit-aligned offset in "
                f"[0, {self._capacity}) (unit {self._unit}); a foreign offset?"
            )
        entry = self._live.get(offset)
        if entry is None:
            raise AllocatorMisuseError(
                f"cannot {action} offset {offset}: no live allocation there "
                f"(double free, or never allocated)"
            )
        return entry

    def free(self, offset: int) -> None:
        """Free the extent at ``offset`` and merge it with free buddies.

        Raises:
            AllocatorMisuseError: ``offset`` is not the offset of a live extent
                (double free, foreign or unaligned offset).
        """
        order, requested = self._live_entry(offset, "free")
        del self._live[offset]
        self._allocated -= self._unit << order
        self._requested -= requested
        # Merging is bounded by the top-level block without an explicit check:
        # the buddy of a whole top-level block of order k lies at the start of
        # the next (smaller) top-level block, which is never free at order k.
        while order < self._max_order:
            buddy = offset ^ (self._unit << order)
            if not self._free[order].discard(buddy):
                break
            offset = min(offset, buddy)
            order += 1
        self._free[order].push(offset)

    def size_of(self, offset: int) -> int:
        """Bytes of the live extent at ``offset`` (its rounded-up size).

        Raises:
            AllocatorMisuseError: no live extent starts at ``offset``.
        """
        order, _ = self._live_entry(offset, "size")
        return self._unit << order

    def requested_of(self, offset: int) -> int:
        """Bytes the caller asked for when the extent at ``offset`` was allocated.

        Raises:
            AllocatorMisuseError: no live extent starts at ``offset``.
        """
        return self._live_entry(offset, "look up")[1]

    def stats(self) -> BuddyStats:
        """Occupancy and fragmentation now; O(log n)."""
        largest = 0
        for order in range(self._max_order, -1, -1):
            if self._free[order].members:
                largest = self._unit << order
                break
        free = self._capacity - self._allocated
        return BuddyStats(
            capacity_bytes=self._capacity,
            allocated_bytes=self._allocated,
            requested_bytes=self._requested,
            free_bytes=free,
            largest_free_bytes=largest,
            live_allocations=len(self._live),
            external_fragmentation=1.0 - largest / free if free else 0.0,
            occupancy=self._allocated / self._capacity,
            internal_fragmentation=(
                1.0 - self._requested / self._allocated if self._allocated else 0.0
            ),
        )

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block as ``(offset, nbytes)``, sorted by offset.

        For diagnostics and tests: it walks every free list, O(free blocks).
        """
        return sorted(
            (offset, self._unit << order)
            for order, free_list in enumerate(self._free)
            for offset in free_list.members
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"BuddyAllocator(capacity_bytes={s.capacity_bytes}, "
            f"min_unit_bytes={self._unit}, allocated_bytes={s.allocated_bytes}, "
            f"live_allocations={s.live_allocations})"
        )
