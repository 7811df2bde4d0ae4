"""The cluster benchmark's scenario, in a process of its own (``python -m
memkv.bench.cluster_run SIZES_JSON``): it starts its own Ray nodes on this
machine (:class:`memkv.cluster.testbed.LocalNodes`) and prints one JSON
document of raw figures; :mod:`memkv.bench.cluster` makes the table.

Nodes: the head (an archive; the driver), A (device + archive + the bench
client), B (device + archive: lost), C (device + the router: lost), D (device:
drained), E (the router's resource only: where Ray restarts it).

1. Data paths: the client on A appends one session to each device and reads it
   back; A's device is on its node (same-node, through the node's object
   store), B's, C's and D's are not (each block crosses between the nodes'
   object stores). Beside them, a raw TCP socket from B's device process to the
   client: the wire these processes have.
2. Node loss: B is killed with its raylet while holding ``archive``-mode
   sessions; the time until every one reads back exact from the archives that
   stay, per GiB of B's data.
3. Drain: D's sessions (both modes) moved to other devices; GB/s.
4. The router's node loss: C is killed; the time until the router Ray restarts
   on E answers a read, its table replayed from the archives.

After each fault: acknowledged blocks that no longer read back exact.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

DEVICE, NVME, ROUTER, CLIENT = "bc_device", "bc_nvme", "bc_router", "bc_client"
NAMESPACE = "memkv-bench-cluster"
TOKENS_PER_BLOCK = 64


def _layout(block_kib: int) -> Any:
    from memkv.storage.layout import KVLayout

    # K and V, fp16: 2 * layers * heads * 64 tokens * 128 * 2 bytes = block_kib KiB.
    layers = max(1, block_kib * 1024 // (2 * 8 * TOKENS_PER_BLOCK * 128 * 2))
    return KVLayout("bench-cluster", layers, 8, 128, block_tokens=TOKENS_PER_BLOCK)


def _config(workdir: Path, capacity: int) -> Any:
    from memkv.config import load_config

    return load_config(overrides={
        "cluster": {"namespace": NAMESPACE, "device_resource": DEVICE, "nvme_resource": NVME,
                    "router_resource": ROUTER},
        "device": {"hot_capacity_bytes": capacity, "warm_capacity_bytes": capacity,
                   "precision": {"later_dtype": "float32"}},
        "archive": {"directory": str(workdir / "$MEMKV_NODE_ID" / "archive"), "fsync": "never",
                    "replicas": 2, "repair_interval_s": 3600},
        "router": {"background_prefetch_interval_s": 3600},
    }, environ={})


def _kv(layout: Any, tokens: int, seed: int) -> tuple[list[Any], list[Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    return ([torch.randn(shape, generator=g).half() for _ in range(layout.num_layers)],
            [torch.randn(shape, generator=g).half() for _ in range(layout.num_layers)])


class BenchClient:
    """A client of the cluster on a node of its own choosing (a Ray actor)."""

    def __init__(self, address: str, block_kib: int) -> None:
        from memkv.cluster import attach

        self.cluster = attach(address, namespace=NAMESPACE)
        self.layout = _layout(block_kib)
        self.digests: dict[str, list[bytes]] = {}

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def write(self, sid: str, blocks: int, seed: int, ack: str) -> dict[str, Any]:
        """A session of ``blocks`` blocks in one turn; where it went and how long it took."""
        import hashlib

        from memkv.storage.layout import split_kv

        tokens = blocks * TOKENS_PER_BLOCK
        keys, values = _kv(self.layout, tokens, seed)
        self.cluster.create_session(sid, self.layout, namespace="bench", ack=ack)
        ids = [seed * 1_000_000 + t for t in range(tokens)]
        started = time.perf_counter()
        self.cluster.put_kv(sid, ids, keys, values)
        seconds = time.perf_counter() - started
        self.digests[sid] = [hashlib.sha256(b.numpy().tobytes()).digest()
                             for b in split_kv(self.layout, keys, values)]
        return {"device": self.cluster.device_of(sid), "seconds": seconds,
                "bytes": blocks * self.layout.block_nbytes(TOKENS_PER_BLOCK)}

    def read(self, sid: str) -> dict[str, Any]:
        """Read a session back: seconds, bytes, and how many blocks are not as written."""
        import hashlib

        started = time.perf_counter()
        blocks = [b.numpy() for _, b in self.cluster.read_session(sid)]
        seconds = time.perf_counter() - started
        got = [hashlib.sha256(b.tobytes()).digest() for b in blocks]
        want = self.digests[sid]
        bad = sum(1 for a, b in zip(got, want, strict=False) if a != b) + abs(len(want) - len(got))
        return {"seconds": seconds, "bytes": sum(b.nbytes for b in blocks), "not_exact": bad,
                "device": self.cluster.device_of(sid)}

    def read_or_lost(self, sid: str) -> dict[str, Any]:
        from memkv.errors import BlockLostError

        try:
            return self.read(sid)
        except BlockLostError as e:
            return {"lost": str(e), "not_exact": len(self.digests[sid])}

    def socket_read(self, port: int, nbytes: int) -> float:
        """Seconds to receive ``nbytes`` over TCP from 127.0.0.1:port."""
        buf = bytearray(4 << 20)
        with socket.create_connection(("127.0.0.1", port)) as s:
            started = time.perf_counter()
            left = nbytes
            while left:
                n = s.recv_into(buf, min(len(buf), left))
                if not n:
                    raise ConnectionError("the sender closed early")
                left -= n
            return time.perf_counter() - started


def _serve_bytes(_self: Any, nbytes: int) -> int:
    """In a device's process: send ``nbytes`` to the first connection (a thread)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    payload = np.random.default_rng(0).bytes(4 << 20)

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            left = nbytes
            while left:
                chunk = payload[: min(len(payload), left)]
                conn.sendall(chunk)
                left -= len(chunk)
        server.close()

    threading.Thread(target=send, daemon=True).start()
    return int(server.getsockname()[1])


