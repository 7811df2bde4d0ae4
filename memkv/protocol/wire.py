"""memkv's binary wire format for KV payloads (see docs/wire-format.md).

A body is a sequence of *frames*::

    frame  := MAGIC (4 bytes, b"MKVF") | header_len (u32, little-endian)
              | header (msgpack map, header_len bytes) | payload (header["nbytes"] bytes)

* An append request is one ``turn`` frame (no payload) followed by its
  ``block`` frames; a read response is ``block`` frames then one ``end``
  frame, so a truncated stream is detected.
* A block header names the block's key, dtype, shape, byte size and the
  CRC32 of its payload; the payload is the tensor's raw C-order bytes.
* Never pickle: headers are msgpack of plain values only.

:class:`FrameReader` parses incrementally from arbitrary chunks straight into
one preallocated buffer per payload, so a request body is copied once (from the
socket into the buffer the block is then read from).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from memkv.errors import InvalidInputError, LayoutMismatchError
from memkv.protocol.checksum import crc32
from memkv.protocol.dtypes import DTYPES
from memkv.protocol.exactness import LOSSY_STEPS

__all__ = [
    "MAGIC",
    "TIER_CODES",
    "TIER_NAMES",
    "BlockFrameTemplate",
    "MAX_HEADER_BYTES",
    "FrameBudget",
    "PREFIX_BYTES",
    "Frame",
    "FrameHeader",
    "StagedResolver",
    "FrameReader",
    "WireError",
    "block_frame_prefix",
    "block_payload",
    "decode_header",
    "decode_prefix",
    "encode_frame",
    "end_frame",
    "frame_checksum",
    "numpy_dtype",
    "staged_ref",
    "staged_reservation",
]

MAGIC = b"MKVF"
_PREFIX = struct.Struct("<4sI")
#: Headers are small (keys, shapes, token ids); anything bigger is malformed.
MAX_HEADER_BYTES = 16 << 20
#: Axes of a block: [layers, 2 (K, V), kv_heads, tokens, head_dim].
BLOCK_RANK = 5

_ITEMSIZE = {name: info.itemsize for name, info in DTYPES.items()}


class WireError(InvalidInputError):
    """A body is malformed, truncated, or its headers disagree with its payloads."""


#: A frame's header: the msgpack map docs/wire-format.md defines for its kind.
#: It comes from outside, so its reader takes each field with a check that names
#: the field (:class:`WireError`) rather than trusting a schema it was not sent.
FrameHeader = dict[str, Any]


@dataclass(slots=True)
class Frame:
    header: FrameHeader
    #: The payload's bytes: its own bytearray, or a view of a buffer the reader was given.
    payload: bytearray | memoryview = field(default_factory=bytearray)

    @property
    def kind(self) -> str:
        return str(self.header.get("kind"))


def payload_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose memory is committed as bytes are written
    into it, not when it is made: a frame that declares a GiB and sends a few bytes
    costs a few pages (``bytearray(n)`` zeroes, and so touches, all of it at once,
    on the event loop). Large sizes are an anonymous mapping the kernel fills on
    first touch, and given back whole when the last view of it goes."""
    return np.empty(nbytes, dtype=np.uint8).data.cast("B")


