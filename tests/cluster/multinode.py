"""memkv on several Ray nodes of this machine, and one of them lost.

Run as a program (``python -m tests.cluster.multinode DIR``): a Ray cluster of
its own (``ray.cluster_utils.Cluster``, Ray's multi-node test harness) cannot
share a pytest process with the suite's session Ray, since a process joins one
cluster. It prints one JSON document of what it saw; ``test_multinode.py``
asserts on it.

The cluster: a head node with an archive (``nvme``) and the router, and three
worker nodes with a device each, two of them with an archive too: three
archives, each cold block on two of them (``archive.replicas``), every archive
in a directory of its node (``$MEMKV_NODE_ID``). Sessions of both
acknowledgement modes are spread over the devices and read back across nodes;
then a worker node with a device and an archive is killed with its raylet and
processes (``remove_node(allow_graceful=False)``), the sessions are read again,
and the router's repair puts the lost archive's copies back on the others.
Then a node joins (a device and the router's resource) and ``memkv up`` runs
again: its device takes new sessions. The other archive worker is drained
(``drain_node``: its sessions to other devices, its archive's blocks to the
archives that stay) and leaves. Last, the router's node is killed: Ray
restarts the router on the joined node, it replays its journal from the
archives, and every session is read again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEVICE, NVME, ROUTER = "mn_device", "mn_nvme", "mn_router"
WORKERS = 3
ARCHIVE_WORKERS = 2  # the first two workers keep an archive beside their device
SESSIONS_PER_MODE = 24 if os.environ.get("MEMKV_SOAK") else 6  # make soak: more
TOKENS = 10  # 3 blocks of 4, the last partial


def _config(archive_dir: Path) -> Any:
    """Small tiers, three archives with two copies of each cold block; repair on demand."""
    from memkv.config import load_config

    unit = 4096
    return load_config(
        overrides={
            "cluster": {"namespace": "memkv-multinode", "device_resource": DEVICE,
                        "nvme_resource": NVME, "router_resource": ROUTER},
            "device": {
                "hot_capacity_bytes": 16 * unit,
                "warm_capacity_bytes": 16 * unit,
                "allocator": {"min_unit_bytes": unit},
                "precision": {"later_dtype": "float32"},
            },
            # One directory per node: the simulated nodes share this machine's disk.
            "archive": {"directory": str(archive_dir / "$MEMKV_NODE_ID" / "archive"),
                        "fsync": "never", "replicas": 2, "repair_interval_s": 3600},
            "router": {"background_prefetch_interval_s": 3600},
        },
        environ={},
    )


def _kv(seed: int) -> tuple[list[Any], list[Any]]:
    import torch

    from memkv.storage.layout import KVLayout

    layout = KVLayout("multinode-model", 2, 2, 8, block_tokens=4)
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, TOKENS, layout.head_dim)
    keys = [torch.randn(shape, generator=g).half() for _ in range(layout.num_layers)]
    values = [torch.randn(shape, generator=g).half() for _ in range(layout.num_layers)]
    return keys, values


def _read(cluster: Any, sid: str) -> list[bytes]:
    return [bytes(block.numpy().tobytes()) for _, block in cluster.read_session(sid)]


def main(workdir: Path) -> dict[str, Any]:
    import httpx
    import ray

    from memkv.api.server import GatewayServer
    from memkv.client import Client
    from memkv.cluster import connect
    from memkv.cluster.testbed import LocalNodes
    from memkv.errors import BlockLostError
    from memkv.storage.layout import KVLayout, split_kv

    layout = KVLayout("multinode-model", 2, 2, 8, block_tokens=4)
    out: dict[str, Any] = {}
    with LocalNodes({NVME: 1}, namespace="memkv-multinode") as nodes:
        # Workers: device + archive, device + archive, device + the router.
        extra = [{NVME: 1}] * ARCHIVE_WORKERS + [{ROUTER: 1}] * (WORKERS - ARCHIVE_WORKERS)
        workers = [nodes.add({DEVICE: 1, **extra[i]}) for i in range(WORKERS)]
        cfg = _config(workdir)
        with connect(nodes.address, config=cfg, detached=False) as cluster:
            node_of = {name: ray.get(handle.node.remote())
                       for name, handle in cluster.devices.items()}
            out["device_nodes"] = len(set(node_of.values()))
            out["archives"] = len(cluster.archives)
            archive_nodes = {w.node_id for w in workers[:ARCHIVE_WORKERS]}
            # Where Ray put the router (it is not pinned; the router's own node loss is
            # a later test): the node lost below is another.
            router_node = ray.get(cluster.router.__ray_call__.remote(
                lambda _self: ray.get_runtime_context().get_node_id()))
            written: dict[str, list[bytes]] = {}
            for i in range(2 * SESSIONS_PER_MODE):
                sid = f"s{i}"
                ack = "archive" if i % 2 == 0 else "memory"
                cluster.create_session(sid, layout, namespace="mn", ack=ack)
                keys, values = _kv(i)
                cluster.put_kv(sid, [i * 1000 + t for t in range(TOKENS)], keys, values)
                written[sid] = [b.numpy().tobytes() for b in split_kv(layout, keys, values)]
            device_of = {sid: cluster.device_of(sid) for sid in written}
            out["devices_used"] = len(set(device_of.values()))
            out["exact_across_nodes"] = all(_read(cluster, s) == written[s] for s in written)
            # Gateways on two nodes (the head, and a worker as a gateway process there):
            # every session reads back exact over HTTP from each, same-node or not.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from memkv.api.workers import GatewayWorker

            remote_gateway: Any = GatewayWorker.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(workers[-1].node_id,
                                                                   soft=False)).remote(
                cluster.routers, 1, {"host": "127.0.0.1", "port": 0, "block_port": None,
                                     "put_staging_bytes": 0, "same_node_reads": True})
            remote_url = ray.get(remote_gateway.info.remote()).url
            with GatewayServer.start(cluster, port=0, block_port=None, put_staging_bytes=0,
                                     same_node_reads=False) as head_gateway:
                seen_exact: set[str] = set()
                for url in (head_gateway.url, remote_url):
                    with Client(url, block_port=False) as reader:
                        seen_exact |= {"exact" if [b.array.tobytes() for b in
                                                   reader.read_blocks(s)] == written[s]
                                       else "differs" for s in written}
                out["gateways_exact"] = sorted(seen_exact)
            ray.get(remote_gateway.stop.remote())
            ray.kill(remote_gateway)
            # Asked near a node (an engine's): placed on that node's device, whatever the load.
            target = workers[-1].node_id
            near_devices = set()
            for i in range(3):
                cluster.create_session(f"near{i}", layout, namespace="mn", near_node=target[:8])
                keys, values = _kv(300 + i)
                cluster.put_kv(f"near{i}", [90_000 + 100 * i + t for t in range(TOKENS)],
                               keys, values)
                near_devices.add(node_of[cluster.device_of(f"near{i}")])
            out["near_node_placed"] = near_devices == {target}

            # Lose the worker node with an archive whose device holds the most sessions
            # (not the router's node).
            victim = max((d for d in cluster.devices
                          if node_of[d] != router_node and node_of[d] in archive_nodes),
                         key=lambda d: (list(device_of.values()).count(d), d))
            node = next(w for w in workers if w.node_id == node_of[victim])
            on_victim = [s for s in written if device_of[s] == victim]
            started = time.monotonic()
            nodes.kill(node)
            out["removed"] = {"device": victim, "sessions": len(on_victim)}
            # The first read after the loss goes over HTTP: whether the gateway or the
            # router finds the device gone first, it is served where the session moved.
            durable = next(s for s in on_victim if int(s[1:]) % 2 == 0)
            with GatewayServer.start(cluster, port=0, block_port=None, put_staging_bytes=0,
                                     same_node_reads=False) as gateway, \
                    Client(gateway.url, block_port=False) as client:
                out["http_after_loss"] = (
                    "exact" if [b.array.tobytes() for b in client.read_blocks(durable)]
                    == written[durable] else "differs")

            outcome: dict[str, str] = {}
            for sid in written:
                try:
                    outcome[sid] = "exact" if _read(cluster, sid) == written[sid] else "differs"
                except BlockLostError as e:
                    outcome[sid] = f"lost: {e}"
            out["recovery_s"] = round(time.monotonic() - started, 2)
            out["archive_mode_on_victim"] = sorted(
                {outcome[s] for s in on_victim if int(s[1:]) % 2 == 0})
            out["memory_mode_on_victim"] = sorted(
                {outcome[s].split(":")[0] for s in on_victim if int(s[1:]) % 2 == 1})
            out["lost_reason_names_device"] = all(
                victim in outcome[s] for s in on_victim if outcome[s].startswith("lost"))
            out["elsewhere"] = sorted(
                {outcome[s] for s in written if device_of[s] != victim})
            out["moved_off_victim"] = all(
                cluster.device_of(s) != victim for s in on_victim if outcome[s] == "exact")
            cluster.create_session("after", layout, namespace="mn")
            keys, values = _kv(99)
            cluster.put_kv("after", list(range(TOKENS)), keys, values)
            out["new_session_device_live"] = cluster.device_of("after") != victim
            stats = cluster.stats()
            out["stats_devices"] = sorted(stats.devices)
            out["stats_archives"] = len(stats.archives)
            # Repair: every block some session holds is on two live archives again.
            repaired = ray.get(cluster.router.repair_replicas.remote())
            out["repair"] = {"lost": repaired.lost_archives, "live": repaired.live_archives,
                             "repaired": repaired.repaired_blocks,
                             "short": repaired.under_replicated}
            again = ray.get(cluster.router.repair_replicas.remote())
            out["repair_again_copies"] = again.repaired_blocks - repaired.repaired_blocks
            out["archive_dirs"] = sorted(p.parent.name for p in workdir.glob("*/archive"))

            # -- A node joins (device + router resource); then the router's node is lost.
            joined = nodes.add({DEVICE: 1, ROUTER: 1})
            # memkv up again: the new node's device joins. (Kept: a non-detached actor
            # lives while its creator holds a handle.)
            rejoined = connect(nodes.address, config=cfg, detached=False)
            new_device = next(d for d in ray.get(cluster.router.devices.remote())
                              if d.startswith(f"memkv-device-{joined.node_id[:12]}"))
            # It takes sessions from the busiest devices in the background (rebalance).
            deadline = time.monotonic() + 30
            rebalanced: list[str] = []
            while not rebalanced and time.monotonic() < deadline:
                rebalanced = [s for s in written if not outcome.get(s, "").startswith("lost")
                              and cluster.device_of(s) == new_device]
                time.sleep(0.2)
            out["rebalanced_to_joined"] = len(rebalanced)
            out["rebalanced_exact"] = all(_read(cluster, s) == written[s] for s in rebalanced)
            # New sessions go to the least loaded device. The background rebalance may
            # still be evening the loads out, and ties go by hot-tier use: a few more
            # sessions (at most six) rather than a race on which device is emptiest.
            for i in range(6):
                sid = f"j{i}"
                cluster.create_session(sid, layout, namespace="mn", ack="archive")
                keys, values = _kv(200 + i)
                cluster.put_kv(sid, [50_000 + 100 * i + t for t in range(TOKENS)], keys, values)
                written[sid] = [b.numpy().tobytes() for b in split_kv(layout, keys, values)]
                if i >= 2 and any(cluster.device_of(s) == new_device
                                  for s in written if s.startswith("j")):
                    break
            out["joined_device_registered"] = new_device in rejoined.devices
            out["joined_device_used"] = any(cluster.device_of(s) == new_device
                                            for s in written if s.startswith("j"))

            # -- The surviving archive worker is drained (device + archive), then leaves.
            live = [s for s in written if not outcome.get(s, "").startswith("lost")]
            leaving = next(w for w in workers[:ARCHIVE_WORKERS] if w.node_id != node.node_id)
            leaving_devices = f"memkv-device-{leaving.node_id[:12]}"
            on_leaving = [s for s in live if cluster.device_of(s).startswith(leaving_devices)]
            # The command an operator (or a pod's preStop hook) runs.
            command = subprocess.run(
                [sys.executable, "-c", "from memkv.cli import main; main()", "drain",
                 leaving.node_id, "--address", nodes.address, "--namespace",
                 "memkv-multinode", "--json"],
                capture_output=True, text=True, timeout=120)
            drained = json.loads(command.stdout.strip().splitlines()[-1])
            out["drain"] = {"sessions": drained["sessions_moved"], "on_node": len(on_leaving),
                            "lost": [drained["sessions_lost"], drained["tokens_lost"]],
                            "short": drained["blocks_short"],
                            "archives": len(drained["archives"]),
                            "seconds": drained["seconds"], "bytes": drained["bytes_moved"],
                            "exit": command.returncode}
            out["drained_exact"] = sorted(
                {"exact" if _read(cluster, s) == written[s] else "differs" for s in live})
            nodes.remove(leaving)
            out["after_drained_node_left"] = sorted(
                {"exact" if _read(cluster, s) == written[s] else "differs" for s in live})
            out["memory_mode_drained"] = sum(1 for s in on_leaving if s.startswith("s")
                                             and int(s[1:]) % 2 == 1)

            router_worker = next(w for w in workers if w.node_id == router_node)
            device_of = {sid: cluster.device_of(sid) for sid in written
                         if not outcome.get(sid, "").startswith("lost")}
            router_devices = f"memkv-device-{router_node[:12]}"
            on_router_node = [s for s, d in device_of.items() if d.startswith(router_devices)]
            probe = next(s for s, d in device_of.items()
                         if s.startswith("j") and not d.startswith(router_devices))
            # A gateway on the head answers throughout: 200, or 503 + Retry-After while
            # the router is away (never a 500).
            gateway = GatewayServer.start(cluster, port=0, block_port=None, put_staging_bytes=0,
                                          same_node_reads=False)
            statuses: set[str] = set()
            started = time.monotonic()
            nodes.kill(router_worker)
            errors: set[str] = set()
            where = lambda _self: ray.get_runtime_context().get_node_id()  # noqa: E731
            while True:
                try:
                    # The killed node's processes may answer for a moment: wait for the
                    # router Ray started elsewhere.
                    now_on = ray.get(cluster.router.__ray_call__.remote(where), timeout=5)
                    if now_on == router_node:
                        time.sleep(0.05)
                        continue
                    ok = _read(cluster, probe) == written[probe]
                    break
                except Exception as e:  # the router restarting: what callers see meanwhile
                    errors.add(type(e).__name__)
                    answer = httpx.get(f"{gateway.url}/v1/sessions/{probe}/blocks", timeout=30)
                    statuses.add(f"{answer.status_code} {answer.headers.get('retry-after', '')}"
                                 .strip())
                    if time.monotonic() - started > 120:
                        raise
                    time.sleep(0.1)
            out["router_recovery_s"] = round(time.monotonic() - started, 2)
            statuses.add(str(httpx.get(f"{gateway.url}/v1/sessions/{probe}/blocks",
                                       timeout=30).status_code))
            gateway.stop()
            out["http_during_router_loss"] = sorted(statuses)
            out["router_outage_errors"] = sorted(errors)
            out["router_probe_exact"] = ok
            out["router_moved_to_joined"] = now_on == joined.node_id
            after: dict[str, str] = {}
            for sid in device_of:
                try:
                    after[sid] = "exact" if _read(cluster, sid) == written[sid] else "differs"
                except BlockLostError as e:
                    after[sid] = f"lost: {e}"
            mode = {s: "memory" if s.startswith("s") and int(s[1:]) % 2 else "archive"
                    for s in after}
            out["after_router_loss"] = {
                m: sorted({after[s].split(":")[0] for s in after if mode[s] == m})
                for m in ("archive", "memory")}
            out["after_router_loss_on_its_node"] = sorted(
                {f"{mode[s]}:{after[s].split(':')[0]}" for s in on_router_node})
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
