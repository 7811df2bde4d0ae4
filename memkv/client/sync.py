"""The synchronous client."""

from __future__ import annotations

import http.client
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import numpy as np

from memkv import errors
from memkv.client.base import (
    AppendStaging,
    KnownSessions,
    fork_body,
    layout_conflict,
    rewind_body,
)
from memkv.client.frames import FRAMES_MEDIA_TYPE, BlockStream, append_body, read_block_frames
from memkv.client.transport import (
    DEFAULT_URL,
    RETRY_STATUSES,
    HttpConnections,
    PortConnections,
    auth_headers,
    error_from,
    port_error,
    raise_for_error,
    retrying,
)
from memkv.client.views import (
    Block,
    Match,
    create_body,
    match_body,
    parse_match,
    parse_resume,
    parse_session,
    parse_turn,
)
from memkv.port_connection import PortConnection, PortError, ReplyBody
from memkv.protocol.forks import tail_of
from memkv.protocol.layout import KVLayout
from memkv.protocol.port import AppendRequest, PortRequest, ReadKeysRequest, ReadRequest, Reply
from memkv.protocol.services import AppendAnswer, ResumeAnswer, SessionView
from memkv.protocol.wire import (
    WireError,
)

if TYPE_CHECKING:
    from memkv.client.reserved import DeviceSegments, SlotReservation
    from memkv.shm.same_node import HostLease
    from memkv.shm.staging import PutStaging

logger = logging.getLogger(__name__)


