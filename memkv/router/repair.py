"""Replica repair: blocks on fewer live archives than ``archive.replicas`` get their
copies back.

Devices write every cold block to ``replicas`` archives on distinct nodes
(:mod:`memkv.actors.cold_replicas`). When an archive's node is lost, its
copies are gone: each pass lists what every live archive holds, finds the
blocks held by fewer than ``min(replicas, live archives)``, and copies each
from an archive that has it whole (its frame verified when read, so a damaged
copy is never the source) to the live archives with the fewest blocks that lack
it, fsynced. A block no session holds is left alone: it is garbage the
collector deletes, or an append in flight not yet recorded (its device writes
its copies itself).

One shard repairs (shard 0): every shard knows every archive, and one pass
over the archives covers every shard's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import msgspec

from memkv.errors import MemberLostError
from memkv.periodic import Periodic
from memkv.protocol.stats import RepairStats
from memkv.router.collector import Collector

__all__ = ["ReplicaRepair", "RepairStats"]

logger = logging.getLogger(__name__)

#: Blocks per copy call (frames travel through the router: bounded memory).
REPAIR_BATCH_BLOCKS = 256


class ReplicaRepair:
    """Passes every ``interval_s`` while the router runs (and on demand: :meth:`run`).

    Args:
        collector: the router's archives and who holds what.
        replicas: copies each block should have.
    """

    def __init__(self, collector: Collector, *, replicas: int, interval_s: float) -> None:
        self.collector = collector
        self.replicas = replicas
        self.interval_s = interval_s
        self._stats = RepairStats(
            replicas=replicas,
            live_archives=0,
            under_replicated=0,
            repaired_blocks=0,
            repaired_bytes=0,
            passes=0,
            last_pass_s=0.0,
        )
        # (an archive lost mid-pass: the next pass goes on)
        self._passes = Periodic(self.run, interval_s, "replica repair")
        self._lock = asyncio.Lock()  # one pass at a time
        #: Archives whose node is leaving (drained): read from, never counted.
        self.leaving: set[str] = set()

    def ensure_running(self) -> None:
        self._passes.ensure_running()

    def cancel(self) -> None:
        self._passes.cancel()

    @property
    def stats(self) -> RepairStats:
        return msgspec.structs.replace(
            self._stats,
            live_archives=len(self.collector.archives),
            lost_archives=sorted(self.collector.lost_archives),
        )

    async def run(self) -> RepairStats:
        """One pass: list every live archive, copy what is short. Returns the stats.

        An archive that is leaving (its node drained) does not count as a copy
        and takes none, but is still read from: its blocks get their copies
        elsewhere while it is there.
        """
        async with self._lock:
            started = time.monotonic()
            holders = await self._holders()
            counted = [n for n in holders if n not in self.leaving]
            target = min(self.replicas, len(counted))
            short: dict[bytes, list[str]] = {}
            for key, have in self._by_key(holders).items():
                if sum(1 for n in have if n not in self.leaving) < target:
                    short[key] = have
            if short:
                referenced = await self.collector.referenced_anywhere(list(short))
                short = {k: h for k, h in short.items() if k in referenced}
            copies, full, nbytes = await self._copy(short, holders, counted, target)
            self._stats = msgspec.structs.replace(
                self._stats,
                under_replicated=len(short) - full,
                repaired_blocks=self._stats.repaired_blocks + copies,
                repaired_bytes=self._stats.repaired_bytes + nbytes,
                passes=self._stats.passes + 1,
                last_pass_s=round(time.monotonic() - started, 3),
            )
            if copies:
                logger.info("replica repair copied %d blocks (%d bytes) in %.2f s",
                            copies, nbytes, self._stats.last_pass_s)
            return self.stats

    async def _holders(self) -> dict[str, set[bytes]]:
        """Each live archive's keys (an archive found lost is forgotten)."""
        out: dict[str, set[bytes]] = {}
        for name, archive in list(self.collector.archives.items()):
            try:
                out[name] = set(await archive.keys())
            except MemberLostError as e:
                self.collector.lose_archive(name, e)
        return out

    @staticmethod
    def _by_key(holders: dict[str, set[bytes]]) -> dict[bytes, list[str]]:
        by_key: dict[bytes, list[str]] = defaultdict(list)
        for name, keys in holders.items():
            for key in keys:
                by_key[key].append(name)
        return by_key

    async def _copy(self, short: dict[bytes, list[str]], holders: dict[str, set[bytes]],
                    counted: list[str], target: int) -> tuple[int, int, int]:
        """Copy each short block to the emptiest counted archives that lack it.

        Returns (copies made, blocks brought to target, bytes copied).
        """
        load = {name: len(holders[name]) for name in counted}
        plan: dict[tuple[str, str], list[bytes]] = defaultdict(list)  # (from, to) -> keys
        for key, have in short.items():
            kept = [n for n in have if n not in self.leaving]
            lacking = sorted((n for n in counted if n not in have), key=lambda n: (load[n], n))
            source = kept[0] if kept else have[0]  # a leaving archive only as a last resort
            for dest in lacking[: target - len(kept)]:
                plan[(source, dest)].append(key)
                load[dest] += 1
        copies = nbytes = 0
        done: dict[bytes, int] = defaultdict(int)
        for (source, dest), keys in plan.items():
            for i in range(0, len(keys), REPAIR_BATCH_BLOCKS):
                batch = keys[i : i + REPAIR_BATCH_BLOCKS]
                try:
                    records = await self.collector.archives[source].get_records(batch)
                    items = [(k, r[0], r[1]) for k, r in zip(batch, records, strict=True)
                             if r is not None]
                    if items:
                        await self.collector.archives[dest].put_frames(items, True)
                except MemberLostError as e:
                    logger.warning("replica repair from %s to %s stopped: %s", source, dest, e)
                    break  # the next pass lists the archives again
                except KeyError:
                    break  # an archive forgotten meanwhile
                copies += len(items)
                nbytes += sum(len(f) for _, f, _ in items)
                for k, _, _ in items:
                    done[k] += 1
        full = sum(1 for k, n in done.items()
                   if sum(1 for a in short[k] if a not in self.leaving) + n >= target)
        return copies, full, nbytes
