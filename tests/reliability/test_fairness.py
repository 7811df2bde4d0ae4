"""One tenant's stalled or trickling appends never hold up another tenant's ([1/5] item 6,
[2/6] item 3).

The gateway reserves each append body's declared length while it is read. With
one budget for the whole gateway, two stalled appends of tenant A (a few KB
sent each) made every append of tenant B answer 503 for the whole body
timeout. Here A stalls two bodies and a third tenant stalls one more (the whole
budget full of stalled bodies), and B's appends must each complete within 1 s.
Trickling: tenants that send a byte every 0.25 s (never "stalled") and open a new
body as soon as one is dropped; with two and with three of them filling the
budget, B's appends must still each complete within 1 s.
The real router and device classes behind fake handles, a real uvicorn, the
real client; sockets opened by hand for the stalled bodies.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from memkv.api.app import create_app
from memkv.api.auth import Authenticator, TokenEntry, hash_token
from memkv.client import Client
from memkv.storage.layout import KVLayout

from ..api.fakes import FakeHandle, device_and_router
from ..api.test_gateway_fakes import _Server
from ..kvdata import random_kv

# One block of 64 tokens is 256 KiB: B's appends need real room in the budget.
LAYOUT = KVLayout("fair-model", num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=64)
UNIT = 1 << 20
BUDGET = 1_500_000
STALLED_BYTES = 700_000
MAX_DELAY_S = 1.0


@pytest.fixture
def gateway(tmp_path):
    device, router, loop = device_and_router(tmp_path / "cold", "fair-dev", unit=UNIT, blocks=8)
    tokens = [TokenEntry(hash_token(f"tok-{t}"), t, frozenset({"write"}))
              for t in ("a", "b", "c", "d")]
    app = create_app(
        FakeHandle(router),
        max_body_bytes=1 << 20,
        same_node_reads=False,
        put_object=lambda payload: payload,
        auth=Authenticator(tokens),
        body_timeout_s=30.0,  # a stall alone would hold its bytes this long
        max_inflight_body_bytes=BUDGET,
    )
    server = _Server(app)
    server.app = app
    yield server
    server.stop()
    device.close()
    loop.close()


def _stall(url: str, tenant: str, session: str, declared: int = STALLED_BYTES,
           sent: int = 5000) -> socket.socket:
    """An append that declares ``declared`` bytes, sends ``sent`` and then nothing."""
    from memkv.protocol.wire import encode_frame

    # A well-formed start (a turn frame, a block frame's header, 5 KB of its payload).
    turn = encode_frame({"kind": "turn", "tokens": list(range(64))})
    block = encode_frame({"kind": "block", "index": 0, "key": b"k" * 16, "dtype": "float16",
                          "nbytes": LAYOUT.block_nbytes(), "crc32": 0})
    start = b"".join(bytes(c) for c in (*turn, *block))
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        f"POST /v1/sessions/{session}/turns HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer tok-{tenant}\r\nContent-Type: application/x-memkv-frames\r\n"
        f"Content-Length: {declared}\r\n\r\n".encode() + start + b"\0" * sent
    )
    return sock


class _Trickler:
    """A tenant that keeps a body of ``declared`` bytes open at a byte every 0.25 s, and
    opens a new one as soon as the gateway drops it (as an attacker would)."""

    def __init__(self, url: str, tenant: str, declared: int) -> None:
        self._url, self._tenant, self._declared = url, tenant, declared
        self._stop = threading.Event()
        self.bodies = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _Trickler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            sock = _stall(self._url, self._tenant, "slow", self._declared, sent=0)
            self.bodies += 1
            try:
                while not self._stop.wait(0.25):
                    if select.select([sock], [], [], 0)[0]:
                        break  # answered (408: dropped): open another
                    sock.sendall(b"\0")
            except OSError:
                pass  # closed: open another
            finally:
                sock.close()


def test_a_stalled_tenant_never_delays_another_tenants_appends(gateway):
    url = gateway.url
    with Client(url, token="tok-a") as a, Client(url, token="tok-c") as c:
        a.create_session("slow", LAYOUT)
        c.create_session("slow", LAYOUT)
    stalled = [_stall(url, "a", "slow"), _stall(url, "a", "slow"), _stall(url, "c", "slow")]
    try:
        time.sleep(0.3)  # the gateway is now reading (and holding) the stalled bodies
        delays = []
        with Client(url, token="tok-b") as b:
            for turn in range(1, 9):
                b.create_session(f"s{turn}", LAYOUT)
                keys, values = random_kv(LAYOUT, 64, seed=turn)
                started = time.monotonic()
                b.append_turn(f"s{turn}", list(range(64)), keys, values, turn=1)
                delays.append(time.monotonic() - started)
        assert max(delays) < MAX_DELAY_S, delays
    finally:
        for sock in stalled:
            sock.close()


@pytest.mark.parametrize("tenants", [("a", "c"), ("a", "c", "d")])
def test_trickling_tenants_never_delay_another_tenants_appends(gateway, tenants):
    url = gateway.url
    for tenant in tenants:
        with Client(url, token=f"tok-{tenant}") as t:
            t.create_session("slow", LAYOUT)
    # Together they declare nearly the whole budget, each within its own share.
    each = min(BUDGET // 2 - 1, (BUDGET - 50_000) // len(tenants))
    tricklers = [_Trickler(url, t, each).start() for t in tenants]
    try:
        time.sleep(0.3)  # the gateway is now reading (and holding) the trickled bodies
        delays = []
        with Client(url, token="tok-b") as b:
            for turn in range(1, 9):
                b.create_session(f"t{len(tenants)}-{turn}", LAYOUT)
                keys, values = random_kv(LAYOUT, 64, seed=turn)
                started = time.monotonic()
                b.append_turn(f"t{len(tenants)}-{turn}", list(range(64)), keys, values, turn=1)
                delays.append(time.monotonic() - started)
        assert max(delays) < MAX_DELAY_S, delays
        # The tricklers were dropped (and came back: the pressure was kept up).
        assert gateway.app.state.gateway.inflight.dropped >= len(tricklers)
        assert sum(t.bodies for t in tricklers) > len(tricklers)
    finally:
        for trickler in tricklers:
            trickler.stop()
