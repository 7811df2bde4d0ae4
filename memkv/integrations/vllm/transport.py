"""How the vLLM connector reaches memkv: the HTTP gateway, or the cluster itself.

- ``gateway`` (default): any engine anywhere, with a tenant token. Where the
  gateway runs on the engine's host and serves shared memory
  (``device.same_node_reads``), loads are copied straight from the devices'
  segments under leases the gateway grants (``/v1/blocks/lease``); otherwise,
  or with ``same_node`` off, blocks travel as checksummed binary frames
  (docs/wire-format.md). The connector finds out by itself and logs which.
- ``cluster``: an engine inside memkv's Ray cluster joins it (``ray_address``)
  and talks to the router and devices directly: no HTTP, no token (the
  cluster is a trusted network), blocks through Ray's object store. With
  ``same_node`` on, blocks on a device of the engine's own node are copied out
  of its shared memory under a lease (the device must allow it:
  ``device.same_node_reads``); others still come in-cluster.

Both speak in memkv blocks ``[layers, 2, kv_heads, tokens, head_dim]`` and
raise on anything wrong; the connector turns every failure into recompute.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from memkv.errors import (
    ConflictError,
    CorruptDataError,
    InvalidInputError,
    UnknownSessionError,
)
from memkv.protocol.ids import PARTITION_SEPARATOR, scoped_session_id
from memkv.protocol.layout import KVLayout

if TYPE_CHECKING:
    from memkv.client.reserved import SlotReservation
    from memkv.cluster import MemkvCluster
    from memkv.shm.same_node import HostLease, SegmentMaps
    from memkv.shm.staging import PutStaging, StagingSlot

__all__ = [
    "ClusterTransport", "GatewayTransport", "KVTransport", "Leased", "transport_from_config",
]

logger = logging.getLogger(__name__)

TRANSPORTS = ("gateway", "cluster")


#: Blocks pinned in this host's shared memory, and how to give them back.
Leased = tuple["HostLease", Callable[[], None]]
#: After an answer without shared memory, how long loads go the plain way before asking again.
_NO_LEASES_RECHECK_S = 60.0
#: Partitions a transport keeps a scoped copy of (one per tenant of a shared engine).
_MAX_SCOPES = 1024
#: After no write reservation, how long saves are staged before one is asked for again.
_NO_RESERVATIONS_RECHECK_S = 10.0


class KVTransport(Protocol):
    """What the connector needs of memkv."""

    def match(self, token_ids: Sequence[int]) -> tuple[int, list[bytes]]:
        """Leading tokens cached (whole blocks) and their block keys."""
        ...

    def read(self, keys: Sequence[bytes], out: Sequence[Any] | None = None
             ) -> list[torch.Tensor]:
        """The blocks of ``keys``, in that order; read into ``out`` (one full-size
        buffer per key) where the transport copies them (a hint: it may not)."""
        ...

    def save(
        self,
        session_id: str,
        priority: str,
        token_ids: Sequence[int],
        blocks: Sequence[torch.Tensor],
        start_block: int,
        reserved: SlotReservation | None = None,
    ) -> None:
        """Append blocks ``start_block ..`` of ``token_ids`` to the session (created if new);
        blocks in ``reserved``'s slots are named, not sent."""
        ...

    def prepare_shared_memory(self, read_maps: SegmentMaps, reservations: bool) -> None:
        """Map this host's device segments (into ``read_maps``; with ``reservations``,
        also writable for :meth:`reserve`) at an engine's start."""
        ...

    def reserve(self, session_id: str, priority: str, token_ids: Sequence[int],
                count: int) -> SlotReservation | None:
        """Slots of the session's device's shared memory for the next save's ``count``
        blocks, ``token_ids`` the session's tokens after it (None: no such path here,
        or no room: stage or send instead)."""
        ...

    def lease(self, keys: Sequence[bytes]) -> Leased | None:
        """The blocks pinned in this host's shared memory (None: no such path here)."""
        ...

    def save_slot(self, nbytes: int) -> StagingSlot | None:
        """Space in this host's shared memory to copy a save of ``nbytes`` into, which
        :meth:`save` then names rather than sends (None: no such path here, or full)."""
        ...

    def warm_up(self) -> None:
        """Connect now (not at the first request): raises if memkv is not reachable."""
        ...

    def scoped(self, partition: str | None) -> KVTransport:
        """This transport in ``#partition`` of its namespace (memkv.protocol.ids): blocks
        hashed apart from the others' (None: itself)."""
        ...

    def close(self) -> None: ...


