"""Python clients of the memkv gateway: :class:`Client` (sync) and :class:`AsyncClient`.

Typed methods for the routes; the server's JSON errors are raised again as
memkv's own exceptions (:mod:`memkv.errors`); idempotent calls (reads, deletes,
and appends, which carry a turn index) are retried on connection errors and
503s. KV goes out as binary frames (docs/wire-format.md) and comes back
streamed, each block read from the socket straight into the array it is then
returned in (``Block.array``; ``Block.tensor`` wraps it for torch users).

Import-light: ``import memkv.client`` loads neither torch nor ray (torch is
imported only when a caller hands in or asks for tensors).

Example:
    >>> with Client("http://127.0.0.1:8080") as client:           # doctest: +SKIP
    ...     client.create_session("chat-1", layout, namespace="tenant-a")
    ...     client.append_turn("chat-1", token_ids, keys, values)
    ...     blocks = [b.tensor for b in client.read_blocks("chat-1")]
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import httpx
import msgpack
import numpy as np

from memkv import errors
from memkv.errors import MemkvError
from memkv.port_connection import AsyncPortConnection, PortConnection, PortError, ReplyBody
from memkv.protocol.checksum import crc32
from memkv.protocol.dtypes import numpy_view_dtype
from memkv.protocol.exactness import LOSSY_STEPS, lossy_name
from memkv.protocol.hashing import BlockHash, chain_hashes, token_array
from memkv.protocol.layout import KV_AXIS_SIZE, KVLayout
from memkv.protocol.wire import (
    MAGIC,
    MAX_HEADER_BYTES,
    TIER_NAMES,
    FrameReader,
    WireError,
    block_payload,
    encode_frame,
)

if TYPE_CHECKING:
    import torch

    from memkv.same_node import HostLease

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
logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8080"
# Retried statuses: the gateway or the cluster is briefly unavailable.
_RETRY_STATUSES = frozenset({502, 503, 504})
_BACKOFF_S = 0.2
# A block payload larger than this is refused while reading (protects the client).
_MAX_BLOCK_BYTES = 1 << 31
_FRAME_PREFIX_BYTES = 8

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
    ack: str = "memory"  # when appends are answered: in memory, or fsynced in the archive
    finite_only: bool = False  # appends holding NaN or inf are refused
    # Tokens whose blocks were lost (a device restarted before they were archived):
    # the session serves its first ``tokens``, an engine recomputes the rest, and
    # the next append sends the blocks after them again. ``partial_reason`` says why.
    lost_tokens: int = 0
    partial_reason: str | None = None


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
    #: In a public namespace: the publisher (tenant) whose blocks these are.
    publisher: str | None = None


@dataclass(frozen=True, slots=True)
class Block:
    """One block as read: its bytes in ``array`` ``[layers, 2, kv_heads, tokens, head_dim]``.

    ``array`` is float32/float16, or uint16 holding bfloat16 bits (numpy has
    no bfloat16); ``tensor`` gives the torch view (no copy). ``exact`` is False
    when memkv kept the block lossily; ``lossy`` names the step (``int8``,
    ``float16`` of fp32, ``delta_rl``) and ``bound`` the error it can make.
    """

    index: int
    key: bytes
    array: np.ndarray
    dtype: str
    tier: str | None  # where the block was found (hot, warm, cold)
    exact: bool = True
    lossy: str = ""

    @property
    def bound(self) -> str:
        """The error the block's lossy step can make (memkv.protocol.exactness)."""
        step = LOSSY_STEPS.get(self.lossy)
        if step is None or (not self.lossy and not self.exact):
            return "lossy: by a step this client does not know of"
        return step.bound

    @property
    def tensor(self) -> torch.Tensor:
        """The block as a torch tensor sharing ``array``'s memory (imports torch)."""
        import torch

        t = torch.from_numpy(self.array)
        return t.view(torch.bfloat16) if self.dtype == "bfloat16" else t


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
        ack=data.get("ack", "memory"),
        finite_only=bool(data.get("finite_only", False)),
        lost_tokens=int(data.get("lost_tokens", 0)),
        partial_reason=data.get("partial_reason"),
    )


