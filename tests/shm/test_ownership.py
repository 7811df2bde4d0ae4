"""Segment ownership (memkv.shm.ownership): one live owner per name, orphans reclaimed."""

import os
import subprocess
import sys
import uuid

import pytest

from memkv.errors import ConflictError
from memkv.shm.ownership import SHM_DIR, SegmentOwnership, reclaim_orphans
from memkv.storage.shm_arena import SharedHostArena

UNIT = 4096


def _exists(name):
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_a_name_has_one_live_owner():
    base = f"memkv-warm-test-{uuid.uuid4().hex[:8]}"
    owner = SegmentOwnership(base)
    try:
        with pytest.raises(ConflictError, match="unique"):
            SegmentOwnership(base)
        assert base not in reclaim_orphans()  # alive: left alone
    finally:
        owner.release()
    SegmentOwnership(base).release()  # free again


def test_segments_of_a_dead_device_are_reclaimed():
    base = f"memkv-warm-test-{uuid.uuid4().hex[:8]}"
    # A process takes the name, makes its segments and dies without cleaning up,
    # and nothing cleans up after it: its resource tracker is told to forget the
    # segments (else the tracker unlinks them as the process ends, racing this test,
    # which is what a device killed with its whole process group never gets).
    code = (
        "import os\n"
        "from multiprocessing import resource_tracker\n"
        "from memkv.shm.ownership import SegmentOwnership\n"
        "from memkv.storage.shm_arena import SharedHostArena\n"
        f"SegmentOwnership({base!r})\n"
        f"a = SharedHostArena({UNIT}, {UNIT}, name={base!r})\n"
        f"b = SharedHostArena({UNIT}, {UNIT}, name={base + '-hot'!r})\n"
        f"resource_tracker.unregister('/' + {base!r}, 'shared_memory')\n"
        f"resource_tracker.unregister('/' + {base + '-hot'!r}, 'shared_memory')\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert _exists(base) and _exists(base + "-hot")
    assert base in reclaim_orphans()
    assert not _exists(base) and not _exists(base + "-hot") and not _exists(base + ".lock")


def test_a_restarted_device_takes_its_own_name_over():
    base = f"memkv-warm-test-{uuid.uuid4().hex[:8]}"
    stale = SharedHostArena(UNIT, UNIT, name=base)
    stale._unlinker.detach()  # as if its process had died without unlinking
    del stale
    owner = SegmentOwnership(base)  # unlinks the stale segment of this name
    try:
        assert not _exists(base)
    finally:
        owner.release()


def test_devices_of_two_deployments_on_one_node_have_segments_of_their_own(tmp_path):
    """Device names repeat across deployments (Ray namespaces) on a node; the scope keeps
    their shared memory apart, and one deployment's device is still one of a kind."""
    import pytest

    from memkv.device import DeviceService
    from memkv.errors import ConflictError
    from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig

    def config(name: str) -> StoreConfig:
        return StoreConfig(hot_capacity_bytes=4096, warm_capacity_bytes=4096,
                           allocator=AllocatorConfig(min_unit_bytes=4096),
                           archive=ArchiveConfig(directory=tmp_path / name, fsync="never"))

    name = f"memkv-device-test-{uuid.uuid4().hex[:8]}-0"
    first = DeviceService(name, config("a"), segment_scope="tenant-a")
    second = DeviceService(name, config("b"), segment_scope="tenant-b")
    try:
        assert first.warm_segment != second.warm_segment
        with pytest.raises(ConflictError, match="already holds the segments"):
            DeviceService(name, config("c"), segment_scope="tenant-a")
    finally:
        first.close()
        second.close()
