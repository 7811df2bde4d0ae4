"""``delta_rl``: quantise, optionally take token deltas, run-length code, then zstd."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import numpy as np
import torch

from memkv.errors import CorruptDataError, InvalidInputError, LayoutMismatchError
from memkv.storage.codecs.base import Codec, _check_bool, _check_level
from memkv.storage.codecs.byte_stages import _BITS_PER_BYTE, _zstd_compressor, _zstd_decompress
from memkv.storage.codecs.delta_rl_schemes import (
    _BLOCK_NDIM,
    _NIBBLE_LEVELS,
    _NIBBLE_MASK,
    _RL_LEN_TYPES,
    _SCHEMES,
    _STEPPED_LEVELS,
    DEFAULT_K_GROUPING,
    DEFAULT_RUN_LENGTH,
    DEFAULT_TOKEN_DELTA,
    K_GROUPINGS,
    KGrouping,
    _check_step,
    _Group4Scheme,
    _identity,
    _Int8Scheme,
    _pack_nibbles,
    _run_count,
    _run_length,
    _scheme,
    _Settings,
    _SteppedScheme,
    _token_delta,
    _undo_token_delta,
    _unpack_nibbles,
)
from memkv.storage.codecs.frame import FrameHeader, _itemsize, _param
from memkv.storage.config import CodecConfig
from memkv.storage.layout import KV_AXIS_SIZE
from memkv.storage.precision import (
    INT8_LEVELS,
)


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
