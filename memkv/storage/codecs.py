"""Self-describing, checksummed frames of KV tensors, and the codecs that make them.

A frame is everything needed to rebuild a tensor, and nothing else::

    fixed header (36 bytes, little-endian)
        magic "MKVC" | version u8 | codec id u8 | dtype code u8 | ndim u8
        | variable-header length u32 | payload length u64 | decoded length u64
        | payload crc32 u32 | header crc32 u32
    variable header
        shape: ndim x u64 | codec params: msgpack map
    payload

The header CRC covers the fixed header (all but itself) and the variable header;
the payload CRC covers the payload. Every decode checks both, the magic, the
version and the lengths, and raises :class:`~memkv.errors.CorruptDataError`
rather than return a tensor built from damaged bytes. (zlib's crc32 runs at
~6 GB/s per core here, a small share of any decode.)

Codecs, by registry name (:data:`CODECS`):

* ``none`` - the raw bytes, checksummed. Fastest; the warm tier's default.
* ``lz4`` - LZ4 block, optionally after a byte shuffle. Honest note: LZ4 has no
  entropy stage, so it gains ~0% on fp16 KV, shuffled or not.
* ``zstd`` - Zstandard, optionally after a byte shuffle (bytes of equal
  significance side by side: the exponent bytes compress, the mantissas do
  not), ~1.18x on fp16 KV, the entropy bound of lossless coding.
* ``delta_rl`` - lossy: quantise (int8 per key channel / per value token,
  4-bit in groups with a per-group scale and minimum, or stepped int8 codes
  sized to the data's spread for the entropy coder), optionally take token
  deltas, run-length code, then entropy-code with zstd. Each stage can be
  switched off; the run-length stage skips itself when it would not shrink.

Frames store tensor bytes in the host's order; memkv targets little-endian hosts.
"""

from __future__ import annotations

import inspect
import math
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Literal, cast

import lz4.block
import msgpack
import numpy as np
import torch
import zstandard

from memkv.errors import CorruptDataError, InvalidInputError, LayoutMismatchError
from memkv.gpu_kernels import ops as kernels
from memkv.protocol.checksum import crc32
from memkv.storage.config import CodecConfig
from memkv.storage.layout import DTYPES, KV_AXIS_SIZE
from memkv.storage.precision import (
    INT8_LEVELS,
    EncodedBlock,
    QuantizedBlock,
    dequantize_int8,
    finite_absmax,
    quantize_int8,
)

__all__ = [
    "CODECS",
    "Int8Codec",
    "encode_stored",
    "FIXED_HEADER_SIZE",
    "FORMAT_VERSION",
    "K_GROUPINGS",
    "MAGIC",
    "MAX_NDIM",
    "STEP_RANGE",
    "Codec",
    "CodecPolicy",
    "DeltaRLCodec",
    "FrameHeader",
    "KGrouping",
    "Lz4Codec",
    "NoneCodec",
    "Tier",
    "ZstdCodec",
    "decode_frame",
    "get_codec",
    "get_codec_for",
    "peek_header",
    "verify_frame",
]

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

# Unsigned words of each item size, for byte work on dtypes numpy lacks (bf16).
_UWORD: dict[int, type[np.unsignedinteger[Any]]] = {
    2: np.uint16,
    4: np.uint32,
}
_BITS_PER_BYTE = 8


# --------------------------------------------------------------------------- frames


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
    codec_cls = _BY_ID.get(codec_id)
    if codec_cls is None:
        raise CorruptDataError(f"unknown codec id {codec_id}; known: {sorted(_BY_ID)}")
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
        codec=codec_cls.name,
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


