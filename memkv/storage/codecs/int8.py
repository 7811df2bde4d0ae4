"""``int8`` frames: a block the precision step already quantised, stored as such."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch

from memkv.errors import CorruptDataError
from memkv.storage.codecs.base import Codec, _check_bool, _check_level
from memkv.storage.codecs.byte_stages import _zstd_compressor, _zstd_decompress
from memkv.storage.codecs.frame import FrameHeader, _build_frame, _param
from memkv.storage.precision import (
    QuantizedBlock,
    dequantize_int8,
    quantize_int8,
)


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