def _created_or_there(create: Callable[[], Any]) -> None:
    """Create a session; one that exists already is this turn's to append to."""
    try:
        create()
    except ConflictError:
        pass


def _check_keys(got: Sequence[bytes], wanted: Sequence[bytes]) -> None:
    if list(got) != list(wanted):
        raise CorruptDataError(
            f"asked memkv for {len(wanted)} blocks and got {len(got)} others; a cache is "
            f"never filled with blocks of other tokens"
        )


class GatewayTransport:
    """The memkv HTTP gateway, through :class:`memkv.client.Client`."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        url: str,
        token: str | None,
        namespace: str | None,
        same_node: bool = True,
        block_port: bool = True,
        save_staging_bytes: int = 0,
    ) -> None:
        from memkv.client import Client

        self.layout = layout
        self._same_node = same_node
        self._save_staging_bytes = save_staging_bytes
        self._namespace = namespace
        self._client = Client(url, token=token, timeout=30.0, retries=1, block_port=block_port)
        self._plain_until = 0.0
        self._no_reservations_until = 0.0
        # Leases go back off the engine's thread: a load's release came at the end of
        # its forward pass, a round trip (3 ms here) before the step's first token.
        self._releases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memkv-release")
        self.path = "unknown"  # how loads come: "shared memory", "block port" or "http"
        self.save_path = "unknown"  # how saves go: "reserved", "staging", or by value
        self._scopes: dict[str, GatewayTransport] = {}  # by partition (scoped())
        self._partition: str | None = None  # of a scoped copy: its sessions' ids end in it

    def match(self, token_ids: Sequence[int]) -> tuple[int, list[bytes]]:
        match = self._client.match(self.layout, self._namespace, list(token_ids))
        return int(match.tokens), [bytes(k) for k in match.blocks]

    def read(self, keys: Sequence[bytes], out: Sequence[Any] | None = None
             ) -> list[torch.Tensor]:
        blocks = self._client.read_blocks_by_key(self._namespace, list(keys), out=out)
        _check_keys([bytes(b.key) for b in blocks], keys)
        return [b.tensor for b in blocks]

    def save(
        self,
        session_id: str,
        priority: str,
        token_ids: Sequence[int],
        blocks: Sequence[torch.Tensor],
        start_block: int,
        reserved: SlotReservation | None = None,
    ) -> None:
        session_id = self._own(session_id)
        if reserved is None:  # a reservation was made for a session that exists
            self._create(session_id, priority)
        self._client.append_turn(
            session_id, list(token_ids), blocks=list(blocks), start_block=start_block,
            reserved=reserved, layout=self.layout,
        )

    def _own(self, session_id: str) -> str:
        """The session's id in this transport's partition (another partition's session of
        the same name is another session: its blocks are hashed apart)."""
        return session_id if self._partition is None else f"{session_id}:{self._partition}"

    def _create(self, session_id: str, priority: str) -> None:
        _created_or_there(lambda: self._client.create_session(
            session_id, self.layout, namespace=self._namespace, priority=priority
        ))

    def prepare_shared_memory(self, read_maps: SegmentMaps, reservations: bool) -> None:
        """Map this host's device segments now (an engine's start), not in its first
        load or save: ``read_maps`` those leased blocks are read from, and (with
        ``reservations``) those reserved slots are written into."""
        if not self._same_node:
            return
        started = time.monotonic()
        segments = self._client.host_segments()
        for segment in segments:
            read_maps.view(str(segment["segment"]), int(segment["segment_bytes"]),
                           str(segment["incarnation"]), populate=True)
        writable = (self._client.map_reservation_segments(segments)
                    if reservations and self._save_staging_bytes > 0 else 0)
        if segments:
            logger.info("memkv mapped %d device segments of this host (%.1f GiB; %d writable "
                        "for saves) in %.2f s", len(segments),
                        sum(int(s["segment_bytes"]) for s in segments) / 2**30, writable,
                        time.monotonic() - started)

    def reserve(self, session_id: str, priority: str, token_ids: Sequence[int],
                count: int) -> SlotReservation | None:
        """A write reservation where the gateway is on this host (one round trip for a
        session that exists; after an answer of none, none asked for a while)."""
        if not self._same_node or self._save_staging_bytes <= 0 \
                or time.monotonic() < self._no_reservations_until:
            return None
        session_id = self._own(session_id)
        try:
            reserved = self._client.reserve_slots(session_id, count, tokens=token_ids)
        except UnknownSessionError:
            self._create(session_id, priority)
            reserved = self._client.reserve_slots(session_id, count, tokens=token_ids)
        if reserved is None:
            self._no_reservations_until = time.monotonic() + _NO_RESERVATIONS_RECHECK_S
            if self.save_path != "staging":
                logger.info("memkv saves are staged in this host's shared memory (no write "
                            "reservation from the session's device)")
            self.save_path = "staging"
            return None
        if self.save_path != "reserved":
            logger.info("memkv saves go straight into the device's shared memory "
                        "(write reservations)")
        self.save_path = "reserved"
        return reserved

    def save_slot(self, nbytes: int) -> StagingSlot | None:
        """Space in the client's staging segment, while the gateway is on this host."""
        if not self._same_node or self._save_staging_bytes <= 0:
            return None
        staging = self._client.staging(self._save_staging_bytes)
        if staging is None or not self._client.stages_appends:
            return None
        return staging.lease(nbytes)

    def lease(self, keys: Sequence[bytes]) -> Leased | None:
        """Leases from a gateway on this host; None (for a while) when it is elsewhere."""
        if not self._same_node or time.monotonic() < self._plain_until:
            return None
        lease = self._client.lease_blocks(self._namespace, list(keys))
        plans = [p.lease_id for p in lease.plans]

        def give_back() -> None:
            for lease_id in plans:
                try:
                    self._client.release_lease(lease_id)
                except Exception:  # noqa: BLE001 - one that ran out is released already
                    logger.debug("memkv lease %s was not given back", lease_id, exc_info=True)

        def release() -> None:
            try:
                self._releases.submit(give_back)
            except RuntimeError:  # closing: give them back here
                give_back()

        if not lease.local or not plans:
            give_back()
            self._plain_until = time.monotonic() + _NO_LEASES_RECHECK_S
            path = "block port" if self._client.uses_block_port() else "http"
            if self.path != path:
                why = ("the gateway runs on another host" if not lease.local
                       else "the gateway serves no shared memory (device.same_node_reads off)")
                logger.info("memkv loads come over the gateway's %s: %s", path, why)
            self.path = path
            return None
        if self.path != "shared memory":
            logger.info("memkv loads come straight from this host's shared memory")
        self.path = "shared memory"
        return lease, release

    def warm_up(self) -> None:
        self._client.health()

    def scoped(self, partition: str | None) -> GatewayTransport:
        """This transport in ``#partition`` of its namespace: the same connection, blocks
        hashed apart (an engine shared by tenants keeps each one's KV in its own)."""
        if partition is None:
            return self
        found = self._scopes.get(partition)
        if found is None:
            found = copy.copy(self)
            found._namespace = f"{PARTITION_SEPARATOR}{partition}"
            found._partition = partition
            if len(self._scopes) >= _MAX_SCOPES:
                self._scopes.pop(next(iter(self._scopes)))
            self._scopes[partition] = found
        return found

    def close(self) -> None:
        self._releases.shutdown(wait=True)  # every lease given back before the client goes
        self._client.close()