def numpy_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype a payload of ``dtype`` is viewed as (bf16 as uint16 bits)."""
    info = DTYPES.get(dtype)
    if info is None:
        raise LayoutMismatchError(
            f"unknown block dtype {dtype!r}; expected one of {sorted(DTYPES)}"
        )
    return info.numpy_view


def encode_frame(
    header: FrameHeader, payload: bytes | memoryview = b""
) -> list[bytes | memoryview]:
    """A frame as chunks to write (the payload is not copied)."""
    if payload:
        header = {**header, "nbytes": len(memoryview(payload).cast("B"))}
    packed = msgpack.packb(header, use_bin_type=True)
    return (
        [_PREFIX.pack(MAGIC, len(packed)) + packed, payload]
        if payload
        else [_PREFIX.pack(MAGIC, len(packed)) + packed]
    )


#: Tiers travel as small ints in block headers, so every header of a response
#: has a size known before its block is fetched (and the response a Content-Length).
TIER_CODES: dict[str, int] = {"hot": 0, "warm": 1, "cold": 2}
TIER_NAMES: dict[int, str] = {code: name for name, code in TIER_CODES.items()}
_CRC_PLACEHOLDER = 0xFFFFFFFF  # packs as msgpack uint32 (0xce + 4 bytes) whatever the value
_CRC_BYTES = 4
_EXACT_AT = -(_CRC_BYTES + 1 + len(msgpack.packb("crc32")) + 1)  # the bool before "crc32"
_TIER_AT = _EXACT_AT - len(msgpack.packb("exact")) - 1  # the fixint before "exact"
_LOSSY_AT = _TIER_AT - len(msgpack.packb("tier")) - 1  # the fixint before "tier"


class BlockFrameTemplate:
    """The prefix of a block frame whose tier, exactness and checksum are filled in later.

    The header ends with ``lossy`` (a positive fixint: the lossy step's code,
    :mod:`memkv.protocol.exactness`), ``tier`` (a positive fixint), ``exact``
    (a bool) and ``crc32`` (a uint32 packed at full width), so those patch in
    place and the prefix's length is fixed before the block is read.
    """

    __slots__ = ("key", "nbytes", "prefix")

    def __init__(
        self, *, index: int, key: bytes, dtype: str, shape: tuple[int, ...], nbytes: int
    ) -> None:
        header = {
            "kind": "block",
            "index": index,
            "key": bytes(key),
            "dtype": dtype,
            "shape": list(shape),
            "nbytes": nbytes,
            "lossy": 0,
            "tier": 0,
            "exact": True,
            "crc32": _CRC_PLACEHOLDER,
        }
        packed = msgpack.packb(header, use_bin_type=True)
        self.prefix = bytearray(_PREFIX.pack(MAGIC, len(packed)) + packed)
        self.key = bytes(key)
        self.nbytes = nbytes

    def fill(self, *, tier: str, exact: bool, crc: int, lossy: str = "") -> bytearray:
        """The prefix with the block's tier, exactness (and lossy step) and checksum."""
        self.prefix[_LOSSY_AT] = LOSSY_STEPS[lossy].code
        self.prefix[_TIER_AT] = TIER_CODES[tier]
        self.prefix[_EXACT_AT] = 0xC3 if exact else 0xC2
        self.prefix[-_CRC_BYTES:] = crc.to_bytes(_CRC_BYTES, "big")
        return self.prefix


def block_frame_prefix(
    *,
    index: int,
    key: bytes,
    dtype: str,
    shape: tuple[int, ...],
    data: memoryview,
    tier: str = "hot",
    exact: bool = True,
    lossy: str = "",
) -> bytes:
    """The prefix (magic, length, header) of a block frame whose payload is ``data``."""
    template = BlockFrameTemplate(
        index=index, key=key, dtype=dtype, shape=tuple(shape), nbytes=data.nbytes
    )
    return bytes(template.fill(tier=tier, exact=exact, crc=crc32(data), lossy=lossy))


def end_frame(count: int) -> bytes:
    packed = msgpack.packb({"kind": "end", "count": count}, use_bin_type=True)
    return _PREFIX.pack(MAGIC, len(packed)) + packed


#: Where a staged block's bytes are: ``(segment, offset, nbytes)`` -> a view of them.
StagedResolver = Callable[[str, int, int], memoryview]


def staged_ref(frame: Frame) -> tuple[str, int] | None:
    """``(segment, offset)`` of a block frame whose bytes are staged in shared memory
    (its header's ``staged``; it carries no payload), or None for a frame with its bytes.

    Raises:
        WireError: an ill-typed ``staged`` field, or one beside a payload.
    """
    ref = frame.header.get("staged")
    if ref is None:
        return None
    index = frame.header.get("index")
    segment = ref.get("segment") if isinstance(ref, dict) else None
    offset = ref.get("offset") if isinstance(ref, dict) else None
    if (not isinstance(segment, str) or not segment or isinstance(offset, bool)
            or not isinstance(offset, int) or offset < 0):
        raise WireError(f"block {index}: 'staged' must be {{'segment': str, 'offset': int >= 0}},"
                        f" got {ref!r:.120}")
    if len(frame.payload):
        raise WireError(f"block {index}: a staged block carries no payload")
    return segment, offset


#: A write reservation's id, as a device makes it (uuid4 hex).
_RESERVATION_ID = re.compile(r"[0-9a-f]{32}")


def staged_reservation(frame: Frame) -> str:
    """The write reservation a staged block's slot belongs to (its ``staged``'s
    ``reservation``; "" for bytes in a staging segment, which the device copies).

    Raises:
        WireError: an ill-formed id.
    """
    ref = frame.header.get("staged")
    reservation = ref.get("reservation", "") if isinstance(ref, dict) else ""
    if reservation == "":
        return ""
    if not isinstance(reservation, str) or not _RESERVATION_ID.fullmatch(reservation):
        raise WireError(f"block {frame.header.get('index')}: 'staged.reservation' must be a "
                        f"reservation id (32 hex digits), got {reservation!r:.80}")
    return reservation