# --------------------------------------------------------------------------- byte helpers


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a uint8 array (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-shuffle: byte ``j`` of every item, for each ``j``, one plane after another.

    Shift-and-truncate on whole words is ~5x faster than a transposed copy of
    the ``[n, itemsize]`` byte matrix in numpy (0.37 vs 2.0 ms per 4 MiB here).
    """
    if itemsize == 1:
        return raw
    words = raw.view(_UWORD[itemsize])
    n = words.size
    out = np.empty(raw.size, dtype=np.uint8)
    for plane in range(itemsize):  # one vectorised pass per byte plane
        np.right_shift(
            words, plane * _BITS_PER_BYTE, out=out[plane * n : (plane + 1) * n], casting="unsafe"
        )
    return out


def _unshuffle_into(shuffled: np.ndarray, out: np.ndarray, itemsize: int) -> None:
    """Inverse of :func:`_shuffle`, written into the uint8 array ``out``."""
    if itemsize == 1:
        out[...] = shuffled
        return
    word = _UWORD[itemsize]
    words = out.view(word)
    n = words.size
    planes = shuffled.reshape(itemsize, n)
    np.left_shift(planes[itemsize - 1], (itemsize - 1) * _BITS_PER_BYTE, out=words, dtype=word)
    if itemsize > 2:
        tmp = np.empty(n, dtype=word)
        for plane in range(itemsize - 2, 0, -1):
            np.left_shift(planes[plane], plane * _BITS_PER_BYTE, out=tmp, dtype=word)
            np.bitwise_or(words, tmp, out=words)
    np.bitwise_or(words, planes[0], out=words)


_local = threading.local()


def _zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe but are costly to build: one per thread and level.
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("cctx", {})
    ctx = cache.get(level)
    if ctx is None:
        ctx = cache[level] = zstandard.ZstdCompressor(level=level)
    return ctx


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    ctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if ctx is None:
        ctx = _local.dctx = zstandard.ZstdDecompressor()
    return ctx


def _zstd_decompress(payload: memoryview, size: int) -> bytes:
    try:
        raw = _zstd_decompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptDataError(f"zstd payload does not decompress: {e}") from e
    if len(raw) != size:
        raise CorruptDataError(f"zstd payload decompressed to {len(raw)} bytes, expected {size}")
    return raw


# --------------------------------------------------------------------------- codecs


def _check_tensor(block: object) -> torch.Tensor:
    if not isinstance(block, torch.Tensor):
        raise InvalidInputError(f"expected a torch.Tensor, got {type(block).__name__}")
    if block.device.type != "cpu":
        raise InvalidInputError(f"codecs take CPU tensors, got one on {block.device}")
    if block.dtype not in _DTYPE_CODES:
        raise InvalidInputError(f"codecs take dtypes {sorted(DTYPES)}, got {block.dtype}")
    if block.dim() > MAX_NDIM:
        raise InvalidInputError(f"codecs take at most {MAX_NDIM} dims, got {block.dim()}")
    return block.detach().contiguous()


# libzstd's ZSTD_minCLevel(): negative levels trade ratio for speed.
_ZSTD_MIN_LEVEL = -(1 << 17)


def _check_level(level: object) -> int:
    lo, hi = _ZSTD_MIN_LEVEL, zstandard.MAX_COMPRESSION_LEVEL
    if isinstance(level, bool) or not isinstance(level, int) or not lo <= level <= hi:
        raise InvalidInputError(f"zstd level must be an int in [{lo}, {hi}], got {level!r}")
    return level


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be a bool, got {value!r}")
    return value


class Codec(ABC):
    """Turns a CPU tensor into a self-describing frame and back.

    Subclasses set :attr:`name`, :attr:`codec_id` and :attr:`lossless` and
    implement the payload half; framing and verification live here. Decoding
    reads its parameters from the frame, so any instance of a codec decodes
    every frame that codec wrote, whatever parameters it was built with.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool]

    def encode(self, block: torch.Tensor) -> bytes:
        """Encode a CPU tensor into a frame.

        Raises:
            InvalidInputError: not a CPU float32/float16/bfloat16 tensor (lossy
                codecs also need a block shape and finite values; see subclasses).
        """
        t = _check_tensor(block)
        params, payload = self._encode_payload(t)
        return _build_frame(self.codec_id, t.dtype, tuple(t.shape), params, payload)

    def decode(self, frame: bytes | bytearray | memoryview) -> torch.Tensor:
        """Decode a frame written by this codec into a new tensor.

        Raises:
            CorruptDataError: any integrity or format check failed.
            InvalidInputError: the frame was written by another codec, or is not
                bytes-like.
        """
        mv = _as_view(frame)
        header = _parse_header(mv)
        if header.codec_id != self.codec_id:
            raise InvalidInputError(
                f"frame was written by codec {header.codec!r}, not {self.name!r}; "
                f"use decode_frame() to dispatch on the header"
            )
        return self._decode_payload(header, _verified_payload(mv, header))

    @abstractmethod
    def error_bound(self) -> str:
        """The stated per-element error bound, human-readable."""

    @abstractmethod
    def _encode_payload(self, block: torch.Tensor) -> tuple[dict[str, Any], list[Any]]:
        """Params for the header and the payload pieces of a contiguous tensor."""

    @classmethod
    @abstractmethod
    def _decode_payload(cls, header: FrameHeader, payload: memoryview) -> torch.Tensor:
        """Rebuild the tensor from a verified payload."""

    @classmethod
    def from_config(cls, config: CodecConfig) -> Codec:
        """This codec with the parameters ``config`` sets for it."""
        return cls()

    def params(self) -> dict[str, Any]:
        """The constructor parameters of this instance."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


class NoneCodec(Codec):
    """The raw tensor bytes, checksummed: no compression, fastest decode."""

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = 0
    lossless: ClassVar[bool] = True

    def error_bound(self) -> str:
        """Bit-exact."""
        return "bit-exact"

    def _encode_payload(self, block: torch.Tensor) -> tuple[dict[str, Any], list[Any]]:
        return {}, [_tensor_bytes(block)]

    @classmethod
    def _decode_payload(cls, header: FrameHeader, payload: memoryview) -> torch.Tensor:
        if len(payload) != header.raw_len:
            raise CorruptDataError(
                f"raw payload is {len(payload)} bytes, expected {header.raw_len}"
            )
        out = torch.empty(header.shape, dtype=header.dtype)
        _tensor_bytes(out)[...] = np.frombuffer(payload, dtype=np.uint8)
        return out


class _ByteCodec(Codec):
    """A lossless byte compressor behind an optional byte shuffle."""

    lossless: ClassVar[bool] = True

    def __init__(self, *, shuffle: bool = True) -> None:
        self.shuffle = _check_bool("shuffle", shuffle)

    def params(self) -> dict[str, Any]:
        """The constructor parameters of this instance."""
        return {"shuffle": self.shuffle}

    def error_bound(self) -> str:
        """Bit-exact."""
        return "bit-exact"

    @abstractmethod
    def _compress(self, data: np.ndarray) -> bytes:
        """Compress a uint8 array."""

    @classmethod
    @abstractmethod
    def _decompress(cls, payload: memoryview, size: int) -> bytes:
        """Decompress to exactly ``size`` bytes (CorruptDataError otherwise)."""

    def _encode_payload(self, block: torch.Tensor) -> tuple[dict[str, Any], list[Any]]:
        raw = _tensor_bytes(block)
        data = _shuffle(raw, block.element_size()) if self.shuffle else raw
        return {"shuffle": self.shuffle}, [self._compress(data)]

    @classmethod
    def _decode_payload(cls, header: FrameHeader, payload: memoryview) -> torch.Tensor:
        shuffled = _param(header.params, "shuffle", bool)
        raw = np.frombuffer(cls._decompress(payload, header.raw_len), dtype=np.uint8)
        out = torch.empty(header.shape, dtype=header.dtype)
        dst = _tensor_bytes(out)
        if shuffled:
            _unshuffle_into(raw, dst, out.element_size())
        else:
            dst[...] = raw
        return out


class Lz4Codec(_ByteCodec):
    """LZ4 block compression, optionally after a byte shuffle.

    Args:
        shuffle: byte-shuffle before compressing.
    """

    name: ClassVar[str] = "lz4"
    codec_id: ClassVar[int] = 1

    @classmethod
    def from_config(cls, config: CodecConfig) -> Codec:
        """LZ4 with the config's shuffle setting."""
        return cls(shuffle=config.shuffle)

    def _compress(self, data: np.ndarray) -> bytes:
        return cast(bytes, lz4.block.compress(data, store_size=False))

    @classmethod
    def _decompress(cls, payload: memoryview, size: int) -> bytes:
        try:
            raw = cast(bytes, lz4.block.decompress(payload, uncompressed_size=size))
        except lz4.block.LZ4BlockError as e:
            raise CorruptDataError(f"lz4 payload does not decompress: {e}") from e
        if len(raw) != size:
            raise CorruptDataError(f"lz4 payload decompressed to {len(raw)} bytes, not {size}")
        return raw


class ZstdCodec(_ByteCodec):
    """Zstandard compression, optionally after a byte shuffle.

    Args:
        level: zstd compression level.
        shuffle: byte-shuffle before compressing.
    """

    name: ClassVar[str] = "zstd"
    codec_id: ClassVar[int] = 2

    def __init__(self, *, level: int = 3, shuffle: bool = True) -> None:
        super().__init__(shuffle=shuffle)
        self.level = _check_level(level)

    @classmethod
    def from_config(cls, config: CodecConfig) -> Codec:
        """Zstd with the config's level and shuffle setting."""
        return cls(level=config.zstd_level, shuffle=config.shuffle)

    def params(self) -> dict[str, Any]:
        """The constructor parameters of this instance."""
        return {"level": self.level, "shuffle": self.shuffle}

    def _compress(self, data: np.ndarray) -> bytes:
        return _zstd_compressor(self.level).compress(data.data)

    @classmethod
    def _decompress(cls, payload: memoryview, size: int) -> bytes:
        return _zstd_decompress(payload, size)


