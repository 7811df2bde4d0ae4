"""The device actor: :class:`DeviceCache`, a shell over the plain block store.

:class:`~memkv.storage.device.service.DeviceService` holds the logic (the
tiers, reads, plans, prefetch, stats); this shell gives it what only a Ray
process has: the node's archive actor as its cold tier (:class:`RemoteColdTier`,
found by name so a restart finds it again), ``ray.put`` to hand read batches
over through the object store, this node's id, and appends whose blocks arrive
as object references.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from memkv.actors.payload import BlockPayload, StagedBlock
from memkv.config import DeviceSettings
from memkv.protocol.enums import Tier
from memkv.protocol.members import StoredBlocks
from memkv.protocol.messages import ChainUpdate
from memkv.protocol.stats import ArchiveStats
from memkv.storage.codecs import decode_frame, encode_stored
from memkv.storage.config import CodecConfig, StoreConfig
from memkv.storage.device.service import DeviceService, attach_priority_session
from memkv.storage.device.warm_segments import warm_segment_name
from memkv.storage.tiers import ColdStats, StoredBlock

__all__ = [
    "DeviceCache",
    "DeviceCacheActor",
    "RemoteColdTier",
    "attach_priority_session",
    "warm_segment_name",
]

# Pause between retries while the archive actor restarts.
_ARCHIVE_RETRY_S = 0.2


class RemoteColdTier:
    """The store's cold tier, kept by an archive actor (shared by the node's devices).

    Blocks are encoded here (the device's CPU does the codec work) and sent as
    frames. ``remove`` does nothing: another device's session may hold the same
    content-addressed block, so only the router, which sees every session,
    deletes archived blocks.
    """

    tier = Tier.COLD
    owns_sessions = False
    capacity_bytes: int | None = None

    def __init__(
        self, archive: Any, codecs: CodecConfig, *, restart_timeout_s: float = 60.0
    ) -> None:
        self._archive = archive
        self._codecs = codecs
        self._restart_timeout_s = restart_timeout_s

    def _call(self, call: Callable[[Any], Any]) -> Any:
        """``ray.get(call(archive handle))``, waiting out a restart (it rebuilds its index).

        Every archive call is idempotent (puts of content-addressed frames,
        reads, membership), so retrying one that may have run is safe.
        """
        for attempt in Retrying(
            retry=retry_if_exception_type(RayActorError),
            stop=stop_after_delay(self._restart_timeout_s),
            wait=wait_fixed(_ARCHIVE_RETRY_S),
            reraise=True,
        ):
            with attempt:
                return ray.get(call(self._archive))
        raise AssertionError("unreachable: Retrying reraises")  # pragma: no cover

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and bool(self._call(lambda a: a.contains.remote([key]))[0])

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        present = self._call(lambda a: a.contains.remote(list(keys)))
        return [k for k, ok in zip(keys, present, strict=True) if not ok]

    def put(self, key: bytes, block: StoredBlock, *, fingerprint: bytes, codec: str) -> int:
        frame = encode_stored(self._codecs, codec, block)
        self._call(lambda a: a.put_frames.remote([(bytes(key), frame, fingerprint)]))
        return len(frame)

    def put_many(
        self, items: Sequence[tuple[bytes, StoredBlock, bytes, str]], *, durable: bool = False
    ) -> list[int]:
        """Encode every block here, then one archive call for them all.

        ``durable``: the archive fsyncs (group-committed) before it answers.
        """
        frames = [(bytes(k), encode_stored(self._codecs, c, b), fp) for k, b, fp, c in items]
        self._call(lambda a: a.put_frames.remote(frames, durable))
        return [len(frame) for _, frame, _ in frames]

    def sync(self) -> None:
        self._call(lambda a: a.flush.remote())

    def load(self, key: bytes) -> torch.Tensor:
        (frame,) = self._call(lambda a: a.get_frames.remote([bytes(key)]))
        return decode_frame(frame)

    def load_many(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """One archive call for every frame, decoded here."""
        frames = self._call(lambda a: a.get_frames.remote([bytes(k) for k in keys]))
        return [decode_frame(f) for f in frames]

    def codecs(self, keys: Sequence[bytes]) -> list[str]:
        found: list[str] = self._call(lambda a: a.codecs.remote([bytes(k) for k in keys]))
        return found

    def remove(self, key: bytes) -> None:
        return None

    def block_keys(self) -> Iterator[bytes]:
        return iter(())

    def stats(self) -> ColdStats:
        s: ArchiveStats = self._call(lambda a: a.stats.remote())
        return ColdStats(s.blocks, s.live_bytes, s.dead_bytes)

    def live_bytes(self) -> int:
        return self.stats().live_bytes

    def close(self) -> None:
        return None


class DeviceCache(DeviceService):
    """A :class:`DeviceService` in a Ray actor (see :class:`DeviceService` for the rest).

    Args:
        archive: the node's ArchiveService actor, or its name in ``namespace``;
            None keeps a local cold tier (single-process use).
        namespace: the deployment's Ray namespace (None: the caller's job's).
            Passed, not read from the runtime context: an actor runs in the
            namespace of the job that created it, which need not be the one
            its deployment's names live in.
        put_object: how read batches are handed over (``ray.put``: the object store).
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
    ) -> None:
        if namespace is None and ray.is_initialized():
            namespace = ray.get_runtime_context().namespace
        archive_name = archive if isinstance(archive, str) else ""
        if isinstance(archive, str):
            # By name: a handle passed as a constructor argument lives in the
            # object store, and a restart after its owner exits would fail.
            archive = ray.get_actor(archive, namespace=namespace)

        def cold_tier(codecs: CodecConfig) -> RemoteColdTier:
            return RemoteColdTier(archive, codecs)

        super().__init__(
            device_id, store_config, cold_tier=cold_tier if archive is not None else None,
            same_node_reads=same_node_reads, devices_on_node=devices_on_node,
            put_object=put_object,
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local",
            # Device names repeat across deployments (namespaces) on one node.
            segment_scope=namespace or "",
            archive_name=archive_name,
        )

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


#: The actor. A few concurrent calls (the store has its own lock) let a prefetch
#: run beside a reader; Ray restarts it if its process dies, with an empty
#: store, which the router detects by the changed incarnation.
# (Ray's stubs leave max_concurrency out of remote()'s overloads.)
DeviceCacheActor = ray.remote(  # type: ignore[call-overload]
    max_restarts=-1, max_task_retries=0, max_concurrency=4
)(DeviceCache)
