"""Where a gateway's read responses get their bytes: the block fetcher and its plan cache.

Where the device runs on the gateway's node the bytes are memoryviews of its
shared-memory arenas, pinned by a lease while they are written (read plans,
held a while in :class:`PlanCache` so a hot session's next read asks the device
nothing); elsewhere they are zero-copy views of Ray objects. The responses that
write them: :mod:`memkv.api.frame_responses`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray.exceptions import RayError

from memkv.api.frame_responses import FetchedBytes
from memkv.errors import CorruptDataError, MemkvError
from memkv.protocol.checksum import crc32
from memkv.protocol.members import BlockReader
from memkv.protocol.messages import PlanEntry, ReadPlan, ReadRoute
from memkv.protocol.payload import READ_BATCH_BLOCKS, READ_WINDOW_BATCHES, BlockPayload
from memkv.shm.same_node import SegmentMaps

__all__ = ["BlockFetcher", "PlanCache"]

#: Lease asked for a plan that is released right after its read.
DEFAULT_PLAN_TTL_S = 30.0
#: How long a read's hold pins every block it announced (released when it ends).
READ_HOLD_S = 120.0


@dataclass(slots=True)
class _HeldLease:
    """A read plan the gateway keeps after serving it: its blocks stay pinned."""

    plan: ReadPlan
    device: BlockReader
    segments: dict[str, np.ndarray]  # the mappings its offsets refer to
    use_until: float  # local monotonic time after which the plan is not used
    nbytes: int
    expires: float  # local monotonic time its lease runs out (at the earliest)
    in_use: int = 0


#: The share of one shared-memory segment a gateway's held plans may pin.
MAX_SEGMENT_SHARE = 0.25


class PlanCache:
    """Read plans the gateway holds on to, so repeated and sequential reads skip the device.

    A plan pins its blocks until its lease runs out; while it has more than
    ``margin_s`` left the gateway serves those blocks from it without asking
    the device again. Plans are asked for with read-ahead (the blocks that
    follow in the session), so a reader walking a session block by block
    costs one device call per ``read_ahead`` blocks. Bounded by
    ``max_bytes`` of pinned blocks: the oldest plans are released first.

    Nor may it starve a device: the plans held on one shared-memory segment pin
    at most ``MAX_SEGMENT_SHARE`` of it, so new blocks always find room in the
    hot tier that readers' pins do not hold.

    Why it is safe: pinned blocks never move or change, and a plan is dropped
    well before its lease ends (``margin_s``, longer than a response takes);
    the client checks every block's checksum besides.
    """

    def __init__(self, *, ttl_s: float, margin_s: float, max_bytes: int) -> None:
        if not 0 < margin_s < ttl_s:
            raise ValueError(f"need 0 < margin_s < ttl_s, got {margin_s} and {ttl_s}")
        self.ttl_s = ttl_s
        self._margin_s = margin_s
        self._max_bytes = max_bytes
        self._held: OrderedDict[str, _HeldLease] = OrderedDict()  # by lease id, oldest first
        self._by_key: dict[tuple[str, bytes], tuple[_HeldLease, PlanEntry]] = {}
        self._bytes = 0
        # Pinned bytes per (device, segment), against a share of the segment.
        self._segment_bytes: dict[tuple[str, str], int] = {}
        self._segment_caps: dict[tuple[str, str], int] = {}
        self.hits = 0
        self.misses = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def lookup(self, device_id: str, key: bytes) -> tuple[_HeldLease, PlanEntry] | None:
        found = self._by_key.get((device_id, key))
        if found is None or time.monotonic() >= found[0].use_until:
            return None
        return found

    def hold(
        self, plan: ReadPlan, device: BlockReader, segments: dict[str, np.ndarray], asked_at: float
    ) -> _HeldLease:
        """Keep ``plan`` (asked for at local time ``asked_at``) for later reads."""
        nbytes = sum(e.nbytes for e in plan.entries if e is not None)
        held = _HeldLease(plan, device, segments, asked_at + plan.ttl_s - self._margin_s, nbytes,
                          asked_at + plan.ttl_s)
        self._held[plan.lease_id] = held
        for entry in plan.entries:
            if entry is not None:
                # A newer plan of the same block replaces the older one's entry.
                self._by_key[(plan.device_id, entry.key)] = (held, entry)
                where = (plan.device_id, entry.segment)
                self._segment_bytes[where] = self._segment_bytes.get(where, 0) + entry.nbytes
                self._segment_caps[where] = int(entry.segment_bytes * MAX_SEGMENT_SHARE)
        self._bytes += nbytes
        return held

    def _over(self, held: _HeldLease) -> bool:
        """Whether the cache pins too much overall or on one of ``held``'s segments."""
        if self._bytes > self._max_bytes:
            return True
        return any(
            self._segment_bytes.get((held.plan.device_id, e.segment), 0)
            > self._segment_caps.get((held.plan.device_id, e.segment), 0)
            for e in held.plan.entries
            if e is not None
        )

    def sweep(self) -> list[_HeldLease]:
        """Drop plans past their use time or over the byte bound; return them for release."""
        now = time.monotonic()
        gone: list[_HeldLease] = []
        for held in list(self._held.values()):  # oldest first
            if held.in_use or not (now >= held.use_until or self._over(held)):
                continue
            self._forget(held)
            gone.append(held)
        return gone

    def drop_keys(self, device_id: str, keys: Sequence[bytes]) -> list[_HeldLease]:
        """Drop the plans holding any of ``keys`` (not those in use); return them for release."""
        for key in keys:
            found = self._by_key.get((device_id, bytes(key)))
            if found is not None:
                found[0].use_until = 0.0
        return self.sweep_all_expired()

    def sweep_all_expired(self) -> list[_HeldLease]:
        """Like :meth:`sweep`, looking at every plan, not just the oldest ones."""
        now = time.monotonic()
        gone = [h for h in self._held.values() if not h.in_use and now >= h.use_until]
        for held in gone:
            self._forget(held)
        return gone

    def _forget(self, held: _HeldLease) -> None:
        del self._held[held.plan.lease_id]
        self._bytes -= held.nbytes
        for entry in held.plan.entries:
            if entry is not None:
                where = (held.plan.device_id, entry.segment)
                self._segment_bytes[where] -= entry.nbytes
                k = (held.plan.device_id, entry.key)
                if k in self._by_key and self._by_key[k][0] is held:
                    del self._by_key[k]


