"""A router shard's figures and its return after a restart: what it reads off its
members rather than decides (kept apart from the session service's logic)."""

from __future__ import annotations

from collections import Counter

from memkv.errors import MemberGoneError
from memkv.protocol.layout import block_token_count
from memkv.protocol.members import Directory
from memkv.protocol.stats import ArchiveStats, ClusterStats, DeviceStats, RepairStats
from memkv.router.collector import Collector
from memkv.router.members import Members
from memkv.router.state import RouterState

__all__ = ["device_stats", "reattach", "table_stats"]


def table_stats(state: RouterState, shard: int, shards: int, devices: dict[str, DeviceStats],
                archives: dict[str, ArchiveStats], *, background_prefetched: int,
                repair: RepairStats | None) -> ClusterStats:
    """The table's figures, with the members' stats given (empty: not asked)."""
    states = Counter("lost" if r.lost else r.state.value for r in state.sessions)
    logical = sum(
        r.layout.block_nbytes(n)
        for r in state.sessions
        for n in block_token_count(r.layout, r.tokens)
    )
    priorities = Counter(r.priority.value for r in state.sessions)
    return ClusterStats(
        shard=shard,
        shards=shards,
        sessions=len(state.sessions),
        logical_bytes=logical,
        session_states=dict(states),
        session_priorities=dict(priorities),
        tenants=state.tenant_usage(),
        devices=devices,
        archives=archives,
        background_prefetched=background_prefetched,
        repair=repair,
    )


async def device_stats(members: Members) -> dict[str, DeviceStats]:
    """Every live device's stats; one that is gone is recovered (or forgotten) and
    left out, so the cluster's figures do not fail with one node."""
    out: dict[str, DeviceStats] = {}
    for device_id in list(members.devices):
        try:
            out[device_id] = await members.devices[device_id].stats()
        except MemberGoneError:
            await members.check(device_id, force=True)
            if device_id in members.devices:
                out[device_id] = await members.devices[device_id].stats()
    return out


async def reattach(state: RouterState, collector: Collector, members: Members,
                   directory: Directory | None) -> None:
    """A restarted router finds the devices and archives its journal names again
    (by name, through ``directory``) and rehomes the sessions of those gone."""
    if directory is not None:
        await collector.reattach(directory)
        await members.reattach(directory)
    else:  # nothing to find them with: the next registrations bring them back
        for name in list(state.known_archives):
            state.forget_archive(name)
        for name in list(state.known_devices):
            state.forget_device(name)
    await members.rehome_orphans()
