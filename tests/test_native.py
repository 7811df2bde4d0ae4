"""memkv.native's slab copy: chunks to their places, CRC32s as zlib makes them, bad
arguments refused before any byte moves."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from memkv import native

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="memkv.native not built")


def _addr(*arrays: np.ndarray) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], np.uint64)


@pytest.mark.parametrize("chunk", [64, 48])  # streamed stores, and memcpy for odd sizes
def test_chunks_land_permuted_and_each_slab_checksum_continues(chunk):
    rng = np.random.default_rng(3)
    slabs = [rng.integers(0, 256, 8 * chunk, dtype=np.uint8) for _ in range(3)]
    outs = [np.zeros(8 * chunk, np.uint8) for _ in range(3)]
    order = np.array([5, 2, 7, 0, 1, 6, 3, 4], np.int64)
    crcs = np.array([0, 0, zlib.crc32(b"before")], np.uint32)
    native.copy_slabs(_addr(*slabs), _addr(*outs), chunk, np.arange(8, dtype=np.int64) * chunk,
                      order * chunk, crcs, native.CRC_SOURCE_SLAB)
    for slab, out, crc, start in zip(slabs, outs, crcs, [0, 0, zlib.crc32(b"before")], strict=True):
        assert (out.reshape(8, chunk)[order] == slab.reshape(8, chunk)).all()
        assert int(crc) == zlib.crc32(slab.tobytes(), start)


def test_chunk_checksums_follow_the_destination_order():
    """CRC_CHUNKS: a gather into a contiguous destination is checksummed in its order."""
    src = np.random.default_rng(4).integers(0, 256, 4 * 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    order = np.array([3, 1, 0, 2], np.int64)
    crcs = np.zeros(1, np.uint32)
    native.copy_slabs(_addr(src), _addr(dst), 64, order * 64, np.arange(4, dtype=np.int64) * 64,
                      crcs, native.CRC_CHUNKS)
    assert (dst.reshape(4, 64) == src.reshape(4, 64)[order]).all()
    assert int(crcs[0]) == zlib.crc32(dst.tobytes())


@pytest.mark.parametrize("bad", ["int addresses", "short offsets", "no crcs"])
def test_arguments_of_the_wrong_kind_are_refused(bad):
    a, b = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    src, dst, off = _addr(a), _addr(b), np.zeros(1, np.int64)
    args = dict(src=src, dst=dst, chunk=64, src_off=off, dst_off=off, crcs=None,
                crc_mode=native.CRC_NONE)
    if bad == "int addresses":
        args["src"] = src.astype(np.int64)
    elif bad == "short offsets":
        args["dst_off"] = np.zeros(2, np.int64)
    else:
        args["crc_mode"] = native.CRC_SOURCE_SLAB
    with pytest.raises(ValueError):
        native.copy_slabs(**args)
