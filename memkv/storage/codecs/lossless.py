"""The lossless codecs: ``none`` (raw bytes, checksummed), ``lz4`` and ``zstd``."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, cast

import lz4.block
import numpy as np
import torch

from memkv.errors import CorruptDataError
from memkv.storage.codecs.base import Codec, _check_bool, _check_level
from memkv.storage.codecs.byte_stages import (
    _shuffle,
    _tensor_bytes,
    _unshuffle_into,
    _zstd_compressor,
    _zstd_decompress,
)
from memkv.storage.codecs.frame import FrameHeader, _param
from memkv.storage.config import CodecConfig


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
