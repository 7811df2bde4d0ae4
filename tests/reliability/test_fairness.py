"""One tenant's stalled appends never hold up another tenant's ([1/5] item 6).

The gateway reserves each append body's declared length while it is read. With
one budget for the whole gateway, two stalled appends of tenant A (a few KB
sent each) made every append of tenant B answer 503 for the whole body
timeout. Here A stalls two bodies and a third tenant stalls one more (the whole
budget full of stalled bodies), and B's appends must each complete within 1 s.
The real router and device classes behind fake handles, a real uvicorn, the
real client; sockets opened by hand for the stalled bodies.
"""

import socket
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
              for t in ("a", "b", "c")]
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
    yield server
    server.stop()
    device.close()
    loop.close()


def _stall(url: str, tenant: str, session: str) -> socket.socket:
    """An append that declares STALLED_BYTES, sends 5 KB and then nothing."""
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
        f"Content-Length: {STALLED_BYTES}\r\n\r\n".encode() + start + b"\0" * 5000
    )
    return sock


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
