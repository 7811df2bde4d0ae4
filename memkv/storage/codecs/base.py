"""The codec interface: framing and verification for every codec, the payload half per codec."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import zstandard

from memkv.errors import InvalidInputError
from memkv.storage.codecs.frame import (
    _DTYPE_CODES,
    MAX_NDIM,
    FrameHeader,
    _as_view,
    _build_frame,
    _parse_header,
    _verified_payload,
)
from memkv.storage.config import CodecConfig
from memkv.storage.layout import DTYPES


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