def main(sizes: dict[str, int], workdir: Path) -> dict[str, Any]:
    import ray

    from memkv.cluster import connect
    from memkv.cluster.testbed import LocalNodes

    block_kib, blocks = sizes["block_kib"], sizes["blocks_per_session"]
    per_device = sizes["sessions_per_device"]
    session_bytes = blocks * block_kib * 1024
    capacity = 2 * (per_device + 2) * session_bytes
    out: dict[str, Any] = {"sizes": sizes}
    with LocalNodes({NVME: 1}, namespace=NAMESPACE,
                    object_store_bytes=max(256 << 20, 4 * session_bytes)) as nodes:
        a = nodes.add({DEVICE: 1, NVME: 1, CLIENT: 1})
        b = nodes.add({DEVICE: 1, NVME: 1})
        c = nodes.add({DEVICE: 1, ROUTER: 1})
        d = nodes.add({DEVICE: 1})
        with connect(nodes.address, config=_config(workdir, capacity), detached=False) as cluster:
            device_on = {n.node_id: f"memkv-device-{n.node_id[:12]}-0" for n in (a, b, c, d)}
            client: Any = ray.remote(BenchClient).options(
                resources={CLIENT: 1}, num_cpus=0).remote(nodes.address, block_kib)

            # 1. Data paths: one session per device, written and read by the client on A.
            paths: dict[str, dict[str, Any]] = {}
            seed = 0
            while len(paths) < 4 and seed < 16:
                seed += 1
                wrote = ray.get(client.write.remote(f"path{seed}", blocks, seed, "memory"))
                if wrote["device"] in paths:
                    continue
                read = ray.get(client.read.remote(f"path{seed}"))
                paths[wrote["device"]] = {"write": wrote, "read": read}
            same = paths.get(device_on[a.node_id])
            cross = [p for dev, p in paths.items() if dev != device_on[a.node_id]]
            sender: Any = cluster.devices[device_on[b.node_id]]
            port = int(ray.get(sender.__ray_call__.remote(_serve_bytes, 4 * session_bytes)))
            wire_s = ray.get(client.socket_read.remote(port, 4 * session_bytes))
            out["paths"] = {
                "same_node": same,
                "cross_node": cross,
                "socket_gbps": 4 * session_bytes / wire_s / 1e9,
                "not_exact": sum(p["read"]["not_exact"] for p in paths.values()),
            }

            # Every device gets sessions of both modes (placement goes round the devices:
            # the mode changes every four), timed as archive-mode appends.
            sessions: dict[str, str] = {f"path{i}": "memory" for i in range(1, seed + 1)}
            archive_writes: list[dict[str, Any]] = []
            for i in range(4 * 2 * per_device):
                ack = "archive" if (i // 4) % 2 == 0 else "memory"
                sid = f"fill{i}"
                wrote = ray.get(client.write.remote(sid, blocks, 100 + i, ack))
                if ack == "archive":
                    archive_writes.append(wrote)
                sessions[sid] = ack
            out["archive_mode_append"] = {
                "bytes": sum(w["bytes"] for w in archive_writes),
                "seconds": sum(w["seconds"] for w in archive_writes),
            }
            where = {s: cluster.device_of(s) for s in sessions}

            # 2. B lost with its raylet.
            on_b = [s for s in sessions if where[s] == device_on[b.node_id]]
            b_bytes = len(on_b) * session_bytes
            started = time.monotonic()
            nodes.kill(b)
            results = {s: ray.get(client.read_or_lost.remote(s)) for s in on_b}
            recovery_s = time.monotonic() - started
            archived = [s for s in on_b if sessions[s] == "archive"]
            out["node_loss"] = {
                "sessions": len(on_b), "archive_sessions": len(archived), "bytes": b_bytes,
                "seconds": recovery_s,
                "seconds_per_gib": recovery_s / (b_bytes / (1 << 30)) if b_bytes else None,
                "acked_blocks_lost": sum(results[s]["not_exact"] for s in archived),
                "memory_sessions_lost": sum(1 for s in on_b if sessions[s] == "memory"
                                            and "lost" in results[s]),
            }
            repair = ray.get(cluster.router.repair_replicas.remote())
            out["repair"] = {"blocks": repair.repaired_blocks, "bytes": repair.repaired_bytes,
                             "seconds": repair.last_pass_s}

            # 3. D drained (its sessions of both modes to the others), then it leaves.
            on_d = [s for s in sessions if where[s] == device_on[d.node_id]]
            drained = cluster.drain_node(d.node_id)
            nodes.remove(d)
            after = {s: ray.get(client.read_or_lost.remote(s)) for s in on_d}
            out["drain"] = {
                "sessions": drained.sessions_moved, "bytes": drained.bytes_moved,
                "seconds": drained.seconds,
                "gbps": drained.bytes_moved / drained.seconds / 1e9 if drained.seconds else None,
                "acked_blocks_lost": sum(after[s]["not_exact"] for s in on_d),
            }

            # 4. The router's node (C) lost: Ray restarts it on E.
            nodes.add({ROUTER: 1})
            live = [s for s in sessions if s not in on_b or sessions[s] == "archive"]
            probe = next(s for s in live if s not in on_d and where[s] == device_on[a.node_id])
            started = time.monotonic()
            nodes.kill(c)
            while True:
                try:
                    now_on = ray.get(cluster.router.__ray_call__.remote(
                        lambda _self: ray.get_runtime_context().get_node_id()), timeout=5)
                    if now_on != c.node_id:
                        ray.get(client.read.remote(probe))
                        break
                except Exception:  # the router restarting: what a reader sees meanwhile
                    if time.monotonic() - started > 180:
                        raise
                time.sleep(0.05)
            router_s = time.monotonic() - started
            checked = {s: ray.get(client.read_or_lost.remote(s)) for s in live}
            out["router_loss"] = {
                "seconds": router_s,
                "acked_blocks_lost": sum(checked[s]["not_exact"] for s in live
                                         if sessions.get(s) == "archive"),
            }
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]), Path(sys.argv[2]))))
