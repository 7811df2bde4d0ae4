"""The frame: a self-describing, checksummed envelope of one tensor (the format in
:mod:`memkv.storage.codecs`), built and verified here for every codec."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack
import torch

from memkv.errors import CorruptDataError, InvalidInputError
from memkv.protocol.checksum import crc32

MAGIC = b"MKVC"
FORMAT_VERSION = 1

# magic, version, codec id, dtype code, ndim, var-header len, payload len,
# decoded len, payload crc, header crc.
_FIXED = struct.Struct("<4sBBBBIQQII")
FIXED_HEADER_SIZE = _FIXED.size
# The header CRC is the fixed header's last field; it covers the bytes before it.
_HEADER_CRC_SIZE = 4
_SHAPE_DIM = struct.Struct("<Q")
# A KV block has 5 dims; allow some room for other tensors, but keep headers small.
MAX_NDIM = 16
# Variable headers are a shape and a few params; anything larger is damage.
_MAX_VAR_HEADER = 1 << 16


class _DTypeCode(IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3


_DTYPE_CODES: dict[torch.dtype, _DTypeCode] = {
    torch.float32: _DTypeCode.FLOAT32,
    torch.float16: _DTypeCode.FLOAT16,
    torch.bfloat16: _DTypeCode.BFLOAT16,
}
_CODE_DTYPES: dict[int, torch.dtype] = {int(c): d for d, c in _DTYPE_CODES.items()}

#: Codec ids as frames carry them. The frame is read before any codec is chosen,
#: so the table lives here; the registry checks every codec against it.
CODEC_NAMES: dict[int, str] = {0: "none", 1: "lz4", 2: "zstd", 3: "delta_rl", 4: "int8"}


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a frame holds, read without decoding the payload.

    Attributes:
        version: frame format version.
        codec: registry name of the codec that wrote the frame.
        codec_id: the codec's numeric id.
        dtype: dtype of the decoded tensor.
        shape: shape of the decoded tensor.
        params: the codec's parameters, as written.
        header_len: bytes of fixed plus variable header.
        payload_len: bytes of payload.
        raw_len: bytes of the decoded tensor.
        payload_crc: crc32 of the payload.
    """

    version: int
    codec: str
    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: Mapping[str, Any]
    header_len: int
    payload_len: int
    raw_len: int
    payload_crc: int

    @property
    def frame_len(self) -> int:
        """Bytes of the whole frame."""
        return self.header_len + self.payload_len

    @property
    def ratio(self) -> float:
        """Decoded bytes per frame byte."""
        return self.raw_len / self.frame_len


def _as_view(frame: bytes | bytearray | memoryview) -> memoryview:
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise InvalidInputError(
            f"a frame must be bytes, bytearray or memoryview, got {type(frame).__name__}"
        )
    mv = memoryview(frame)
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise InvalidInputError("a frame memoryview must be contiguous")
        mv = mv.cast("B")
    return mv


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _build_frame(
    codec_id: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    params: Mapping[str, Any],
    payload: Sequence[Any],
) -> bytes:
    """Assemble a frame from payload pieces (buffers), computing lengths and CRCs."""
    numel = math.prod(shape)
    var = b"".join(_SHAPE_DIM.pack(d) for d in shape) + msgpack.packb(dict(params))
    payload_len = 0
    payload_crc = 0
    for part in payload:
        payload_crc = crc32(part, payload_crc)
        payload_len += memoryview(part).nbytes
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        codec_id,
        int(_DTYPE_CODES[dtype]),
        len(shape),
        len(var),
        payload_len,
        numel * _itemsize(dtype),
        payload_crc,
        0,
    )
    header_crc = crc32(var, crc32(fixed[:-_HEADER_CRC_SIZE]))
    fixed = fixed[:-_HEADER_CRC_SIZE] + header_crc.to_bytes(_HEADER_CRC_SIZE, "little")
    return b"".join([fixed, var, *payload])


