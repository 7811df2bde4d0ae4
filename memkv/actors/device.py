"""The device actor: :class:`DeviceCache`, a shell over the plain block store.

:class:`~memkv.device.service.DeviceService` holds the logic (the
tiers, reads, plans, prefetch, stats); this shell gives it what only a Ray
process has: the cluster's archive actors as its cold tier (:class:`ArchiveReplicas`,
found by name so a restart finds them again), ``ray.put`` to hand read batches
over through the object store, this node's id, and appends whose blocks arrive
as object references.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from memkv.actors.cold_replicas import ArchiveReplicas, replica_order
from memkv.actors.handles import named_actors
from memkv.actors.node_env import export_node_id
from memkv.config import DeviceSettings
from memkv.config.schema import KVEventsSettings
from memkv.device.kv_events import KVEventPublisher
from memkv.device.service import DeviceService, attach_priority_session
from memkv.protocol.members import StoredBlocks
from memkv.protocol.messages import ChainUpdate
from memkv.protocol.payload import BlockPayload, StagedBlock
from memkv.shm.ownership import warm_segment_name
from memkv.storage.config import CodecConfig, StoreConfig
from memkv.storage.pool_ladder import TierLadder
from memkv.storage.tier_events import TierEventLog

logger = logging.getLogger(__name__)

__all__ = [
    "ArchiveReplicas",
    "DeviceCache",
    "DeviceCacheActor",
    "attach_priority_session",
    "replica_order",
    "warm_segment_name",
]


class DeviceCache(DeviceService):
    """A :class:`DeviceService` in a Ray actor (see :class:`DeviceService` for the rest).

    Args:
        archive: the node's ArchiveService actor, or its name in ``namespace``;
            None keeps a local cold tier (single-process use).
        archives: the names of every archive this device may use, in
            preference order (:func:`replica_order`; ``archive`` first); empty:
            ``archive`` alone.
        archive_replicas: copies of each cold block, on that many archives.
        replica_timeout_s: how long a cold write waits for each copy (None: for all).
        namespace: the deployment's Ray namespace (None: the caller's job's).
            Passed, not read from the runtime context: an actor runs in the
            namespace of the job that created it, which need not be the one
            its deployment's names live in.
        put_object: how read batches are handed over (``ray.put``: the object store).
        kv_events: publish tier changes as vLLM's KV events (default: the device
            settings' ``kv_events``; :mod:`memkv.device.kv_events`).
    """

    def __init__(
        self,
        device_id: str,
        store_config: StoreConfig | DeviceSettings,
        archive: Any = None,
        *,
        same_node_reads: bool | None = None,
        devices_on_node: int = 1,
        put_object: Callable[[list[BlockPayload]], object] = ray.put,
        namespace: str | None = None,
        archives: Sequence[str] = (),
        archive_replicas: int = 1,
        replica_timeout_s: float | None = None,
        kv_events: KVEventsSettings | None = None,
    ) -> None:
        if ray.is_initialized():
            export_node_id()  # warm-tier paths may name $MEMKV_NODE_ID
        if namespace is None and ray.is_initialized():
            namespace = ray.get_runtime_context().namespace
        archive_name = archive if isinstance(archive, str) else ""
        members: list[tuple[str, Any]] = []
        if isinstance(archive, str):
            # By name: a handle passed as a constructor argument lives in the
            # object store, and a restart after its owner exits would fail.
            names = list(archives) or [archive]
            members = named_actors(names, namespace)
        elif archive is not None:
            members = [("archive", archive)]

        def cold_tier(codecs: CodecConfig) -> ArchiveReplicas:
            return ArchiveReplicas(members, codecs, replicas=archive_replicas,
                                   replica_timeout_s=replica_timeout_s)

        sizes = None
        if isinstance(store_config, DeviceSettings):
            kv_events = kv_events or store_config.kv_events
            # A deployment's settings say whether reads are planned (off unless
            # turned on); a plain StoreConfig (tests, one process) plans them.
            if same_node_reads is None:
                same_node_reads = store_config.same_node_reads
            # Resolved here, in the actor: only it knows whether Ray gave it a GPU
            # (Ray narrows CUDA_VISIBLE_DEVICES, so its GPU is cuda:0).
            device = store_config.resolve_device(0 if torch.cuda.is_available() else None)
            # Sized here too: 'auto' measures this node's free memory.
            sizes = store_config.tier_sizes(device, devices_on_node=devices_on_node)
            store_config = store_config.store_config(device=device, archive=None, sizes=sizes)
        super().__init__(
            device_id,
            store_config,
            cold_tier=cold_tier if archive is not None else None,
            same_node_reads=True if same_node_reads is None else same_node_reads,
            tier_sizes=sizes,
            put_object=put_object,
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local",
            # Device names repeat across deployments (namespaces) on one node.
            segment_scope=namespace or "",
            archive_name=archive_name,
        )
        self.kv_events: KVEventPublisher | None = None
        if kv_events is not None:
            self.kv_events = publish_tier_events(self.pool.ladder, kv_events, device_id)

    def put(  # also takes blocks by object reference
        self,
        update: ChainUpdate,
        blocks: Sequence[BlockPayload | StagedBlock | torch.Tensor | ray.ObjectRef],
        checksums: Sequence[int] | None = None,
        durable: bool = False,
        owner: str = "",
        since: tuple[str, int] | None = None,
    ) -> StoredBlocks:
        """:meth:`DeviceService.put`, with blocks sent by reference fetched first."""
        refs = [i for i, b in enumerate(blocks) if isinstance(b, ray.ObjectRef)]
        resolved: list[Any] = list(blocks)
        if refs:
            pending: list[Any] = [blocks[i] for i in refs]
            for i, value in zip(refs, ray.get(pending), strict=True):
                resolved[i] = value
        return super().put(update, resolved, checksums, durable, owner, since)

    def close(self) -> None:
        super().close()
        if self.kv_events is not None:
            self.kv_events.close()  # (after the pool: its last changes go out too)


def publish_tier_events(ladder: TierLadder, settings: KVEventsSettings,
                        device_id: str) -> KVEventPublisher:
    """Start publishing ``ladder``'s tier changes (``device.kv_events``) from this process."""
    log = TierEventLog()
    ladder.tier_events = log
    endpoint = settings.endpoint
    local_gpu = int(ray.get_gpu_ids()[0]) if ray.is_initialized() and ray.get_gpu_ids() else 0
    head, sep, port = endpoint.rpartition(":")
    if not settings.connect and endpoint.startswith("tcp://") and port.isdigit() and int(
            port) > 0 and sep:
        endpoint = f"{head}:{int(port) + local_gpu}"
    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    publisher = KVEventPublisher(log, endpoint, host=host, device_id=device_id,
                                 interval_s=settings.interval_s, connect=settings.connect)
    logger.info("device %s publishes kv events on %s", device_id, publisher.endpoint)
    return publisher


#: The actor. A few concurrent calls (the store has its own lock) let a prefetch
#: run beside a reader; Ray restarts it if its process dies, with an empty
#: store, which the router detects by the changed incarnation.
# (Ray's stubs leave max_concurrency out of remote()'s overloads.)
DeviceCacheActor = ray.remote(  # type: ignore[call-overload]
    max_restarts=-1, max_task_retries=0, max_concurrency=4
)(DeviceCache)
