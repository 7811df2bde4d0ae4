"""The asynchronous client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

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
from memkv.client.frames import FRAMES_MEDIA_TYPE, BlockStream, append_body, joined
from memkv.client.transport import (
    DEFAULT_URL,
    async_retrying,
    auth_headers,
    bearer,
    port_error,
    raise_for_error,
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
from memkv.port_connection import AsyncPortConnection, PortError
from memkv.protocol.forks import tail_of
from memkv.protocol.layout import KVLayout
from memkv.protocol.port import AppendRequest, PortRequest, ReadRequest, Reply
from memkv.protocol.services import AppendAnswer, ResumeAnswer, SessionView
from memkv.protocol.wire import (
    WireError,
)

if TYPE_CHECKING:
    from memkv.client.reserved import DeviceSegments, SlotReservation
    from memkv.shm.staging import PutStaging

logger = logging.getLogger(__name__)


class AsyncClient:
    """Asynchronous client of the memkv gateway (same methods as :class:`Client`).

    Appends and session reads go over the gateway's block port when it
    advertises one (``block_port=False``: HTTP only), on one connection that
    concurrent calls share, pipelined.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float = 60.0,
        retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
        token: str | None = None,
        block_port: bool = True,
    ) -> None:
        auth = auth_headers(token)
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, headers=auth
        )
        self._retries = retries
        self._timeout = timeout
        self._host = urlsplit(base_url).hostname or "127.0.0.1"
        self._token = bearer(auth)
        self._port_wanted = block_port and transport is None
        self._port_number: int | None = None
        self._port_known = False
        self._port: AsyncPortConnection | None = None
        self._port_lock = asyncio.Lock()
        self._known = KnownSessions()
        self._staging = AppendStaging()
        self._device_segments: DeviceSegments | None = None  # made by reserve_slots

    def staging(self, nbytes: int) -> PutStaging | None:
        """This client's staging segment (as :meth:`memkv.client.Client.staging`): blocks
        appended from a slot of it are named, not sent, to a gateway on this host."""
        return self._staging.get(nbytes)

    @property
    def stages_appends(self) -> bool:
        return self._staging.active is not None

    @property
    def block_path(self) -> str:
        """``"block port"`` or ``"http"``: how KV bodies travel (known after the first)."""
        return "block port" if self._port is not None and not self._port.broken else "http"

    async def _port_connection(self) -> AsyncPortConnection | None:
        if not self._port_wanted:
            return None
        async with self._port_lock:
            if self._port is not None and not self._port.broken:
                return self._port
            if not self._port_known:
                port = (await self.health()).get("block_port")
                self._port_known = True
                self._port_number = port if isinstance(port, int) else None
            if self._port_number is None:
                return None
            try:
                self._port = await AsyncPortConnection.open(
                    self._host, self._port_number, token=self._token, timeout=self._timeout
                )
            except OSError as e:
                logger.warning("block port %s:%s unreachable (%s): KV over HTTP from now on",
                               self._host, self._port_number, e)
                self._port_number = None
                return None
            return self._port

    async def _over_port(
        self, request: PortRequest, body: Sequence[bytes | memoryview] = ()
    ) -> tuple[AsyncPortConnection, Reply, int | None, asyncio.Future[None]] | None:
        """A request over the block port (its id 0: the connection numbers it),
        retried like HTTP's; None: no port, use HTTP."""
        async for attempt in async_retrying(self._retries):
            with attempt:
                conn = await self._port_connection()
                if conn is None:
                    return None
                try:
                    reply, length, done = await conn.request(request, body)
                except PortError as e:
                    raise port_error(e) from None
                except (OSError, WireError):
                    conn.broken = True
                    raise
                return conn, reply, length, done
        raise AssertionError("unreachable: the last attempt raises")

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._port is not None:
            await self._port.aclose()
        self._staging.close()
        if self._device_segments is not None:
            self._device_segments.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self, method: str, path: str, *, idempotent: bool, **kwargs: Any
    ) -> httpx.Response:
        async for attempt in async_retrying(self._retries if idempotent else 0):
            with attempt:
                response = await self._http.request(method, path, **kwargs)
                raise_for_error(response)
                return response
        raise AssertionError("unreachable: the last attempt raises")

    async def health(self) -> dict[str, Any]:
        return dict((await self._request("GET", "/healthz", idempotent=True)).json())

    async def stats(self) -> dict[str, Any]:
        return dict((await self._request("GET", "/v1/stats", idempotent=True)).json())

    async def create_session(
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
        r = await self._request("POST", "/v1/sessions", json=body, idempotent=False)
        return self._known.remember(parse_session(r.json()))

    async def session(self, session_id: str) -> SessionView:
        r = await self._request("GET", f"/v1/sessions/{session_id}", idempotent=True)
        return self._known.remember(parse_session(r.json()))

    async def suspend(self, session_id: str, *, offline: bool = False) -> SessionView:
        r = await self._request(
            "POST",
            f"/v1/sessions/{session_id}/suspend",
            json={"offline": offline},
            idempotent=True,
        )
        return parse_session(r.json())

    async def fork_session(self, session_id: str, new_id: str, *, at_tokens: int | None = None,
                     token_ids: Sequence[int] | None = None) -> SessionView:
        """A new session ``new_id`` holding the first ``at_tokens`` tokens of
        ``session_id`` (None: all): its blocks are shared, not copied (a partial last
        block is copied once). ``token_ids``: the session's tokens, needed when
        ``at_tokens`` ends inside a block."""
        tail = await self._tail(session_id, at_tokens, token_ids)
        r = await self._request("POST", f"/v1/sessions/{session_id}/fork",  # a retry would find
                              json=fork_body(new_id, at_tokens, tail), idempotent=False)  # new_id
        return self._known.remember(parse_session(r.json()))

    async def rewind_session(self, session_id: str, tokens: int, *,
                       token_ids: Sequence[int] | None = None) -> SessionView:
        """Keep the session's first ``tokens`` tokens; the blocks after them are let go.
        ``token_ids``: the session's tokens, needed when ``tokens`` ends inside a block."""
        tail = await self._tail(session_id, tokens, token_ids)
        r = await self._request("POST", f"/v1/sessions/{session_id}/rewind",
                              json=rewind_body(tokens, tail), idempotent=True)
        return parse_session(r.json())

    async def _tail(self, session_id: str, at: int | None,
                 token_ids: Sequence[int] | None) -> tuple[int, ...] | None:
        if token_ids is None or at is None:
            return None
        view = await self.session(session_id)
        return tail_of(view.layout.layout(), view.tokens, at, token_ids)

    async def resume(self, session_id: str) -> ResumeAnswer:
        r = await self._request("POST", f"/v1/sessions/{session_id}/resume", idempotent=True)
        return parse_resume(r.json())

    async def delete_session(self, session_id: str) -> None:
        self._known.forget(session_id)
        await self._request("DELETE", f"/v1/sessions/{session_id}", idempotent=False)

    async def append_turn(
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
        """Append a turn (as :meth:`Client.append_turn`: only blocks not yet stored are
        sent, a view gone stale is refreshed once, blocks in ``reserved``'s slots are
        named, and a session of another ``layout`` refuses the blocks)."""
        session = self._known.get(session_id) or await self.session(session_id)
        if layout_conflict(session, layout) is not None:
            session = await self.session(session_id)  # the view may be stale
            if (conflict := layout_conflict(session, layout)) is not None:
                raise conflict
        try:
            return await self._append(session, token_ids, keys, values, blocks, start_block,
                                      turn, reserved)
        except (errors.ConflictError, errors.PrefixNotStoredError) as e:
            # A stale view of ours: a conflict, or blocks a partial loss took since
            # (then, given every token's KV, the append goes again from what survived).
            if not self._known.worth_refreshing(e, session_id, turn,
                                                resendable=blocks is None):
                raise
            session = await self.session(session_id)
            return await self._append(session, token_ids, keys, values, blocks, start_block,
                                      turn, reserved)

    async def reserve_slots(
        self, session_id: str, blocks: int, *, tokens: Sequence[int] | None = None,
        ttl_s: float = 30.0,
    ) -> SlotReservation | None:
        """A write reservation for the session's next append (as
        :meth:`Client.reserve_slots`)."""
        from memkv.client.reserved import DeviceSegments, parse_reservation, reservation_body

        r = await self._request("POST", f"/v1/sessions/{quote(session_id, safe='')}/reservations",
                                json=reservation_body(blocks, tokens, ttl_s), idempotent=False)
        if self._device_segments is None:
            self._device_segments = DeviceSegments()
        return parse_reservation(r.json(), self._device_segments)

    async def _append(
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
                return await self._send_append(session, token_ids, keys, values, blocks,
                                               start_block, turn, staging, reserved)
            except errors.WrongNodeError as e:
                if staging is not None:
                    self._staging.refused(e)
        return await self._send_append(session, token_ids, keys, values, blocks, start_block,
                                       turn, None)

    async def _send_append(
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
        sent = await self._over_port(AppendRequest(id=0, session_id=session.session_id), body)
        if sent is not None:
            _, reply, _, done = sent
            done.set_result(None)
            result = parse_turn(reply.result or {})
        else:
            r = await self._request(
                "POST",
                f"/v1/sessions/{session.session_id}/turns",
                content=joined(body),
                headers={"content-type": FRAMES_MEDIA_TYPE},
                idempotent=True,
            )
            result = parse_turn(r.json())
        self._known.appended(session, result, token_ids)
        return result

    async def read_blocks(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[Block]:
        seen = self._known.read_turn(session_id)
        sent = await self._over_port(ReadRequest(id=0, session_id=session_id, start=start,
                                                 end=end, turn=seen))
        if sent is not None:
            async for block in _port_blocks(*sent):
                yield block
            return
        params: dict[str, int] = {"start": start}
        if end is not None:
            params["end"] = end
        if seen is not None:
            params["turn"] = seen
        async with self._http.stream(
            "GET", f"/v1/sessions/{session_id}/blocks", params=params
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                raise_for_error(response)
            parser = BlockStream()
            async for chunk in response.aiter_raw():
                for block in parser.feed(chunk):
                    yield block
            parser.close()

    async def match(
        self, layout: KVLayout, namespace: str | None, token_ids: Sequence[int] | np.ndarray
    ) -> Match:
        body = match_body(layout, namespace, token_ids)
        r = await self._request("POST", "/v1/match", json=body, idempotent=True)
        return parse_match(r.json())


async def _port_blocks(
    conn: AsyncPortConnection, reply: Reply, length: int | None,
    done: asyncio.Future[None],
) -> AsyncIterator[Block]:
    """The blocks of a block port reply of ``length`` bytes, read to its end."""
    parser = BlockStream()
    left = length or 0
    try:
        while left:
            chunk = await conn.read(min(left, _ASYNC_READ_BYTES))
            if not chunk:
                raise WireError("the block stream was cut (the block port closed)")
            left -= len(chunk)
            for block in parser.feed(chunk):
                yield block
        parser.close()
    finally:
        if left:  # not read to its end: the connection is out of step
            conn.broken = True
        done.set_result(None)


#: Bytes per read of an async block port reply (each is parsed as it comes).
_ASYNC_READ_BYTES = 1 << 20