class _Joining:
    """Joining memkv's Ray cluster in the background, waited on for a bounded time.

    ``ray.init`` can wait forever (a GCS that is not there, an address Ray
    rewrote), and a connector that waits with it never lets the engine start.
    One attempt runs at a time, on a daemon thread; callers wait for it until
    the first deadline and not at all after it (each request then computes
    instead), and a failed attempt is retried after ``retry_s``.
    """

    def __init__(self, join: Callable[[], Any], *, address: str, timeout_s: float,
                 retry_s: float = 30.0) -> None:
        self._join = join
        self._address = address
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + timeout_s
        self._joined: Any = None
        self._failed: BaseException | None = None
        self._failed_at = 0.0
        self._done = threading.Event()
        self._start()

    def _start(self) -> None:
        self._done.clear()
        threading.Thread(target=self._run, name="memkv-join-ray", daemon=True).start()

    def _run(self) -> None:
        try:
            self._joined = self._join()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who recomputes
            self._failed, self._failed_at = e, time.monotonic()
        finally:
            self._done.set()

    def get(self) -> Any:
        """The joined cluster.

        Raises:
            TimeoutError: not joined yet (the attempt goes on in the background).
            MemkvError | RayError | ...: the last attempt failed (a new one has started
                if ``retry_s`` passed since).
        """
        if not self._done.wait(max(0.0, self._deadline - time.monotonic())):
            raise TimeoutError(
                f"memkv's Ray cluster at {self._address!r} was not joined within "
                f"{self._timeout_s:g} s (connect_timeout_s); computing instead while "
                f"joining goes on in the background"
            )
        if self._joined is not None:
            return self._joined
        with self._lock:
            failed = self._failed
            if self._done.is_set() and time.monotonic() - self._failed_at >= self._retry_s:
                self._failed = None
                self._deadline = time.monotonic()  # requests never wait for a retry
                self._start()
        assert failed is not None
        raise failed


