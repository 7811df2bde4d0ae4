"""The quantisation schemes of ``delta_rl``: int8 per channel/token, stepped int8,
4-bit groups, and the stages after them (token deltas, run lengths)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from memkv.errors import CorruptDataError, InvalidInputError
from memkv.gpu_kernels import ops as kernels
from memkv.storage.codecs.byte_stages import _local
from memkv.storage.codecs.frame import FrameHeader, _itemsize, _param
from memkv.storage.precision import (
    QuantizedBlock,
    dequantize_int8,
    finite_absmax,
    quantize_int8,
)

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