class BlockFetcher:
    """Fetches blocks from a device in pipelined batches.

    Args:
        maps: mappings of shared-memory segments, or None to never read them
            (same-node reads switched off).
        node_id: the gateway's Ray node: plans of devices elsewhere are not used.
        plans: where plans are kept between reads (None: released after each read).
        read_ahead: blocks planned per device call (the ones asked for and those
            that follow them in the session), when ``plans`` keeps them.
        hold_s: how long a read pins every block it announced (released when it ends).
    """

    def __init__(
        self,
        maps: SegmentMaps | None,
        node_id: str | None,
        plans: PlanCache | None = None,
        read_ahead: int = READ_BATCH_BLOCKS,
        hold_s: float = READ_HOLD_S,
    ) -> None:
        self._maps = maps
        self._hold_s = hold_s
        self._node_id = node_id
        self._plans = plans
        self._read_ahead = max(read_ahead, READ_BATCH_BLOCKS)
        self.same_node_blocks = 0
        self.in_cluster_blocks = 0
        self.leases_lost = 0
        self._settling: set[asyncio.Future[None]] = set()
        # Devices on other nodes, or that serve no plans: read through Ray.
        self._in_cluster_only: set[str] = set()

    async def fetch(
        self,
        device_id: str,
        device: BlockReader,
        keys: Sequence[bytes],
        stream: str | None,
        following: Sequence[bytes] = (),
    ) -> AsyncIterator[FetchedBytes]:
        """The blocks of ``keys`` in order; at most READ_WINDOW_BATCHES batches ahead.

        Every block is pinned on the device before the first is yielded (one
        call, sent ahead of the first batch's): a session deleted while the
        response streams cannot take blocks from under it, so a read that got
        its head sends everything it announced. The pin goes after the last.

        Args:
            device_id, device: the device's name and its reader corridor.
            following: the keys after ``keys`` in the session (for read-ahead).
        """
        batches = [keys[i : i + READ_BATCH_BLOCKS] for i in range(0, len(keys), READ_BATCH_BLOCKS)]
        ahead = list(keys) + list(following)
        in_flight: deque[_Asked] = deque()
        # Plans whose bytes were handed to the transport. They are released (or
        # kept, with a plan cache) one batch later and the last ones after the
        # end frame, since the transport may still hold a view of unsent bytes.
        drained: list[_HeldLease | ReadPlan] = []
        releases: list[Any] = []
        hold: Any = None
        # Every block in plans this gateway holds: their leases pin them already, so
        # the read needs no pin of its own (nor the device round trip it costs).
        pinned = self._pin_held(device_id, keys)
        held_until = -math.inf  # when the read's hold runs out, at the earliest
        try:
            # Sent before the first batch's call, so the device runs it first.
            if keys and pinned is None:
                held_until = time.monotonic() + self._hold_s
                pending_hold = device.hold_for_read(keys, self._hold_s)
            else:
                pending_hold = None
            for n, batch in enumerate(batches):
                in_flight.append(
                    self._ask(device_id, device, batch, stream, ahead, n * READ_BATCH_BLOCKS)
                    if pinned is None else _Asked(device_id, batch, None, True, 0.0)
                )
                if n == 0 and pending_hold is not None:
                    hold = await pending_hold  # UnknownBlockError: before any byte
                if len(in_flight) > READ_WINDOW_BATCHES:
                    held = len(drained)
                    async for item in self._drain(device, in_flight.popleft(), stream, drained,
                                                  pinned, held_until):
                        yield item
                    releases += self._let_go(drained[:held], device)
                    del drained[:held]
            while in_flight:
                async for item in self._drain(device, in_flight.popleft(), stream, drained,
                                              pinned, held_until):
                    yield item
        finally:
            if pinned is not None:
                for lease in {id(h): h for h, _ in pinned.values()}.values():
                    lease.in_use -= 1
            releases += self._let_go(drained, device)
            if hold:
                releases.append(device.release_lease(hold))
            # Plans asked for but never drained (the client went away).
            for asked in in_flight:
                if asked.ref is not None and asked.planned:
                    releases.append(_release_later(device, asked.ref))
            task = asyncio.ensure_future(self._settle(releases))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    def _pin_held(self, device_id: str, keys: Sequence[bytes]
                  ) -> dict[bytes, tuple[_HeldLease, PlanEntry]] | None:
        """Where every block of ``keys`` is in a plan this gateway holds: those plans,
        kept (``in_use``) until the read ends; None if any block is not."""
        if (self._plans is None or self._maps is None or not keys
                or device_id in self._in_cluster_only):
            return None
        found = {}
        for key in keys:
            entry = self._plans.lookup(device_id, bytes(key))
            if entry is None:
                return None
            found[bytes(key)] = entry
        for held in {id(h): h for h, _ in found.values()}.values():
            held.in_use += 1
        self._plans.hits += 1
        return found

    def _let_go(self, drained: Sequence[_HeldLease | ReadPlan], device: BlockReader) -> list[Any]:
        """Plans done with: release them, or (with a cache) mark them free and sweep."""
        out: list[Any] = []
        for item in drained:
            if isinstance(item, _HeldLease):
                item.in_use -= 1
            else:
                out.append(device.release_lease(item.lease_id))
        if self._plans is not None:
            for held in self._plans.sweep():
                out.append(held.device.release_lease(held.plan.lease_id))
        return out

    def _ask(
        self,
        device_id: str,
        device: BlockReader,
        batch: Sequence[bytes],
        stream: str | None,
        ahead: Sequence[bytes],
        offset: int,
    ) -> _Asked:
        if self._maps is None or device_id in self._in_cluster_only:
            return _Asked(device_id, batch, device.fetch_blocks(batch, stream), False, 0.0)
        if self._plans is not None and all(
            self._plans.lookup(device_id, k) is not None for k in batch
        ):
            self._plans.hits += 1
            return _Asked(device_id, batch, None, True, 0.0)
        wanted: list[bytes] = []
        if self._plans is not None:
            self._plans.misses += 1
            # Read ahead: the blocks that follow, where they sit in memory already.
            wanted = [
                k
                for k in ahead[offset + len(batch) : offset + self._read_ahead]
                if self._plans.lookup(device_id, k) is None
            ]
        ttl = self._plans.ttl_s if self._plans is not None else DEFAULT_PLAN_TTL_S
        planned = device.read_plan(batch, stream, ttl, wanted)
        return _Asked(device_id, batch, planned, True, time.monotonic())

    async def _settle(self, releases: list[Any]) -> None:
        for done in releases:
            try:
                released = await done
            except (MemkvError, RayError):
                # A plan that failed (its device restarted, a block went) pins
                # nothing, so there is nothing to give back.
                continue
            if not released:
                # The lease ran out while its bytes were written: they may have
                # changed under the socket. The client's checksum check stops
                # them; this counts how often it happens.
                self.leases_lost += 1

    async def _drain(
        self,
        device: BlockReader,
        asked: _Asked,
        stream: str | None,
        drained: list[_HeldLease | ReadPlan],
        pinned: dict[bytes, tuple[_HeldLease, PlanEntry]] | None = None,
        held_until: float = -math.inf,
    ) -> AsyncIterator[FetchedBytes]:
        """A batch's blocks; those in shared memory say until when a pin keeps them
        (the plan's lease or the read's hold, whichever lasts longer)."""
        batch = asked.batch
        if not asked.planned:
            for payload in await asked.ref:
                self.in_cluster_blocks += 1
                yield _from_payload(payload)
            return
        if asked.ref is None:  # every block was in plans the gateway holds
            assert self._plans is not None
            # (found when the read began and kept since, or looked up now)
            serving = [pinned[bytes(k)] if pinned is not None
                       else self._plans.lookup(asked.device_id, bytes(k)) for k in batch]
            if all(found is not None for found in serving):
                for found in serving:
                    assert found is not None
                    found[0].in_use += 1
                    drained.append(found[0])
                for found in serving:
                    assert found is not None
                    self.same_node_blocks += 1
                    yield _entry_bytes(found[0].segments[found[1].segment], found[1],
                                       max(found[0].expires, held_until))
                return
            # One ran out between asking and serving: plan the batch now.
            asked = _Asked(
                asked.device_id,
                batch,
                device.read_plan(batch, stream, self._plans.ttl_s),
                True,
                time.monotonic(),
            )
        plan: ReadPlan = await asked.ref
        if plan.node_id != self._node_id or self._maps is None or not plan.same_node:
            # The device is elsewhere, or does not serve plans: give any pins
            # back and read this device in-cluster from now on.
            if plan.lease_id:
                drained.append(plan)
            self._in_cluster_only.add(asked.device_id)
            for payload in await device.fetch_blocks(batch, stream):
                self.in_cluster_blocks += 1
                yield _from_payload(payload)
            return
        segments = {
            e.segment: self._maps.view(e.segment, e.segment_bytes, plan.incarnation)
            for e in plan.entries
            if e is not None
        }
        # Handed over now: an async generator interrupted by the client going
        # away is not closed, so no finally of ours would run.
        if self._plans is not None:
            held = self._plans.hold(plan, device, segments, asked.at)
            held.in_use += 1
            drained.append(held)
        else:
            drained.append(plan)
        entries = plan.entries[: len(batch)]
        missing = [k for k, e in zip(batch, entries, strict=True) if e is None]
        fallback: dict[bytes, BlockPayload] = {}
        if missing:
            fallback = {p.key: p for p in await device.get_blocks(missing, stream)}
        for key, planned in zip(batch, entries, strict=True):
            if planned is None:
                self.in_cluster_blocks += 1
                yield _from_payload(fallback[bytes(key)])
                continue
            self.same_node_blocks += 1
            yield _entry_bytes(segments[planned.segment], planned,
                               max(asked.at + plan.ttl_s, held_until))

    def plan_stats(self) -> dict[str, int]:
        if self._plans is None:
            return {"hits": 0, "misses": 0, "held_bytes": 0}
        return {
            "hits": self._plans.hits,
            "misses": self._plans.misses,
            "held_bytes": self._plans.held_bytes,
        }

    async def release_all(self) -> None:
        """Give back every plan this gateway holds (it is shutting down)."""
        if self._plans is None:
            return
        for held in list(self._plans._held.values()):
            held.use_until = 0.0
            held.in_use = 0
        gone = self._plans.sweep_all_expired()
        await asyncio.gather(
            *(h.device.release_lease(h.plan.lease_id) for h in gone),
            return_exceptions=True,  # a device gone meanwhile holds nothing any more
        )

    async def release_session(self, route: ReadRoute) -> None:
        """Give back the plans held on a session's blocks (before it is suspended or deleted)."""
        if self._plans is None:
            return
        gone = self._plans.drop_keys(route.device_id, route.keys)
        await asyncio.gather(*(h.device.release_lease(h.plan.lease_id) for h in gone))


