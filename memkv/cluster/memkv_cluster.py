"""``MemkvCluster``: memkv's in-cluster client API, over the router shards and devices.

Session calls go to the shard that owns the session, through its typed
:class:`~memkv.actors.handles.SessionServiceHandle`, and answer the session
service's own messages (:mod:`memkv.protocol.services`); block reads go to the
devices directly, through Ray's object store or (same node) shared memory.
:func:`memkv.cluster.connect` and :func:`memkv.cluster.attach` make one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TypeVar

import numpy as np
import ray
import torch
from ray.actor import ActorHandle
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
)

from memkv.actors.handles import (
    ACTOR_GONE_ERRORS,
    MemberHandle,
    Pending,
)
from memkv.actors.restarts import through_restarts
from memkv.actors.router_shards import (
    RouterShards,
    merge_created,
    merge_located,
    merge_prefix,
    merge_stats,
)
from memkv.cluster.operations import NodeDrain, drain_node, drain_to_archive
from memkv.config import MemkvConfig
from memkv.errors import InvalidInputError, UnknownBlockError, WrongNodeError
from memkv.protocol.enums import parse_ack, parse_priority
from memkv.protocol.forks import fork_request, tail_of
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.members import Answer, BlockReader
from memkv.protocol.messages import PlanEntry, ReadPlan
from memkv.protocol.payload import READ_BATCH_BLOCKS, READ_WINDOW_BATCHES, BlockPayload
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    CreateSession,
    LayoutSpec,
    ResumeAnswer,
    RewindSession,
    SessionView,
)
from memkv.protocol.stats import ClusterStats
from memkv.shm.same_node import HostLease, SameNodeReader, shm_identity
from memkv.shm.staging import PutStaging, staging_for, staging_node
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.payloads import from_payload, to_payload

__all__ = ["MemkvCluster", "NodeDrain"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# A read that hits a device while it restarts is retried this often after the
# router has recovered the device.
_DEVICE_RETRIES = 1
_CLOSE_TIMEOUT_S = 30.0
#: How long a read waits for a router shard Ray is restarting (its node lost: a new
#: node, the journal replayed from the archives).
ROUTER_RESTART_WAIT_S = 120.0


def _from_router(call: Callable[[], Pending[_T]]) -> _T:
    """A router shard's answer to ``call()``, asked again while the router restarts
    (reads and recoveries only: they change nothing a second call would change
    again, so one that ran before its answer was lost is safe)."""
    return through_restarts(lambda: call().result(), timeout_s=ROUTER_RESTART_WAIT_S)


class MemkvCluster:
    """A connection to memkv's actors, with the in-cluster client API.

    In-cluster readers get blocks through Ray's object store (zero-copy reads);
    the HTTP gateway is the way in from outside the cluster.
    """

    def __init__(
        self,
        config: MemkvConfig,
        routers: RouterShards,
        devices: dict[str, ActorHandle],
        archives: dict[str, ActorHandle],
        *,
        owned: list[ActorHandle],
        started_ray: bool,
    ) -> None:
        self.config = config
        # The session table's shards; each session's calls go to its owner.
        self.routers = routers
        self.router = self.routers.first
        self.devices = devices
        self.archives = archives
        self._owned = owned
        self._started_ray = started_ray
        self._closed = False
        self._readers: dict[str, SameNodeReader] = {}
        self._remote_devices: set[str] = set()  # devices of other nodes: no same-node reads
        # Appends staged in shared memory for this node's devices (memkv.shm.staging):
        # made on the first append, None when no device runs here (or after a refusal).
        self._staging: PutStaging | None = None
        self._staging_checked = False

    # -- sessions ----------------------------------------------------------------------

    def create_session(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str = "default",
        priority: str = "normal",
        ack: str | None = None,
        exact_only: bool = False,
        finite_only: bool = False,
        near_node: str | None = None,
    ) -> SessionView:
        """A new session; ``ack`` (``memory`` / ``archive``) and ``exact_only``:
        see docs/durability.md; ``finite_only``: appends through a gateway holding
        NaN or inf are refused (docs/security.md); ``near_node``: on a device of
        that Ray node if it has one ("self": this process's node, whose reads
        then take the same-node path)."""
        if near_node == "self":
            near_node = ray.get_runtime_context().get_node_id()
        request = CreateSession(
            session_id=session_id, layout=LayoutSpec.of(layout), namespace=namespace,
            priority=parse_priority(priority), ack=parse_ack(ack),
            exact_only=exact_only, finite_only=finite_only, near_node=near_node,
        )
        return self.routers.service(session_id).create_session(request).result()

    def create_sessions(self, requests: Sequence[CreateSession]) -> list[SessionView]:
        """Many sessions in one call per router shard (the journal made durable once).

        Raises:
            InvalidInputError, ConflictError, CapacityError: naming the request's index
                (``spec <i>``); the ones before it are created (retry from there).
        """
        indices, calls = self.routers.create_sessions(requests)
        return merge_created(indices, [c.result() for c in calls])

    def session(self, session_id: str) -> SessionView:
        return self.routers.service(session_id).session(session_id).result()

    def put_kv(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> AppendAnswer:
        """Store a session's whole KV (per-layer K and V for every token so far).

        Only blocks from the first one that differs from the stored chain are
        sent: earlier turns' blocks are never copied again.
        """
        record = self.session(session_id)
        layout = record.layout.layout()
        tokens = [int(t) for t in token_ids]
        chain = chain_hashes(tokens, layout, record.namespace)
        start = 0
        for old, new in zip(record.chain, chain, strict=False):
            if bytes(old) != bytes(new):
                break
            start += 1
        blocks = split_kv(layout, keys, values)
        return self._put(session_id, tokens, chain, blocks[start:], start)

    def put_blocks(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        blocks: Sequence[torch.Tensor],
        start_block: int = 0,
        *,
        staging: PutStaging | None = None,
    ) -> AppendAnswer:
        """Store blocks ``start_block ..`` of a session whose tokens so far are ``token_ids``.

        ``staging``: a segment of the caller's the blocks were written into
        (:func:`memkv.shm.staging.staging_for`): a device of this node copies them
        from there, with no copy on this side.
        """
        record = self.session(session_id)
        tokens = [int(t) for t in token_ids]
        chain = chain_hashes(tokens, record.layout.layout(), record.namespace)
        return self._put(session_id, tokens, chain, list(blocks), start_block, staging)

    def _put(
        self,
        session_id: str,
        tokens: list[int],
        chain: Sequence[bytes],
        blocks: Sequence[torch.Tensor],
        start_block: int,
        caller_staging: PutStaging | None = None,
    ) -> AppendAnswer:
        if len(blocks) != len(chain) - start_block:
            raise InvalidInputError(
                f"{len(tokens)} tokens make {len(chain)} blocks; from block {start_block} "
                f"expected {len(chain) - start_block} blocks, got {len(blocks)}"
            )
        payloads = [to_payload(chain[start_block + i], b) for i, b in enumerate(blocks)]

        request = AppendTurn(session_id=session_id, token_ids=AppendTurn.pack_tokens(tokens),
                             start_block=start_block, chain=tuple(bytes(k) for k in chain))

        def put(sent: Sequence[object]) -> AppendAnswer:
            return self.routers.service(session_id).put_blocks(request, list(sent)).result()

        if caller_staging is not None and payloads:
            in_place = caller_staging.describe(payloads, staging_node())
            if in_place is not None:
                try:
                    return put(in_place)
                except WrongNodeError:
                    pass  # the session's device is on another node: by value below
        staging = self._put_staging()
        slot = staging.lease(sum(p.nbytes for p in payloads)) if staging and payloads else None
        if slot is not None and staging is not None:
            # One copy into shared memory the device copies from: no object store.
            copies = []
            for p in payloads:
                view = slot.take(p.nbytes)
                assert view is not None  # the slot was sized for every block
                dst = np.frombuffer(view, dtype=p.data.dtype).reshape(p.data.shape)
                np.copyto(dst, p.data)
                copies.append(BlockPayload(p.key, p.dtype, dst))
            staged = staging.describe(copies, staging_node())
            assert staged is not None  # every copy lies in the slot
            result: AppendAnswer
            # The slot is reused only once the call has answered (the device has
            # copied); an interrupt mid-call leaves it taken rather than risk that.
            try:
                result = put(staged)
            except WrongNodeError:
                slot.release()
                self._drop_staging()  # this node's devices are not where sessions live
            except Exception:
                slot.release()
                raise
            else:
                slot.release()
                return result
        # By reference: the router forwards the refs and the device maps the
        # blocks from the object store, so no process copies them on the way.
        return put([ray.put(p) for p in payloads])

    def _put_staging(self) -> PutStaging | None:
        """This process's staging segment, made once a device runs on its node."""
        if not self._staging_checked:
            self._staging_checked = True
            self._staging = staging_for([MemberHandle(d) for d in self.devices.values()],
                                        self.config.gateway.put_staging_bytes)
        return self._staging

    def _drop_staging(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def resume(self, session_id: str) -> ResumeAnswer:
        """Answers at once with the chain and each block's tier; blocks follow lazily."""
        return self.routers.service(session_id).resume(session_id).result()

    def read_session(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> Iterator[tuple[bytes, torch.Tensor]]:
        """Yield ``(key, block)`` in chain order, fetched lazily in small pipelined batches.

        A batch of :data:`READ_BATCH_BLOCKS` is one object in the node's object
        store (zero-copy read-only views: copy before writing); at most
        :data:`READ_WINDOW_BATCHES` are in flight, so the device promotes
        blocks just ahead of the reader, and the first arrives before the last
        is loaded. If the device dies mid-read, the router recovers it (from
        the archive) and the read goes on from the next block. Whether each
        block is exact: :meth:`read_session_payloads`.
        """
        for payload in self.read_session_payloads(session_id, start, end):
            yield payload.key, from_payload(payload)

    def read_session_payloads(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> Iterator[BlockPayload]:
        """:meth:`read_session`'s blocks with what is known of each: ``exact`` (False
        once its bytes went through a lossy step), ``lossy`` (which one:
        memkv.protocol.exactness), ``tier`` (where it was found); ``data`` is a
        read-only view (``memkv.protocol.payload.from_payload`` makes the tensor)."""
        position = start
        attempt = 0
        service = self.routers.service(session_id)
        while True:
            route = _from_router(partial(service.read_route, session_id, position, end))
            device_id, device = route.device_id, route.device
            if device is None:  # the session holds no block yet
                return
            try:
                for payload in _pipelined(device, list(route.keys), session_id):
                    position += 1
                    yield payload
                return
            except ACTOR_GONE_ERRORS:
                if attempt >= _DEVICE_RETRIES:
                    raise
                attempt += 1
                _from_router(partial(service.device_failed, device_id))

    def get_blocks(self, session_id: str, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """Blocks by key from the session's device (retried once if the device restarted)."""
        service = self.routers.service(session_id)
        asked: list[str] = []  # the device of each attempt

        def recover(_: RetryCallState) -> None:
            _from_router(partial(service.device_failed, asked[-1]))  # it recovers it

        for attempt in Retrying(
            retry=retry_if_exception_type(ACTOR_GONE_ERRORS),
            stop=stop_after_attempt(1 + _DEVICE_RETRIES),
            before_sleep=recover,
            reraise=True,
        ):
            with attempt:
                device_id, device = _from_router(partial(service.device_of, session_id))
                asked.append(device_id)
                payloads = device.get_blocks([bytes(k) for k in keys], session_id).result()
                return [from_payload(p) for p in payloads]
        raise AssertionError("unreachable: Retrying reraises")  # pragma: no cover

    def match_prefix(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int]
    ) -> tuple[int, list[bytes]]:
        """Leading tokens of ``token_ids`` that sessions of ``namespace`` cached, and their keys."""
        tokens = [int(t) for t in token_ids]
        found = merge_prefix(ray.get(self.routers.match_prefix(layout, namespace, tokens)))
        return found.tokens, list(found.blocks)

    def blocks_by_key(
        self, keys: Sequence[bytes], namespace: str, *, same_node: bool = False
    ) -> list[BlockPayload]:
        """Blocks of ``namespace`` by key, in the order asked, from whichever devices hold them.

        ``same_node``: blocks on a device of this node are copied out of its
        shared memory under a lease (checksum checked) instead of through the
        object store; the device must allow it (``device.same_node_reads``),
        else it plans nothing and the blocks come in-cluster.

        Raises:
            UnknownBlockError: a key that no device of the namespace holds.
        """
        wanted = [bytes(k) for k in keys]
        groups = merge_located([p.result() for p in self.routers.locate_blocks(wanted, namespace)])
        found: dict[bytes, BlockPayload] = {}
        for device_id, device, group in groups:
            if same_node and device_id not in self._remote_devices:
                try:
                    copies = self._reader(device_id, device).read(group)
                except WrongNodeError:
                    self._remote_devices.add(device_id)
                    copies = []
                for c in copies:
                    found[c.key] = BlockPayload(c.key, c.dtype, c.array, c.found, c.exact, c.lossy)
            for payload in device.get_blocks([k for k in group if k not in found]).result():
                found[payload.key] = payload
        missing = [k for k in wanted if k not in found]
        if missing:
            raise UnknownBlockError(
                f"{len(missing)} of {len(wanted)} blocks are not held in namespace "
                f"{namespace!r} (first {missing[0].hex()})"
            )
        return [found[k] for k in wanted]

    def lease_blocks(self, keys: Sequence[bytes], namespace: str, ttl_s: float = 30.0
                     ) -> tuple[HostLease, Callable[[], None]]:
        """Blocks of ``namespace`` pinned in this node's shared memory, and how to let go.

        Blocks on devices of other nodes (or of a deployment without
        ``device.same_node_reads``) are answered None: read them with
        :meth:`blocks_by_key`. The release does not wait for the devices.

        Raises:
            UnknownBlockError: a key that no device of the namespace holds.
        """
        wanted = [bytes(k) for k in keys]
        groups = merge_located([p.result() for p in self.routers.locate_blocks(wanted, namespace)])
        plans: list[tuple[SameNodeReader, ReadPlan]] = []
        where: dict[bytes, tuple[ReadPlan, PlanEntry]] = {}
        for device_id, device, group in groups:
            if device_id in self._remote_devices:
                continue
            reader = self._reader(device_id, device)
            try:
                plan = reader.plan(group)
            except WrongNodeError:
                self._remote_devices.add(device_id)
                continue
            if not plan.lease_id:
                continue
            plans.append((reader, plan))
            for entry in plan.entries:
                if entry is not None:
                    where[entry.key] = (plan, entry)

        def release() -> None:
            for reader, plan in plans:
                reader.release_async(plan)

        lease = HostLease(shm_identity(), tuple(p for _, p in plans),
                          tuple(where.get(k) for k in wanted))
        return lease, release

    def _reader(self, device_id: str, device: BlockReader) -> SameNodeReader:
        """One reader per device: its segment mappings are kept between reads."""
        reader = self._readers.get(device_id)
        if reader is None:
            node_id = ray.get_runtime_context().get_node_id()
            reader = self._readers[device_id] = SameNodeReader(device, node_id=node_id)
        return reader

    def suspend(self, session_id: str, *, offline: bool = False) -> SessionView:
        return self.routers.service(session_id).suspend(session_id, offline).result()

    def set_priority(self, session_id: str, priority: str) -> SessionView:
        service = self.routers.service(session_id)
        return service.set_priority(session_id, parse_priority(priority)).result()

    def delete_session(self, session_id: str) -> None:
        self.routers.service(session_id).delete_session(session_id).result()

    def fork_session(self, session_id: str, new_id: str, at_tokens: int | None = None,
                     token_ids: Sequence[int] | None = None) -> SessionView:
        """A new session ``new_id`` holding the first ``at_tokens`` tokens of
        ``session_id`` (None: all), sharing its blocks: no byte is copied but a
        partial last block's (:mod:`memkv.router.forks`). ``token_ids``: the
        session's tokens, needed when ``at_tokens`` ends inside a block."""
        parent = self.session(session_id)
        tail = tail_of(parent.layout.layout(), parent.tokens, at_tokens or parent.tokens,
                       token_ids)
        request = fork_request(parent, new_id, at_tokens, tail_tokens=tail)
        return self.routers.service(new_id).fork_session(request).result()

    def rewind_session(self, session_id: str, tokens: int,
                       token_ids: Sequence[int] | None = None) -> SessionView:
        """Keep the session's first ``tokens`` tokens; the blocks after them are let go.
        ``token_ids``: the session's tokens, needed when ``tokens`` ends inside a block."""
        tail = None
        if token_ids is not None:
            view = self.session(session_id)
            tail = tail_of(view.layout.layout(), view.tokens, tokens, token_ids)
        request = RewindSession(session_id=session_id, tokens=tokens, tail_tokens=tail)
        return self.routers.service(session_id).rewind_session(request).result()

    def stats(self) -> ClusterStats:
        return merge_stats(ray.get(self.routers.stats()))

    def device_of(self, session_id: str) -> str:
        service = self.routers.service(session_id)
        device_id, _ = _from_router(partial(service.device_of, session_id))
        return device_id

    # -- lifecycle ---------------------------------------------------------------------

    def disconnect(self) -> None:
        """Leave the cluster's (detached) actors running; disconnect from Ray."""
        if self._closed:
            return
        self._closed = True
        self._close_readers()
        if ray.is_initialized():
            ray.shutdown()

    def drain_node(self, node_id: str | None = None) -> NodeDrain:
        """Move everything off a Ray node that is about to leave, losing nothing
        (:func:`memkv.cluster.operations.drain_node`)."""
        return drain_node(self, node_id)

    def drain_to_archive(
        self,
        timeout_s: float,
        progress: Callable[[str, int, int], None] | None = None,
        batch_blocks: int = 64,
    ) -> bool:
        """Give every held block a durable archive copy (a planned stop:
        :func:`memkv.cluster.operations.drain_to_archive`). Returns whether
        everything was written."""
        return drain_to_archive(self, timeout_s, progress, batch_blocks)

    @property
    def owns_actors(self) -> bool:
        """Whether :meth:`shutdown` stops actors (the embedded default), not only leaves."""
        return bool(self._owned)

    def shutdown(self) -> None:
        """Stop the actors this connection created, and Ray if it started it.

        Against a cluster it created nothing (its actors are detached and
        shared), so this only disconnects.
        """
        if self._closed:
            return
        self._closed = True
        self._close_readers()
        # Close first: devices unlink their shared-memory warm pools and the
        # archive flushes; ray.kill alone would leave both behind.
        closing = [MemberHandle(h).close() for h in self._owned if h not in self.routers.handles]
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        try:
            for closed in closing:
                closed.result(timeout=max(deadline - time.monotonic(), 0.0))
        except (*ACTOR_GONE_ERRORS, ray.exceptions.GetTimeoutError) as e:
            logger.warning("some memkv actors did not close cleanly: %s", e)
        for handle in self._owned:
            try:
                ray.kill(handle, no_restart=True)
            except ValueError:  # already gone
                pass
        if self._started_ray:
            ray.shutdown()

    def _close_readers(self) -> None:
        self._drop_staging()
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> MemkvCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _pipelined(device: BlockReader, keys: list[bytes], stream: str
               ) -> Iterator[BlockPayload]:
    """Payloads of ``keys`` in order, with a bounded window of batched fetch_blocks calls.

    Each batch arrives as a reference to one object-store object (see
    ``DeviceCache.fetch_blocks``) whose arrays this process maps read-only.
    """
    batches = [keys[i : i + READ_BATCH_BLOCKS] for i in range(0, len(keys), READ_BATCH_BLOCKS)]
    in_flight: deque[Answer[list[BlockPayload]]] = deque()
    for batch in batches:
        in_flight.append(device.fetch_blocks(batch, stream))
        if len(in_flight) > READ_WINDOW_BATCHES:
            yield from in_flight.popleft().result()
    while in_flight:
        yield from in_flight.popleft().result()
