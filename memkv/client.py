"""Python clients of the memkv gateway: :class:`Client` (sync) and :class:`AsyncClient`.

Typed methods for the routes; the server's JSON errors are raised again as
memkv's own exceptions (:mod:`memkv.errors`); idempotent calls (reads, deletes,
and appends, which carry a turn index) are retried on connection errors and
503s. KV goes out as binary frames (docs/wire-format.md) and comes back
streamed, each block read straight into the buffer its tensor then wraps.

Example:
    >>> with Client("http://127.0.0.1:8080") as client:           # doctest: +SKIP
    ...     client.create_session("chat-1", layout, namespace="tenant-a")
    ...     client.append_turn("chat-1", token_ids, keys, values)
    ...     blocks = [b.tensor for b in client.read_blocks("chat-1")]
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch

from memkv import errors
from memkv.errors import MemkvError
from memkv.protocol.checksum import crc32
from memkv.protocol.hashing import chain_hashes, token_array
from memkv.protocol.wire import (
    FrameReader,
    WireError,
    block_payload,
    encode_frame,
)
from memkv.storage.layout import KVLayout, split_kv

__all__ = [
    "AsyncClient",
    "Block",
    "Client",
    "Match",
    "ResumeView",
    "SessionView",
    "TurnResult",
]

FRAMES_MEDIA_TYPE = "application/x-memkv-frames"
DEFAULT_URL = "http://127.0.0.1:8080"
# Retried statuses: the gateway or the cluster is briefly unavailable.
_RETRY_STATUSES = frozenset({502, 503, 504})
_BACKOFF_S = 0.2
# A block payload larger than this is refused while reading (protects the client).
_MAX_BLOCK_BYTES = 1 << 31

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ERRORS: dict[str, type[MemkvError]] = {
    name: getattr(errors, name)
    for name in errors.__all__
    if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), MemkvError)
}
_ERRORS.update({"WireError": errors.InvalidInputError, "PayloadTooLarge": errors.InvalidInputError})


@dataclass(frozen=True, slots=True)
class SessionView:
    session_id: str
    namespace: str
    layout: KVLayout
    priority: str
    state: str
    tokens: int
    turn: int
    chain: list[bytes]
    device_id: str | None


@dataclass(frozen=True, slots=True)
class TurnResult:
    chain: list[bytes]
    new_blocks: int
    deduplicated_blocks: int
    released_blocks: int
    turn: int
    replayed: bool


@dataclass(frozen=True, slots=True)
class Match:
    tokens: int
    blocks: list[bytes]


@dataclass(frozen=True, slots=True)
class Block:
    index: int
    key: bytes
    tensor: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]
    tier: str | None  # where the block was found (hot, warm, cold)


@dataclass(frozen=True, slots=True)
class ResumeView:
    session_id: str
    tokens: int
    blocks: list[tuple[bytes, str, int]]  # (key, tier, tokens)


# -- shared request building and response parsing (sync and async alike) --------------------


def _session(data: dict[str, Any]) -> SessionView:
    return SessionView(
        session_id=data["session_id"],
        namespace=data["namespace"],
        layout=KVLayout.from_dict(data["layout"]),
        priority=data["priority"],
        state=data["state"],
        tokens=int(data["tokens"]),
        turn=int(data["turn"]),
        chain=[bytes.fromhex(k) for k in data["chain"]],
        device_id=data.get("device_id"),
    )


def _turn(data: dict[str, Any]) -> TurnResult:
    return TurnResult(
        chain=[bytes.fromhex(k) for k in data["chain"]],
        new_blocks=int(data["new_blocks"]),
        deduplicated_blocks=int(data["deduplicated_blocks"]),
        released_blocks=int(data["released_blocks"]),
        turn=int(data["turn"]),
        replayed=bool(data.get("replayed", False)),
    )


def _resume(data: dict[str, Any]) -> ResumeView:
    return ResumeView(
        data["session_id"],
        int(data["tokens"]),
        [(bytes.fromhex(b["key"]), b["tier"], int(b["tokens"])) for b in data["blocks"]],
    )


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        cls = _ERRORS.get(error["type"], MemkvError)
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        cls, message = MemkvError, response.text[:500]
    raise cls(f"{message} (HTTP {response.status_code})")


def _append_body(
    session: SessionView,
    token_ids: Sequence[int] | np.ndarray,
    blocks: Sequence[torch.Tensor] | None,
    keys: Sequence[torch.Tensor] | None,
    values: Sequence[torch.Tensor] | None,
    start_block: int | None,
    turn: int | None,
) -> list[bytes | memoryview]:
    """The frames of an append: only blocks from the first one not stored for the session."""
    tokens = token_array(token_ids)
    layout = session.layout
    chain = chain_hashes(tokens, layout, session.namespace)
    if blocks is None:
        if keys is None or values is None:
            raise errors.InvalidInputError("append_turn needs keys and values, or blocks")
        blocks = split_kv(layout, keys, values)
        start = 0
        for old, new in zip(session.chain, chain, strict=False):
            if old != new:
                break
            start += 1
        blocks = blocks[start:]
    else:
        start = start_block or 0
    if len(blocks) != len(chain) - start:
        raise errors.InvalidInputError(
            f"{tokens.size} tokens make {len(chain)} blocks; from block {start} expected "
            f"{len(chain) - start} blocks, got {len(blocks)}"
        )
    head = {
        "kind": "turn",
        "v": 1,
        "turn": session.turn + 1 if turn is None else turn,
        "tokens": tokens.astype("<i8").tobytes(),
        "start_block": start,
        "layout": layout.to_dict(),
        "blocks": len(blocks),
    }
    chunks: list[bytes | memoryview] = list(encode_frame(head))
    for i, block in enumerate(blocks, start=start):
        layout.check_block(block)
        t = block.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype is torch.bfloat16 else t
        data = memoryview(raw.numpy().data).cast("B")
        chunks.extend(
            encode_frame(
                {
                    "kind": "block",
                    "index": i,
                    "key": bytes(chain[i]),
                    "dtype": layout.dtype,
                    "shape": list(t.shape),
                    "crc32": crc32(data),
                },
                data,
            )
        )
    return chunks


class _BlockStream:
    """Turns streamed response bytes into :class:`Block` objects; checks the end frame."""

    def __init__(self) -> None:
        self._reader = FrameReader(max_payload_bytes=_MAX_BLOCK_BYTES)
        self._count = 0
        self._ended = False

    def feed(self, chunk: bytes) -> Iterator[Block]:
        for frame in self._reader.feed(chunk):
            if frame.kind == "end":
                if frame.header.get("count") != self._count:
                    raise WireError(
                        f"stream ended after {self._count} blocks, its end frame says "
                        f"{frame.header.get('count')}"
                    )
                self._ended = True
                continue
            key, dtype, array = block_payload(frame)
            # The frame's own buffer becomes the tensor: no copy after the socket read.
            tensor = torch.from_numpy(array)
            if dtype == "bfloat16":
                tensor = tensor.view(torch.bfloat16)
            self._count += 1
            yield Block(int(frame.header["index"]), key, tensor, frame.header.get("tier"))

    def close(self) -> None:
        self._reader.close()
        if not self._ended:
            raise WireError(f"the block stream was cut after {self._count} blocks (no end frame)")


# -- the sync client ---------------------------------------------------------------------------


class Client:
    """Synchronous client of the memkv gateway.

    Args:
        base_url: the gateway, e.g. ``http://127.0.0.1:8080``.
        timeout: seconds per request (connect, read, write).
        retries: extra attempts for idempotent requests on connection errors and 502/503/504.
        transport: an httpx transport (tests).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float = 60.0,
        retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport)
        self._retries = retries

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, path: str, *, idempotent: bool, **kwargs: Any
    ) -> httpx.Response:
        last_attempt = self._retries if idempotent else 0
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == last_attempt:
                    raise
            else:
                if response.status_code not in _RETRY_STATUSES or attempt == last_attempt:
                    _raise_for_error(response)
                    return response
            time.sleep(_BACKOFF_S * (2**attempt))
            attempt += 1

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
        namespace: str = "default",
        priority: str = "normal",
    ) -> SessionView:
        body = {
            "session_id": session_id,
            "layout": layout.to_dict(),
            "namespace": namespace,
            "priority": priority,
        }
        return _session(self._request("POST", "/v1/sessions", json=body, idempotent=False).json())

    def session(self, session_id: str) -> SessionView:
        return _session(self._request("GET", f"/v1/sessions/{session_id}", idempotent=True).json())

    def suspend(self, session_id: str, *, offline: bool = False) -> SessionView:
        r = self._request(
            "POST",
            f"/v1/sessions/{session_id}/suspend",
            json={"offline": offline},
            idempotent=True,
        )
        return _session(r.json())

    def resume(self, session_id: str) -> ResumeView:
        r = self._request("POST", f"/v1/sessions/{session_id}/resume", idempotent=True)
        return _resume(r.json())

    def input_end(self, session_id: str) -> int:
        """Tell memkv a turn's input is complete (prefetch now). Returns blocks prefetched."""
        r = self._request("POST", f"/v1/sessions/{session_id}/input-end", idempotent=True)
        return int(r.json()["prefetched"])

    def delete_session(self, session_id: str) -> None:
        self._request("DELETE", f"/v1/sessions/{session_id}", idempotent=False)

    # -- KV

    def append_turn(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[torch.Tensor] | None = None,
        values: Sequence[torch.Tensor] | None = None,
        *,
        blocks: Sequence[torch.Tensor] | None = None,
        start_block: int | None = None,
        turn: int | None = None,
    ) -> TurnResult:
        """Append a turn: the session's tokens so far and their KV.

        Pass per-layer ``keys``/``values`` for every token (only blocks not yet
        stored for the session are sent), or ready ``blocks`` from
        ``start_block``. ``turn`` defaults to the session's turn + 1; a retry of
        the same turn is answered without storing anything again.
        """
        session = self.session(session_id)
        body = _append_body(session, token_ids, blocks, keys, values, start_block, turn)
        r = self._request(
            "POST",
            f"/v1/sessions/{session_id}/turns",
            content=_joined(body),
            headers={"content-type": FRAMES_MEDIA_TYPE},
            idempotent=True,
        )
        return _turn(r.json())

    def read_blocks(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> Iterator[Block]:
        """Stream a session's blocks in chain order (the first arrives before the last loads)."""
        params: dict[str, int] = {"start": start}
        if end is not None:
            params["end"] = end
        with self._http.stream(
            "GET", f"/v1/sessions/{session_id}/blocks", params=params
        ) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            parser = _BlockStream()
            for chunk in response.iter_raw():
                yield from parser.feed(chunk)
            parser.close()

    def read_blocks_by_key(self, namespace: str, keys: Sequence[bytes]) -> list[Block]:
        body = {"namespace": namespace, "keys": [bytes(k).hex() for k in keys]}
        with self._http.stream("POST", "/v1/blocks/read", json=body) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            parser = _BlockStream()
            out = [b for chunk in response.iter_raw() for b in parser.feed(chunk)]
            parser.close()
            return out

    def match(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int] | np.ndarray
    ) -> Match:
        body = {
            "layout": layout.to_dict(),
            "namespace": namespace,
            "token_ids": token_array(token_ids).tolist(),
        }
        data = self._request("POST", "/v1/match", json=body, idempotent=True).json()
        return Match(int(data["tokens"]), [bytes.fromhex(k) for k in data["blocks"]])


