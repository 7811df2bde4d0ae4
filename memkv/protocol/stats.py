"""The cluster's figures, typed: what ``/v1/stats`` serves and ``/metrics``,
``memkv status`` and the status page read.

A router shard answers a stats document (plain values, as JSON carries them);
its readers turn it into :class:`ClusterStats` with :func:`cluster_stats` and
read fields by attribute. A field renamed at its source then fails loudly where
the document is read (naming the field) instead of reading as 0 on a dashboard.
Unknown fields are kept out of the types and ignored, so a newer device's extra
figure does not break an older gateway.
"""

from __future__ import annotations

from typing import Any

import msgspec

from memkv.errors import InvalidInputError

__all__ = [
    "ArchiveStats",
    "ClusterStats",
    "DeviceStats",
    "LeaseStats",
    "ReservationStats",
    "TenantUse",
    "TierStats",
    "as_document",
    "cluster_stats",
]


class TierStats(msgspec.Struct, frozen=True, kw_only=True):
    """One memory tier of a device."""

    capacity_bytes: int | None
    used_bytes: int
    blocks: int
    hits: int
    evictions: int
    fragmentation: float | None = None


class LeaseStats(msgspec.Struct, frozen=True, kw_only=True):
    """Read plans of a device: pinning blocks now, granted and run out since it started."""

    active: int = 0
    granted: int = 0
    expired: int = 0


class ReservationStats(msgspec.Struct, frozen=True, kw_only=True):
    """Write reservations of a device: open now, granted and run out since it started,
    and the slots appends filled that it adopted without a copy."""

    active: int = 0
    granted: int = 0
    expired: int = 0
    adopted_slots: int = 0


class DeviceStats(msgspec.Struct, frozen=True, kw_only=True):
    """One device actor: its tiers and what moved between them since it started."""

    tiers: dict[str, TierStats]
    blocks: int
    unique_bytes: int
    dedup_hits: int
    dedup_bytes_saved: int
    misses: int
    promotions: int
    demotions: int
    prefetched: int
    prefetch_used: int
    precision_fallbacks: int
    lossy_conversions: int = 0
    cold_write_batches: int = 0
    cold_blocks_written: int = 0
    #: Of the demotions, those made ahead of puts, off the request path (headroom).
    demotions_ahead: int = 0
    kernels: str = "cpu"
    leases: LeaseStats = msgspec.field(default_factory=LeaseStats)
    reservations: ReservationStats = msgspec.field(default_factory=ReservationStats)
    device_id: str = ""
    #: This process's identity: a restarted device answers another one.
    incarnation: str = ""
    #: Whether the arenas' pages are populated yet (first reads are slower before).
    prefault_done: bool = False
    #: What the tiers reserved and why, in words (``memkv up`` prints it).
    reserved: str = ""
    #: The hot tier's used share of its capacity (0 when it has none).
    hot_usage: float = 0.0

    @property
    def prefetch_accuracy(self) -> float | None:
        """Prefetched blocks then read / prefetched blocks (None before any prefetch)."""
        return self.prefetch_used / self.prefetched if self.prefetched else None

    @property
    def reads(self) -> int:
        return sum(t.hits for t in self.tiers.values())


class ArchiveStats(msgspec.Struct, frozen=True, kw_only=True):
    """One archive actor (the cold tier on a node)."""

    blocks: int
    live_bytes: int
    dead_bytes: int
    bytes_on_disk: int
    corrupt_records: int = 0
    segments: int = 0
    #: archive.capacity_bytes (None: the disk's size).
    capacity_bytes: int | None = None
    #: Free bytes of the disk the archive's directory is on.
    disk_free_bytes: int | None = None
    #: Writes refused for want of room (a full disk or capacity_bytes reached).
    refused_writes: int = 0
    #: The directory's owner (memkv.archive.identity): stable across restarts.
    archive_id: str = ""
    host: str = ""

    @property
    def room_bytes(self) -> int | None:
        """Bytes it can still take: the smaller of the disk's free bytes and what is left
        of its budget (None: unknown)."""
        left = [v for v in (self.disk_free_bytes,
                            None if self.capacity_bytes is None
                            else max(0, self.capacity_bytes - self.bytes_on_disk))
                if v is not None]
        return min(left) if left else None


class TenantUse(msgspec.Struct, frozen=True, kw_only=True):
    sessions: int
    bytes: int


class RepairStats(msgspec.Struct, frozen=True, kw_only=True):
    """Replica repair of the cold tier (the router's, :mod:`memkv.router.repair`)."""

    replicas: int  # copies of each block asked for (archive.replicas)
    live_archives: int
    under_replicated: int  # blocks short of copies after the last pass
    repaired_blocks: int  # copies made, over the router's life
    repaired_bytes: int
    passes: int
    last_pass_s: float
    lost_archives: list[str] = msgspec.field(default_factory=list)


class DrainReport(msgspec.Struct, frozen=True, kw_only=True):
    """What draining one device (on one router shard) did."""

    device: str
    sessions_moved: int
    sessions_lost: int  # not even their first block survived (410 from then on)
    tokens_lost: int  # of sessions that kept a prefix
    blocks_archived: int  # memory-only blocks given a durable cold copy
    bytes_moved: int  # logical KV bytes of the sessions moved
    seconds: float
    moved_to: dict[str, int] = msgspec.field(default_factory=dict)


class ClusterStats(msgspec.Struct, frozen=True, kw_only=True):
    """The whole table's figures (one shard's, or every shard's merged)."""

    sessions: int
    logical_bytes: int
    session_states: dict[str, int] = msgspec.field(default_factory=dict)
    session_priorities: dict[str, int] = msgspec.field(default_factory=dict)
    tenants: dict[str, TenantUse] = msgspec.field(default_factory=dict)
    devices: dict[str, DeviceStats] = msgspec.field(default_factory=dict)
    archives: dict[str, ArchiveStats] = msgspec.field(default_factory=dict)
    background_prefetched: int = 0
    #: Replica repair of the cold tier (the shard that runs it: shard 0).
    repair: RepairStats | None = None
    #: Sessions per shard, in shard order (a sharded table; empty with one shard).
    shard_sessions: list[int] = msgspec.field(default_factory=list)
    #: Which shard answered (None: every shard's figures merged).
    shard: int | None = None
    shards: int = 1


def as_document(stats: msgspec.Struct) -> dict[str, Any]:
    """A stats struct as plain JSON values (what ``/v1/stats`` serves)."""
    document: dict[str, Any] = msgspec.to_builtins(stats)
    return document


def cluster_stats(document: dict[str, Any]) -> ClusterStats:
    """A router's stats document as :class:`ClusterStats`.

    Raises:
        InvalidInputError: a figure is missing or of the wrong type (named).
    """
    try:
        return msgspec.convert(document, ClusterStats, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidInputError(f"the stats document does not read as ClusterStats: {e}") from e