# --------------------------------------------------------------------------- delta_rl

KGrouping = Literal["channel", "token"]
#: 4-bit key grouping: ``channel`` = groups of ``group`` tokens within one key
#: channel (KIVI); ``token`` = groups of ``group`` channels within one token.
K_GROUPINGS: tuple[KGrouping, ...] = ("channel", "token")
_NIBBLE_LEVELS = 15  # 4-bit codes 0..15
_NIBBLE_MASK = 0x0F
_NIBBLE_SHIFT = 4
# Above this |x| an fp32 computation of (x - min) or min + 15 * scale could
# overflow, so such blocks are quantised and decoded in float64 ("wide").
_WIDE_ABSMAX = 2.0**120
# Rounding the stored scale up lets min + 15 * scale pass the group max by at
# most 2**-7 of the range (bf16); clamp at decode when that could leave the
# output dtype's range.
_CLAMP_MARGIN = 2.0**-5
# Run-length lengths are stored in the narrowest unsigned type that fits.
_RL_LEN_TYPES: tuple[type[np.unsignedinteger[Any]], ...] = (
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
)
_BLOCK_NDIM = 5
_K, _V = 0, 1
_TOKEN_AXIS_BLOCK = 3  # token axis of [L, 2, H, T, D]
#: Defaults chosen by memkv/bench/codec_measure.py (see DeltaRLCodec).
DEFAULT_TOKEN_DELTA = False
DEFAULT_RUN_LENGTH = True
DEFAULT_K_GROUPING: KGrouping = "channel"


def _identity(codes: np.ndarray) -> np.ndarray:
    return codes


# The bit-level math is memkv.gpu_kernels' (one copy, with CUDA kernels beside it).
_pack_nibbles = kernels.pack_nibbles


def _unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    half = (n + 1) // 2
    if packed.size != half:
        raise CorruptDataError(f"{packed.size} packed bytes cannot hold {n} 4-bit codes")
    return kernels.unpack_nibbles(packed, n)


_token_delta = kernels.token_delta
_undo_token_delta = kernels.undo_token_delta