@dataclass(frozen=True, slots=True)
class _Asked:
    device_id: str
    batch: Sequence[bytes]
    ref: Any  # the device's answer on its way (a ReadPlan, or payloads); None: served
    # from held plans
    planned: bool
    at: float  # local monotonic time the plan was asked for


def _entry_bytes(segment: np.ndarray, entry: PlanEntry, valid_until: float) -> FetchedBytes:
    if entry.offset < 0 or entry.offset + entry.nbytes > segment.size:
        raise CorruptDataError(f"block {entry.key.hex()} lies outside its segment")
    data = segment[entry.offset : entry.offset + entry.nbytes].data
    return FetchedBytes(
        entry.key, data, entry.found, entry.exact, entry.crc32, entry.lossy, entry.dtype,
        tuple(entry.shape), valid_until,
    )


async def _release_later(device: BlockReader, plan_ref: Any) -> bool:
    plan: ReadPlan = await plan_ref
    return bool(await device.release_lease(plan.lease_id))


def _from_payload(payload: BlockPayload) -> FetchedBytes:
    data = np.ascontiguousarray(payload.data).data.cast("B")
    return FetchedBytes(
        payload.key, data, payload.tier or "hot", payload.exact, crc32(data), payload.lossy,
        payload.dtype, tuple(payload.data.shape),
    )