def _parse_header(mv: memoryview) -> FrameHeader:
    if len(mv) < FIXED_HEADER_SIZE:
        raise CorruptDataError(
            f"truncated frame: {len(mv)} bytes, the fixed header alone needs {FIXED_HEADER_SIZE}"
        )
    (
        magic,
        version,
        codec_id,
        dtype_code,
        ndim,
        var_len,
        payload_len,
        raw_len,
        payload_crc,
        header_crc,
    ) = _FIXED.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptDataError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if var_len > _MAX_VAR_HEADER:
        raise CorruptDataError(f"variable header of {var_len} bytes exceeds {_MAX_VAR_HEADER}")
    header_len = FIXED_HEADER_SIZE + var_len
    if len(mv) < header_len:
        raise CorruptDataError(
            f"truncated frame: {len(mv)} bytes, its header alone needs {header_len}"
        )
    var = mv[FIXED_HEADER_SIZE:header_len]
    crc = crc32(var, crc32(mv[: FIXED_HEADER_SIZE - _HEADER_CRC_SIZE]))
    if crc != header_crc:
        raise CorruptDataError(
            f"frame header checksum mismatch ({crc:#010x} != {header_crc:#010x})"
        )
    # The header is intact from here on: what follows are format violations.
    if version != FORMAT_VERSION:
        raise CorruptDataError(
            f"unsupported frame format version {version}; this build reads {FORMAT_VERSION}"
        )
    codec_name = CODEC_NAMES.get(codec_id)
    if codec_name is None:
        raise CorruptDataError(f"unknown codec id {codec_id}; known: {sorted(CODEC_NAMES)}")
    dtype = _CODE_DTYPES.get(dtype_code)
    if dtype is None:
        raise CorruptDataError(f"unknown dtype code {dtype_code}; known: {sorted(_CODE_DTYPES)}")
    shape_len = ndim * _SHAPE_DIM.size
    if ndim > MAX_NDIM or shape_len > var_len:
        raise CorruptDataError(f"frame header declares {ndim} dims in {var_len} bytes")
    shape = tuple(_SHAPE_DIM.unpack_from(var, i * _SHAPE_DIM.size)[0] for i in range(ndim))
    try:
        params = msgpack.unpackb(var[shape_len:], raw=False)
    except (ValueError, TypeError) as e:  # msgpack's format errors are ValueErrors
        raise CorruptDataError(f"frame codec params do not parse: {e}") from e
    if not isinstance(params, dict):
        raise CorruptDataError(f"frame codec params must be a map, got {type(params).__name__}")
    if raw_len != math.prod(shape) * _itemsize(dtype):
        raise CorruptDataError(
            f"frame declares {raw_len} decoded bytes for shape {shape} of {dtype}"
        )
    return FrameHeader(
        version=version,
        codec=codec_name,
        codec_id=codec_id,
        dtype=dtype,
        shape=shape,
        params=params,
        header_len=header_len,
        payload_len=payload_len,
        raw_len=raw_len,
        payload_crc=payload_crc,
    )


def peek_header(frame: bytes | bytearray | memoryview) -> FrameHeader:
    """Read and verify a frame's header without touching the payload.

    ``frame`` may be just the frame's first bytes, as long as they hold the
    whole header; :attr:`FrameHeader.frame_len` then says how much to read.

    Raises:
        InvalidInputError: ``frame`` is not a bytes-like object.
        CorruptDataError: bad magic, version, checksum or header fields, or
            fewer bytes than the header.
    """
    return _parse_header(_as_view(frame))


def verify_frame(frame: bytes | bytearray | memoryview) -> FrameHeader:
    """Check a whole frame's header and payload checksums without decoding it.

    Used where frames are stored rather than decoded (the archive), so a frame
    damaged in transit is refused before it is kept.

    Raises:
        InvalidInputError: ``frame`` is not a bytes-like object.
        CorruptDataError: any integrity check failed.
    """
    mv = _as_view(frame)
    header = _parse_header(mv)
    _verified_payload(mv, header)
    return header


def _verified_payload(mv: memoryview, header: FrameHeader) -> memoryview:
    if len(mv) != header.frame_len:
        what = "truncated" if len(mv) < header.frame_len else "over-long"
        raise CorruptDataError(
            f"{what} frame: {len(mv)} bytes, its header declares {header.frame_len}"
        )
    payload = mv[header.header_len :]
    crc = crc32(payload)
    if crc != header.payload_crc:
        raise CorruptDataError(
            f"frame payload checksum mismatch ({crc:#010x} != {header.payload_crc:#010x})"
        )
    return payload


def _param(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """A codec param from a verified header; a missing or mistyped one is a format error."""
    value = params.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptDataError(f"frame codec param {key!r} is {value!r}, expected {kind}")
    return value
