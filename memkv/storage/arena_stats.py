"""What an arena reports about its occupancy (:class:`ArenaStats`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ArenaStats"]


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """A snapshot of an arena's occupancy.

    Attributes:
        capacity_bytes: bytes of the buffer.
        used_bytes: bytes callers asked for, over live allocations.
        reserved_bytes: bytes taken from the buddy allocator (extents and whole slabs).
        free_bytes: ``capacity_bytes - reserved_bytes``. Free slots inside
            slabs are not counted: they only fit their size class.
        largest_free_bytes: the largest extent the buddy allocator can hand out now.
        live_allocations: allocations not yet freed.
        slabs: slabs in use.
        internal_fragmentation: ``1 - used / reserved`` (0 when nothing is reserved):
            rounding, alignment and empty slab slots.
        external_fragmentation: ``1 - largest_free / free`` (0 when nothing is free).
        occupancy: ``reserved / capacity``: how full the arena is for new requests.
    """

    capacity_bytes: int
    used_bytes: int
    reserved_bytes: int
    free_bytes: int
    largest_free_bytes: int
    live_allocations: int
    slabs: int
    internal_fragmentation: float
    external_fragmentation: float
    occupancy: float