def _run_length(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of equal codes: ``(values, lengths)`` with ``np.repeat(values, lengths) == flat``."""
    if flat.size == 0:
        return flat[:0], np.zeros(0, dtype=np.uint8)
    starts = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.append(starts, flat.size))
    len_type = next(t for t in _RL_LEN_TYPES if lengths.max() <= np.iinfo(t).max)
    return flat[starts], lengths.astype(len_type)


def _run_count(flat: np.ndarray) -> int:
    return 0 if flat.size == 0 else 1 + int(np.count_nonzero(flat[1:] != flat[:-1]))


def _round_up(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative ``values`` in ``dtype``, rounded up (never below the input).

    The stored scale must cover its group's whole range, or the top code
    would clip the group max.
    """
    stored = values.to(dtype)
    low = stored.to(values.dtype) < values
    if bool(low.any()):
        word = torch.int16 if stored.element_size() == 2 else torch.int32
        bumped = (stored.view(word) + 1).view(dtype)  # next float up: positive, so +1 ulp
        stored = torch.where(low, bumped, stored)
    return stored


@dataclass(frozen=True, slots=True)
class _Stream:
    """One array of codes and the axis its tokens run along."""

    codes: np.ndarray
    token_axis: int


@dataclass(frozen=True, slots=True)
class _Quantised:
    streams: list[_Stream]
    tables: list[np.ndarray]  # scales and minimums, as raw arrays
    meta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Geometry:
    """Sizes the decoder derives from the shape and params, before reading a byte."""

    stream_shapes: list[tuple[int, ...]]
    token_axes: list[int]
    table_shapes: list[tuple[int, ...]]
    table_dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _Settings:
    """What a scheme needs besides the block: the codec's quantisation parameters."""

    group: int
    k_grouping: KGrouping
    step: float | None = None


class _Scheme(ABC):
    """A quantisation scheme of delta_rl."""

    bits: ClassVar[int]

    @staticmethod
    @abstractmethod
    def quantise(block: torch.Tensor, settings: _Settings) -> _Quantised:
        """Codes, tables and decode metadata of a finite block."""

    @staticmethod
    @abstractmethod
    def geometry(shape: tuple[int, ...], dtype: torch.dtype, settings: _Settings) -> _Geometry:
        """What the decoder expects for a block of ``shape``."""

    @staticmethod
    @abstractmethod
    def dequantise(
        codes: list[np.ndarray],
        tables: list[torch.Tensor],
        header: FrameHeader,
        settings: _Settings,
    ) -> torch.Tensor:
        """Rebuild the block."""


class _Int8Scheme(_Scheme):
    """precision.py's int8: symmetric, keys per channel, values per token."""

    bits: ClassVar[int] = 8

    @staticmethod
    def quantise(block: torch.Tensor, settings: _Settings) -> _Quantised:
        q = quantize_int8(block)
        codes = q.data.numpy().view(np.uint8)
        return _Quantised(
            streams=[_Stream(codes, _TOKEN_AXIS_BLOCK)],
            tables=[q.k_scale.numpy(), q.v_scale.numpy()],
            meta={},
        )

    @staticmethod
    def geometry(shape: tuple[int, ...], dtype: torch.dtype, settings: _Settings) -> _Geometry:
        layers, _, heads, tokens, dim = shape
        return _Geometry(
            stream_shapes=[shape],
            token_axes=[_TOKEN_AXIS_BLOCK],
            table_shapes=[(layers, heads, dim), (layers, heads, tokens)],
            table_dtype=torch.float32,
        )

    @staticmethod
    def dequantise(
        codes: list[np.ndarray],
        tables: list[torch.Tensor],
        header: FrameHeader,
        settings: _Settings,
    ) -> torch.Tensor:
        data = torch.from_numpy(codes[0].view(np.int8))
        q = QuantizedBlock(data=data, k_scale=tables[0], v_scale=tables[1], dtype=header.dtype)
        return dequantize_int8(q)


#: Stepped codes are int8: |code| <= 127 by construction of the scale.
_STEPPED_LEVELS = 127
#: Above this |x| the squares of the RMS could overflow fp32: compute in float64.
_STEPPED_WIDE_ABSMAX = 2.0**60
_K_TOKEN_AXIS = 2  # token axis of a half [L, H, T, D]


def _stepped_scale(r: torch.Tensor, dim: int, step: float, dtype: torch.dtype) -> torch.Tensor:
    """``max(step * rms, absmax / 127)`` along ``dim``, rounded up in ``dtype`` (0 -> 1).

    The absmax floor keeps every code within int8 even where one element is
    far from the rest; rounding up keeps it there after the table's rounding.
    """
    if r.shape[dim] == 0:  # no tokens (or channels): nothing to scale
        return torch.ones((*r.shape[:dim], 1, *r.shape[dim + 1:]), dtype=dtype)
    rms = r.square().mean(dim, keepdim=True).sqrt()
    amax = r.abs().amax(dim, keepdim=True)
    scale = torch.maximum(rms * step, amax / _STEPPED_LEVELS)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: any scale
    # Near the dtype's limit step x RMS could round to inf; absmax/127 always fits.
    return _round_up(scale.clamp_(max=torch.finfo(dtype).max), dtype)


def _stepped_codes(r: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    q = torch.round(r / scale).clamp_(-_STEPPED_LEVELS, _STEPPED_LEVELS)
    return q.to(torch.int8).numpy().view(np.uint8)


class _SteppedScheme(_Scheme):
    """Fine uniform steps, sized to the data's spread, for the entropy coder to shrink.

    Keys: each channel minus its mean over the block's tokens (keys carry
    channels with large, stable offsets), divided by ``step`` x the RMS of
    what is left; values: each token divided by ``step`` x its RMS. Codes are
    int8 (the scale never falls below absmax / 127, so none clips) but
    concentrated on a few values near zero: at steps around the RMS they
    carry ~2-2.5 bits of entropy, which zstd's Huffman stage codes at close to
    that. A uniform quantiser followed by an entropy coder reaches a given
    error in fewer bits than fixed-width codes with min/max scales, whose
    levels are spent evenly on a range most values never visit.

    Tables, in the block's dtype: key scale and mean per channel, value scale
    per token. Hence ``|x - x_hat| <= scale / 2`` (plus rounding to the output dtype).
    """

    bits: ClassVar[int] = 8

    @staticmethod
    def quantise(block: torch.Tensor, settings: _Settings) -> _Quantised:
        step = settings.step
        assert step is not None  # DeltaRLCodec picks this scheme only with a step
        absmax = finite_absmax(block, "block to quantise")
        wide = absmax > _STEPPED_WIDE_ABSMAX
        compute = torch.float64 if wide else torch.float32
        k = block[:, _K].to(compute)
        mean = (k.mean(dim=_K_TOKEN_AXIS, keepdim=True) if k.shape[_K_TOKEN_AXIS] else
                k.new_zeros((*k.shape[:2], 1, k.shape[3]))).to(block.dtype)  # as stored
        r = k - mean.to(compute)
        k_scale = _stepped_scale(r, _K_TOKEN_AXIS, step, block.dtype)
        v = block[:, _V].to(compute)
        v_scale = _stepped_scale(v, 3, step, block.dtype)
        streams = [_Stream(_stepped_codes(r, k_scale.to(compute)), _K_TOKEN_AXIS),
                   _Stream(_stepped_codes(v, v_scale.to(compute)), _K_TOKEN_AXIS)]
        # |x_hat| <= |x| + scale / 2 and scale <= (step + 2/127) * 2 * absmax (+ rounding up).
        reach = absmax * (1 + (step + 2 / _STEPPED_LEVELS) * (1 + _CLAMP_MARGIN))
        return _Quantised(
            streams=streams,
            tables=[_raw_table(k_scale), _raw_table(mean), _raw_table(v_scale)],
            meta={"wide": wide, "clamp": reach >= torch.finfo(block.dtype).max},
        )

    @staticmethod
    def geometry(shape: tuple[int, ...], dtype: torch.dtype, settings: _Settings) -> _Geometry:
        layers, _, heads, tokens, dim = shape
        half = (layers, heads, tokens, dim)
        return _Geometry(
            stream_shapes=[half, half],
            token_axes=[_K_TOKEN_AXIS, _K_TOKEN_AXIS],
            table_shapes=[(layers, heads, 1, dim), (layers, heads, 1, dim),
                          (layers, heads, tokens, 1)],
            table_dtype=dtype,
        )

    @staticmethod
    def dequantise(
        codes: list[np.ndarray],
        tables: list[torch.Tensor],
        header: FrameHeader,
        settings: _Settings,
    ) -> torch.Tensor:
        compute = _compute_dtype(header)
        out = torch.empty(header.shape, dtype=header.dtype)
        k_scale, mean, v_scale = (t.to(compute) for t in tables)
        k = torch.from_numpy(codes[0].view(np.int8))
        v = torch.from_numpy(codes[1].view(np.int8))
        # A few layers at a time through one reused buffer: a fresh fp32 temporary
        # the size of a half block faults in its pages on every decode, which
        # measured as much as the arithmetic itself (1 MiB blocks: 0.43 -> 0.20 ms).
        for layers in _layer_chunks(k.shape):
            x = _decode_scratch(k[layers].shape, compute)
            torch.addcmul(mean[layers], x.copy_(k[layers]), k_scale[layers], out=x)
            _store(out[layers, _K], x, header)
            _store(out[layers, _V], x.copy_(v[layers]).mul_(v_scale[layers]), header)
        return out


#: Elements of the reused decode buffer (fp32: 16 MiB); larger blocks go a few layers at a time.
_DECODE_SCRATCH_ELEMENTS = 4 << 20


def _layer_chunks(shape: torch.Size) -> list[slice]:
    """Ranges of the leading (layer) axis that fit the decode buffer (at least one layer)."""
    step = max(1, _DECODE_SCRATCH_ELEMENTS // max(1, math.prod(shape[1:])))
    return [slice(i, i + step) for i in range(0, shape[0], step)]


def _decode_scratch(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """This thread's reused buffer, viewed as ``shape`` of ``dtype`` (grown when needed)."""
    need = math.prod(shape) * _itemsize(dtype)
    buf: torch.Tensor | None = getattr(_local, "decode_scratch", None)
    if buf is None or buf.numel() < need:
        buf = _local.decode_scratch = torch.empty(max(need, 1), dtype=torch.uint8)
    return buf[:need].view(dtype).view(shape)


def _compute_dtype(header: FrameHeader) -> torch.dtype:
    """float64 for a frame whose values could overflow fp32 arithmetic ("wide"), else fp32."""
    return torch.float64 if _param(header.params, "wide", bool) else torch.float32


def _store(target: torch.Tensor, x: torch.Tensor, header: FrameHeader) -> None:
    """Decoded values into the output: clamped to its dtype where the frame says they may
    pass it, rounded to it (and laid out as ``target``) in one copy."""
    if _param(header.params, "clamp", bool):
        limit = torch.finfo(header.dtype).max
        x.clamp_(-limit, limit)
    target.copy_(x.reshape(target.shape))


def _k_view(k: torch.Tensor, k_grouping: KGrouping) -> torch.Tensor:
    """Keys ``[L, H, T, D]`` arranged so groups run along the last axis."""
    return k.transpose(2, 3) if k_grouping == "channel" else k


def _group_count(n: int, group: int) -> int:
    return -(-n // group)


class _Group4Scheme(_Scheme):
    """4-bit asymmetric codes in groups of ``group`` with a per-group scale and minimum.

    Each half (K, V) is laid out so its groups run along memory - keys as
    ``[L, H, D, T]`` (channel grouping: a group is ``group`` tokens of one
    channel) or ``[L, H, T, D]``, values as ``[L, H, T, D]`` - and cut into
    groups of ``group`` consecutive elements. A group that does not divide
    a row continues into the next one, so only the very end is padded (by
    repeating the last element, which keeps the group's min and max) and
    partial blocks or ``group > head_dim`` cost no padding codes.

    The minimum is a value of the group, so it is stored exactly in the
    block's own dtype; the scale ``(max - min) / 15`` is rounded *up* in that
    dtype so the 16 levels always reach the group max. Hence
    ``|x - x_hat| <= scale / 2`` (plus rounding to the output dtype).
    """

    bits: ClassVar[int] = 4

    @staticmethod
    def _token_axes(k_grouping: KGrouping) -> list[int]:
        # Keys grouped per channel are stored [L, H, D, T]; everything else [L, H, T, D].
        return [3 if k_grouping == "channel" else 2, 2]

    @staticmethod
    def quantise(block: torch.Tensor, settings: _Settings) -> _Quantised:
        group, k_grouping = settings.group, settings.k_grouping
        absmax = finite_absmax(block, "block to quantise")
        wide = absmax > _WIDE_ABSMAX
        compute = torch.float64 if wide else torch.float32
        halves = (_k_view(block[:, _K], k_grouping), block[:, _V])
        streams: list[_Stream] = []
        tables: list[np.ndarray] = []
        token_axes = _Group4Scheme._token_axes(k_grouping)
        for half, token_axis in zip(halves, token_axes, strict=True):
            x = half.to(compute, memory_format=torch.contiguous_format)
            lo, hi = kernels.group_minmax(x.reshape(-1), group)
            # max/15 - min/15 cannot overflow where (max - min) could.
            scale = _round_up(hi / _NIBBLE_LEVELS - lo / _NIBBLE_LEVELS, block.dtype)
            minimum = lo.to(block.dtype)  # exact: an element of the block
            q = kernels.group4_codes(x.reshape(-1), group, scale, minimum)
            codes = q.reshape(x.shape).numpy()  # padding codes dropped
            streams.append(_Stream(codes, token_axis))
            tables += [_raw_table(scale), _raw_table(minimum)]
        out_max = torch.finfo(block.dtype).max
        return _Quantised(
            streams=streams,
            tables=tables,
            meta={"wide": wide, "clamp": absmax * (1 + _CLAMP_MARGIN) >= out_max},
        )

    @staticmethod
    def geometry(shape: tuple[int, ...], dtype: torch.dtype, settings: _Settings) -> _Geometry:
        group, k_grouping = settings.group, settings.k_grouping
        layers, _, heads, tokens, dim = shape
        k_shape = (
            (layers, heads, dim, tokens)
            if k_grouping == "channel"
            else (layers, heads, tokens, dim)
        )
        v_shape = (layers, heads, tokens, dim)
        tables = [(_group_count(math.prod(s), group), 1) for s in (k_shape, v_shape)]
        return _Geometry(
            stream_shapes=[k_shape, v_shape],
            token_axes=_Group4Scheme._token_axes(k_grouping),
            table_shapes=[tables[0], tables[0], tables[1], tables[1]],
            table_dtype=dtype,
        )

    @staticmethod
    def dequantise(
        codes: list[np.ndarray],
        tables: list[torch.Tensor],
        header: FrameHeader,
        settings: _Settings,
    ) -> torch.Tensor:
        group, k_grouping = settings.group, settings.k_grouping
        compute = _compute_dtype(header)
        out = torch.empty(header.shape, dtype=header.dtype)
        targets = (_k_view(out[:, _K], k_grouping), out[:, _V])
        for i, target in enumerate(targets):
            x = kernels.group4_dequantize(codes[i], group, tables[2 * i], tables[2 * i + 1],
                                          compute)
            _store(target, x, header)  # one pass: rounds to the block dtype, un-transposes keys
        return out


def _raw_table(t: torch.Tensor) -> np.ndarray:
    """A table's bytes as a numpy array (bf16 has no numpy dtype: its raw words)."""
    t = t.contiguous()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


_SCHEMES: dict[int, type[_Scheme]] = {s.bits: s for s in (_Int8Scheme, _Group4Scheme)}
#: Stepped steps outside this range are mistakes: below, codes spread over
#: all of int8 (use bits=8 without a step); above, a handful of levels.
STEP_RANGE = (0.01, 8.0)


def _scheme(bits: int, step: float | None) -> type[_Scheme]:
    return _SteppedScheme if step is not None else _SCHEMES[bits]


def _check_step(step: object) -> float:
    low, high = STEP_RANGE
    if isinstance(step, bool) or not isinstance(step, int | float) or not low <= step <= high:
        raise InvalidInputError(
            f"delta_rl step must be a number in [{low}, {high}] (x the RMS), got {step!r}")
    return float(step)


class DeltaRLCodec(Codec):
    """Lossy KV-block codec: quantise, token delta, run-length, entropy coding.

    Stages, in order (each switchable; the decoder reads which ran from the frame):

    1. **Quantise** (``bits``): 8 = int8 with one scale per key channel and per
       value token (as :func:`~memkv.storage.precision.quantize_int8`); 4 =
       4-bit codes in groups of ``group`` elements with a per-group scale and
       minimum; keys grouped along tokens within a channel (``k_grouping=
       "channel"``, KIVI) or along channels within a token (``"token"``),
       values always within a token. Tables are stored in the block's dtype
       (int8: fp32). With ``step`` (bits 8): *stepped* codes - uniform steps
       of ``step`` x the RMS of each key channel (less its mean) and value
       token, which the entropy stage codes in ~2-2.5 bits a value.
    2. **Token delta** (``token_delta``): each code minus the code of the
       previous token in the same channel, modulo 2**bits.
    3. **Run-length** (``run_length``): runs of equal codes as (value, length)
       streams; skipped for a frame when it would not shrink the codes.
    4. **Entropy** (``level``; ``None`` = off): zstd over codes and tables.
       4-bit codes are packed two per byte first: zstd's Huffman stage then
       models pairs of codes, which measured smaller than one code per byte.

    Defaults are what ``memkv/bench/codec_measure.py`` measured on the reference
    model's KV (random weights, 8 x 1 MiB fp16 blocks, one core): 4-bit groups
    of 32 give 3.3x at 7% relative RMS error, decoding at ~1.6-1.8 GB/s; the
    zstd stage adds ~4%, token delta ~1% at half the decode speed (so it is
    off), run-length nothing on such data (it skips itself, at no decode cost).
    Trained-model KV, peakier, compresses further (see TARGETS.md).

    Args:
        bits: 4 or 8.
        group: 4-bit group size (elements); ignored at 8 bits.
        token_delta: take token deltas of the codes.
        run_length: try the run-length stage.
        level: zstd level of the entropy stage, or None to skip it.
        k_grouping: 4-bit key grouping, ``"channel"`` or ``"token"``.
        step: stepped codes' step, a multiple of the RMS in
            :data:`STEP_RANGE` (needs ``bits=8``); None = fixed-width codes.
            memkv's config default is 0.5 with zstd level 1: 6.4x smaller than
            fp16 at +0.3% perplexity on both trained models (BENCHMARKS.md).

    Raises:
        InvalidInputError: a parameter outside its valid values.

    :meth:`encode` raises :class:`~memkv.errors.LayoutMismatchError` for a
    tensor not shaped ``[layers, 2, kv_heads, tokens, head_dim]`` and
    :class:`~memkv.errors.PrecisionOverflowError` for NaN or inf.
    """

    name: ClassVar[str] = "delta_rl"
    codec_id: ClassVar[int] = 3
    lossless: ClassVar[bool] = False

    def __init__(
        self,
        *,
        bits: int = 4,
        group: int = 32,
        token_delta: bool = DEFAULT_TOKEN_DELTA,
        run_length: bool = DEFAULT_RUN_LENGTH,
        level: int | None = 3,
        k_grouping: KGrouping = DEFAULT_K_GROUPING,
        step: float | None = None,
    ) -> None:
        if bits not in _SCHEMES or isinstance(bits, bool):
            raise InvalidInputError(
                f"delta_rl bits must be one of {sorted(_SCHEMES)}, got {bits!r}"
            )
        if step is not None:
            step = _check_step(step)
            if bits != _SteppedScheme.bits:
                raise InvalidInputError(
                    f"delta_rl step makes int8 codes: expected bits=8 with it, got {bits!r}")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise InvalidInputError(f"delta_rl group must be a positive int, got {group!r}")
        if k_grouping not in K_GROUPINGS:
            raise InvalidInputError(
                f"delta_rl k_grouping must be one of {list(K_GROUPINGS)}, got {k_grouping!r}"
            )
        self.bits = bits
        self.group = group
        self.token_delta = _check_bool("token_delta", token_delta)
        self.run_length = _check_bool("run_length", run_length)
        self.level = None if level is None else _check_level(level)
        self.k_grouping: KGrouping = k_grouping
        self.step = step

    @property
    def _settings(self) -> _Settings:
        return _Settings(self.group, self.k_grouping, self.step)

    @classmethod
    def from_config(cls, config: CodecConfig) -> Codec:
        """delta_rl with the config's stage settings and zstd level."""
        return cls(
            bits=config.delta_rl_bits,
            group=config.delta_rl_group,
            token_delta=config.delta_rl_token_delta,
            run_length=config.delta_rl_run_length,
            level=config.delta_rl_level,
            k_grouping=config.delta_rl_k_grouping,
            step=config.delta_rl_step,
        )

    def params(self) -> dict[str, Any]:
        """The constructor parameters of this instance."""
        return {
            "bits": self.bits,
            "group": self.group,
            "token_delta": self.token_delta,
            "run_length": self.run_length,
            "level": self.level,
            "k_grouping": self.k_grouping,
            "step": self.step,
        }

    def error_bound(self) -> str:
        """The per-element bound of the quantisation stage (later stages are exact)."""
        if self.step is not None:
            return (
                f"|err| <= scale/2 per element, scale = max({self.step:g} x RMS, absmax/"
                f"{_STEPPED_LEVELS}) of its key channel (less its mean) or value token, rounded "
                f"up to the block dtype (plus rounding to the output dtype)"
            )
        if self.bits == _Int8Scheme.bits:
            return (
                f"|err| <= scale/2 per element, scale = absmax/{INT8_LEVELS} of its key "
                f"channel or value token (plus rounding to the output dtype)"
            )
        along = "tokens of a key channel" if self.k_grouping == "channel" else "channels"
        return (
            f"|err| <= scale/2 per element, scale = (max - min)/{_NIBBLE_LEVELS} of its "
            f"group of {self.group} (keys: {along}; values: channels of a token), rounded up "
            f"to the block dtype (plus rounding to the output dtype)"
        )

    def _encode_payload(self, block: torch.Tensor) -> tuple[dict[str, Any], list[Any]]:
        if block.dim() != _BLOCK_NDIM or block.shape[1] != KV_AXIS_SIZE:
            raise LayoutMismatchError(
                f"delta_rl encodes blocks [layers, 2, kv_heads, tokens, head_dim], got "
                f"{tuple(block.shape)}"
            )
        scheme = _scheme(self.bits, self.step)
        quantised = scheme.quantise(block, self._settings)
        mask = _NIBBLE_MASK if self.bits == _Group4Scheme.bits else None
        streams = [
            _token_delta(s.codes, s.token_axis, mask) if self.token_delta else s.codes
            for s in quantised.streams
        ]
        flat = np.concatenate([s.reshape(-1) for s in streams])
        pack = _pack_nibbles if mask is not None else _identity
        plain_bytes = (flat.size * self.bits + _BITS_PER_BYTE - 1) // _BITS_PER_BYTE
        sections: list[np.ndarray] = []
        runs = rl_len_size = 0
        # Count runs first (one compare pass): build the streams only if they can pay.
        if self.run_length and _run_count(flat) * (self.bits / _BITS_PER_BYTE + 1) < plain_bytes:
            values, lengths = _run_length(flat)
            packed_values = pack(values)
            if packed_values.nbytes + lengths.nbytes < plain_bytes:
                sections += [packed_values, lengths]
                runs, rl_len_size = values.size, lengths.itemsize
        if not rl_len_size:
            sections.append(pack(flat))
        sections += [np.ascontiguousarray(t).view(np.uint8).reshape(-1) for t in quantised.tables]
        params: dict[str, Any] = {
            "bits": self.bits,
            "group": self.group,
            "k_grouping": self.k_grouping,
            "step": self.step,
            "delta": self.token_delta,
            "rl": rl_len_size,  # bytes per run length; 0 = stage skipped
            "runs": runs,
            "entropy": self.level is not None,
            "sections": [int(s.nbytes) for s in sections],
            **quantised.meta,
        }
        if self.level is None:
            return params, sections
        stored = b"".join(sections)  # type: ignore[arg-type]  # numpy arrays are buffers
        return params, [_zstd_compressor(self.level).compress(stored)]

    @classmethod
    def _decode_payload(cls, header: FrameHeader, payload: memoryview) -> torch.Tensor:
        p = header.params
        bits = _param(p, "bits", int)
        k_grouping = _param(p, "k_grouping", str)
        group = _param(p, "group", int)
        step = p.get("step")  # absent in frames written before stepped codes
        valid_step = step is None or (isinstance(step, float) and step > 0 and bits == 8)
        if bits not in _SCHEMES or k_grouping not in K_GROUPINGS or group < 1 or not valid_step:
            raise CorruptDataError(f"bad delta_rl params {dict(p)!r}")
        scheme = _scheme(bits, step)
        if len(header.shape) != _BLOCK_NDIM or header.shape[1] != KV_AXIS_SIZE:
            raise CorruptDataError(f"delta_rl frame of non-block shape {header.shape}")
        settings = _Settings(group, cast(KGrouping, k_grouping), step)
        geo = scheme.geometry(header.shape, header.dtype, settings)
        sizes = _param(p, "sections", list)
        if not all(isinstance(s, int) and s >= 0 for s in sizes):
            raise CorruptDataError(f"bad delta_rl section sizes {sizes!r}")
        stored_len = sum(sizes)
        if _param(p, "entropy", bool):
            data = memoryview(_zstd_decompress(payload, stored_len))
        elif len(payload) == stored_len:
            data = payload
        else:
            raise CorruptDataError(f"payload is {len(payload)} bytes, sections sum to {stored_len}")
        offsets = np.cumsum([0, *sizes]).tolist()
        parts = [
            np.frombuffer(data[a:b], dtype=np.uint8)
            for a, b in zip(offsets, offsets[1:], strict=False)
        ]
        n_codes = sum(math.prod(s) for s in geo.stream_shapes)
        flat = cls._codes(parts, p, bits, n_codes, len(geo.table_shapes))
        streams = []
        start = 0
        mask = _NIBBLE_MASK if bits == _Group4Scheme.bits else None
        delta = _param(p, "delta", bool)
        for shape, axis in zip(geo.stream_shapes, geo.token_axes, strict=True):
            size = math.prod(shape)
            s = flat[start : start + size].reshape(shape)
            start += size
            streams.append(_undo_token_delta(s, axis, mask) if delta else s)
        table_parts = parts[len(parts) - len(geo.table_shapes) :]
        tables = [
            _table(raw, shape, geo.table_dtype)
            for raw, shape in zip(table_parts, geo.table_shapes, strict=True)
        ]
        return scheme.dequantise(streams, tables, header, settings)

    @staticmethod
    def _codes(
        parts: list[np.ndarray], p: Mapping[str, Any], bits: int, n_codes: int, n_tables: int
    ) -> np.ndarray:
        """The flat code stream (token deltas still applied) from the code sections."""
        rl = _param(p, "rl", int)
        nibbles = bits == _Group4Scheme.bits
        expected_sections = n_tables + (2 if rl else 1)
        if len(parts) != expected_sections:
            raise CorruptDataError(
                f"delta_rl frame has {len(parts)} sections, expected {expected_sections}"
            )
        if not rl:
            if nibbles:
                return _unpack_nibbles(parts[0], n_codes)
            if parts[0].size != n_codes:
                raise CorruptDataError(f"{parts[0].size} code bytes, expected {n_codes}")
            return parts[0].copy()  # writable, owned: the codes become a tensor
        runs = _param(p, "runs", int)
        len_type = {np.dtype(t).itemsize: t for t in _RL_LEN_TYPES}.get(rl)
        if len_type is None or parts[1].size != runs * rl:
            raise CorruptDataError(
                f"bad run-length section: {parts[1].size} bytes for {runs} "
                f"runs of {rl}-byte lengths"
            )
        values = _unpack_nibbles(parts[0], runs) if nibbles else parts[0]
        lengths = parts[1].view(len_type)
        if values.size != runs or int(lengths.sum(dtype=np.uint64)) != n_codes:
            raise CorruptDataError(f"run-length section does not expand to {n_codes} codes")
        return np.repeat(values, lengths)


def _table(raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    itemsize = _itemsize(dtype)
    if raw.size != math.prod(shape) * itemsize:
        raise CorruptDataError(f"table of {raw.size} bytes does not fit shape {shape} of {dtype}")
    if raw.size == 0:  # torch cannot reinterpret an empty byte tensor
        return torch.empty(shape, dtype=dtype)
    # copy(): a writable array owned by the tensor (raw may view a read-only frame).
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


# --------------------------------------------------------------------------- int8 frames


class Int8Codec(Codec):
    """A warm tier's int8 block as it is: codes (zstd-compressed where that helps) + scales.

    Why a codec of its own: a block kept int8 in the warm tier has already lost
    precision; decoding it to fp16 for a cold frame would double its size, and
    re-quantising with another scheme would add a second error. This frame
    carries the same codes and scales, so the cold copy is no larger than the
    warm one plus a header and decodes to the same values.
    """

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 4
    lossless: ClassVar[bool] = False

    def __init__(self, *, entropy: bool = True, level: int = 1) -> None:
        self._entropy = _check_bool("entropy", entropy)
        self._level = _check_level(level)

    def params(self) -> dict[str, Any]:
        return {"entropy": self._entropy, "level": self._level}

    def error_bound(self) -> str:
        return "|err| <= scale/2 per element, scale = absmax/127 per K channel / V token"

    def _encode_payload(self, block: torch.Tensor) -> tuple[dict[str, Any], list[Any]]:
        return self._payload_of(quantize_int8(block))

    def encode_quantized(self, q: QuantizedBlock) -> bytes:
        """The frame of an already quantised block (no re-quantisation)."""
        params, payload = self._payload_of(q)
        return _build_frame(self.codec_id, q.dtype, tuple(q.data.shape), params, payload)

    def _payload_of(self, q: QuantizedBlock) -> tuple[dict[str, Any], list[Any]]:
        codes = q.data.contiguous().cpu().numpy().view(np.uint8).reshape(-1)
        scales = [
            q.k_scale.to(torch.float32).contiguous().cpu().numpy().reshape(-1),
            q.v_scale.to(torch.float32).contiguous().cpu().numpy().reshape(-1),
        ]
        packed: Any = codes
        compressed = False
        if self._entropy:
            squeezed = _zstd_compressor(self._level).compress(codes.data)
            # Keep the raw codes where zstd does not pay for itself.
            if len(squeezed) < codes.nbytes:
                packed, compressed = squeezed, True
        params = {
            "z": compressed,
            "n": int(codes.size),
            "ks": list(q.k_scale.shape),
            "vs": list(q.v_scale.shape),
        }
        return params, [np.asarray(scales[0]), np.asarray(scales[1]), packed]

    @classmethod
    def _decode_payload(cls, header: FrameHeader, payload: memoryview) -> torch.Tensor:
        return dequantize_int8(cls.decode_quantized(header, payload), header.dtype)

    @classmethod
    def decode_quantized(cls, header: FrameHeader, payload: memoryview) -> QuantizedBlock:
        """The codes and scales of a verified int8 payload."""
        p = header.params
        ks = tuple(_param(p, "ks", list))
        vs = tuple(_param(p, "vs", list))
        n = _param(p, "n", int)
        if n != math.prod(header.shape):
            raise CorruptDataError(f"int8 frame holds {n} codes for shape {header.shape}")
        k_bytes, v_bytes = 4 * math.prod(ks), 4 * math.prod(vs)
        if len(payload) < k_bytes + v_bytes:
            raise CorruptDataError("int8 frame is shorter than its scales")
        k_scale = torch.from_numpy(
            np.frombuffer(payload[:k_bytes], dtype=np.float32).copy()
        ).reshape(ks)
        v_scale = torch.from_numpy(
            np.frombuffer(payload[k_bytes : k_bytes + v_bytes], dtype=np.float32).copy()
        ).reshape(vs)
        rest = payload[k_bytes + v_bytes :]
        raw = _zstd_decompress(rest, n) if _param(p, "z", bool) else bytes(rest)
        if len(raw) != n:
            raise CorruptDataError(f"int8 frame decoded to {len(raw)} codes, expected {n}")
        codes = torch.from_numpy(np.frombuffer(raw, dtype=np.int8).copy()).reshape(header.shape)
        return QuantizedBlock(data=codes, k_scale=k_scale, v_scale=v_scale, dtype=header.dtype)


def encode_stored(
    config: CodecConfig, codec: str, block: torch.Tensor | QuantizedBlock | EncodedBlock
) -> bytes:
    """The cold frame of a block as a memory tier holds it.

    A raw block is encoded with ``codec``; an int8 block keeps its codes and
    scales (:class:`Int8Codec`), whatever ``codec`` says, so quantised blocks
    stay quantised all the way to disk; an encoded block is its frame already.
    """
    if isinstance(block, QuantizedBlock):
        return Int8Codec().encode_quantized(block)
    if isinstance(block, EncodedBlock):
        return block.frame.cpu().numpy().tobytes()  # a frame already
    return get_codec_for(config, codec).encode(block.cpu())


# --------------------------------------------------------------------------- registry

#: Every codec by registry name.
CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoneCodec, Lz4Codec, ZstdCodec, DeltaRLCodec, Int8Codec)
}
_BY_ID: dict[int, type[Codec]] = {c.codec_id: c for c in CODECS.values()}


def get_codec(name: str, **params: Any) -> Codec:
    """Build a codec by registry name.

    Example:
        >>> frame = get_codec("zstd", level=3).encode(block)  # doctest: +SKIP

    Raises:
        InvalidInputError: unknown name (the message lists the valid ones), or a
            parameter the codec does not take or accept.
    """
    cls = CODECS.get(name)
    if cls is None:
        raise InvalidInputError(f"unknown codec {name!r}; expected one of {sorted(CODECS)}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise InvalidInputError(
            f"codec {name!r} takes parameters {accepted}, got unknown {unknown}"
        )
    return cls(**params)


def get_codec_for(config: CodecConfig, name: str) -> Codec:
    """Build the codec ``name`` with the parameters ``config`` sets (level, shuffle, bits, group).

    Raises:
        InvalidInputError: unknown name.
    """
    cls = CODECS.get(name)
    if cls is None:
        raise InvalidInputError(f"unknown codec {name!r}; expected one of {sorted(CODECS)}")
    return cls.from_config(config)


def decode_frame(frame: bytes | bytearray | memoryview) -> torch.Tensor:
    """Decode any frame, dispatching on the codec id in its header.

    Raises:
        CorruptDataError: any integrity or format check failed.
        InvalidInputError: ``frame`` is not bytes-like.
    """
    mv = _as_view(frame)
    header = _parse_header(mv)
    return _BY_ID[header.codec_id]._decode_payload(header, _verified_payload(mv, header))


# --------------------------------------------------------------------------- policy

Tier = Literal["warm", "cold"]
_TIERS: tuple[Tier, ...] = ("warm", "cold")


class CodecPolicy:
    """Chooses the codec of a block by tier and use.

    Rules, in order:

    1. A block rewritten often (``update_count >= hot_update_threshold``) is
       stored with ``none``: it would be re-encoded before it paid back.
    2. Warm tier: ``config.warm_codec`` (lossless; ``none`` by default, since
       fp16 KV compresses by ~1.18x at best without loss).
    3. Cold tier, session offline: ``config.cold_lossy_codec`` (Delta+RL).
    4. Cold tier, history at least ``cold_min_turns_old`` turns old:
       ``config.cold_codec`` (zstd). Younger cold history uses the warm codec,
       since it is likely read back soon. The default of 0 sends all online
       cold history to ``cold_codec``; the design article's figure is 10.

    Args:
        config: the codec settings.
        cold_min_turns_old: see rule 4; defaults to ``config.cold_min_turns_old``.

    Raises:
        InvalidInputError: a configured codec name is unknown, or
            ``cold_min_turns_old`` is negative.
    """

    def __init__(self, config: CodecConfig, *, cold_min_turns_old: int | None = None) -> None:
        if cold_min_turns_old is None:
            cold_min_turns_old = config.cold_min_turns_old
        for field in ("warm_codec", "cold_codec", "cold_lossy_codec"):
            value = getattr(config, field)
            if value not in CODECS:
                raise InvalidInputError(
                    f"CodecConfig.{field} = {value!r}; expected one of {sorted(CODECS)}"
                )
        if not CODECS[config.warm_codec].lossless:
            raise InvalidInputError(
                f"CodecConfig.warm_codec must be lossless, got {config.warm_codec!r}"
            )
        _check_count("cold_min_turns_old", cold_min_turns_old)
        self._config = config
        self._cold_min_turns_old = cold_min_turns_old

    def choose(
        self, tier: Tier, *, update_count: int, offline: bool = False, turns_old: int = 0
    ) -> str:
        """The registry name of the codec for a block.

        Args:
            tier: ``"warm"`` or ``"cold"``.
            update_count: times the block was rewritten.
            offline: the session's user is offline (long idle).
            turns_old: turns since the block was written.

        Raises:
            InvalidInputError: unknown tier or a negative count.
        """
        if tier not in _TIERS:
            raise InvalidInputError(f"tier must be one of {list(_TIERS)}, got {tier!r}")
        _check_count("update_count", update_count)
        _check_count("turns_old", turns_old)
        _check_bool("offline", offline)
        cfg = self._config
        if update_count >= cfg.hot_update_threshold:
            return NoneCodec.name
        if tier == "warm":
            return cfg.warm_codec
        if offline:
            return cfg.cold_lossy_codec
        if turns_old >= self._cold_min_turns_old:
            return cfg.cold_codec
        return cfg.warm_codec


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{name} must be a non-negative int, got {value!r}")
