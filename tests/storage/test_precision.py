"""Tests of memkv.storage.precision: conversion, int8 quantisation, error stats, policy."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.errors import InvalidInputError, LayoutMismatchError, PrecisionOverflowError
from memkv.storage.config import PrecisionConfig
from memkv.storage.precision import (
    INT8_LEVELS,
    PrecisionPolicy,
    QuantizedBlock,
    StoredPrecision,
    convert,
    dequantize_int8,
    finite_absmax,
    measure_error,
    quantize_int8,
)

FP16_MAX = 65504.0
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _block(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, scale: float = 1.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Clamped to fp16's range so large magnitudes give extremes, not infinities.
    return (torch.randn(shape, generator=g) * scale).clamp(-FP16_MAX, FP16_MAX).to(dtype)


# ----------------------------------------------------------------------------- convert


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES + ["float32", "float16", "bfloat16"])
def test_convert_matches_torch_for_in_range_values(src: torch.dtype, dst: object) -> None:
    x = _block((3, 50), src, scale=100.0)
    y = convert(x, dst)  # type: ignore[arg-type]
    target = dst if isinstance(dst, torch.dtype) else getattr(torch, str(dst))
    assert y.dtype == target
    assert torch.equal(y, x.to(target))


def test_convert_fp16_limit_is_where_rounding_reaches_inf() -> None:
    # 65519 rounds down to 65504; 65520 rounds (ties-to-even) up to inf.
    assert convert(torch.tensor([FP16_MAX, -65519.0]), torch.float16).abs().max() == FP16_MAX
    with pytest.raises(PrecisionOverflowError) as e:
        convert(torch.tensor([1.0, -65520.0]), torch.float16)
    assert "65520" in str(e.value) and "65504" in str(e.value) and "float16" in str(e.value)


def test_convert_overflow_between_16_bit_formats_and_from_fp32() -> None:
    with pytest.raises(PrecisionOverflowError):
        convert(torch.tensor([1e5], dtype=torch.bfloat16), torch.float16)
    with pytest.raises(PrecisionOverflowError):
        convert(torch.tensor([torch.finfo(torch.float32).max]), torch.bfloat16)
    big = torch.tensor([1e5])
    assert convert(big, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", DTYPES)
def test_convert_refuses_non_finite_input_even_to_same_dtype(
    bad: float, dtype: torch.dtype
) -> None:
    x = torch.tensor([0.0, bad, 2.0]).to(dtype)
    with pytest.raises(PrecisionOverflowError, match="non-finite"):
        convert(x, dtype)


def test_convert_empty_and_bad_arguments() -> None:
    assert convert(torch.empty(0, 4), torch.float16).shape == (0, 4)
    with pytest.raises(InvalidInputError):
        convert(torch.zeros(3, dtype=torch.int32), torch.float16)
    with pytest.raises(InvalidInputError):
        convert(torch.zeros(3), "float64")
    with pytest.raises(InvalidInputError):
        convert(torch.zeros(3), torch.int8)
    with pytest.raises(InvalidInputError):
        convert([1.0], torch.float16)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, width=32), min_size=1, max_size=20))
def test_convert_to_fp16_raises_iff_torch_would_give_inf(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    expected = x.to(torch.float16)
    if torch.isfinite(expected).all():
        assert torch.equal(convert(x, torch.float16), expected)
    else:
        with pytest.raises(PrecisionOverflowError):
            convert(x, torch.float16)


def test_finite_absmax() -> None:
    assert finite_absmax(torch.tensor([-3.0, 2.0])) == 3.0
    assert finite_absmax(torch.empty(0)) == 0.0
    with pytest.raises(PrecisionOverflowError):
        finite_absmax(torch.tensor([1.0, math.nan]))


# ----------------------------------------------------------------------------- int8


def _int8_bound(block: torch.Tensor) -> torch.Tensor:
    """Per-element bound: scale/2 of its K channel or V token, plus rounding slack."""
    x = block.float()
    if x.numel() == 0:
        return x
    k_scale = x[:, 0].abs().amax(dim=2, keepdim=True) / INT8_LEVELS
    v_scale = x[:, 1].abs().amax(dim=3, keepdim=True) / INT8_LEVELS
    scale = torch.stack([k_scale.expand_as(x[:, 0]), v_scale.expand_as(x[:, 1])], dim=1)
    eps = torch.finfo(block.dtype).eps
    return scale * (0.5 + 1e-5) + x.abs() * eps + torch.finfo(block.dtype).tiny


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    tokens=st.integers(0, 40),
    dim=st.integers(1, 24),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0, FP16_MAX / 4]),
)
def test_int8_error_within_half_a_step(
    layers: int,
    heads: int,
    tokens: int,
    dim: int,
    dtype: torch.dtype,
    seed: int,
    magnitude: float,
) -> None:
    block = _block((layers, 2, heads, tokens, dim), dtype, seed, magnitude)
    q = quantize_int8(block)
    assert q.data.dtype == torch.int8 and q.data.shape == block.shape
    assert q.k_scale.shape == (layers, heads, dim) and q.k_scale.dtype == torch.float32
    assert q.v_scale.shape == (layers, heads, tokens) and q.v_scale.dtype == torch.float32
    assert q.data.numel() == 0 or int(q.data.abs().max()) <= INT8_LEVELS
    out = dequantize_int8(q)
    assert out.dtype == dtype and out.shape == block.shape
    assert torch.isfinite(out).all()
    err = (out.float() - block.float()).abs()
    assert (err <= _int8_bound(block)).all()


def test_int8_error_is_small_relative_to_absmax() -> None:
    block = _block((2, 2, 2, 256, 64), torch.float16, seed=3)
    out = dequantize_int8(quantize_int8(block))
    stats = measure_error(block.float(), out.float())
    absmax = float(block.abs().max())
    assert stats.max_abs <= absmax / (2 * INT8_LEVELS) * 1.01
    assert stats.rel_rms < 0.01


def test_int8_zero_channels_and_tokens_do_not_divide_by_zero() -> None:
    block = _block((1, 2, 2, 8, 4), torch.float32)
    block[:, 0, :, :, 1] = 0.0  # a zero key channel
    block[:, 1, :, 3, :] = 0.0  # a zero value token
    q = quantize_int8(block)
    assert (q.k_scale[:, :, 1] == 0).all() and (q.v_scale[:, :, 3] == 0).all()
    out = dequantize_int8(q)
    assert torch.isfinite(out).all()
    assert (out[:, 0, :, :, 1] == 0).all() and (out[:, 1, :, 3, :] == 0).all()
    zeros = dequantize_int8(quantize_int8(torch.zeros(1, 2, 1, 5, 3)))
    assert torch.equal(zeros, torch.zeros(1, 2, 1, 5, 3))


def test_int8_fp16_extremes_never_dequantise_to_inf() -> None:
    block = torch.full((1, 2, 1, 4, 4), FP16_MAX, dtype=torch.float16)
    block[..., 0] = -FP16_MAX
    out = dequantize_int8(quantize_int8(block))
    assert torch.isfinite(out).all()
    assert torch.equal(out, block)


def test_int8_rejects_bad_blocks() -> None:
    with pytest.raises(PrecisionOverflowError):
        quantize_int8(torch.tensor([math.nan]).expand(1, 2, 1, 1, 1).contiguous())
    with pytest.raises(LayoutMismatchError):
        quantize_int8(torch.zeros(2, 3, 1, 4, 4))
    with pytest.raises(LayoutMismatchError):
        quantize_int8(torch.zeros(2, 4, 4))
    with pytest.raises(InvalidInputError):
        quantize_int8(torch.zeros(1, 2, 1, 4, 4, dtype=torch.int32))


def test_dequantize_to_other_dtype_and_overflow() -> None:
    block = _block((1, 2, 1, 6, 4), torch.float32, scale=2.0)
    q = quantize_int8(block)
    assert dequantize_int8(q, "bfloat16").dtype == torch.bfloat16
    assert torch.equal(dequantize_int8(q, torch.float16), dequantize_int8(q).to(torch.float16))
    big = quantize_int8(block * 1e6)
    with pytest.raises(PrecisionOverflowError):
        dequantize_int8(big, torch.float16)
    bad = QuantizedBlock(data=q.data, k_scale=q.k_scale[:, :, :2], v_scale=q.v_scale, dtype=q.dtype)
    with pytest.raises(InvalidInputError):
        dequantize_int8(bad)


def test_quantized_block_nbytes() -> None:
    q = quantize_int8(torch.zeros(2, 2, 3, 5, 7))
    assert q.nbytes == 2 * 2 * 3 * 5 * 7 + 4 * (2 * 3 * 7 + 2 * 3 * 5)


# ----------------------------------------------------------------------------- errors


def test_measure_error_known_values() -> None:
    ref = torch.tensor([1.0, -1.0, 1.0, -1.0])
    approx = torch.tensor([1.5, -1.0, 1.0, -1.5])
    stats = measure_error(ref, approx)
    # Float summation order differs between torch builds: compare to the last ulp or so.
    assert stats.max_abs == 0.5
    assert stats.rms == pytest.approx(math.sqrt(0.125), rel=1e-12)
    assert stats.rel_rms == pytest.approx(math.sqrt(0.125), rel=1e-12)
    assert measure_error(torch.zeros(3), torch.zeros(3)).rel_rms == 0.0
    assert measure_error(torch.zeros(3), torch.ones(3)).rel_rms == math.inf
    assert measure_error(torch.empty(0), torch.empty(0)).max_abs == 0.0
    with pytest.raises(InvalidInputError):
        measure_error(torch.zeros(3), torch.zeros(4))
    with pytest.raises(InvalidInputError):
        measure_error([0.0], torch.zeros(1))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- policy


def test_policy_first_round_keeps_model_dtype_later_uses_fp16() -> None:
    policy = PrecisionPolicy(PrecisionConfig(), "float32")
    assert policy.choose(0, refcount=3, idle_seconds=0.0) is StoredPrecision.FLOAT32
    assert policy.choose(1, refcount=3, idle_seconds=0.0) is StoredPrecision.FLOAT16
    assert policy.choose(7, refcount=0, idle_seconds=599.9) is StoredPrecision.FLOAT16


def test_policy_long_idle_low_refcount_drops_to_int8() -> None:
    cfg = PrecisionConfig(int8_idle_seconds=60.0, int8_max_refcount=1)
    policy = PrecisionPolicy(cfg, "float16")
    assert policy.choose(3, refcount=1, idle_seconds=60.0) is StoredPrecision.INT8
    assert policy.choose(0, refcount=0, idle_seconds=1e6) is StoredPrecision.INT8
    assert policy.choose(3, refcount=2, idle_seconds=1e6) is StoredPrecision.FLOAT16
    assert policy.choose(3, refcount=1, idle_seconds=59) is StoredPrecision.FLOAT16


def test_policy_compacts_after_its_own_idle_time_before_int8_and_by_the_same_refcount() -> None:
    cfg = PrecisionConfig(int8_idle_seconds=60.0, compact_idle_seconds=600.0, int8_max_refcount=1)
    policy = PrecisionPolicy(cfg, "float16")
    assert policy.choose(3, refcount=1, idle_seconds=60.0) is StoredPrecision.INT8
    assert policy.choose(3, refcount=1, idle_seconds=600.0) is StoredPrecision.COMPACT
    assert policy.choose(3, refcount=2, idle_seconds=1e6) is StoredPrecision.FLOAT16
    off = PrecisionPolicy(PrecisionConfig(int8_idle_seconds=60.0), "float16")
    assert off.choose(3, refcount=0, idle_seconds=1e9) is StoredPrecision.INT8


def test_policy_never_up_converts_and_keeps_bf16_unless_configured() -> None:
    up = PrecisionPolicy(PrecisionConfig(later_dtype="float32"), "float16")
    assert up.choose(5, refcount=2, idle_seconds=0.0) is StoredPrecision.FLOAT16
    bf16_default = PrecisionPolicy(PrecisionConfig(), "bfloat16")
    assert bf16_default.choose(5, refcount=2, idle_seconds=0.0) is StoredPrecision.BFLOAT16
    bf16_to_fp16 = PrecisionPolicy(PrecisionConfig(later_dtype="float16"), "bfloat16")
    assert bf16_to_fp16.choose(5, refcount=2, idle_seconds=0.0) is StoredPrecision.FLOAT16
    fp32_to_bf16 = PrecisionPolicy(PrecisionConfig(later_dtype="bfloat16"), "float32")
    assert fp32_to_bf16.later_dtype is StoredPrecision.BFLOAT16
    assert fp32_to_bf16.model_dtype is StoredPrecision.FLOAT32


@pytest.mark.parametrize(
    "args",
    [
        (-1, 0, 0.0),
        (0, -1, 0.0),
        (0, 0, -0.5),
        (0, 0, math.nan),
        (True, 0, 0.0),
        (1.5, 0, 0.0),
        (0, 0, "1"),
    ],
)
def test_policy_rejects_bad_inputs(args: tuple[object, object, object]) -> None:
    policy = PrecisionPolicy(PrecisionConfig(), "float16")
    with pytest.raises(InvalidInputError):
        policy.choose(*args)  # type: ignore[arg-type]


def test_policy_rejects_unknown_model_dtype() -> None:
    with pytest.raises(InvalidInputError, match="float16"):
        PrecisionPolicy(PrecisionConfig(), "int8")
