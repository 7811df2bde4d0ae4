"""Copies from a shared-memory segment straight into vLLM-shaped paged caches.

The segment is a real file in /dev/shm; what lands in the paged cache is
compared with the reference scatter (memkv.gpu_kernels.reference.paged_write),
for both of vLLM's layouts and for the dtypes vLLM runs in.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

from memkv import native
from memkv.gpu_kernels import reference
from memkv.integrations.vllm import direct_load
from memkv.integrations.vllm.direct_load import DirectLoad
from memkv.protocol.checksum import crc32
from memkv.protocol.messages import PlanEntry, ReadPlan
from memkv.shm.same_node import LEASE_MARGIN_S, SegmentMaps

L, H, N, D = 3, 2, 4, 8
SHAPE = (L, 2, H, N, D)
NUM_BLOCKS = 6


@pytest.fixture
def segment():
    name = f"memkv-test-direct-{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/{name}"
    yield name, path
    os.unlink(path)


def _blocks(dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn((n, *SHAPE), generator=g).to(dtype)


def _write_segment(path: str, blocks: torch.Tensor, gap: int = 64) -> list[int]:
    """The blocks at spread-out offsets of a segment file; their offsets."""
    raw = [b.contiguous().view(torch.uint8).numpy().tobytes() for b in blocks]
    offsets, data = [], bytearray(gap)
    for r in raw:
        offsets.append(len(data))
        data += r + bytes(gap)
    with open(path, "wb") as f:
        f.write(data)
    return offsets


def _load(name, path, blocks, block_ids, *, expires_at=1e18, corrupt=None, clock=None):
    offsets = _write_segment(path, blocks)
    size = os.path.getsize(path)
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    entries = []
    for i, (block, off) in enumerate(zip(blocks, offsets, strict=True)):
        raw = block.contiguous().view(torch.uint8).numpy()
        entries.append(PlanEntry(
            key=bytes([i]) * 16, found="warm", segment=name, segment_bytes=size, offset=off,
            nbytes=raw.nbytes, shape=SHAPE, dtype=dtype[block.dtype], crc32=crc32(raw),
            exact=True,
        ))
    if corrupt is not None:  # one byte of one block changes after its checksum was made
        with open(path, "r+b") as f:
            f.seek(offsets[corrupt] + 5)
            byte = f.read(1)
            f.seek(offsets[corrupt] + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
    plan = ReadPlan("lease-1", "dev0", "node", "inc-1", 30.0, tuple(entries), expires_at)
    released = []
    load = DirectLoad(
        SegmentMaps(),
        [(plan, e, b) for e, b in zip(entries, block_ids, strict=True)],
        lambda: released.append(True),
        **({"clock": clock} if clock else {}),
    )
    return load, released


def _caches(layout: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == reference.PAGED_CPU:
        shape = (NUM_BLOCKS, H, N, 2 * D)
    else:
        shape = (2, NUM_BLOCKS, N, H, D)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.fixture(autouse=True, params=["native", "numpy"])
def copier(request, monkeypatch):
    """Every test on both CPU paths: memkv.native's slab copies and numpy's; counts the
    native calls so a test can tell the path it took."""
    calls = []
    if request.param == "numpy":
        monkeypatch.setattr(native, "AVAILABLE", False)
    else:
        real = native.copy_slabs
        monkeypatch.setattr(native, "copy_slabs",
                            lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return request.param, calls


def test_the_native_copier_is_built_here():
    """`pip install` builds memkv/native/kvcopy.c where a C compiler is (CI's machines)."""
    assert native._copy_slabs is not None  # AVAILABLE itself is patched per path here


@pytest.fixture(params=[False, True], ids=["one thread", "two threads"])
def threads(request, monkeypatch):
    """Loads as small as these tests' go on two threads too (large ones do by default)."""
    if request.param:
        monkeypatch.setattr(direct_load, "PARALLEL_MIN_BYTES", 0)
    return request.param


@pytest.mark.parametrize("layout", [reference.PAGED_CPU, reference.PAGED_FLASH])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layers_land_where_the_reference_scatter_puts_them(segment, layout, dtype, threads,
                                                          copier):
    blocks, ids = _blocks(dtype, 3), [4, 0, 2]
    load, released = _load(*segment, blocks, ids)
    for layer in range(L):
        got, want = _caches(layout, dtype)
        load.write_layer(layer, got, layout)
        reference.paged_write(blocks, ids, layer, want, layout)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), layer
    assert load.finish() == set() and released == [True]
    assert load.finish() == set() and released == [True]  # once only
    path, calls = copier
    assert (len(calls) > 0) == (path == "native")


