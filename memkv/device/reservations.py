"""Write reservations: slots of a device's shared memory that a writer on its node
fills, and an append then names, so that the device stores the bytes where they
are instead of copying them (a save's second copy).

A plain class embedded in the device, like :mod:`memkv.device.leases`.
A reservation ends when an append names its slots (those it did not name go
back with it) or when its time runs out (a writer that died must not hold
memory for ever); expired ones are swept on every grant and take. A writer
must not write into a slot after its reservation ran out: the space may hold
another block by then. The CRC32 made when a slot is adopted is what every
read checks, so a late write is detected, never served; writers keep well
inside the time (``memkv.integrations.vllm`` asks for a reservation per save and
uses it within the save).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from memkv.errors import InvalidInputError, LeaseExpiredError
from memkv.protocol.payload import StagedBlock
from memkv.storage.arena import Allocation
from memkv.storage.block_pool import BlockPool, ReservedSlots

__all__ = ["DEFAULT_RESERVATION_S", "MAX_RESERVATION_S", "Reservation", "SlotReservations"]

#: How long a reservation's slots wait for the append that names them (seconds).
DEFAULT_RESERVATION_S = 30.0
MAX_RESERVATION_S = 300.0
#: Reserved slots may take at most this share of their tier (the rest serves
#: everyone else: a writer that reserves and vanishes holds no more than this).
MAX_RESERVED_SHARE = 0.5


@dataclass(slots=True)
class Reservation:
    reservation_id: str
    reserved: ReservedSlots
    expires_at: float
    #: Slots not named by an append yet, by offset.
    open_slots: dict[int, Allocation] = field(default_factory=dict)


class SlotReservations:
    """A device's write reservations, by id.

    Args:
        pool: the pool whose tiers the slots are in.
        clock: monotonic seconds (a fake in tests).
    """

    def __init__(self, pool: BlockPool, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._clock = clock
        self._reservations: dict[str, Reservation] = {}
        self._lock = threading.Lock()
        self.granted = 0
        self.expired = 0
        self.adopted_slots = 0

    def __len__(self) -> int:
        return len(self._reservations)

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for r in self._reservations.values()
                       for s in r.open_slots.values())

    def grant(self, count: int, slot_bytes: int, ttl_s: float) -> Reservation | None:
        """``count`` slots of ``slot_bytes`` for ``ttl_s`` seconds (None: no room, or no
        shared-memory tier, or more than the share reservations may take)."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) \
                or not 0 < ttl_s <= MAX_RESERVATION_S:
            raise InvalidInputError(
                f"a reservation's ttl_s must be in (0, {MAX_RESERVATION_S}] seconds, got {ttl_s!r}")
        self.sweep()
        capacity = self._pool.shared_capacity_bytes()
        if capacity is None or self.reserved_bytes + count * slot_bytes \
                > MAX_RESERVED_SHARE * capacity:
            return None
        reserved = self._pool.reserve_slots(count, slot_bytes)
        if reserved is None:
            return None
        reservation = Reservation(uuid.uuid4().hex, reserved, self._clock() + ttl_s,
                                  {s.offset: s for s in reserved.slots})
        with self._lock:
            self._reservations[reservation.reservation_id] = reservation
            self.granted += 1
        return reservation

    def take(self, staged: StagedBlock) -> Allocation:
        """The reserved slot a staged block names, taken out of its reservation.

        Raises:
            LeaseExpiredError: no such reservation (it ran out, or this device restarted).
            InvalidInputError: the block names a slot the reservation does not hold
                (another segment, another offset, named twice) or is larger than it.
        """
        self.sweep()
        with self._lock:
            reservation = self._reservations.get(staged.reservation)
            if reservation is None:
                raise LeaseExpiredError(
                    f"block {staged.key.hex()}: write reservation {staged.reservation!r} is not "
                    f"held here (it ran out, or the device restarted): send the bytes")
            slot = reservation.open_slots.get(staged.offset)
            if staged.segment != reservation.reserved.segment or slot is None:
                raise InvalidInputError(
                    f"block {staged.key.hex()}: {staged.segment!r}+{staged.offset} is not an "
                    f"open slot of reservation {staged.reservation!r}")
            if staged.nbytes > slot.nbytes:
                raise InvalidInputError(
                    f"block {staged.key.hex()}: {staged.nbytes} bytes do not fit its reserved "
                    f"slot of {slot.nbytes}")
            del reservation.open_slots[staged.offset]
            return slot

    def finish(self, reservation_ids: Iterable[str], unused: Iterable[Allocation]) -> None:
        """An append is done with these reservations: ``unused`` (taken, not adopted)
        and every slot it did not name go back."""
        leftover = list(unused)
        with self._lock:
            for reservation_id in reservation_ids:
                reservation = self._reservations.pop(reservation_id, None)
                if reservation is not None:
                    leftover.extend(reservation.open_slots.values())
        if leftover:
            self._pool.free_slots(leftover)

    def note_adopted(self, count: int) -> None:
        self.adopted_slots += count

    def sweep(self) -> None:
        """End reservations whose time ran out; their slots go back."""
        now = self._clock()
        with self._lock:
            gone = [r for r in self._reservations.values() if r.expires_at <= now]
            for reservation in gone:
                del self._reservations[reservation.reservation_id]
            self.expired += len(gone)
        slots = [s for r in gone for s in r.open_slots.values()]
        if slots:
            self._pool.free_slots(slots)

    def close(self) -> None:
        """Forget every reservation (the pool frees its arenas as a whole)."""
        with self._lock:
            self._reservations.clear()
