"""A full archive through the real actors: the append that cannot get a cold copy fails
as StorageFullError (HTTP 507), acknowledges nothing, and loses nothing stored.

Its own deployment (namespace and resources of its own) on the suite's Ray, whose one
archive has an ``archive.capacity_bytes`` a few blocks large. Where a second archive
has room the copy goes there instead (``tests/actors/test_cold_replicas.py``).
"""

from __future__ import annotations

import pytest
import ray
import torch

from memkv.api.errors import error_document
from memkv.errors import StorageFullError
from memkv.storage.layout import KVLayout, split_kv

from ..conftest import FULL_DEVICE, FULL_NVME
from ..kvdata import random_kv

LAYOUT = KVLayout("full-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
BLOCK_BYTES = LAYOUT.block_nbytes()


@pytest.fixture(scope="module")
def full_cluster(cluster, tmp_path_factory):
    from memkv.cluster import connect
    from memkv.config import load_config

    config = load_config(
        overrides={
            "cluster": {"namespace": "memkv-test-full", "embedded_devices": 1,
                        "device_resource": FULL_DEVICE, "nvme_resource": FULL_NVME},
            "device": {"hot_capacity_bytes": 1 << 20, "warm_capacity_bytes": 1 << 20,
                       "allocator": {"min_unit_bytes": 4096}},
            # Room for about four blocks' frames (incompressible random KV).
            "archive": {"directory": str(tmp_path_factory.mktemp("full-archive")),
                        "fsync": "never", "capacity_bytes": 4 * BLOCK_BYTES + 2048},
            "router": {"background_prefetch_interval_s": 3600},
        },
        environ={},
    )
    address = ray.get_runtime_context().gcs_address
    with connect(address, config=config, detached=False) as c:
        yield c


def test_an_append_no_archive_can_copy_is_507_and_loses_nothing(full_cluster) -> None:
    full_cluster.create_session("kept", LAYOUT, namespace="full", ack="archive")
    keys, values = random_kv(LAYOUT, 8, 1)
    full_cluster.put_kv("kept", list(range(8)), keys, values)  # two blocks: room
    kept = split_kv(LAYOUT, keys, values)

    full_cluster.create_session("big", LAYOUT, namespace="full", ack="archive")
    keys, values = random_kv(LAYOUT, 32, 2)
    with pytest.raises(StorageFullError, match="full") as refused:
        full_cluster.put_kv("big", list(range(1000, 1032)), keys, values)
    error = error_document(refused.value)
    assert (error["status"], error["type"]) == (507, "StorageFullError")
    # Nothing acknowledged for the refused turn; the earlier session reads back exact.
    assert full_cluster.session("big").tokens == 0
    got = [b.clone() for _, b in full_cluster.read_session("kept")]
    assert len(got) == len(kept) and all(torch.equal(a, b) for a, b in zip(got, kept, strict=True))
    (stats,) = full_cluster.stats().archives.values()
    assert stats.refused_writes >= 1 and stats.capacity_bytes == 4 * BLOCK_BYTES + 2048
    assert stats.room_bytes is not None and stats.room_bytes < 2 * BLOCK_BYTES