def test_a_strided_cache_view_gets_the_same_bytes(segment):
    """vLLM's layer caches are views into one allocation: a block's stride is not its size."""
    blocks, ids = _blocks(torch.bfloat16, 2), [1, 3]
    load, _ = _load(*segment, blocks, ids)
    backing = torch.zeros((NUM_BLOCKS, 2, H, N, 2 * D), dtype=torch.bfloat16)  # 2 layers
    want = torch.zeros((NUM_BLOCKS, H, N, 2 * D), dtype=torch.bfloat16)
    got = backing[:, 1]  # the second layer of each block
    load.write_layer(0, got, reference.PAGED_CPU)
    reference.paged_write(blocks, ids, 0, want, reference.PAGED_CPU)
    assert torch.equal(got, want) and not backing[:, 0].any()


def test_a_vllm_block_id_outside_the_cache_is_refused(segment):
    blocks = _blocks(torch.float32, 2)
    load, _ = _load(*segment, blocks, [0, NUM_BLOCKS])  # one past the end
    cache, _ = _caches(reference.PAGED_CPU, torch.float32)
    with pytest.raises(IndexError):
        load.write_layer(0, cache, reference.PAGED_CPU)


def test_a_cache_of_another_shape_is_refused(segment):
    blocks = _blocks(torch.float32, 1)
    load, _ = _load(*segment, blocks, [0])
    cache = torch.zeros((NUM_BLOCKS, H + 1, N, 2 * D))  # one head too many
    with pytest.raises(ValueError):
        load.write_layer(0, cache, reference.PAGED_CPU)


def test_a_block_changed_after_its_checksum_is_named_and_the_lease_still_goes_back(
        segment, threads):
    blocks = _blocks(torch.bfloat16, 3)
    load, released = _load(*segment, blocks, [1, 3, 5], corrupt=1)
    cache, _ = _caches(reference.PAGED_CPU, torch.bfloat16)
    for layer in range(L):
        load.write_layer(layer, cache, reference.PAGED_CPU)
    assert load.finish() == {3}
    assert released == [True]


def test_layers_out_of_order_or_never_asked_for_are_still_checked(segment):
    blocks = _blocks(torch.float32, 2)
    load, _ = _load(*segment, blocks, [0, 1], corrupt=0)
    cache, _ = _caches(reference.PAGED_FLASH, torch.float32)
    load.write_layer(2, cache, reference.PAGED_FLASH)  # not layer 0 first: checked at finish
    assert load.finish() == {0}


def test_a_lease_that_ran_out_before_the_end_voids_every_block(segment):
    now = [100.0]
    blocks = _blocks(torch.float32, 2)
    load, released = _load(*segment, blocks, [0, 1], expires_at=101.0, clock=lambda: now[0])
    cache, _ = _caches(reference.PAGED_CPU, torch.float32)
    for layer in range(L):
        load.write_layer(layer, cache, reference.PAGED_CPU)
    now[0] = 101.0 - LEASE_MARGIN_S / 2  # inside the margin: the device may move them
    assert load.finish() == {0, 1} and released == [True]


def test_a_plan_outside_its_segment_is_refused_before_any_copy(segment):
    name, path = segment
    with open(path, "wb") as f:
        f.write(bytes(1024))
    entry = PlanEntry(b"k" * 16, "warm", name, 1024, 1000, 4096, SHAPE, "float32", 0, True)
    plan = ReadPlan("lease", "dev", "node", "inc", 30.0, (entry,), 1e18)
    with pytest.raises(ValueError, match="outside segment"):
        DirectLoad(SegmentMaps(), [(plan, entry, 0)], lambda: None)


def test_the_copy_reads_the_segment_in_place(segment):
    """No copy of the block is made on the way: the sources are views of the mapping."""
    blocks = _blocks(torch.float32, 1)
    load, _ = _load(*segment, blocks, [0])
    (source,) = load._sources
    assert not source.layers.flags.owndata and source.layers.base is not None
    assert np.shares_memory(source.layers, source.typed)