class ClusterTransport:
    """memkv's actors, joined from inside its Ray cluster (see the module)."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        address: str,
        ray_namespace: str | None,
        namespace: str,
        same_node: bool,
        connect_timeout_s: float = 10.0,
        save_staging_bytes: int = 0,
    ) -> None:
        from memkv.cluster import attach

        self.layout = layout
        self._namespace = namespace
        self._same_node = same_node
        self._timeout_s = connect_timeout_s
        self._save_staging_bytes = save_staging_bytes
        self._save_staging: PutStaging | None = None
        self._save_staging_checked = False
        self._root = self  # scoped copies share its staging
        self._scopes: dict[str, ClusterTransport] = {}
        self._joining = _Joining(
            lambda: attach(address, namespace=ray_namespace),
            address=address,
            timeout_s=connect_timeout_s,
        )

    @property
    def _cluster(self) -> MemkvCluster:
        cluster: MemkvCluster = self._joining.get()
        return cluster

    def match(self, token_ids: Sequence[int]) -> tuple[int, list[bytes]]:
        return self._cluster.match_prefix(self.layout, self._namespace, token_ids)

    def read(self, keys: Sequence[bytes], out: Sequence[Any] | None = None
             ) -> list[torch.Tensor]:
        # Zero-copy views of Ray objects (or shared memory): nothing to read into.
        from memkv.storage.payloads import from_payload

        payloads = self._cluster.blocks_by_key(keys, self._namespace, same_node=self._same_node)
        _check_keys([p.key for p in payloads], keys)
        return [from_payload(p) for p in payloads]

    def save(
        self,
        session_id: str,
        priority: str,
        token_ids: Sequence[int],
        blocks: Sequence[torch.Tensor],
        start_block: int,
        reserved: SlotReservation | None = None,
    ) -> None:
        # The id a gateway tenant of this name has for it: sessions of other
        # namespaces never collide with this one's.
        scoped = scoped_session_id(self._namespace, session_id)
        _created_or_there(lambda: self._cluster.create_session(
            scoped, self.layout, namespace=self._namespace, priority=priority
        ))
        self._cluster.put_blocks(scoped, list(token_ids), list(blocks), start_block,
                                 staging=self._save_staging)

    def prepare_shared_memory(self, read_maps: SegmentMaps, reservations: bool) -> None:
        pass  # reads map their plans' segments as they come; saves stage

    def reserve(self, session_id: str, priority: str, token_ids: Sequence[int],
                count: int) -> SlotReservation | None:
        return None  # in-cluster saves stage through the node's staging segment

    def lease(self, keys: Sequence[bytes]) -> Leased | None:
        if not self._same_node:
            return None
        return self._cluster.lease_blocks(keys, self._namespace)

    def save_slot(self, nbytes: int) -> StagingSlot | None:
        """Space in a staging segment of this process's, where a device of this node can
        copy from (:meth:`MemkvCluster.put_blocks` names the blocks, no copy)."""
        root = self._root
        if not root._same_node or root._save_staging_bytes <= 0:
            return None
        if not root._save_staging_checked:
            root._save_staging_checked = True
            from memkv.actors.handles import MemberHandle
            from memkv.shm.staging import staging_for

            devices = [MemberHandle(d) for d in root._cluster.devices.values()]
            root._save_staging = staging_for(devices, root._save_staging_bytes,
                                             role="client-stage")
            if root._save_staging is not None:
                root._save_staging.prefault()
        return root._save_staging.lease(nbytes) if root._save_staging is not None else None

    def warm_up(self) -> None:
        import ray

        ray.get(self._cluster.router.ping.remote(), timeout=self._timeout_s)

    def scoped(self, partition: str | None) -> ClusterTransport:
        """This transport in ``#partition`` of its namespace (sessions and blocks apart)."""
        if partition is None:
            return self
        root = self._root
        found = root._scopes.get(partition)
        if found is None:
            found = copy.copy(root)
            found._namespace = f"{root._namespace}{PARTITION_SEPARATOR}{partition}"
            if len(root._scopes) >= _MAX_SCOPES:
                root._scopes.pop(next(iter(root._scopes)))
            root._scopes[partition] = found
        return found

    def close(self) -> None:
        if self._save_staging is not None:
            self._save_staging.close()
            self._save_staging = None
        try:
            cluster = self._cluster
        except Exception:  # noqa: BLE001 - never joined: nothing to let go of
            return
        cluster.disconnect()