class Client:
    """Synchronous client of the memkv gateway.

    Args:
        base_url: the gateway, e.g. ``http://127.0.0.1:8080``.
        timeout: seconds per request (connect, read, write).
        retries: extra attempts for idempotent requests on connection errors and 502/503/504.
        transport: an httpx transport (tests); block bodies then go through httpx too.
        token: the bearer token (default: ``$MEMKV_TOKEN``; none for a gateway
            without authentication).
        block_port: send appends and session reads over the gateway's block
            port when it advertises one (``/healthz``); False: HTTP only.
            :attr:`block_path` says which is in use.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float = 60.0,
        retries: int = 2,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
        block_port: bool = True,
    ) -> None:
        self._auth = auth_headers(token)
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport, headers=self._auth
        )
        self._retries = retries
        # Block routes over http.client unless a custom transport is in play.
        self._blocks = HttpConnections(base_url, timeout) if transport is None else None
        self._ports = (
            PortConnections(base_url, self._auth, timeout, self._advertised_port)
            if block_port and transport is None
            else None
        )
        # Sessions this client appended to: layout, namespace and chain do not
        # need a round trip per append (a stale entry is refreshed on conflict).
        self._known = KnownSessions()
        self._staging = AppendStaging()
        self._device_segments: DeviceSegments | None = None  # made by reserve_slots

    def close(self) -> None:
        self._http.close()
        if self._device_segments is not None:
            self._device_segments.close()
        if self._blocks is not None:
            self._blocks.close()
        if self._ports is not None:
            self._ports.close()
        self._staging.close()

    def staging(self, nbytes: int) -> PutStaging | None:
        """This client's staging segment in shared memory (made on the first call, of
        ``nbytes``, its pages populated): blocks appended from a slot of it
        (``staging(n).lease(...)``) are named in the append rather than sent, and a
        gateway on this host reads them there (one copy fewer, no socket). None
        where there is no shared memory; appends from elsewhere send their bytes."""
        return self._staging.get(nbytes)

    @property
    def stages_appends(self) -> bool:
        """Whether appends name blocks in this client's staging (False: the gateway
        runs on another host, or there is no staging)."""
        return self._staging.active is not None

    @property
    def block_path(self) -> str:
        """``"block port"`` or ``"http"``: how KV bodies travel (known after the first)."""
        return "block port" if self._ports is not None and self._ports.usable else "http"

    def uses_block_port(self) -> bool:
        """Whether KV bodies go over the gateway's block port (connects to learn it)."""
        return self._ports is not None and self._ports.get() is not None

    def _advertised_port(self) -> int | None:
        port = self.health().get("block_port")
        return port if isinstance(port, int) and not isinstance(port, bool) else None

    def _over_port(
        self, request: PortRequest, body: Sequence[bytes | memoryview] = ()
    ) -> tuple[PortConnection, Reply, ReplyBody] | None:
        """A request over the block port (its id 0: the connection numbers it),
        retried like HTTP's; None: no port, use HTTP."""
        ports = self._ports
        assert ports is not None
        for attempt in retrying(self._retries):
            with attempt:
                conn = ports.get()
                if conn is None:
                    return None
                try:
                    reply, reply_body = conn.request(request, body)
                except PortError as e:
                    if conn.broken or e.status in RETRY_STATUSES:
                        ports.drop()
                    raise port_error(e) from None
                except (OSError, WireError):
                    ports.drop()
                    raise
                return conn, reply, reply_body
        raise AssertionError("unreachable: the last attempt raises")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, *, idempotent: bool, **kwargs: Any
    ) -> httpx.Response:
        for attempt in retrying(self._retries if idempotent else 0):
            with attempt:
                response = self._http.request(method, path, **kwargs)
                raise_for_error(response)
                return response
        raise AssertionError("unreachable: the last attempt raises")

    def _block_request(
        self,
        method: str,
        path: str,
        body: Iterable[bytes | memoryview] | None = None,
        length: int = 0,
        content_type: str = FRAMES_MEDIA_TYPE,
    ) -> http.client.HTTPResponse:
        """A block-route request over http.client, retried like :meth:`_request`.

        Only requests that are idempotent come here (reads, and appends, which
        carry a turn index).
        """
        if self._blocks is None:
            raise RuntimeError("no block connection with a custom transport")
        headers = {
            "content-type": content_type,
            "content-length": str(length),
            **self._auth,
        }
        blocks = self._blocks
        for attempt in retrying(self._retries):
            with attempt:
                conn = blocks.get()
                try:
                    conn.request(method, path, body=body, headers=headers)
                    response = conn.getresponse()
                except (OSError, http.client.HTTPException):
                    blocks.drop()
                    raise
                if response.status >= 400:
                    raise error_from(response.status, response.read())
                return response
        raise AssertionError("unreachable: the last attempt raises")

    # -- health and stats

    def health(self) -> dict[str, Any]:
        return dict(self._request("GET", "/healthz", idempotent=True).json())

    def ready(self) -> bool:
        return self._http.get("/readyz").status_code == 200

    def stats(self) -> dict[str, Any]:
        return dict(self._request("GET", "/v1/stats", idempotent=True).json())

    # -- sessions

    def create_session(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str | None = None,
        priority: str = "normal",
        ack: str | None = None,
        exact_only: bool = False,
        finite_only: bool = False,
        near: str | None = None,
    ) -> SessionView:
        """A new session; ``near``: ``"gateway"`` places it on a device of the
        gateway's node (its reads there take the same-node path), a Ray node id
        on that node's; by load otherwise."""
        body = create_body(session_id, layout, namespace, priority, ack, exact_only, finite_only,
                           near)
        r = self._request("POST", "/v1/sessions", json=body, idempotent=False)
        return self._known.remember(parse_session(r.json()))

    def session(self, session_id: str) -> SessionView:
        r = self._request("GET", f"/v1/sessions/{session_id}", idempotent=True)
        return self._known.remember(parse_session(r.json()))

    def suspend(self, session_id: str, *, offline: bool = False) -> SessionView:
        r = self._request(
            "POST",
            f"/v1/sessions/{session_id}/suspend",
            json={"offline": offline},
            idempotent=True,
        )
        return parse_session(r.json())

    def fork_session(self, session_id: str, new_id: str, *, at_tokens: int | None = None,
                     token_ids: Sequence[int] | None = None) -> SessionView:
        """A new session ``new_id`` holding the first ``at_tokens`` tokens of
        ``session_id`` (None: all): its blocks are shared, not copied (a partial last
        block is copied once). ``token_ids``: the session's tokens, needed when
        ``at_tokens`` ends inside a block."""
        tail = self._tail(session_id, at_tokens, token_ids)
        r = self._request("POST", f"/v1/sessions/{session_id}/fork",  # a retry would find
                              json=fork_body(new_id, at_tokens, tail), idempotent=False)  # new_id
        return self._known.remember(parse_session(r.json()))

    def rewind_session(self, session_id: str, tokens: int, *,
                       token_ids: Sequence[int] | None = None) -> SessionView:
        """Keep the session's first ``tokens`` tokens; the blocks after them are let go.
        ``token_ids``: the session's tokens, needed when ``tokens`` ends inside a block."""
        tail = self._tail(session_id, tokens, token_ids)
        r = self._request("POST", f"/v1/sessions/{session_id}/rewind",
                              json=rewind_body(tokens, tail), idempotent=True)
        return parse_session(r.json())

    def _tail(self, session_id: str, at: int | None,
                 token_ids: Sequence[int] | None) -> tuple[int, ...] | None:
        if token_ids is None or at is None:
            return None
        view = self.session(session_id)
        return tail_of(view.layout.layout(), view.tokens, at, token_ids)

    def resume(self, session_id: str) -> ResumeAnswer:
        r = self._request("POST", f"/v1/sessions/{session_id}/resume", idempotent=True)
        return parse_resume(r.json())

    def input_end(self, session_id: str) -> int:
        """Tell memkv a turn's input is complete (prefetch now). Returns blocks prefetched."""
        r = self._request("POST", f"/v1/sessions/{session_id}/input-end", idempotent=True)
        return int(r.json()["prefetched"])

    def delete_session(self, session_id: str) -> None:
        self._known.forget(session_id)
        self._request("DELETE", f"/v1/sessions/{session_id}", idempotent=False)

    # -- KV

    def append_turn(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[Any] | None = None,
        values: Sequence[Any] | None = None,
        *,
        blocks: Sequence[Any] | None = None,
        start_block: int | None = None,
        turn: int | None = None,
        reserved: SlotReservation | None = None,
        layout: KVLayout | None = None,
    ) -> AppendAnswer:
        """Append a turn: the session's tokens so far and their KV.

        Pass per-layer ``keys``/``values`` tensors for every token (only blocks
        not yet stored for the session are sent), or ready ``blocks`` (numpy
        arrays or tensors ``[layers, 2, kv_heads, tokens, head_dim]``) from
        ``start_block``. ``turn`` defaults to the session's turn + 1; a retry of
        the same turn is answered without storing anything again. ``reserved``:
        blocks that lie in its slots (:meth:`reserve_slots`) are named, not sent.
        ``layout``: the layout the blocks were computed in; a session of another
        layout refuses them (ConflictError) rather than storing them under its own
        model's hashes.
        """
        session = self._known.get(session_id) or self.session(session_id)
        if layout_conflict(session, layout) is not None:
            session = self.session(session_id)  # the view may be stale
            if (conflict := layout_conflict(session, layout)) is not None:
                raise conflict
        try:
            return self._append(session, token_ids, keys, values, blocks, start_block, turn,
                                reserved)
        except (errors.ConflictError, errors.PrefixNotStoredError) as e:
            # A stale view of ours: a conflict, or blocks a partial loss took since
            # (then, given every token's KV, the append goes again from what survived).
            if not self._known.worth_refreshing(e, session_id, turn,
                                                resendable=blocks is None):
                raise
            session = self.session(session_id)
            return self._append(session, token_ids, keys, values, blocks, start_block, turn,
                                reserved)

    def host_segments(self) -> list[dict[str, Any]]:
        """The shared-memory segments of the devices on the gateway's host (``device_id``,
        ``incarnation``, ``segment``, ``segment_bytes``, ``reservable``); [] where the
        gateway runs on another host."""
        from memkv.shm.same_node import shm_identity

        doc = self._request("GET", "/v1/segments", idempotent=True).json()
        if doc.get("host") != shm_identity():
            return []
        return list(doc.get("segments", []))

    def map_reservation_segments(self, segments: Sequence[dict[str, Any]] | None = None
                                 ) -> int:
        """Map the segments write reservations are made in (of :meth:`host_segments`),
        their page tables populated now: a client that saves through reservations
        calls it at start, so that its first save pays no page faults. Returns how
        many were mapped."""
        from memkv.client.reserved import DeviceSegments

        if segments is None:
            segments = self.host_segments()
        if self._device_segments is None:
            self._device_segments = DeviceSegments()
        mapped = 0
        for segment in segments:
            if not segment.get("reservable"):
                continue
            try:
                self._device_segments.view(str(segment["segment"]),
                                           int(segment["segment_bytes"]))
                mapped += 1
            except (OSError, KeyError, TypeError, ValueError) as e:
                logger.info("memkv segment %s not mapped: %s", segment, e)
        return mapped

    def reserve_slots(
        self, session_id: str, blocks: int, *, tokens: Sequence[int] | None = None,
        ttl_s: float = 30.0,
    ) -> SlotReservation | None:
        """Slots of the session's device's shared memory for its next append's ``blocks``
        blocks (a write reservation; this host only): copy block i into
        ``reservation.slot(i)`` and pass ``reserved=`` to :meth:`append_turn`; the
        device keeps the bytes where they are. ``tokens``: the session's tokens after
        that append (a new session is placed by their prefix). None where the
        gateway or the device is elsewhere, or short of room: stage or send instead.
        Fill the slots while ``reservation.writable``, never after.
        """
        from memkv.client.reserved import DeviceSegments, parse_reservation, reservation_body

        doc = self._request("POST", f"/v1/sessions/{quote(session_id, safe='')}/reservations",
                            json=reservation_body(blocks, tokens, ttl_s),
                            idempotent=False).json()
        if self._device_segments is None:
            self._device_segments = DeviceSegments()
        return parse_reservation(doc, self._device_segments)

    def _append(
        self,
        session: SessionView,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[Any] | None,
        values: Sequence[Any] | None,
        blocks: Sequence[Any] | None,
        start_block: int | None,
        turn: int | None,
        reserved: SlotReservation | None = None,
    ) -> AppendAnswer:
        staging = self._staging.active
        if staging is not None or reserved is not None:
            try:
                return self._send_append(session, token_ids, keys, values, blocks,
                                         start_block, turn, staging, reserved)
            except errors.WrongNodeError as e:
                if staging is not None:
                    self._staging.refused(e)
        return self._send_append(session, token_ids, keys, values, blocks, start_block, turn,
                                 None)

    def _send_append(
        self,
        session: SessionView,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[Any] | None,
        values: Sequence[Any] | None,
        blocks: Sequence[Any] | None,
        start_block: int | None,
        turn: int | None,
        staging: PutStaging | None,
        reserved: SlotReservation | None = None,
    ) -> AppendAnswer:
        body, _ = append_body(session, token_ids, blocks, keys, values, start_block, turn,
                              staging, reserved=reserved)
        path = f"/v1/sessions/{session.session_id}/turns"
        sent = (
            self._over_port(AppendRequest(id=0, session_id=session.session_id), body)
            if self._ports is not None
            else None
        )
        if sent is not None:
            result = parse_turn(sent[1].result or {})
        elif self._blocks is None:
            r = self._request(
                "POST",
                path,
                content=b"".join(body),
                headers={"content-type": FRAMES_MEDIA_TYPE},
                idempotent=True,
            )
            result = parse_turn(r.json())
        else:
            import json

            length = sum(memoryview(c).nbytes for c in body)
            response = self._block_request("POST", path, body, length)
            result = parse_turn(json.loads(response.read()))
        self._known.appended(session, result, token_ids)
        return result

    def read_blocks(
        self,
        session_id: str,
        start: int = 0,
        end: int | None = None,
        *,
        out: Sequence[Any] | None = None,
    ) -> Iterator[Block]:
        """Stream a session's blocks in chain order (the first arrives before the last loads).

        Args:
            out: destination buffers, one per block (numpy arrays or contiguous
                CPU tensors of exactly the block's bytes): each block is read
                from the socket straight into its buffer, and ``Block.array``
                views it. New arrays when None.

        Raises:
            WireError: the stream was cut or a block failed its checksum.
            InvalidInputError: ``out`` does not fit the blocks.
        """
        query = f"start={start}" + (f"&end={end}" if end is not None else "")
        seen = self._known.read_turn(session_id)
        if seen is not None:
            query += f"&turn={seen}"
        path = f"/v1/sessions/{session_id}/blocks?{query}"
        sent = (
            self._over_port(ReadRequest(id=0, session_id=session_id, start=start, end=end,
                                        turn=seen))
            if self._ports is not None
            else None
        )
        if sent is not None:
            _, _, reply_body = sent
            try:
                yield from read_block_frames(reply_body, out)
            finally:
                if reply_body.left:  # not read to its end: the connection is out of step
                    assert self._ports is not None
                    self._ports.drop()
            return
        if self._blocks is None:
            if out is not None:
                raise errors.InvalidInputError("out= needs the default transport")
            yield from self._read_via_httpx("GET", path)
            return
        response = self._block_request("GET", path)
        try:
            yield from read_block_frames(response, out)
        except BaseException:
            # A half-read response leaves the connection unusable.
            self._blocks.drop()
            raise

    def _read_via_httpx(self, method: str, path: str, **kwargs: Any) -> Iterator[Block]:
        with self._http.stream(method, path, **kwargs) as response:
            if response.status_code >= 400:
                response.read()
                raise_for_error(response)
            parser = BlockStream()
            for chunk in response.iter_raw():
                yield from parser.feed(chunk)
            parser.close()

    def read_blocks_by_key(
        self, namespace: str | None, keys: Sequence[bytes], *, out: Sequence[Any] | None = None
    ) -> list[Block]:
        """Blocks by key (e.g. a prefix :meth:`match` found), in the order asked.

        ``namespace``: a public namespace the token may read (None: the
        tenant's). Read from the socket the way :meth:`read_blocks` reads,
        into ``out`` when given (one buffer per key, as :meth:`read_blocks`).
        """
        if out is not None and len(out) < len(keys):
            raise errors.InvalidInputError(f"{len(keys)} keys need as many out buffers, "
                                           f"got {len(out)}")
        sent = (
            self._over_port(ReadKeysRequest(id=0, namespace=namespace,
                                            keys=[bytes(k) for k in keys]))
            if self._ports is not None
            else None
        )
        if sent is not None:
            try:
                return list(read_block_frames(sent[2], out, body_ends=False))
            except BaseException:
                assert self._ports is not None
                self._ports.drop()  # a half-read reply leaves the connection out of step
                raise
        body = {"namespace": namespace, "keys": [bytes(k).hex() for k in keys]}
        if self._blocks is None:
            if out is not None:
                raise errors.InvalidInputError("out= needs the default transport")
            return list(self._read_via_httpx("POST", "/v1/blocks/read", json=body))
        import json

        payload = json.dumps(body).encode()
        response = self._block_request(
            "POST", "/v1/blocks/read", [payload], len(payload), content_type="application/json"
        )
        try:
            return list(read_block_frames(response, out))
        except BaseException:
            self._blocks.drop()
            raise

    def lease_blocks(
        self, namespace: str | None, keys: Sequence[bytes], *, ttl_s: float = 30.0
    ) -> HostLease:
        """Pin blocks in the gateway host's shared memory and learn where they are.

        Of use only on the gateway's host (``lease.local``): copy them with
        :func:`memkv.shm.same_node.copy_entries`, check each CRC32, and give every
        plan back with :meth:`release_lease`. Blocks answered None: read them
        with :meth:`read_blocks_by_key`. Not retried (a retry would pin twice).
        """
        from memkv.shm.same_node import HostLease

        body = {"namespace": namespace, "keys": [bytes(k).hex() for k in keys], "ttl_s": ttl_s}
        doc = self._request("POST", "/v1/blocks/lease", json=body, idempotent=False).json()
        try:
            return HostLease.from_json(doc)
        except (KeyError, TypeError, ValueError) as e:
            raise errors.CorruptDataError(f"the gateway's lease answer is malformed: {e}") from e

    def release_lease(self, lease_id: str) -> None:
        """Give a lease back (blocks may move again); one that ran out answers UnknownBlockError."""
        self._request("DELETE", f"/v1/blocks/lease/{quote(lease_id, safe='')}", idempotent=True)

    def match(
        self, layout: KVLayout, namespace: str | None, token_ids: Sequence[int] | np.ndarray
    ) -> Match:
        body = match_body(layout, namespace, token_ids)
        return parse_match(self._request("POST", "/v1/match", json=body, idempotent=True).json())


# -- the async client --------------------------------------------------------------------------
