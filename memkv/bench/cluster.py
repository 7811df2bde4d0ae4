"""``memkv bench cluster``: memkv on six Ray nodes of this machine, and three faults.

Cross-node appends and reads beside same-node ones and beside a raw TCP socket
between the same processes; the time to serve a lost node's sessions again (per
GiB of its data), a drain's GB/s, the time to a restarted router's first
answer; and acknowledged blocks lost in each fault (target 0 in ``archive``
mode). The scenario runs in a process of its own, on Ray nodes of its own
(:mod:`memkv.bench.cluster_run`): a process joins one Ray cluster.

The nodes share this machine's two cores, memory and loopback: "cross-node"
here is a copy between two object stores over 127.0.0.1, not a network, and
the figures are ratios taken side by side, not a cluster's absolute speeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from memkv.bench.context import BenchContext
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult
from memkv.cluster.loopback import LOOPBACK_ENV
from memkv.errors import MemkvError

__all__ = ["run"]

FULL = {"block_kib": 1024, "blocks_per_session": 16, "sessions_per_device": 2}
QUICK = {"block_kib": 256, "blocks_per_session": 8, "sessions_per_device": 1}
SCENARIO_TIMEOUT_S = 900


def _gbps(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


def _scenario(sizes: dict[str, int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="memkv-bench-cluster-") as workdir:
        run = subprocess.run(
            [sys.executable, "-m", "memkv.bench.cluster_run", json.dumps(sizes), workdir],
            capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S,
            env={**os.environ, **LOOPBACK_ENV},
        )
    if run.returncode != 0:
        raise MemkvError(f"the cluster scenario failed: {run.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return figures


def run(ctx: BenchContext) -> SuiteResult:
    sizes = QUICK if ctx.quick else FULL
    return result_of(_scenario(sizes), quick=ctx.quick)


def result_of(seen: dict[str, Any], *, quick: bool) -> SuiteResult:
    """The table and notes of a scenario's raw figures (``seen["sizes"]``: its sizes)."""
    sizes = seen["sizes"]
    paths = seen["paths"]
    same = paths["same_node"]
    cross = paths["cross_node"]
    socket = paths["socket_gbps"]
    same_read = _gbps(same["read"]["bytes"], same["read"]["seconds"])
    same_write = _gbps(same["write"]["bytes"], same["write"]["seconds"])
    cross_read = _gbps(sum(p["read"]["bytes"] for p in cross),
                       sum(p["read"]["seconds"] for p in cross))
    cross_write = _gbps(sum(p["write"]["bytes"] for p in cross),
                        sum(p["write"]["seconds"] for p in cross))
    durable = seen["archive_mode_append"]
    durable_write = _gbps(durable["bytes"], durable["seconds"])
    loss, drain, router = seen["node_loss"], seen["drain"], seen["router_loss"]

    def vs(x: float | None, y: float | None) -> float | None:
        return round(x / y, 3) if x is not None and y else None

    rows: list[list[Any]] = [
        ["read, same node (object store, zero-copy)", same_read, vs(same_read, socket),
         paths["not_exact"]],
        ["read, across nodes", cross_read, vs(cross_read, socket), paths["not_exact"]],
        ["append (memory mode), same node", same_write, vs(same_write, socket), "-"],
        ["append (memory mode), across nodes", cross_write, vs(cross_write, socket), "-"],
        ["append (archive mode: 2 fsynced archive copies)", durable_write,
         vs(durable_write, socket), "-"],
        ["raw TCP socket, device process -> client process", round(socket, 3), 1.0, "-"],
        [f"drain: {drain['sessions']} sessions moved off a node", drain["gbps"],
         vs(drain["gbps"], socket), drain["acked_blocks_lost"]],
    ]
    faults = [
        ["node lost (device + archive)", round(loss["seconds"], 2),
         round(loss["seconds_per_gib"], 1) if loss["seconds_per_gib"] else "-",
         loss["archive_sessions"], loss["acked_blocks_lost"], loss["memory_sessions_lost"]],
        ["router's node lost (restarted elsewhere)", round(router["seconds"], 2), "-", "-",
         router["acked_blocks_lost"], "-"],
        ["node drained, then removed", round(drain["seconds"], 2), "-", drain["sessions"],
         drain["acked_blocks_lost"], 0],
    ]
    notes = [
        f"Six Ray nodes on this machine (ray.cluster_utils.Cluster): the head (an archive), "
        f"A (device, archive, the bench client), B (device, archive), C (device, router), "
        f"D (device), E (the router's resource, added before C is killed). Sessions of "
        f"{sizes['blocks_per_session']} blocks of {sizes['block_kib']} KiB, written in one "
        f"turn and read whole by the client on A; archive.replicas 2.",
        "Ratios are to the raw TCP socket between the same two processes (B's device and "
        "the client), measured in the same run: a read across nodes is an object-store to "
        "object-store copy over loopback, then a copy into the reader.",
        "Faults (acknowledged blocks lost: archive-mode sessions' blocks not read back "
        "exact; target 0):",
        f"A node lost with its device and archive (raylet and processes killed): its "
        f"{loss['sessions']} sessions ({loss['bytes'] / (1 << 20):.0f} MiB) answered again "
        f"after {loss['seconds']:.2f} s ({loss['seconds_per_gib']:.1f} s per GiB of the "
        f"node's data): {loss['acked_blocks_lost']} acknowledged blocks lost of "
        f"{loss['archive_sessions']} archive-mode sessions, "
        f"{loss['memory_sessions_lost']} memory-mode sessions lost (410, as documented).",
        f"The router's node lost: {router['seconds']:.2f} s until the router Ray restarted "
        f"on another node answered a read (table replayed from the archives), "
        f"{router['acked_blocks_lost']} acknowledged blocks lost.",
        f"A node drained then removed: {drain['sessions']} sessions of both modes "
        f"({drain['bytes'] / (1 << 20):.0f} MiB) moved in {drain['seconds']:.2f} s, "
        f"{drain['acked_blocks_lost']} blocks lost.",
        f"Replica repair after the node loss: {seen['repair']['blocks']} blocks "
        f"({seen['repair']['bytes']} bytes) copied in {seen['repair']['seconds']} s.",
    ]
    return SuiteResult(
        suite="cluster",
        title="memkv on six Ray nodes: cross-node paths, node loss, router loss, drain",
        columns=["path", "GB/s", "vs raw socket", "blocks not exact"],
        rows=rows,
        figures={**seen, "faults": faults},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "path", "GB/s",
                      ["read same", "read cross", "append same", "append cross", "socket"],
                      {"GB/s": [same_read, cross_read, same_write, cross_write,
                                round(socket, 3)]}),
        quick=quick,
    )
