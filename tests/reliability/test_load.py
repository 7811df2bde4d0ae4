"""Load through the gateway while the device, archive and router are killed with SIGKILL.

Several clients (threads, each with its own connections: half of them send KV
over the block port, half over HTTP) run agent sessions turn by turn through
the real gateway; after every acknowledged turn
they read the whole session back and compare every byte. Meanwhile a fault
thread kills a device actor, the archive actor and the router of a deployment
of the fault tests' own (``fault_cluster``) by pid. Clients
retry what the gateway answers 503 to (a service restarting) with the same
turn index (appends are idempotent by turn).

What must hold: no read ever returns other bytes than were written; every
turn acknowledged for an ``archive``-mode session is served at the end; a
``memory``-mode session either reads back intact or answers 410 (its newest
blocks were only in the memory of a killed device); the tiers stay within
their capacities. The quick variant runs in ``make test``; ``make soak``
(MEMKV_SOAK=1) runs it at full size and writes its figures to
``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
import torch

from memkv.client import Client
from memkv.errors import BlockLostError, MemkvError
from memkv.storage.layout import KVLayout, split_kv

LAYOUT = KVLayout("load-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
SOAK = os.environ.get("MEMKV_SOAK") == "1"
CLIENTS = 8 if SOAK else 3
SESSIONS_PER_CLIENT = 8 if SOAK else 2
TURNS = 8 if SOAK else 3
TOKENS_PER_TURN = 6
RETRY_FOR_S = 60.0


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter = field(default_factory=Counter)
    requests: int = 0
    bytes_written: int = 0
    bytes_verified: int = 0
    mismatches: list = field(default_factory=list)
    acknowledged: dict = field(default_factory=dict)  # session -> (turn, expected blocks)
    lost_memory_sessions: set = field(default_factory=set)

    def saw(self, status: str) -> None:
        with self.lock:
            self.statuses[status] += 1
            self.requests += 1


def _kv(seed: int, tokens: int):
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    keys = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    values = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    return keys, values


def _retry(tally: Tally, what, stop: float):
    """Run ``what`` until it answers, retrying a restarting service (503) until ``stop``."""
    while True:
        try:
            result = what()
        except BlockLostError:
            tally.saw("410")
            raise
        except MemkvError as e:
            text = str(e)
            status = text.rsplit("(HTTP ", 1)[-1].rstrip(")") if "(HTTP " in text else "error"
            tally.saw(status)
            if status not in ("503", "502", "504") or time.monotonic() > stop:
                raise
            time.sleep(0.2)
            continue
        except OSError:
            tally.saw("connection")
            if time.monotonic() > stop:
                raise
            time.sleep(0.2)
            continue
        tally.saw("2xx")
        return result


def _client_loop(url: str, index: int, tally: Tally, progress: threading.Semaphore) -> None:
    # Half the clients send KV over the block port, half over HTTP.
    with Client(url, retries=0, block_port=index % 2 == 0) as client:
        sids = [f"load-{index}-{j}" for j in range(SESSIONS_PER_CLIENT)]
        modes = {sid: ("archive" if j % 2 == 0 else "memory") for j, sid in enumerate(sids)}
        # Each session its own tokens and its own KV (the same tokens with other KV
        # would be two truths for one block hash: memkv trusts the hash).
        full = {sid: _kv(index * 100 + j, TOKENS_PER_TURN * TURNS) for j, sid in enumerate(sids)}
        token_base = {sid: index * 1_000_000 + j * 10_000 for j, sid in enumerate(sids)}
        stop = time.monotonic() + RETRY_FOR_S
        for sid in sids:
            _retry(tally, lambda sid=sid: client.create_session(sid, LAYOUT, ack=modes[sid]), stop)
        for turn in range(1, TURNS + 1):
            n = TOKENS_PER_TURN * turn
            for sid in sids:
                if sid in tally.lost_memory_sessions:
                    continue
                keys, values = full[sid]
                tokens = [token_base[sid] + i for i in range(n)]
                sent_k = [k[:, :n] for k in keys]
                sent_v = [v[:, :n] for v in values]
                expected = [b.numpy().tobytes() for b in split_kv(LAYOUT, sent_k, sent_v)]
                try:
                    stop = time.monotonic() + RETRY_FOR_S  # per request: outlast one restart
                    _retry(
                        tally,
                        lambda sid=sid, t=tokens, k=sent_k, v=sent_v, turn=turn: client.append_turn(
                            sid, t, k, v, turn=turn
                        ),
                        stop,
                    )
                    got = _retry(
                        tally,
                        lambda sid=sid: [b.array.tobytes() for b in client.read_blocks(sid)],
                        stop,
                    )
                except BlockLostError:
                    assert modes[sid] == "memory", f"{sid}: an archive-mode session was lost"
                    with tally.lock:
                        tally.lost_memory_sessions.add(sid)
                    continue
                with tally.lock:
                    tally.bytes_written += sum(len(b) for b in expected)
                    if got != expected:
                        tally.mismatches.append((sid, turn))
                    tally.bytes_verified += sum(len(b) for b in got)
                    tally.acknowledged[sid] = (turn, expected, modes[sid])
                progress.release()


def _pid(handle) -> int:
    return int(ray.get(handle.__ray_call__.remote(lambda _self: os.getpid())))


@pytest.mark.slow
def test_load_through_the_gateway_while_actors_are_killed(fault_cluster, fault_gateway, tmp_path):
    tally = Tally()
    progress = threading.Semaphore(0)
    start = time.monotonic()
    clients = [
        threading.Thread(
            target=_client_loop, args=(fault_gateway.url, i, tally, progress), daemon=True
        )
        for i in range(CLIENTS)
    ]
    for t in clients:
        t.start()
    device_id = sorted(fault_cluster.devices)[0]
    archive = next(iter(fault_cluster.archives.values()))
    targets = [
        ("device", fault_cluster.devices[device_id]),
        ("archive", archive),
        ("router", fault_cluster.router),
    ]
    faults: list[str] = []
    per_fault = max(1, CLIENTS * SESSIONS_PER_CLIENT * TURNS // (len(targets) + 1))
    for name, handle in targets:
        for _ in range(per_fault):  # let some turns land between faults
            if not progress.acquire(timeout=RETRY_FOR_S):
                break
        os.kill(_pid(handle), signal.SIGKILL)
        faults.append(name)
    for t in clients:
        t.join(timeout=RETRY_FOR_S * TURNS * 2)
        assert not t.is_alive(), "a client hung"
    # Everything acknowledged for an archive-mode session is served, byte for byte.
    lost_blocks = 0
    with Client(fault_gateway.url) as client:
        for sid, (turn, expected, mode) in tally.acknowledged.items():
            try:
                got = _retry(
                    tally,
                    lambda sid=sid: [b.array.tobytes() for b in client.read_blocks(sid)],
                    time.monotonic() + RETRY_FOR_S,
                )
            except BlockLostError:
                assert mode == "memory", f"{sid}: archive-mode turn {turn} lost"
                continue
            if got != expected:
                lost_blocks += sum(1 for a, b in zip(got, expected, strict=False) if a != b) + abs(
                    len(got) - len(expected)
                )
        for sid in tally.acknowledged:
            _retry(tally, lambda sid=sid: client.delete_session(sid), time.monotonic() + 30)
    stats = ray.get(fault_cluster.router.stats.remote())
    for dev in stats.devices.values():
        for tier in ("hot", "warm"):
            t = dev.tiers[tier]
            assert t.capacity_bytes is not None and t.used_bytes <= t.capacity_bytes
    assert tally.mismatches == [], f"reads returned other bytes: {tally.mismatches}"
    assert lost_blocks == 0
    assert faults == ["device", "archive", "router"]
    figures = {
        "clients": CLIENTS,
        "sessions": CLIENTS * SESSIONS_PER_CLIENT,
        "turns_per_session": TURNS,
        "requests": tally.requests,
        "bytes_written": tally.bytes_written,
        "bytes_verified": tally.bytes_verified,
        "duration_s": round(time.monotonic() - start, 1),
        "faults_injected": faults,
        "status_codes": dict(tally.statuses),
        "memory_mode_sessions_lost": sorted(tally.lost_memory_sessions),
        "archive_mode_acknowledged_blocks_lost": lost_blocks,
    }
    print(json.dumps(figures, indent=2))
    out = Path("benchmarks/results/soak.json") if SOAK else tmp_path / "load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
