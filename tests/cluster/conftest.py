"""One embedded Ray for the whole integration suite (ray.init costs seconds and ~1 GiB)."""

import pytest

from memkv.cluster import connect
from memkv.config import load_config

UNIT = 4096


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    archive_dir = tmp_path_factory.mktemp("archive")
    config = load_config(
        overrides={
            "cluster": {
                "namespace": "memkv-test",
                "embedded_devices": 2,
                "embedded_object_store_bytes": 200 * 1024 * 1024,
                "embedded_num_cpus": 2,
            },
            # Small tiers (8 blocks of 512 bytes per unit) so pressure is cheap to create.
            "device": {
                "hot_capacity_bytes": 4 * UNIT,
                "warm_capacity_bytes": 4 * UNIT,
                "allocator": {"min_unit_bytes": UNIT},
                "debug_refcounts": True,
            },
            "archive": {"directory": str(archive_dir), "fsync": "never"},
            "router": {"background_prefetch_interval_s": 0.5},
        }
    )
    with connect(config=config) as c:
        yield c
