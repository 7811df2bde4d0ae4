"""The device's sweeper: segments of processes that died on the host are unlinked
while memkv runs (a killed engine's staging), not only when the next one starts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import pytest

from memkv.shm.ownership import SHM_DIR
from memkv.shm.sweeper import OrphanSweeper


def test_a_killed_engines_staging_is_unlinked_by_the_next_sweep():
    # An engine's connector makes its save staging (memkv.shm.staging.client_staging) and
    # is killed: nothing of it unlinks the segment.
    code = (
        "import os, signal\n"
        "from multiprocessing import resource_tracker\n"
        "from memkv.shm.staging import client_staging\n"
        "s = client_staging(1 << 20)\n"
        "resource_tracker.unregister('/' + s.segment, 'shared_memory')\n"
        "print(s.segment, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    name = proc.stdout.strip()
    assert name and os.path.exists(os.path.join(SHM_DIR, name)), proc.stderr
    sweeper = OrphanSweeper(interval_s=3600)
    assert name in sweeper.sweep()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert sweeper.reclaimed >= 1


def test_a_live_owners_segment_is_left_alone():
    from memkv.shm.staging import client_staging

    staging = client_staging(1 << 20)
    assert staging is not None
    try:
        assert staging.segment not in OrphanSweeper(interval_s=3600).sweep()
        assert os.path.exists(os.path.join(SHM_DIR, staging.segment))
    finally:
        staging.close()


def test_the_thread_sweeps_every_interval_and_stops():
    swept = threading.Event()

    def reclaim() -> list[str]:
        swept.set()
        return [f"memkv-test-{uuid.uuid4().hex[:6]}"]

    sweeper = OrphanSweeper(interval_s=0.01, reclaim=reclaim).start()
    try:
        assert swept.wait(5)
    finally:
        sweeper.close()
    assert sweeper.reclaimed >= 1


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        OrphanSweeper(interval_s=0)


def test_mappings_of_unlinked_segments_are_let_go_of():
    """A process that maps others' staging (a device copying staged blocks) lets go of a
    segment once it is unlinked: its mapping would keep the pages alive."""
    from memkv.shm.same_node import SegmentMaps
    from memkv.shm.staging import client_staging

    maps = SegmentMaps()
    gone, staying = client_staging(1 << 20), client_staging(1 << 20)
    assert gone is not None and staying is not None
    try:
        for staging in (gone, staying):
            maps.view(staging.segment, 1 << 20, "incarnation")
        gone.close()
        assert maps.prune_unlinked() == 1 and len(maps) == 1
    finally:
        staying.close()
        maps.close()
