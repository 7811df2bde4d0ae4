"""Precision conversion, int8 quantisation of KV blocks, and the precision policy.

Three jobs:

* :func:`convert` moves a tensor between fp32, fp16 and bf16 and refuses to
  create (or carry) a non-finite value: a silent ``inf`` in a KV cache poisons
  every attention score that touches it, so overflow is a caller error.
* :func:`quantize_int8` / :func:`dequantize_int8` store a block in int8 with
  KIVI-style grouping (keys per channel, values per token; see
  :func:`quantize_int8` for why).
* :class:`PrecisionPolicy` decides which of those precisions a block is kept in,
  from its age (turn), sharing (refcount) and idleness.

:func:`measure_error` gives the error figures that every lossy step reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

from memkv.errors import InvalidInputError, LayoutMismatchError, PrecisionOverflowError
from memkv.gpu_kernels import ops as kernels
from memkv.storage.config import PrecisionConfig
from memkv.storage.layout import DTYPES, KV_AXIS_SIZE

__all__ = [
    "INT8_LEVELS",
    "EncodedBlock",
    "ErrorStats",
    "PrecisionPolicy",
    "QuantizedBlock",
    "StoredPrecision",
    "convert",
    "dequantize_int8",
    "finite_absmax",
    "int8_scales",
    "measure_error",
    "quantize_int8",
    "resolve_dtype",
]

INT8_LEVELS = kernels.INT8_LEVELS

# Axes of a block [layers, 2, kv_heads, tokens, head_dim].
_BLOCK_NDIM = 5
_KV_AXIS = 1


class StoredPrecision(StrEnum):
    """The precision a block is stored in."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    COMPACT = "compact"  # a Delta+RL frame (memkv.storage.codecs), decoded on read


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating storage dtype given as a torch dtype or its name.

    Raises:
        InvalidInputError: not one of float32, float16, bfloat16.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InvalidInputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise InvalidInputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
    return dtype


def _check_float_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES.values():
        raise InvalidInputError(f"{what} must have a dtype in {sorted(DTYPES)}, got {t.dtype}")
    return t


def _absmax(t: torch.Tensor) -> float:
    """Largest |x| of ``t`` (0.0 when empty); NaN or inf when ``t`` holds one.

    One ``aminmax`` pass instead of ``abs().max()`` avoids a full-size temporary.
    """
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t)
    lo_f, hi_f = float(lo), float(hi)
    if math.isnan(lo_f) or math.isnan(hi_f):
        return math.nan
    return max(-lo_f, hi_f)


def finite_absmax(t: torch.Tensor, what: str = "tensor") -> float:
    """The largest |x| of ``t`` (0.0 when empty), refusing NaN and inf.

    Raises:
        PrecisionOverflowError: ``t`` holds a NaN or an infinity.
    """
    amax = _absmax(t)
    if not math.isfinite(amax):
        bad = int((~torch.isfinite(t)).sum())
        raise PrecisionOverflowError(
            f"{what} holds {bad} non-finite value(s) (NaN or inf); a KV cache must be finite"
        )
    return amax


def convert(t: torch.Tensor, dtype: torch.dtype | str) -> torch.Tensor:
    """Convert a tensor to fp32, fp16 or bf16, refusing non-finite results.

    Args:
        t: a float32/float16/bfloat16 tensor (any shape, any device).
        dtype: the target dtype, as a torch dtype or its name.

    Returns:
        ``t`` in ``dtype`` (``t`` itself when it already has that dtype).

    Raises:
        InvalidInputError: ``t`` is not a float tensor of a supported dtype, or
            ``dtype`` is not supported.
        PrecisionOverflowError: ``t`` holds NaN or inf, or a finite value of
            ``t`` would round to infinity in ``dtype`` (e.g. |x| >= 65520 in fp16).
    """
    t = _check_float_tensor(t, "tensor to convert")
    target = resolve_dtype(dtype)
    if t.is_cuda and t.dtype != target:
        # One kernel pass casts and counts what is not finite (memkv.gpu_kernels).
        out, bad = kernels.cast(t, target)
        if bad:
            raise PrecisionOverflowError(
                f"{bad} value(s) are not finite in {target} (NaN or inf in the tensor, or "
                f"beyond ±{torch.finfo(target).max:.6g})"
            )
        return out
    amax = finite_absmax(t, "tensor to convert")
    # Rounding is monotone, so the largest |x| overflows iff any element does;
    # one scalar conversion decides it (65504 < |x| < 65520 rounds to 65504 in fp16).
    if t.numel() and not math.isfinite(float(torch.tensor(amax, dtype=torch.float64).to(target))):
        raise PrecisionOverflowError(
            f"max |x| = {amax:.6g} overflows {target} (finite range ±{torch.finfo(target).max:.6g})"
        )
    return t.to(target)


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """A block kept as a codec frame, decoded when read.

    Attributes:
        frame: the frame's bytes, 1-D uint8 (a view into an arena while resident).
        dtype: the dtype the frame decodes to.
        codec: the codec's registry name (a lossy one: the point is its size).
    """

    frame: torch.Tensor
    dtype: torch.dtype
    codec: str

    @property
    def nbytes(self) -> int:
        return self.frame.numel()


