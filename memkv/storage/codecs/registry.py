"""Every codec by name and by id; building one from a config; decoding any frame."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from memkv.errors import InvalidInputError
from memkv.storage.codecs.base import Codec
from memkv.storage.codecs.delta_rl import DeltaRLCodec
from memkv.storage.codecs.frame import CODEC_NAMES, _as_view, _parse_header, _verified_payload
from memkv.storage.codecs.int8 import Int8Codec
from memkv.storage.codecs.lossless import Lz4Codec, NoneCodec, ZstdCodec
from memkv.storage.config import CodecConfig
from memkv.storage.precision import EncodedBlock, QuantizedBlock

#: Every codec by registry name.
CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoneCodec, Lz4Codec, ZstdCodec, DeltaRLCodec, Int8Codec)
}
_BY_ID: dict[int, type[Codec]] = {c.codec_id: c for c in CODECS.values()}
if {i: c.name for i, c in _BY_ID.items()} != CODEC_NAMES:
    raise AssertionError(f"codec ids {sorted(_BY_ID)} disagree with the frame's CODEC_NAMES")


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
