"""The plain classes under the device and archive actors, without Ray."""

import pytest
import torch

from memkv.actors.archive import ArchiveService
from memkv.actors.device import DeviceCache
from memkv.errors import (
    CorruptDataError,
    InvalidInputError,
    LayoutMismatchError,
    UnknownBlockError,
)
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.members import StoredBlocks
from memkv.protocol.payload import BlockPayload
from memkv.router.sessions import SessionTable
from memkv.storage.codecs import get_codec
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.payloads import from_payload, to_payload

LAYOUT = KVLayout("m", 2, 2, 8, block_tokens=4)


def blocks(tokens, seed=0, layout=LAYOUT):
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    ks = [torch.randn(shape, generator=g).to(layout.torch_dtype) for _ in range(layout.num_layers)]
    vs = [torch.randn(shape, generator=g).to(layout.torch_dtype) for _ in range(layout.num_layers)]
    return split_kv(layout, ks, vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_payload_round_trip_is_bit_exact(dtype):
    t = torch.randn(2, 2, 2, 3, 8).to(dtype)
    p = to_payload(b"k" * 16, t)
    assert torch.equal(from_payload(p), t)
    back = from_payload(p, copy=True)
    back.zero_()
    assert torch.equal(from_payload(p), t)  # the copy was independent
    with pytest.raises(LayoutMismatchError, match="dtype"):
        from_payload(BlockPayload(b"k" * 16, "int4", p.data))
    with pytest.raises(LayoutMismatchError):
        to_payload(b"k", torch.zeros(2, dtype=torch.int8))


def test_device_cache_round_trip_with_local_cold_tier(tmp_path):
    cfg = StoreConfig(
        hot_capacity_bytes=4096,
        warm_capacity_bytes=4096,
        allocator=AllocatorConfig(min_unit_bytes=4096),
        archive=ArchiveConfig(directory=tmp_path, fsync="never"),
    )
    dev = DeviceCache("dev-0", cfg)
    assert dev.ping().device_id == "dev-0"
    # The device keeps no sessions: its owner (here a bare table) plans each append.
    owner = SessionTable()
    owner.create("s", LAYOUT, namespace="t")
    bl = blocks(40)
    chain = [bytes(k) for k in chain_hashes(range(40), LAYOUT, "t")]
    update = owner.plan_append("s", 40, chain)
    result = dev.put(update, [to_payload(b"", b) for b in bl])
    assert result == StoredBlocks(new_blocks=10, deduplicated_blocks=0, released_blocks=0)
    read = [from_payload(p) for p in dev.get_blocks(chain, "s")]
    assert all(torch.equal(a, b) for a, b in zip(read, bl, strict=True))
    assert set(dev.locations(chain)) <= {"hot", "warm", "cold"}
    assert dev.deactivate(chain) is False  # suspended: every block went cold
    assert [t for _, t, _ in dev.activate(chain)] == ["cold"] * 10
    assert dev.prefetch(chain[:2]) == 2
    got = [from_payload(p) for p in dev.get_blocks(chain)]
    assert all(torch.equal(a, b) for a, b in zip(got, bl, strict=True))
    st = dev.stats()
    assert st.device_id == "dev-0" and 0 < st.hot_usage <= 1
    assert dev.release(chain, True) == 10
    assert dev.stats().blocks == 0
    dev.close()


def test_archive_service_dedups_serves_and_survives_restart(tmp_path):
    cfg = ArchiveConfig(directory=tmp_path, fsync="never")
    arch = ArchiveService(cfg)
    codec = get_codec("zstd")
    b0, b1 = blocks(8)
    frames = [
        (b"a" * 16, codec.encode(b0), LAYOUT.fingerprint),
        (b"b" * 16, codec.encode(b1), LAYOUT.fingerprint),
    ]
    assert arch.put_frames(frames) == 2
    assert arch.put_frames(frames) == 0  # content-addressed: stored once
    assert arch.contains([b"a" * 16, b"c" * 16]) == [True, False]
    incarnation = arch.ping()
    arch.close()

    again = ArchiveService(cfg)
    assert again.ping() != incarnation
    assert again.stats().blocks == 2
    (frame,) = again.get_frames([b"b" * 16])
    assert torch.equal(codec.decode(frame), b1)
    assert again.delete([b"a" * 16, b"z" * 16]) == 1
    with pytest.raises(UnknownBlockError):
        again.get_frames([b"a" * 16])
    with pytest.raises(InvalidInputError, match="16-byte"):
        again.put_frames([(b"short", frames[0][1], LAYOUT.fingerprint)])
    bad = bytearray(frames[0][1])
    bad[-1] ^= 0xFF
    with pytest.raises(CorruptDataError):
        again.put_frames([(b"c" * 16, bytes(bad), LAYOUT.fingerprint)])
    assert again.contains([b"c" * 16]) == [False]
    again.close()
