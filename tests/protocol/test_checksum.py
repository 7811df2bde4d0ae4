"""The block checksum is zlib's CRC32, whichever implementation computes it."""

import zlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from memkv.protocol.checksum import crc32


@given(st.binary(max_size=4096), st.integers(min_value=0, max_value=2**32 - 1))
def test_same_values_as_zlib(data, start):
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, start) == zlib.crc32(data, start)


def test_buffers_without_copies():
    a = np.arange(1 << 16, dtype=np.uint16)
    assert crc32(a.data.cast("B")) == zlib.crc32(a.tobytes())
