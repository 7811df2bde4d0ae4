"""Planned operations of a running deployment, through the in-cluster API: a node
drained before it leaves, every held block archived before a planned stop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import ray
from ray.actor import ActorHandle

from memkv.actors.handles import ACTOR_GONE_ERRORS, DeviceHandle, MemberHandle, RouterOpsHandle
from memkv.errors import InvalidInputError
from memkv.protocol.stats import DrainReport

if TYPE_CHECKING:
    from memkv.cluster.memkv_cluster import MemkvCluster

__all__ = ["NodeDrain", "drain_node", "drain_to_archive"]

logger = logging.getLogger(__name__)

#: Repair passes a node drain runs for its archive's blocks to have their copies
#: elsewhere (one is enough unless an archive is lost meanwhile).
_DRAIN_REPAIR_PASSES = 3


@dataclass(frozen=True)
class NodeDrain:
    """What :func:`drain_node` did."""

    node: str
    devices: list[str]
    archives: list[str]
    reports: list[DrainReport]  # one per device and router shard
    blocks_short: int  # blocks still short of copies on the archives that stay
    seconds: float

    @property
    def sessions_moved(self) -> int:
        return sum(r.sessions_moved for r in self.reports)

    @property
    def lost(self) -> tuple[int, int]:
        """(sessions lost, tokens lost): both 0 when every block reached the archives."""
        return (sum(r.sessions_lost for r in self.reports),
                sum(r.tokens_lost for r in self.reports))

    @property
    def bytes_moved(self) -> int:
        return sum(r.bytes_moved for r in self.reports)

    def document(self) -> dict[str, Any]:
        """As plain JSON values (``memkv drain --json``)."""
        return {
            "node": self.node, "devices": self.devices, "archives": self.archives,
            "sessions_moved": self.sessions_moved, "bytes_moved": self.bytes_moved,
            "sessions_lost": self.lost[0], "tokens_lost": self.lost[1],
            "blocks_short": self.blocks_short, "seconds": self.seconds,
            "reports": [msgspec.to_builtins(r) for r in self.reports],
        }


def drain_node(cluster: MemkvCluster, node_id: str | None = None) -> NodeDrain:
    """Move everything off a Ray node that is about to leave, losing nothing.

    Its archive stops counting as a replica (repair copies its blocks to the
    others while it can still be read), every device on it hands its
    sessions to devices elsewhere (:mod:`memkv.router.drain`; reads
    are served throughout), then repair runs until every block some session
    holds has its copies on the archives that stay.

    Args:
        node_id: the Ray node id (a unique prefix will do); None: this
            process's node (a worker pod's preStop hook).

    Raises:
        InvalidInputError: no memkv device or archive runs on that node.
    """
    started = time.monotonic()
    node_id = node_id or ray.get_runtime_context().get_node_id()
    # The router's members now (this client's may be stale: lost, joined).
    ops = [RouterOpsHandle(h) for h in cluster.routers.handles]
    cluster.devices = ops[0].device_actors().result()
    cluster.archives = ops[0].archive_actors().result()
    devices = _members_on(node_id, cluster.devices)
    archives = _members_on(node_id, cluster.archives)
    if not devices and not archives:
        raise InvalidInputError(f"no memkv device or archive runs on node {node_id}")
    for archive in archives:
        for retired in [shard.retire_archive(archive) for shard in ops]:
            retired.result()
    reports = []
    for device in devices:
        for shard in ops:
            reports.append(shard.drain_device(device).result())
        cluster.devices.pop(device, None)
    repair = None
    if archives:
        for _ in range(_DRAIN_REPAIR_PASSES):
            repair = ops[0].repair_replicas().result()
            if repair.under_replicated == 0:
                break
    return NodeDrain(
        node=node_id, devices=devices, archives=archives, reports=reports,
        blocks_short=repair.under_replicated if repair is not None else 0,
        seconds=round(time.monotonic() - started, 3),
    )


def _members_on(node_id: str, members: dict[str, ActorHandle]) -> list[str]:
    """Names of ``members`` whose ``node()`` is ``node_id`` (or a prefix of it either way)."""
    found = []
    for name in sorted(members):
        try:
            at = MemberHandle(members[name]).node().result()
        except ACTOR_GONE_ERRORS:
            continue  # gone already: nothing of it to move
        if at.startswith(node_id) or node_id.startswith(at):
            found.append(name)
    return found


def drain_to_archive(
    cluster: MemkvCluster,
    timeout_s: float,
    progress: Callable[[str, int, int], None] | None = None,
    batch_blocks: int = 64,
) -> bool:
    """Give every held block a durable archive copy (a planned stop).

    Devices write, batch by batch, the blocks their sessions hold that live
    only in memory; the router shards' journals are made durable last. A
    restart then serves every session again, ``memory`` mode included.
    Stops at ``timeout_s`` (what is left is lost with the memory, as in a
    crash). ``progress(device_id, written so far, left)`` after each batch.
    Returns whether everything was written.
    """
    deadline = time.monotonic() + timeout_s
    complete = True
    for device_id, handle in sorted(cluster.devices.items()):
        written = 0
        while True:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                complete = False
                break
            try:
                done, left = DeviceHandle(handle).archive_held(batch_blocks).result(left_s)
            except (*ACTOR_GONE_ERRORS, ray.exceptions.GetTimeoutError) as e:
                logger.warning("device %s was not drained: %s", device_id, e)
                complete = False
                break
            written += int(done)
            if progress is not None:
                progress(device_id, written, int(left))
            if left == 0:
                break
    try:
        flushes = [RouterOpsHandle(h).flush_journal() for h in cluster.routers.handles]
        for flushed in flushes:
            flushed.result(timeout=max(deadline - time.monotonic(), 1.0))
    except (*ACTOR_GONE_ERRORS, ray.exceptions.GetTimeoutError) as e:
        logger.warning("a router journal was not made durable: %s", e)
        complete = False
    return complete