def _create_body(
    session_id: str,
    layout: KVLayout,
    namespace: str | None,
    priority: str,
    ack: str | None,
    exact_only: bool,
    finite_only: bool,
) -> dict[str, Any]:
    """A create's JSON body. ``finite_only``: appends with NaN or inf are refused (422)."""
    body: dict[str, Any] = {
        "session_id": session_id,
        "layout": layout.to_dict(),
        "namespace": namespace,
        "priority": priority,
        "ack": ack,
        "exact_only": exact_only,
    }
    if finite_only:  # only when asked: a gateway before it knows no such field
        body["finite_only"] = True
    return body


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


def _error_from(status: int, body: bytes) -> MemkvError:
    try:
        import json

        error = json.loads(body)["error"]
        cls = _ERRORS.get(error["type"], MemkvError)
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        cls, message = MemkvError, body[:500].decode("utf-8", "replace")
    return cls(f"{message} (HTTP {status})")


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise _error_from(response.status_code, response.content)


def _block_array(layout: KVLayout, block: Any, index: int) -> np.ndarray:
    """A block (numpy array or torch tensor) as a C-contiguous numpy array of its bytes' dtype."""
    if hasattr(block, "detach"):  # a torch tensor: the caller has torch loaded already
        import torch

        t = block.detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") != layout.dtype:
            raise errors.LayoutMismatchError(
                f"block {index} is {t.dtype}, the session's layout is {layout.dtype}"
            )
        array = (t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy()
        array = array.view(numpy_view_dtype(layout.dtype))
    elif isinstance(block, np.ndarray):
        array = np.ascontiguousarray(block)
        if array.dtype != numpy_view_dtype(layout.dtype):
            raise errors.LayoutMismatchError(
                f"block {index} is {array.dtype}; a {layout.dtype} layout takes "
                f"{numpy_view_dtype(layout.dtype)} arrays"
            )
    else:
        raise errors.LayoutMismatchError(
            f"block {index} must be a numpy array or a torch tensor, got {type(block).__name__}"
        )
    shape = tuple(array.shape)
    if (
        len(shape) != 5
        or shape[:3] != (layout.num_layers, KV_AXIS_SIZE, layout.num_kv_heads)
        or shape[4] != layout.head_dim
        or not 0 < shape[3] <= layout.block_tokens
    ):
        raise errors.LayoutMismatchError(
            f"block {index}: expected shape {layout.block_shape()} "
            f"(tokens 1..{layout.block_tokens}), got {shape}"
        )
    return array


def _append_body(
    session: SessionView,
    token_ids: Sequence[int] | np.ndarray,
    blocks: Sequence[Any] | None,
    keys: Sequence[Any] | None,
    values: Sequence[Any] | None,
    start_block: int | None,
    turn: int | None,
) -> tuple[list[bytes | memoryview], list[BlockHash]]:
    """The frames of an append (only blocks from the first one not stored), and the chain."""
    tokens = token_array(token_ids)
    layout = session.layout
    chain = chain_hashes(tokens, layout, session.namespace)
    if blocks is None:
        if keys is None or values is None:
            raise errors.InvalidInputError("append_turn needs keys and values, or blocks")
        from memkv.storage.layout import split_kv  # torch: per-layer tensors came in

        start = 0
        for old, new in zip(session.chain, chain, strict=False):
            if old != new:
                break
            start += 1
        blocks = split_kv(layout, keys, values)[start:]
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
        array = _block_array(layout, block, i)
        data = array.data.cast("B")
        chunks.extend(
            encode_frame(
                {
                    "kind": "block",
                    "index": i,
                    "key": bytes(chain[i]),
                    "dtype": layout.dtype,
                    "shape": list(array.shape),
                    "crc32": crc32(data),
                },
                data,
            )
        )
    return chunks, chain


def _after_append(session: SessionView, result: TurnResult, tokens: int) -> SessionView:
    return replace(session, chain=list(result.chain), turn=result.turn, tokens=tokens)


def _check_block_header(header: dict[str, Any], count: int) -> tuple[bytes, str, list[int], int]:
    key, dtype, shape, nbytes = (
        header.get("key"),
        header.get("dtype"),
        header.get("shape"),
        header.get("nbytes"),
    )
    if not isinstance(key, bytes) or not isinstance(dtype, str) or not isinstance(shape, list):
        raise WireError(f"block frame {count}: malformed header {header!r:.200}")
    if not isinstance(nbytes, int) or not 0 <= nbytes <= _MAX_BLOCK_BYTES:
        raise WireError(f"block frame {count}: bad 'nbytes' {nbytes!r}")
    item = numpy_view_dtype(dtype).itemsize
    if int(np.prod(shape, dtype=np.int64)) * item != nbytes:
        raise WireError(f"block frame {count}: shape {shape} of {dtype} is not {nbytes} bytes")
    return key, dtype, shape, nbytes


def _tier_name(raw: object) -> str | None:
    if isinstance(raw, int):
        return TIER_NAMES.get(raw)
    return raw if isinstance(raw, str) else None


def _make_block(
    header: dict[str, Any], key: bytes, dtype: str, shape: list[int], buf: np.ndarray
) -> Block:
    crc = header.get("crc32")
    if not isinstance(crc, int) or crc32(buf) != crc:
        raise WireError(f"block {header.get('index')}: payload checksum does not match its header")
    array = buf.view(numpy_view_dtype(dtype)).reshape(shape)
    return Block(
        int(header.get("index", 0)),
        key,
        array,
        dtype,
        _tier_name(header.get("tier")),
        bool(header.get("exact", True)),
        lossy_name(header.get("lossy")),
    )


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
            self._count += 1
            yield Block(
                int(frame.header["index"]),
                key,
                array,
                dtype,
                _tier_name(frame.header.get("tier")),
                bool(frame.header.get("exact", True)),
                lossy_name(frame.header.get("lossy")),
            )

    def close(self) -> None:
        self._reader.close()
        if not self._ended:
            raise WireError(f"the block stream was cut after {self._count} blocks (no end frame)")


class _PerThread:
    """One connection per thread, each closed by :meth:`close` (what both kinds share)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()

    def _keep(self, conn: Any) -> None:
        self._local.conn = conn
        with self._lock:
            self._all.append(conn)

    def drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


class _Connections(_PerThread):
    """One persistent ``http.client`` connection per thread, for the block routes.

    Block bodies skip httpx: ``http.client`` sends a list of memoryviews with
    ``sendall`` (no join) and reads each payload with ``readinto`` straight
    into its array (httpx reads 64 KiB chunks through h11 and joins them).
    """

    def __init__(self, base_url: str, timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise errors.InvalidInputError(f"expected an http(s) URL, got {base_url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._timeout = timeout
        super().__init__()

    def get(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._timeout)
            self._keep(conn)
        return conn


class _PortConnections(_PerThread):
    """One block-port connection per thread, once the gateway has advertised its port.

    A port that cannot be reached is not tried again: HTTP carries everything.
    """

    def __init__(
        self, base_url: str, auth: dict[str, str], timeout: float, discover: Any
    ) -> None:
        super().__init__()
        self._host = urlsplit(base_url).hostname or "127.0.0.1"
        self._token = _bearer(auth)
        self._timeout = timeout
        self._discover = discover
        self._port: int | None = None
        self._known = False
        self.usable = False

    def get(self) -> PortConnection | None:
        conn: PortConnection | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.broken:
            return conn
        if not self._known:
            self._port, self._known = self._discover(), True
        if self._port is None:
            return None
        try:
            conn = PortConnection(self._host, self._port, token=self._token,
                                  timeout=self._timeout)
        except OSError as e:
            logger.warning("block port %s:%s unreachable (%s): KV over HTTP from now on",
                           self._host, self._port, e)
            self._port, self.usable = None, False
            return None
        self.usable = True
        self._keep(conn)
        return conn


def _bearer(auth: dict[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer`` header dict (the block port's hello)."""
    return auth.get("authorization", "")[len("Bearer ") :] or None


def _port_error(e: PortError) -> MemkvError:
    import json

    return _error_from(e.status, json.dumps({"error": e.error}).encode())


def _read_exact(response: Any, n: int, what: str) -> bytes:
    data = response.read(n)
    if len(data) != n:
        raise WireError(f"the block stream was cut in the middle of {what}")
    return data


def _read_into(response: Any, buf: np.ndarray) -> None:
    view = buf.data.cast("B")
    filled = 0
    while filled < view.nbytes:
        got = response.readinto(view[filled:])
        if not got:
            raise WireError("the block stream was cut in the middle of a block")
        filled += got


def _destination(out: Sequence[Any] | None, count: int, nbytes: int) -> np.ndarray:
    """Where block ``count`` is read to: the caller's buffer, or a new array."""
    if out is None:
        return np.empty(nbytes, dtype=np.uint8)
    if count >= len(out):
        raise errors.InvalidInputError(f"the response has more blocks than the {len(out)} given")
    dst = out[count]
    if hasattr(dst, "detach"):  # a torch tensor
        import torch

        t = dst.detach()
        if not (t.is_contiguous() and t.device.type == "cpu"):
            raise errors.InvalidInputError("out tensors must be contiguous CPU tensors")
        dst = t.view(torch.uint8).numpy()  # the tensor's own bytes (bf16 included)
    array = np.asarray(dst)
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise errors.InvalidInputError(f"out[{count}] must be a writable C-contiguous buffer")
    flat = array.reshape(-1).view(np.uint8)
    if flat.nbytes != nbytes:
        raise errors.InvalidInputError(
            f"out[{count}] holds {flat.nbytes} bytes, block {count} has {nbytes}"
        )
    return flat


def _read_block_frames(
    response: Any, out: Sequence[Any] | None = None, *, body_ends: bool = True
) -> Iterator[Block]:
    """Parse a block response straight off the socket; check the end frame and the length.

    ``response``: an ``http.client`` response, or a block port reply's body
    (anything with ``read(n)`` and ``readinto(view)``). ``body_ends``: the body
    ends with its end frame (checked); False for a block port reply that runs
    to its end frame, after which the connection's next reply follows.
    """
    count = 0
    while True:
        prefix = _read_exact(response, _FRAME_PREFIX_BYTES, "a frame prefix")
        if prefix[:4] != MAGIC:
            raise WireError(f"bad frame magic {prefix[:4]!r}, expected {MAGIC!r}")
        header_len = int.from_bytes(prefix[4:], "little")
        if header_len > MAX_HEADER_BYTES:
            raise WireError(f"frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            header = msgpack.unpackb(_read_exact(response, header_len, "a header"), raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise WireError(f"frame header is not valid msgpack: {e}") from e
        if not isinstance(header, dict):
            raise WireError("a frame header must be a msgpack map")
        kind = header.get("kind")
        if kind == "end":
            if header.get("count") != count:
                raise WireError(
                    f"stream ended after {count} blocks, its end frame says {header.get('count')}"
                )
            if body_ends and response.read(1):
                raise WireError("bytes after the end frame")
            return
        if kind != "block":
            raise WireError(f"expected a block or end frame, got {kind!r}")
        key, dtype, shape, nbytes = _check_block_header(header, count)
        buf = _destination(out, count, nbytes)
        _read_into(response, buf)
        count += 1
        yield _make_block(header, key, dtype, shape, buf)


# -- the sync client ---------------------------------------------------------------------------


#: The bearer token a client sends when it is given none.
TOKEN_ENV = "MEMKV_TOKEN"


def _auth_headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"authorization": f"Bearer {token}"} if token else {}


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
        self._auth = _auth_headers(token)
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport, headers=self._auth
        )
        self._retries = retries
        # Block routes over http.client unless a custom transport is in play.
        self._blocks = _Connections(base_url, timeout) if transport is None else None
        self._ports = (
            _PortConnections(base_url, self._auth, timeout, self._advertised_port)
            if block_port and transport is None
            else None
        )
        # Sessions this client appended to: layout, namespace and chain do not
        # need a round trip per append (a stale entry is refreshed on conflict).
        self._known: dict[str, SessionView] = {}

    def close(self) -> None:
        self._http.close()
        if self._blocks is not None:
            self._blocks.close()
        if self._ports is not None:
            self._ports.close()

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
        self, header: dict[str, Any], body: Sequence[bytes | memoryview] = ()
    ) -> tuple[PortConnection, dict[str, Any], ReplyBody] | None:
        """A request over the block port, retried like HTTP's; None: no port, use HTTP."""
        attempt = 0
        while True:
            assert self._ports is not None
            conn = self._ports.get()
            if conn is None:
                return None
            try:
                reply, reply_body = conn.request(header, body)
            except PortError as e:
                if conn.broken or e.status in _RETRY_STATUSES:
                    self._ports.drop()
                if e.status not in _RETRY_STATUSES or attempt == self._retries:
                    raise _port_error(e) from None
            except (OSError, WireError):
                self._ports.drop()
                if attempt == self._retries:
                    raise
            else:
                return conn, reply, reply_body
            time.sleep(_BACKOFF_S * (2**attempt))
            attempt += 1

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
        attempt = 0
        while True:
            conn = self._blocks.get()
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException):
                self._blocks.drop()
                if attempt == self._retries:
                    raise
            else:
                if response.status < 400:
                    return response
                error_body = response.read()
                if response.status not in _RETRY_STATUSES or attempt == self._retries:
                    raise _error_from(response.status, error_body)
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
        namespace: str | None = None,
        priority: str = "normal",
        ack: str | None = None,
        exact_only: bool = False,
        finite_only: bool = False,
    ) -> SessionView:
        body = _create_body(session_id, layout, namespace, priority, ack, exact_only, finite_only)
        view = _session(self._request("POST", "/v1/sessions", json=body, idempotent=False).json())
        self._known[session_id] = view
        return view

    def session(self, session_id: str) -> SessionView:
        view = _session(self._request("GET", f"/v1/sessions/{session_id}", idempotent=True).json())
        self._known[session_id] = view
        return view

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
        self._known.pop(session_id, None)
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
    ) -> TurnResult:
        """Append a turn: the session's tokens so far and their KV.

        Pass per-layer ``keys``/``values`` tensors for every token (only blocks
        not yet stored for the session are sent), or ready ``blocks`` (numpy
        arrays or tensors ``[layers, 2, kv_heads, tokens, head_dim]``) from
        ``start_block``. ``turn`` defaults to the session's turn + 1; a retry of
        the same turn is answered without storing anything again.
        """
        session = self._known.get(session_id) or self.session(session_id)
        try:
            return self._append(session, token_ids, keys, values, blocks, start_block, turn)
        except errors.ConflictError:
            if turn is not None or session_id not in self._known:
                raise
            # Our view of the session was stale (another writer): refresh, try once more.
            session = self.session(session_id)
            return self._append(session, token_ids, keys, values, blocks, start_block, turn)

    def _append(
        self,
        session: SessionView,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[Any] | None,
        values: Sequence[Any] | None,
        blocks: Sequence[Any] | None,
        start_block: int | None,
        turn: int | None,
    ) -> TurnResult:
        body, _ = _append_body(session, token_ids, blocks, keys, values, start_block, turn)
        path = f"/v1/sessions/{session.session_id}/turns"
        sent = (
            self._over_port({"op": "append", "session_id": session.session_id}, body)
            if self._ports is not None
            else None
        )
        if sent is not None:
            result = _turn(sent[1]["result"])
        elif self._blocks is None:
            r = self._request(
                "POST",
                path,
                content=b"".join(body),
                headers={"content-type": FRAMES_MEDIA_TYPE},
                idempotent=True,
            )
            result = _turn(r.json())
        else:
            import json

            length = sum(memoryview(c).nbytes for c in body)
            response = self._block_request("POST", path, body, length)
            result = _turn(json.loads(response.read()))
        self._known[session.session_id] = _after_append(
            session, result, int(token_array(token_ids).size)
        )
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
        known = self._known.get(session_id)
        if known is not None:
            # The turn this client has seen: a gateway at that turn or later
            # answers from its own view, without a router call.
            query += f"&turn={known.turn}"
        path = f"/v1/sessions/{session_id}/blocks?{query}"
        sent = (
            self._over_port({"op": "read", "session_id": session_id, "start": start, "end": end,
                             "turn": known.turn if known is not None else None})
            if self._ports is not None
            else None
        )
        if sent is not None:
            _, _, reply_body = sent
            try:
                yield from _read_block_frames(reply_body, out)
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
            yield from _read_block_frames(response, out)
        except BaseException:
            # A half-read response leaves the connection unusable.
            self._blocks.drop()
            raise

    def _read_via_httpx(self, method: str, path: str, **kwargs: Any) -> Iterator[Block]:
        with self._http.stream(method, path, **kwargs) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            parser = _BlockStream()
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
            self._over_port({"op": "read_keys", "namespace": namespace,
                             "keys": [bytes(k) for k in keys]})
            if self._ports is not None
            else None
        )
        if sent is not None:
            try:
                return list(_read_block_frames(sent[2], out, body_ends=False))
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
            return list(_read_block_frames(response, out))
        except BaseException:
            self._blocks.drop()
            raise

    def lease_blocks(
        self, namespace: str | None, keys: Sequence[bytes], *, ttl_s: float = 30.0
    ) -> HostLease:
        """Pin blocks in the gateway host's shared memory and learn where they are.

        Of use only on the gateway's host (``lease.local``): copy them with
        :func:`memkv.same_node.copy_entries`, check each CRC32, and give every
        plan back with :meth:`release_lease`. Blocks answered None: read them
        with :meth:`read_blocks_by_key`. Not retried (a retry would pin twice).
        """
        from memkv.same_node import HostLease

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
        body = {
            "layout": layout.to_dict(),
            "namespace": namespace,
            "token_ids": token_array(token_ids).tolist(),
        }
        data = self._request("POST", "/v1/match", json=body, idempotent=True).json()
        return Match(int(data["tokens"]), [bytes.fromhex(k) for k in data["blocks"]],
                     data.get("publisher"))