def block_payload(
    frame: Frame, staged: StagedResolver | None = None
) -> tuple[bytes, str, np.ndarray]:
    """Check a block frame against its header; return ``(key, dtype, array)`` (no copy).

    ``staged``: resolves a block staged in shared memory (:func:`staged_ref`) to
    a view of its bytes; without it such a frame is refused.

    Raises:
        WireError: a missing or ill-typed field, a size that does not match the
            shape and dtype, or a payload whose CRC32 differs from the header's.
    """
    h = frame.header
    if frame.kind != "block":
        raise WireError(f"expected a block frame, got {frame.kind!r}")
    key, dtype, shape, crc = h.get("key"), h.get("dtype"), h.get("shape"), h.get("crc32")
    if not isinstance(key, bytes) or len(key) != 16:
        raise WireError(f"block {h.get('index')}: 'key' must be 16 bytes, got {key!r:.40}")
    if (
        not isinstance(shape, list)
        or len(shape) != BLOCK_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise WireError(
            f"block {h.get('index')}: 'shape' must be {BLOCK_RANK} non-negative ints "
            f"[layers, 2, kv_heads, tokens, head_dim], got {shape!r:.80}"
        )
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise WireError(
            f"block {h.get('index')}: 'dtype' must be one of {sorted(_ITEMSIZE)}, got {dtype!r}"
        )
    expected = math.prod(shape) * _ITEMSIZE[dtype]  # exact: no int64 wrap-around
    payload: bytearray | memoryview = frame.payload
    ref = staged_ref(frame)
    if ref is not None:
        if staged is None:
            raise WireError(f"block {h.get('index')}: staged blocks are not taken here; "
                            "send the block's bytes")
        payload = staged(ref[0], ref[1], expected)
    if expected != len(payload):
        raise WireError(
            f"block {h.get('index')}: header says shape {shape} of {dtype} ({expected} bytes), "
            f"payload has {len(payload)} bytes"
        )
    if ref is not None and crc is None:
        pass  # staged, not sent: nothing crossed a wire (the device makes its checksum)
    elif not isinstance(crc, int) or crc32(payload) != crc:
        raise WireError(f"block {h.get('index')}: payload checksum does not match its header")
    array = np.frombuffer(payload, dtype=numpy_dtype(dtype)).reshape(shape)
    return key, dtype, array


def frame_checksum(frame: Frame) -> int | None:
    """The writer's CRC32 of a block frame's payload (checked by :func:`block_payload`);
    None for a staged block sent without one (the device makes it)."""
    crc = frame.header.get("crc32")
    return None if crc is None else int(crc)


#: Bytes of a frame's fixed prefix (magic + header length).
PREFIX_BYTES = _PREFIX.size


def decode_prefix(prefix: bytes | bytearray | memoryview, max_header_bytes: int = MAX_HEADER_BYTES
                  ) -> int:
    """The header length a frame's 8-byte prefix announces, after checking its magic."""
    magic, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise WireError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if header_len > max_header_bytes:
        raise WireError(f"frame header of {header_len} bytes exceeds {max_header_bytes}")
    return int(header_len)


def decode_header(raw: bytes, max_payload_bytes: int) -> tuple[FrameHeader, int]:
    """A frame header and its payload size, checked before anything is allocated for it."""
    try:
        header = msgpack.unpackb(raw, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"frame header is not valid msgpack: {e}") from e
    if not isinstance(header, dict):
        raise WireError("a frame header must be a msgpack map")
    nbytes = header.get("nbytes", 0)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise WireError(f"frame 'nbytes' must be a non-negative int, got {nbytes!r}")
    if nbytes > max_payload_bytes:
        raise WireError(f"frame payload of {nbytes} bytes exceeds {max_payload_bytes}")
    return header, nbytes


#: Frames one append body may hold: its turn frame and this many blocks.
MAX_BODY_BLOCKS = 1 << 16
#: Header bytes of the block frames of one body, all together (a block header is
#: ~150 bytes; the turn frame's own header, its tokens, may be up to MAX_HEADER_BYTES).
MAX_BODY_BLOCK_HEADER_BYTES = 32 << 20
#: One block frame's header (the turn frame's may be up to MAX_HEADER_BYTES).
MAX_BLOCK_HEADER_BYTES = 64 << 10


class FrameBudget:
    """What one body's frames may cost before their payloads: their count and header bytes.

    40 MB of header-only frames once took +800 MiB of gateway memory and 9 s of CPU
    before the answer; now a body past either bound is refused as it arrives.
    """

    __slots__ = ("_frames", "_header_bytes")

    def __init__(self) -> None:
        self._frames = 0
        self._header_bytes = 0

    def max_header(self) -> int:
        """The largest header the next frame may have."""
        return MAX_HEADER_BYTES if self._frames == 0 else MAX_BLOCK_HEADER_BYTES

    def take(self, header_len: int) -> None:
        """Count a frame whose header is ``header_len`` bytes.

        Raises:
            WireError: past a bound.
        """
        if header_len > self.max_header():
            raise WireError(f"a frame header of {header_len} bytes: a block frame's is at "
                            f"most {MAX_BLOCK_HEADER_BYTES}")
        if self._frames:
            self._header_bytes += header_len
        self._frames += 1
        if self._frames > MAX_BODY_BLOCKS + 1:
            raise WireError(f"a body of more than {MAX_BODY_BLOCKS} block frames")
        if self._header_bytes > MAX_BODY_BLOCK_HEADER_BYTES:
            raise WireError(f"a body whose block frame headers pass "
                            f"{MAX_BODY_BLOCK_HEADER_BYTES} bytes")


class FrameReader:
    """Incremental frame parser: feed chunks, collect frames.

    Args:
        max_payload_bytes: the largest payload accepted in one frame.
        allocate: where payloads go: given a size, a writable byte view of that
            size, or None for a bytearray of the frame's own (the gateway reads
            append bodies into shared memory this way).
    """

    def __init__(
        self,
        max_payload_bytes: int,
        allocate: Callable[[int], memoryview | None] | None = None,
    ) -> None:
        self._max_payload = max_payload_bytes
        self._allocate = allocate
        self._buf = bytearray()  # bytes of an incomplete prefix/header
        self._frame: Frame | None = None  # frame whose payload is being filled
        self._filled = 0
        self._budget = FrameBudget()
        self._counted = False  # the header being gathered is counted in the budget

    def feed(self, chunk: bytes | memoryview) -> Iterator[Frame]:
        """Consume ``chunk``; yield every frame it completes.

        Header bytes are gathered in a small buffer (only as many as the header
        needs); payload bytes go straight into the frame's own buffer.
        """
        view = memoryview(chunk).cast("B")
        while view:
            if self._frame is None:
                taken = self._gather_header(view)
                view = view[taken:]
                frame = self._take_header()
                if frame is None:
                    continue  # the header needs more bytes than this chunk had
                if not frame.payload:
                    yield frame
                    continue
                self._frame, self._filled = frame, 0
                continue
            need = len(self._frame.payload) - self._filled
            take = min(need, len(view))
            self._frame.payload[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == len(self._frame.payload):
                frame, self._frame = self._frame, None
                yield frame

    def _gather_header(self, view: memoryview) -> int:
        """Move the bytes the next header still needs from ``view``; return how many."""
        if len(self._buf) < _PREFIX.size:
            need = _PREFIX.size - len(self._buf)
        else:
            _, header_len = _PREFIX.unpack_from(self._buf)
            need = _PREFIX.size + min(header_len, MAX_HEADER_BYTES + 1) - len(self._buf)
        take = min(need, len(view))
        self._buf += view[:take]
        if len(self._buf) == _PREFIX.size and take == need:
            # The prefix just completed: the header length is known now.
            _, header_len = _PREFIX.unpack_from(self._buf)
            more = min(header_len, MAX_HEADER_BYTES + 1, len(view) - take)
            self._buf += view[take : take + more]
            take += more
        return take

    def close(self) -> None:
        """The body ended: anything pending means it was truncated."""
        if self._frame is not None or self._buf:
            raise WireError("truncated body: it ends in the middle of a frame")

    def _take_header(self) -> Frame | None:
        if len(self._buf) < _PREFIX.size:
            return None
        header_len = decode_prefix(self._buf)
        if not self._counted:  # as soon as its length is known, before its bytes
            self._budget.take(header_len)
            self._counted = True
        end = _PREFIX.size + header_len
        if len(self._buf) < end:
            return None
        header, nbytes = decode_header(bytes(self._buf[_PREFIX.size : end]), self._max_payload)
        del self._buf[:end]
        self._counted = False
        payload = self._allocate(nbytes) if self._allocate is not None and nbytes else None
        return Frame(header, payload if payload is not None else payload_buffer(nbytes))