# -- the async client --------------------------------------------------------------------------


class AsyncClient:
    """Asynchronous client of the memkv gateway (same methods as :class:`Client`)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float = 60.0,
        retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=transport)
        self._retries = retries

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self, method: str, path: str, *, idempotent: bool, **kwargs: Any
    ) -> httpx.Response:
        last_attempt = self._retries if idempotent else 0
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == last_attempt:
                    raise
            else:
                if response.status_code not in _RETRY_STATUSES or attempt == last_attempt:
                    _raise_for_error(response)
                    return response
            await asyncio.sleep(_BACKOFF_S * (2**attempt))
            attempt += 1

    async def health(self) -> dict[str, Any]:
        return dict((await self._request("GET", "/healthz", idempotent=True)).json())

    async def stats(self) -> dict[str, Any]:
        return dict((await self._request("GET", "/v1/stats", idempotent=True)).json())

    async def create_session(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str = "default",
        priority: str = "normal",
    ) -> SessionView:
        body = {
            "session_id": session_id,
            "layout": layout.to_dict(),
            "namespace": namespace,
            "priority": priority,
        }
        r = await self._request("POST", "/v1/sessions", json=body, idempotent=False)
        return _session(r.json())

    async def session(self, session_id: str) -> SessionView:
        r = await self._request("GET", f"/v1/sessions/{session_id}", idempotent=True)
        return _session(r.json())

    async def suspend(self, session_id: str, *, offline: bool = False) -> SessionView:
        r = await self._request(
            "POST",
            f"/v1/sessions/{session_id}/suspend",
            json={"offline": offline},
            idempotent=True,
        )
        return _session(r.json())

    async def resume(self, session_id: str) -> ResumeView:
        r = await self._request("POST", f"/v1/sessions/{session_id}/resume", idempotent=True)
        return _resume(r.json())

    async def delete_session(self, session_id: str) -> None:
        await self._request("DELETE", f"/v1/sessions/{session_id}", idempotent=False)

    async def append_turn(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[torch.Tensor] | None = None,
        values: Sequence[torch.Tensor] | None = None,
        *,
        blocks: Sequence[torch.Tensor] | None = None,
        start_block: int | None = None,
        turn: int | None = None,
    ) -> TurnResult:
        session = await self.session(session_id)
        body = _append_body(session, token_ids, blocks, keys, values, start_block, turn)
        r = await self._request(
            "POST",
            f"/v1/sessions/{session_id}/turns",
            content=_joined(body),
            headers={"content-type": FRAMES_MEDIA_TYPE},
            idempotent=True,
        )
        return _turn(r.json())

    async def read_blocks(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[Block]:
        params: dict[str, int] = {"start": start}
        if end is not None:
            params["end"] = end
        async with self._http.stream(
            "GET", f"/v1/sessions/{session_id}/blocks", params=params
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for_error(response)
            parser = _BlockStream()
            async for chunk in response.aiter_raw():
                for block in parser.feed(chunk):
                    yield block
            parser.close()

    async def match(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int] | np.ndarray
    ) -> Match:
        body = {
            "layout": layout.to_dict(),
            "namespace": namespace,
            "token_ids": token_array(token_ids).tolist(),
        }
        data = (await self._request("POST", "/v1/match", json=body, idempotent=True)).json()
        return Match(int(data["tokens"]), [bytes.fromhex(k) for k in data["blocks"]])


def _joined(chunks: list[bytes | memoryview]) -> bytes:
    # httpx sends one bytes body with a Content-Length (the gateway checks it
    # against its limit before reading); joining costs one copy of the payload.
    return b"".join(chunks)
