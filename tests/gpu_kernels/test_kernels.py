"""The CUDA kernels without a GPU: nvcc compiles each for sm_80 and sm_90, and each
kernel's host build (g++, the grid as a loop) gives what the CPU reference gives —
bit for bit — on edge cases: partial blocks, odd sizes, all-zero channels, extreme
values. On a machine with a GPU, the ``gpu``-marked tests compare the device kernels
with the reference too (``pytest -m gpu``).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from memkv.gpu_kernels import reference as ref
from memkv.gpu_kernels.loader import (
    ARCHITECTURES,
    backend,
    host_library,
    kernel_sources,
    nvcc_ptx_command,
)

SOURCES = kernel_sources()


def test_the_sources_are_there():
    assert {s.stem for s in SOURCES} == {"cast", "delta", "gather", "group4", "int8"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_every_source_compiles_for_the_gpus(source, arch, tmp_path):
    out = tmp_path / f"{source.stem}.{arch}.ptx"
    done = subprocess.run(nvcc_ptx_command(source, arch, out), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert ".entry" in out.read_text()  # kernels made it into the PTX


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the kernels' host build")
    cache = tmp_path_factory.mktemp("kernels")
    return {s.stem: host_library(s, cache) for s in SOURCES}


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    assert a.flags.c_contiguous
    return ctypes.c_void_p(a.ctypes.data)


I32, I64 = ctypes.c_int, ctypes.c_longlong


def rng(seed):
    return np.random.default_rng(seed)


# -- casts ------------------------------------------------------------------------------------

EXTREMES = np.array(
    [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.9, 65520.0, -70000.0, 3.0e38, -3.4e38, 1e-8, 6e-8,
     5.96e-8, 1e-40, np.inf, -np.inf, np.nan, 0.1, 1.0 / 3.0, 2.0**-24, 2.0**-25,
     # exact ties: round to even, not up (bf16: 1 + 2^-8 and 1 + 3 * 2^-8; fp16: 2^-11 steps)
     1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11],
    dtype=np.float32,
)


@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16])
def test_casts_round_like_torch_and_count_what_is_not_finite(host, target):
    x = np.concatenate([EXTREMES, rng(0).standard_normal(1001).astype(np.float32) * 1e3])
    bits = np.empty(x.size, dtype=np.uint16)
    count = np.zeros(1, dtype=np.uint64)
    name = "host_cast_f32_to_f16" if target is torch.float16 else "host_cast_f32_to_bf16"
    getattr(host["cast"], name)(ptr(x), ptr(bits), I64(x.size), ptr(count))
    want, nonfinite = ref.cast(torch.from_numpy(x), target)
    got = torch.from_numpy(bits.view(np.int16)).view(target)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all())
    assert int(count[0]) == nonfinite > 0
    # And back: widening is exact.
    back = np.empty(x.size, dtype=np.float32)
    count[:] = 0
    name = "host_cast_f16_to_f32" if target is torch.float16 else "host_cast_bf16_to_f32"
    getattr(host["cast"], name)(ptr(bits), ptr(back), I64(x.size), ptr(count))
    np.testing.assert_array_equal(back, want.float().numpy())
    assert int(count[0]) == nonfinite


# -- int8 -------------------------------------------------------------------------------------

def _block(shape, seed, *, zero_channel=False, extreme=False):
    x = rng(seed).standard_normal(shape).astype(np.float32)
    if zero_channel:
        x[:, 0, :, :, 0] = 0.0  # an all-zero key channel
        x[:, 1, :, 0, :] = 0.0  # an all-zero value token
    if extreme:
        x[0, 0, 0, 0, 0] = 65504.0
        x[-1, 1, -1, -1, -1] = -3.0e38
        x[0, 1, 0, 0, :] *= 1e-30
    return x


@pytest.mark.parametrize(
    ("shape", "kind"),
    [((2, 2, 2, 8, 16), "plain"), ((3, 2, 3, 5, 7), "odd"), ((1, 2, 1, 1, 1), "one"),
     ((2, 2, 2, 3, 8), "zero"), ((2, 2, 2, 4, 8), "extreme")],
)
def test_int8_matches_the_reference_bit_for_bit(host, shape, kind):
    x = _block(shape, seed=len(kind), zero_channel=kind == "zero", extreme=kind == "extreme")
    L, _, H, T, D = shape
    k = np.empty((L, H, D), dtype=np.float32)
    v = np.empty((L, H, T), dtype=np.float32)
    host["int8"].host_int8_scales(ptr(x), ptr(k), ptr(v), I32(L), I32(H), I32(T), I32(D))
    codes = np.empty(shape, dtype=np.int8)
    host["int8"].host_int8_quantize(ptr(x), ptr(k), ptr(v), ptr(codes), I32(L), I32(H), I32(T),
                                    I32(D))
    want_codes, want_k, want_v = ref.int8_quantize(torch.from_numpy(x))
    np.testing.assert_array_equal(k, want_k.numpy())
    np.testing.assert_array_equal(v, want_v.numpy())
    np.testing.assert_array_equal(codes, want_codes.numpy())
    out = np.empty(shape, dtype=np.float32)
    host["int8"].host_int8_dequantize(ptr(codes), ptr(k), ptr(v), ptr(out), I32(L), I32(H),
                                      I32(T), I32(D))
    want = ref.int8_dequantize(want_codes, want_k, want_v, torch.empty(shape))
    np.testing.assert_array_equal(out, want.numpy())
    assert np.all(np.abs(out) <= np.abs(x).max())  # never beyond the original's range


# -- 4-bit groups and nibbles -------------------------------------------------------------------

@pytest.mark.parametrize(("n", "group"), [(64, 16), (100, 32), (7, 128), (1, 4), (129, 64)])
def test_group4_matches_the_reference(host, n, group):
    x = (rng(n).standard_normal(n) * 10).astype(np.float32)
    x[: min(group, n)] = 3.25  # a constant group: scale 0, codes 0
    groups = -(-n // group)
    lo = np.empty(groups, dtype=np.float32)
    hi = np.empty(groups, dtype=np.float32)
    host["group4"].host_group_minmax(ptr(x), I64(n), I32(group), ptr(lo), ptr(hi))
    want_lo, want_hi = ref.group_minmax(torch.from_numpy(x), group)
    np.testing.assert_array_equal(lo, want_lo.numpy().ravel())
    np.testing.assert_array_equal(hi, want_hi.numpy().ravel())
    scale = ((want_hi - want_lo) / ref.NIBBLE_LEVELS).contiguous()
    minimum = want_lo.contiguous()
    codes = np.empty(n, dtype=np.uint8)
    s, m = scale.numpy().ravel().copy(), minimum.numpy().ravel().copy()
    host["group4"].host_group4_codes(ptr(x), I64(n), I32(group), ptr(s), ptr(m), ptr(codes))
    want_codes = ref.group4_codes(torch.from_numpy(x), group, scale, minimum)
    np.testing.assert_array_equal(codes, want_codes.numpy())
    out = np.empty(n, dtype=np.float32)
    host["group4"].host_group4_dequantize(ptr(codes), I64(n), I32(group), ptr(s), ptr(m),
                                          ptr(out))
    np.testing.assert_array_equal(out, ref.group4_dequantize(codes, group, scale, minimum).numpy())
    # Nibbles: packed as the codecs pack them, and back.
    packed = np.empty((n + 1) // 2, dtype=np.uint8)
    host["group4"].host_pack_nibbles(ptr(codes), I64(n), ptr(packed))
    np.testing.assert_array_equal(packed, ref.pack_nibbles(codes))
    unpacked = np.empty(n, dtype=np.uint8)
    host["group4"].host_unpack_nibbles(ptr(packed), I64(n), ptr(unpacked))
    np.testing.assert_array_equal(unpacked, codes)


# -- the token delta ---------------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "axis", "mask"),
                         [((2, 3, 9, 5), 2, 0x0F), ((4, 1, 7), 1, None), ((3, 16, 1), 1, 0xFF)])
def test_token_delta_matches_the_reference_and_inverts(host, shape, axis, mask):
    codes = rng(7).integers(0, 16 if mask == 0x0F else 256, size=shape, dtype=np.uint8)
    outer = int(np.prod(shape[:axis]))
    inner = int(np.prod(shape[axis + 1:]))
    T = shape[axis]
    m = 0xFF if mask is None else mask
    out = np.empty_like(codes)
    host["delta"].host_token_delta(ptr(codes), ptr(out), I64(outer), I32(T), I64(inner), I32(m))
    np.testing.assert_array_equal(out, ref.token_delta(codes, axis, mask))
    back = np.empty_like(codes)
    host["delta"].host_undo_token_delta(ptr(out), ptr(back), I64(outer), I32(T), I64(inner),
                                        I32(m))
    np.testing.assert_array_equal(back, ref.undo_token_delta(out, axis, mask))
    np.testing.assert_array_equal(back, codes)


# -- block copies ------------------------------------------------------------------------------

def test_gather_and_scatter_match_the_reference(host):
    arena = rng(3).integers(0, 256, size=1 << 16, dtype=np.uint8)
    block = 1024
    offsets = [4096, 0, 60 * 1024, 8192 + 512]  # scattered, out of order
    out = np.empty(len(offsets) * block, dtype=np.uint8)
    offs = np.array(offsets, dtype=np.int64)
    host["gather"].host_gather_blocks(ptr(arena), ptr(offs), I64(len(offsets)), I64(block),
                                      ptr(out))
    want = ref.gather_blocks(torch.from_numpy(arena), offsets, block)
    np.testing.assert_array_equal(out, want.numpy())
    target = np.zeros_like(arena)
    host["gather"].host_scatter_blocks(ptr(out), ptr(offs), I64(len(offsets)), I64(block),
                                       ptr(target))
    expected = torch.zeros(arena.size, dtype=torch.uint8)
    ref.scatter_blocks(want, offsets, block, expected)
    np.testing.assert_array_equal(target, expected.numpy())


@pytest.mark.parametrize("layout", [ref.PAGED_CPU, ref.PAGED_FLASH], ids=["cpu", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_copies_match_the_reference(host, layout, dtype):
    n, L, H, N, D, num_blocks = 3, 2, 2, 4, 8, 7
    blocks = torch.randn(n, L, 2, H, N, D).to(dtype)
    shape = (num_blocks, H, N, 2 * D) if layout == ref.PAGED_CPU else (2, num_blocks, N, H, D)
    ids = [5, 0, 3]
    word, suffix = (np.uint16, "u16") if dtype is torch.bfloat16 else (np.uint32, "u32")
    view = torch.int16 if dtype is torch.bfloat16 else torch.int32
    for layer in range(L):
        want = torch.zeros(shape, dtype=dtype)
        ref.paged_write(blocks, ids, layer, want, layout)
        got = np.zeros(shape, dtype=word)
        src = blocks.view(view).numpy().view(word).copy()
        id_arr = np.array(ids, dtype=np.int64)
        getattr(host["gather"], f"host_paged_write_{suffix}")(
            ptr(src), ptr(id_arr), I64(n), I32(L), I32(layer), I32(H), I32(N), I32(D),
            I64(num_blocks), I32(layout), ptr(got))
        np.testing.assert_array_equal(got, want.view(view).numpy().view(word))
        back = np.zeros_like(src)
        getattr(host["gather"], f"host_paged_read_{suffix}")(
            ptr(got), ptr(id_arr), I64(n), I32(L), I32(layer), I32(H), I32(N), I32(D),
            I64(num_blocks), I32(layout), ptr(back))
        expected = torch.zeros_like(blocks)
        ref.paged_read(want, ids, layer, expected, layout)
        np.testing.assert_array_equal(back, expected.view(view).numpy().view(word))


@pytest.mark.parametrize("layout", [ref.PAGED_CPU, ref.PAGED_FLASH], ids=["cpu", "flash"])
def test_paged_copies_of_consecutive_ids_in_runs_equal_block_by_block(layout):
    """A tensor of blocks is copied a run of consecutive ids at a time, a list a block at a
    time: the same bytes land in the same places either way."""
    n, L, H, N, D, num_blocks = 6, 2, 2, 4, 8, 9
    blocks = torch.randn(n, L, 2, H, N, D)
    shape = (num_blocks, H, N, 2 * D) if layout == ref.PAGED_CPU else (2, num_blocks, N, H, D)
    ids = [2, 3, 4, 0, 7, 8]  # runs of 3, 1 and 2
    for layer in range(L):
        by_runs, by_block = torch.zeros(shape), torch.zeros(shape)
        ref.paged_write(blocks, ids, layer, by_runs, layout)
        ref.paged_write(list(blocks), ids, layer, by_block, layout)
        assert torch.equal(by_runs, by_block) and by_runs.abs().sum() > 0
        back_runs, back_block = torch.zeros_like(blocks), torch.zeros_like(blocks)
        ref.paged_read(by_runs, ids, layer, back_runs, layout)
        ref.paged_read(by_runs, ids, layer, list(back_block), layout)
        assert torch.equal(back_runs, back_block)
        assert torch.equal(back_runs[:, layer], blocks[:, layer])
    with pytest.raises(ValueError, match="block ids"):
        ref.paged_read(by_runs, ids[:2], 0, back_runs, layout)


def test_the_backend_is_visible_and_can_be_forced(monkeypatch):
    assert backend() in ("cuda", "cpu")
    monkeypatch.setenv("MEMKV_KERNELS", "cpu")
    assert backend() == "cpu"


# -- on a GPU ----------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(backend() != "cuda", reason="no usable CUDA device here")


@gpu
@needs_gpu
def test_device_kernels_match_the_reference():
    from memkv.gpu_kernels import ops

    block = torch.from_numpy(_block((2, 2, 4, 32, 128), seed=11, zero_channel=True))
    codes, k, v = ops.int8_quantize(block.cuda())
    want_codes, want_k, want_v = ref.int8_quantize(block)
    assert torch.equal(codes.cpu(), want_codes) and torch.equal(k.cpu(), want_k)
    assert torch.equal(v.cpu(), want_v)
    out = ops.int8_dequantize(codes, k, v, torch.empty(block.shape, device="cuda"))
    assert torch.equal(out.cpu(), ref.int8_dequantize(want_codes, want_k, want_v,
                                                      torch.empty(block.shape)))
    x = torch.from_numpy(EXTREMES).cuda()
    for target in (torch.float16, torch.bfloat16):
        got, count = ops.cast(x, target)
        want, nonfinite = ref.cast(x.cpu(), target)
        assert count == nonfinite
        assert bool(((got.cpu().view(torch.int16) == want.view(torch.int16))
                     | (got.cpu().isnan() & want.isnan())).all())
    arena = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    offsets = [4096, 0, 8192]
    got = ops.gather_blocks(arena.cuda(), offsets, 1024)
    assert torch.equal(got.cpu(), ref.gather_blocks(arena, offsets, 1024))
    blocks = torch.randn(3, 2, 2, 2, 4, 8).to(torch.bfloat16)
    for layout, shape in ((ref.PAGED_CPU, (7, 2, 4, 16)), (ref.PAGED_FLASH, (2, 7, 4, 2, 8))):
        want = torch.zeros(shape, dtype=torch.bfloat16)
        ref.paged_write(blocks, [5, 0, 3], 1, want, layout)
        got = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        ops.paged_write(blocks.cuda(), [5, 0, 3], 1, got, layout)
        assert torch.equal(got.cpu(), want)
