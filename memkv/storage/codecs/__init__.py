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

The package, one idea per module: :mod:`.frame` (the envelope), :mod:`.base`
(the codec interface), :mod:`.byte_stages` (shuffle, zstd), :mod:`.lossless`,
:mod:`.delta_rl_schemes` and :mod:`.delta_rl`, :mod:`.int8`, :mod:`.registry`
(by name and id; decoding any frame) and :mod:`.policy` (a tier's codec).
"""

from __future__ import annotations

from memkv.storage.codecs.base import Codec
from memkv.storage.codecs.delta_rl import DeltaRLCodec
from memkv.storage.codecs.delta_rl_schemes import K_GROUPINGS, STEP_RANGE, KGrouping
from memkv.storage.codecs.frame import (
    FIXED_HEADER_SIZE,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
    FrameHeader,
    peek_header,
    verify_frame,
)
from memkv.storage.codecs.int8 import Int8Codec
from memkv.storage.codecs.lossless import Lz4Codec, NoneCodec, ZstdCodec
from memkv.storage.codecs.policy import CodecPolicy, Tier
from memkv.storage.codecs.registry import (
    CODECS,
    decode_frame,
    encode_stored,
    get_codec,
    get_codec_for,
)

__all__ = [
    "CODECS",
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
    "Int8Codec",
    "KGrouping",
    "Lz4Codec",
    "NoneCodec",
    "Tier",
    "ZstdCodec",
    "decode_frame",
    "encode_stored",
    "get_codec",
    "get_codec_for",
    "peek_header",
    "verify_frame",
]