#: The client staging a same-host engine copies its saves into (a save larger than
#: what is free goes over the socket).
SAVE_STAGING_BYTES = 1 << 30


def _nonnegative_int(extra: dict[str, Any], name: str, default: int) -> int:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{name} must be an int >= 0, got {value!r}")
    return value


def transport_from_config(layout: KVLayout, extra: dict[str, Any]) -> KVTransport:
    """The transport ``kv_connector_extra_config`` asks for (see the connector's docstring).

    Raises:
        InvalidInputError: an unknown ``transport``, or ``cluster`` without ``ray_address``.
    """
    kind = str(extra.get("transport", "gateway"))
    if kind == "gateway":
        return GatewayTransport(
            layout,
            url=str(extra.get("url", "http://127.0.0.1:8080")),
            token=extra.get("token"),
            namespace=extra.get("namespace"),
            same_node=bool(extra.get("same_node", True)),
            block_port=bool(extra.get("block_port", True)),
            save_staging_bytes=_nonnegative_int(extra, "save_staging_bytes",
                                                SAVE_STAGING_BYTES),
        )
    if kind == "cluster":
        address = extra.get("ray_address")
        if not address:
            raise InvalidInputError(
                "transport 'cluster' needs ray_address (e.g. 'auto' on a node of the cluster)"
            )
        return ClusterTransport(
            layout,
            address=str(address),
            ray_namespace=extra.get("ray_namespace"),
            namespace=str(extra.get("namespace") or "default"),
            same_node=bool(extra.get("same_node", False)),
            connect_timeout_s=_positive(extra, "connect_timeout_s", 10.0),
            save_staging_bytes=_nonnegative_int(extra, "save_staging_bytes",
                                                SAVE_STAGING_BYTES),
        )
    raise InvalidInputError(f"transport must be one of {list(TRANSPORTS)}, got {kind!r}")


def _positive(extra: dict[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidInputError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
