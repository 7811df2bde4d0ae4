"""[2/6] item 1: a reader that stops reading never gets another tenant's KV.

The attack, as measured from outside: with same-node reads on, tenant X opens a
read of its session with a tiny receive buffer, takes 64 KiB and stops; its
blocks' pins run out while the rest of its answer waits in the gateway's
transport (which holds the shared memory by reference); X deletes its session,
tenant B stores blocks that land in that memory, and X reads on. Before the
fix, 42 of 48 blocks X got were B's. Here the pins are made short (2 s) so the
attack takes seconds: the gateway must cut X off (its stall bound, 1 s) and X
must never see a byte of B's, over HTTP and over the block port.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from memkv.api.auth import Authenticator, TokenEntry, hash_token
from memkv.client import Client
from memkv.port_connection import _hello
from memkv.protocol.layout import KVLayout
from memkv.protocol.wire import encode_frame

from ..kvdata import random_kv

LAYOUT = KVLayout("leak-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
                  block_tokens=64)  # 128 KiB blocks
X_BLOCKS, B_BLOCKS = 48, 56  # X's 6 MiB: more than the kernel's socket buffers hold
STALL_S, HOLD_S, PLAN_USE_S = 1.0, 2.0, 3.0
#: Past every pin a read can hold: a held plan's 5.5 s (the attack's reads are served
#: from plans the gateway holds, asked for by the session's read just before).
PINS_S = PLAN_USE_S + STALL_S + 1.0 + 0.5


@pytest.fixture
def gateway(shm_cluster):
    """A gateway of its own per test: its plan cache holds what that test's reads asked."""
    import memkv.api.app as app_module
    import memkv.api.blocks as blocks_module
    from memkv.api.server import GatewayServer

    roles = frozenset({"read", "write"})
    auth = Authenticator([TokenEntry(hash_token("tok-x"), "tenant-x", roles),
                          TokenEntry(hash_token("tok-b"), "tenant-b", roles)], open_metrics=False)
    with pytest.MonkeyPatch.context() as patch:
        # Every pin a read takes is short: held plans are used for 3 s after they are
        # asked for and pin for PLAN_USE_S + stall + safety + margin = 5.5 s.
        patch.setattr(app_module, "PLAN_USE_S", PLAN_USE_S)
        patch.setattr(app_module, "PLAN_MARGIN_S", 0.5)
        patch.setattr(blocks_module, "DEFAULT_PLAN_TTL_S", HOLD_S)
        with GatewayServer.start(shm_cluster, host="127.0.0.1", port=0, block_port=0, auth=auth,
                                 read_stall_s=STALL_S, read_hold_s=HOLD_S,
                                 max_body_bytes=64 << 20) as gw:
            yield gw


def _session(gw, token: str, sid: str, blocks: int, seed: int, *, read: bool) -> bytes:
    """Store a session of ``blocks`` blocks (and read it once, as its engine would: the
    gateway then holds plans of its blocks); return its KV bytes, block after block."""
    tokens = list(range(1, blocks * LAYOUT.block_tokens + 1))
    keys, values = random_kv(LAYOUT, len(tokens), seed=seed)
    with Client(gw.url, token=token, block_port=False) as client:
        client.create_session(sid, LAYOUT)
        client.append_turn(sid, tokens, keys, values)
        if read:
            list(client.read_blocks(sid))
    t = LAYOUT.block_tokens
    return b"".join(
        torch.stack([torch.stack([k[:, i * t : (i + 1) * t], v[:, i * t : (i + 1) * t]])
                     for k, v in zip(keys, values, strict=True)]).contiguous().numpy().tobytes()
        for i in range(blocks))


def _stalled_reader(address: tuple[str, int], request: list[bytes | memoryview]) -> socket.socket:
    """A connection with a 4 KiB receive buffer that sends ``request`` and takes 64 KiB."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    sock.sendall(b"".join(bytes(c) for c in request))
    taken = 0
    while taken < 64 << 10:
        chunk = sock.recv(4096)
        assert chunk, "the gateway closed before sending 64 KiB"
        taken += len(chunk)
    return sock


def _rest(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    out = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    sock.close()
    return bytes(out)


def _attack(gw, sid: str, request: list[bytes | memoryview], address: tuple[str, int]) -> None:
    _session(gw, "tok-x", sid, X_BLOCKS, seed=1, read=True)
    reader = _stalled_reader(address, request)
    time.sleep(PINS_S + 1.0)  # past the stall bound and every pin of the read
    with Client(gw.url, token="tok-x", block_port=False) as x:
        x.delete_session(sid)
    theirs = _session(gw, "tok-b", f"{sid}-b", B_BLOCKS, seed=2, read=False)
    rest = _rest(reader)
    # Cut off: what the kernel had taken before the stall, not the rest of X's answer...
    assert (64 << 10) + len(rest) < X_BLOCKS * LAYOUT.block_nbytes(), len(rest)
    # ...and not one piece of B's blocks in what came (64-byte samples, every 4 KiB).
    samples = [theirs[i : i + 64] for i in range(0, len(theirs), 4096)]
    leaked = sum(sample in rest for sample in samples)
    with Client(gw.url, token="tok-b", block_port=False) as b:
        b.delete_session(f"{sid}-b")  # the device as the next test expects it
    assert not leaked, f"{leaked} pieces of tenant B's KV reached tenant X"


def test_a_stalled_http_reader_is_cut_off_and_never_sent_another_tenants_kv(gateway):
    sid = "leak-http"
    request = [(f"GET /v1/sessions/{sid}/blocks HTTP/1.1\r\nHost: gw\r\n"
                "Authorization: Bearer tok-x\r\n\r\n").encode()]
    host, port = gateway.url.removeprefix("http://").split(":")
    _attack(gateway, sid, request, (host, int(port)))


def test_a_stalled_block_port_reader_is_cut_off_and_never_sent_another_tenants_kv(gateway):
    sid = "leak-port"
    request = [*_hello("tok-x"), *encode_frame(
        {"kind": "request", "id": 1, "op": "read", "session_id": sid, "start": 0, "end": None,
         "turn": None})]
    host = gateway.url.removeprefix("http://").split(":")[0]
    _attack(gateway, sid, request, (host, gateway.block_port))


def test_a_reader_that_keeps_reading_gets_its_whole_answer(gateway):
    """The stall bound cuts readers that stop, not slow ones that go on."""
    ours = _session(gateway, "tok-x", "steady", X_BLOCKS, seed=3, read=False)
    with Client(gateway.url, token="tok-x") as x:  # over the block port
        assert x.uses_block_port()
        again = b"".join(b.array.tobytes() for b in x.read_blocks("steady"))
    assert again == ours