# -- the async client --------------------------------------------------------------------------


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
        auth = _auth_headers(token)
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, headers=auth
        )
        self._retries = retries
        self._timeout = timeout
        self._host = urlsplit(base_url).hostname or "127.0.0.1"
        self._token = _bearer(auth)
        self._port_wanted = block_port and transport is None
        self._port_number: int | None = None
        self._port_known = False
        self._port: AsyncPortConnection | None = None
        self._port_lock = asyncio.Lock()

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
        self, header: dict[str, Any], body: Sequence[bytes | memoryview] = ()
    ) -> tuple[AsyncPortConnection, dict[str, Any], int | None, asyncio.Future[None]] | None:
        """A request over the block port, retried like HTTP's; None: no port, use HTTP."""
        attempt = 0
        while True:
            conn = await self._port_connection()
            if conn is None:
                return None
            try:
                reply, length, done = await conn.request(header, body)
            except PortError as e:
                if e.status not in _RETRY_STATUSES or attempt == self._retries:
                    raise _port_error(e) from None
            except (OSError, WireError):
                conn.broken = True
                if attempt == self._retries:
                    raise
            else:
                return conn, reply, length, done
            await asyncio.sleep(_BACKOFF_S * (2**attempt))
            attempt += 1

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._port is not None:
            await self._port.aclose()

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
        namespace: str | None = None,
        priority: str = "normal",
        ack: str | None = None,
        exact_only: bool = False,
        finite_only: bool = False,
    ) -> SessionView:
        body = _create_body(session_id, layout, namespace, priority, ack, exact_only, finite_only)
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
        keys: Sequence[Any] | None = None,
        values: Sequence[Any] | None = None,
        *,
        blocks: Sequence[Any] | None = None,
        start_block: int | None = None,
        turn: int | None = None,
    ) -> TurnResult:
        session = await self.session(session_id)
        body, _ = _append_body(session, token_ids, blocks, keys, values, start_block, turn)
        sent = await self._over_port({"op": "append", "session_id": session_id}, body)
        if sent is not None:
            _, reply, _, done = sent
            done.set_result(None)
            return _turn(reply["result"])
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
        sent = await self._over_port({"op": "read", "session_id": session_id, "start": start,
                                      "end": end})
        if sent is not None:
            async for block in _port_blocks(*sent):
                yield block
            return
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
        self, layout: KVLayout, namespace: str | None, token_ids: Sequence[int] | np.ndarray
    ) -> Match:
        body = {
            "layout": layout.to_dict(),
            "namespace": namespace,
            "token_ids": token_array(token_ids).tolist(),
        }
        data = (await self._request("POST", "/v1/match", json=body, idempotent=True)).json()
        return Match(int(data["tokens"]), [bytes.fromhex(k) for k in data["blocks"]],
                     data.get("publisher"))


async def _port_blocks(
    conn: AsyncPortConnection, reply: dict[str, Any], length: int | None,
    done: asyncio.Future[None],
) -> AsyncIterator[Block]:
    """The blocks of a block port reply of ``length`` bytes, read to its end."""
    parser = _BlockStream()
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


def _joined(chunks: list[bytes | memoryview]) -> bytes:
    # httpx sends one bytes body with a Content-Length (the gateway checks it
    # against its limit before reading); joining costs one copy of the payload.
    return b"".join(chunks)
