"""memkv on four Ray nodes of this machine, one of which dies with a device and an
archive (``multinode.py``).

The scenario runs in a process of its own (its Ray cluster cannot share this
one's); it reports what it saw as JSON, asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from memkv.cluster.loopback import LOOPBACK_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_sessions_spread_over_nodes_and_survive_node_losses_as_their_mode_promises(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "tests.cluster.multinode", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, **LOOPBACK_ENV},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    # One device per worker node, every one used; reads from the head exact.
    assert seen["device_nodes"] == 3 and seen["devices_used"] == 3
    assert seen["exact_across_nodes"]
    assert seen["gateways_exact"] == ["exact"]  # over HTTP from gateways on two nodes
    assert seen["near_node_placed"]  # create_session(near_node=...) lands on that node
    # The lost node's archive-mode sessions read back whole from another device;
    # its memory-mode ones answer BlockLostError (410) naming the device; the rest
    # of the cluster is untouched, and new sessions go to live devices only.
    assert seen["http_after_loss"] == "exact"  # the gateway's first read after the loss
    assert seen["archive_mode_on_victim"] == ["exact"]
    assert seen["memory_mode_on_victim"] == ["lost"]
    assert seen["lost_reason_names_device"]
    assert seen["moved_off_victim"]
    assert seen["elsewhere"] == ["exact"]
    assert seen["new_session_device_live"]
    assert seen["removed"]["device"] not in seen["stats_devices"]
    assert len(seen["stats_devices"]) == 2
    # Three archives, each in its node's own directory; the lost node's archive is
    # left out of the figures, and repair put its copies back on the others.
    assert seen["archives"] == 3 and len(seen["archive_dirs"]) == 3
    assert seen["stats_archives"] == 2
    assert len(seen["repair"]["lost"]) == 1 and seen["repair"]["live"] == 2
    assert seen["repair"]["repaired"] > 0 and seen["repair"]["short"] == 0
    assert seen["repair_again_copies"] == 0
    # A node joins: its device takes new sessions. Then the router's node dies: Ray
    # restarts the router on the joined node (the only other with its resource), it
    # replays its journal from the archives, and archive-mode sessions read back
    # whole, those on the router's node's device included.
    assert seen["joined_device_registered"] and seen["joined_device_used"]
    assert seen["rebalanced_to_joined"] > 0 and seen["rebalanced_exact"]
    # The other archive worker is drained and leaves: its sessions (memory mode
    # included) moved whole, its archive's blocks copied to the archives that stay.
    drain = seen["drain"]
    assert drain["sessions"] >= drain["on_node"] > 0 and seen["memory_mode_drained"] > 0
    assert drain["lost"] == [0, 0] and drain["short"] == 0 and drain["archives"] == 1
    assert drain["exit"] == 0  # `memkv drain NODE` exits 0 when nothing was lost
    assert seen["drained_exact"] == ["exact"] and seen["after_drained_node_left"] == ["exact"]
    assert seen["router_moved_to_joined"] and seen["router_probe_exact"]
    assert set(seen["http_during_router_loss"]) <= {"200", "503 1"}, seen
    assert "200" in seen["http_during_router_loss"]
    assert set(seen["router_outage_errors"]) <= {"ActorUnavailableError", "ActorDiedError",
                                                 "GetTimeoutError"}
    assert seen["after_router_loss"]["archive"] == ["exact"]
    # (a memory-mode session the drain moved is in the archives: it may read whole)
    assert set(seen["after_router_loss_on_its_node"]) <= {"archive:exact", "memory:lost",
                                                          "memory:exact"}
