"""[2/6] item 2: a client that declares a GiB over the block port and leaves costs nothing.

Measured from outside before the fix: six rounds of "declare ~1 GiB, send 3.5 KB,
close" took the gateway from 2.8 to 9.0 GB of RSS, still there 20 s later (the
body's buffer was allocated and zeroed on the event loop when declared, and a
reference cycle through the exception's traceback kept it), and each stalled
/healthz for 0.6-3.2 s. The gateway here runs in this process, so its RSS is ours.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from memkv.client import Client
from memkv.port_connection import _hello
from memkv.protocol.layout import KVLayout
from memkv.protocol.wire import encode_frame

GIB = 1 << 30
ROUNDS = 6
#: What six rounds may add to the process (a GiB each before the fix).
MAX_GROWTH = 256 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def gateway(cluster):
    from memkv.api.server import GatewayServer

    with GatewayServer.start(cluster, host="127.0.0.1", port=0, block_port=0,
                             max_body_bytes=2 * GIB, put_staging_bytes=0) as gw:
        yield gw


def _declare_and_leave(gateway) -> None:
    """An append that declares ~1 GiB (its first frame's payload), sends 3.5 KB, closes."""
    host = gateway.url.removeprefix("http://").split(":")[0]
    sock = socket.create_connection((host, gateway.block_port), timeout=10)
    head = encode_frame({"kind": "request", "id": 1, "op": "append", "session_id": "big",
                         "body_bytes": GIB})
    frame = encode_frame({"kind": "turn", "nbytes": GIB - 200})
    sock.sendall(b"".join(bytes(c) for c in (*_hello(None), *head, *frame)) + b"\0" * 3500)
    time.sleep(0.05)  # the gateway is now reading the body
    sock.close()


def test_declared_bodies_commit_no_memory_and_a_client_that_leaves_frees_at_once(gateway):
    with Client(gateway.url) as client:
        client.create_session("big", KVLayout("mem-model", 2, 2, 8, block_tokens=4))
        before = _rss()
        slowest_health = 0.0
        for _ in range(ROUNDS):
            _declare_and_leave(gateway)
            started = time.monotonic()
            assert client.health()["status"] == "ok"
            slowest_health = max(slowest_health, time.monotonic() - started)
        # Every body's hold is gone (the gateway let go of what each connection held).
        deadline = time.monotonic() + 5
        while client.stats()["gateway"]["inflight_body_bytes"] and time.monotonic() < deadline:
            time.sleep(0.02)
        grown = _rss() - before
    assert grown < MAX_GROWTH, f"{ROUNDS} declared GiB bodies grew the gateway by {grown} bytes"
    assert slowest_health < 0.5, slowest_health
