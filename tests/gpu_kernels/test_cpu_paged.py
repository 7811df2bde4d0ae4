"""The native CPU paged copies (memkv.gpu_kernels.cpu_paged) against the reference."""

from __future__ import annotations

import pytest
import torch

from memkv import native
from memkv.gpu_kernels import cpu_paged, ops
from memkv.gpu_kernels import reference as ref

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="memkv.native not built")

L, H, N, D, BLOCKS = 3, 2, 8, 16, 7


def _cache(layout: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (BLOCKS, H, N, 2 * D) if layout == ref.PAGED_CPU else (2, BLOCKS, N, H, D)
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize("layout", [ref.PAGED_CPU, ref.PAGED_FLASH])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
def test_native_writes_and_reads_equal_the_reference(layout, dtype, as_list):
    blocks = torch.randn((3, L, 2, H, N, D)).to(dtype)
    ids = [4, 5, 1]
    for layer in range(L):
        got, want = _cache(layout, dtype), None
        want = got.clone()
        src = list(blocks) if as_list else blocks
        assert cpu_paged.paged_copy("write", src, ids, layer, got, layout)
        ref.paged_write(blocks, ids, layer, want, layout)
        assert torch.equal(got, want)
        back, expected = torch.zeros_like(blocks), torch.zeros_like(blocks)
        dst = list(back) if as_list else back
        assert cpu_paged.paged_copy("read", dst, ids, layer, got, layout)
        ref.paged_read(want, ids, layer, expected, layout)
        assert torch.equal(back, expected)


def test_ops_take_the_native_path_on_a_layer_view_of_one_allocation():
    """vLLM's caches: layer views of one allocation (a block's stride spans its layers)."""
    backing = torch.randn((BLOCKS, L, H, N, 2 * D))
    blocks = torch.randn((2, L, 2, H, N, D))
    want = backing.clone()
    ops.paged_write(blocks, [6, 0], 1, backing[:, 1], ref.PAGED_CPU)
    ref.paged_write(blocks, [6, 0], 1, want[:, 1], ref.PAGED_CPU)
    assert torch.equal(backing, want)


def test_what_is_not_laid_out_for_it_is_left_to_the_reference():
    cache = _cache(ref.PAGED_CPU, torch.float32)
    blocks = torch.randn((1, L, 2, H + 1, N, D))  # heads the cache does not have
    assert not cpu_paged.paged_copy("write", blocks, [0], 0, cache, ref.PAGED_CPU)
    with pytest.raises(RuntimeError):
        ops.paged_write(blocks, [0], 0, cache, ref.PAGED_CPU)


def test_a_block_id_outside_the_cache_is_refused():
    cache = _cache(ref.PAGED_CPU, torch.float32)
    with pytest.raises(IndexError):
        cpu_paged.paged_copy("write", torch.randn((1, L, 2, H, N, D)), [BLOCKS], 0, cache,
                             ref.PAGED_CPU)