@dataclass(frozen=True, slots=True)
class QuantizedBlock:
    """An int8 block with its scales.

    Attributes:
        data: int8 codes, the block's shape ``[layers, 2, kv_heads, tokens, head_dim]``.
        k_scale: fp32 key scales, one per channel: ``[layers, kv_heads, head_dim]``.
        v_scale: fp32 value scales, one per token: ``[layers, kv_heads, tokens]``.
        dtype: the dtype the block had before quantisation.
    """

    data: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: codes plus scales."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.k_scale, self.v_scale))


def _check_block(block: object, what: str = "block") -> torch.Tensor:
    t = _check_float_tensor(block, what)
    if t.dim() != _BLOCK_NDIM or t.shape[_KV_AXIS] != KV_AXIS_SIZE:
        raise LayoutMismatchError(
            f"{what} must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(t.shape)}"
        )
    return t


def int8_scales(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 scales of a finite block: ``(k_scale, v_scale)`` in fp32.

    ``k_scale[l, h, d] = max_t |K[l, h, t, d]| / 127``; ``v_scale[l, h, t] =
    max_d |V[l, h, t, d]| / 127``, rounded down where needed so that ``127 *
    scale <= absmax`` (a dequantised value never leaves the original's range).
    All-zero channels/tokens get scale 0. The math is :mod:`memkv.gpu_kernels`'.
    """
    return kernels.int8_scales(block)


def quantize_int8(block: torch.Tensor) -> QuantizedBlock:
    """Quantise a block to int8: keys per channel, values per token (KIVI grouping).

    Why this grouping: keys carry a few outlier *channels* whose magnitude is
    stable across tokens, so one scale per channel keeps an outlier from
    crushing the resolution of its neighbours; values have no such channels,
    and attention mixes them per token, so a per-token scale bounds the error
    of each mixed row (Liu et al., "KIVI", 2024). Symmetric absmax/127 needs no
    zero point: dequantisation is one multiply, zero stays exactly zero, and KV
    values are close to centred, so a zero point would buy little at 8 bits.

    Args:
        block: ``[layers, 2, kv_heads, tokens, head_dim]``, fp32/fp16/bf16, finite.

    Returns:
        The codes and fp32 scales; ``|x - dequantized| <= scale / 2`` per element
        (plus rounding to the output dtype).

    Raises:
        InvalidInputError: not a float tensor of a supported dtype.
        LayoutMismatchError: not shaped like a block.
        PrecisionOverflowError: the block holds NaN or inf.
    """
    block = _check_block(block)
    finite_absmax(block, "block to quantise")
    data, k_scale, v_scale = kernels.int8_quantize(block)
    return QuantizedBlock(data=data, k_scale=k_scale, v_scale=v_scale, dtype=block.dtype)


def dequantize_int8(q: QuantizedBlock, dtype: torch.dtype | str | None = None) -> torch.Tensor:
    """Rebuild a block from its int8 codes.

    Args:
        q: the quantised block.
        dtype: output dtype; the block's original dtype by default.

    Returns:
        A new ``[layers, 2, kv_heads, tokens, head_dim]`` tensor.

    Raises:
        InvalidInputError: unsupported ``dtype``, or scales that do not fit the codes.
        PrecisionOverflowError: the values do not fit ``dtype`` (only possible
            when asking for a narrower dtype than the original).
    """
    target = q.dtype if dtype is None else resolve_dtype(dtype)
    layers, _, heads, tokens, dim = q.data.shape
    if tuple(q.k_scale.shape) != (layers, heads, dim) or tuple(q.v_scale.shape) != (
        layers,
        heads,
        tokens,
    ):
        raise InvalidInputError(
            f"scales do not fit codes {tuple(q.data.shape)}: k_scale "
            f"{tuple(q.k_scale.shape)} (expected {(layers, heads, dim)}), v_scale "
            f"{tuple(q.v_scale.shape)} (expected {(layers, heads, tokens)})"
        )
    # |q * scale| <= absmax of the original, so the original dtype always holds
    # the result: write it directly (the multiply runs in fp32, then rounds once).
    direct = target == q.dtype
    out = torch.empty(q.data.shape, dtype=target if direct else torch.float32)
    kernels.int8_dequantize(q.data, q.k_scale, q.v_scale, out)
    return out if direct else convert(out, target)


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """How far an approximation is from its reference.

    Attributes:
        max_abs: largest |reference - approx|.
        rms: root mean square of the difference.
        rel_rms: ``rms`` divided by the RMS of the reference (0 when both are 0,
            inf when only the reference is 0).
    """

    max_abs: float
    rms: float
    rel_rms: float


def measure_error(reference: torch.Tensor, approx: torch.Tensor) -> ErrorStats:
    """Error of ``approx`` against ``reference``, computed in float64.

    Raises:
        InvalidInputError: not tensors, or shapes differ.
    """
    for name, t in (("reference", reference), ("approx", approx)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if reference.shape != approx.shape:
        raise InvalidInputError(
            f"reference and approx must have the same shape, got {tuple(reference.shape)} "
            f"and {tuple(approx.shape)}"
        )
    if reference.numel() == 0:
        return ErrorStats(max_abs=0.0, rms=0.0, rel_rms=0.0)
    ref = reference.double()
    diff = ref - approx.double()
    max_abs = float(diff.abs().max())
    rms = float(diff.square().mean().sqrt())
    ref_rms = float(ref.square().mean().sqrt())
    if ref_rms > 0:
        rel = rms / ref_rms
    else:
        rel = 0.0 if rms == 0 else math.inf
    return ErrorStats(max_abs=max_abs, rms=rms, rel_rms=rel)


_ITEMSIZE: dict[StoredPrecision, int] = {
    StoredPrecision.FLOAT32: 4,
    StoredPrecision.FLOAT16: 2,
    StoredPrecision.BFLOAT16: 2,
    StoredPrecision.INT8: 1,
}


def _check_non_negative(name: str, value: float, kind: type) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or value < 0:
        raise InvalidInputError(f"{name} must be a non-negative {kind.__name__}, got {value!r}")
    if isinstance(value, float) and math.isnan(value):
        raise InvalidInputError(f"{name} must be a non-negative number, got NaN")


class PrecisionPolicy:
    """Chooses the stored precision of a block.

    Rules, in order:

    1. A long-idle block (``idle_seconds >= int8_idle_seconds``) that few
       sessions share (``refcount <= int8_max_refcount``) drops to int8,
       whatever its turn: nobody is about to read it, and the error is bounded.
    2. A first-round block (``turn == 0``) keeps the model dtype: it holds the
       system prompt and first user turn that every later turn attends to.
    3. Later blocks use ``config.later_dtype``, but never *up*-convert (fp16 to
       fp32 would double the bytes and add nothing). ``auto`` means fp16, except
       that a bf16 model stays bf16: bf16 values can exceed fp16's range.

    Args:
        config: the precision settings.
        model_dtype: the model's KV dtype (``float32``, ``float16``, ``bfloat16``).

    Raises:
        InvalidInputError: unknown ``model_dtype``.
    """

    def __init__(self, config: PrecisionConfig, model_dtype: str) -> None:
        if model_dtype not in DTYPES:
            raise InvalidInputError(
                f"model_dtype must be one of {sorted(DTYPES)}, got {model_dtype!r}"
            )
        self._config = config
        self._model = StoredPrecision(model_dtype)
        self._later = self._resolve_later(config, self._model)

    @staticmethod
    def _resolve_later(config: PrecisionConfig, model: StoredPrecision) -> StoredPrecision:
        if config.later_dtype == "auto":
            return (
                model
                if model is StoredPrecision.BFLOAT16
                else min(model, StoredPrecision.FLOAT16, key=lambda p: _ITEMSIZE[p])
            )
        later = StoredPrecision(config.later_dtype)
        return model if _ITEMSIZE[later] > _ITEMSIZE[model] else later

    @property
    def model_dtype(self) -> StoredPrecision:
        """The model's KV dtype."""
        return self._model

    @property
    def later_dtype(self) -> StoredPrecision:
        """The precision of blocks after the first round (after the no-up-convert rule)."""
        return self._later

    def choose(self, turn: int, refcount: int, idle_seconds: float) -> StoredPrecision:
        """The precision a block should be stored in now.

        Args:
            turn: the session turn that produced the block (0 = first round).
            refcount: sessions (or readers) holding the block.
            idle_seconds: time since the block was last read.

        Returns:
            The stored precision.

        Raises:
            InvalidInputError: a negative or non-numeric argument.
        """
        _check_non_negative("turn", turn, int)
        _check_non_negative("refcount", refcount, int)
        if isinstance(idle_seconds, int) and not isinstance(idle_seconds, bool):
            idle_seconds = float(idle_seconds)
        _check_non_negative("idle_seconds", idle_seconds, float)
        cfg = self._config
        if refcount <= cfg.int8_max_refcount:
            if cfg.compact_idle_seconds is not None and idle_seconds >= cfg.compact_idle_seconds:
                return StoredPrecision.COMPACT
            if idle_seconds >= cfg.int8_idle_seconds:
                return StoredPrecision.INT8
        if turn == 0:
            return self._model
        return self._later
