"""The block port: memkv's frames over bare TCP beside HTTP (memkv.api.block_port).

Against the session's cluster and gateway (whose block port the client finds
by itself), and gateways of their own for tokens and a short body timeout.
"""

from __future__ import annotations

import random
import socket
import time
import uuid

import msgpack
import pytest
import torch

from memkv.api.auth import Authenticator, TokenEntry, hash_token
from memkv.client import Client
from memkv.client.frames import append_body, read_block_frames
from memkv.errors import (
    InvalidInputError,
    UnauthorizedError,
    UnknownBlockError,
    UnknownSessionError,
)
from memkv.port_connection import PortConnection, PortError
from memkv.protocol.wire import encode_frame
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv

LAYOUT = KVLayout("port-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
TOKENS = {
    "alice": ("tok-alice", TokenEntry(hash_token("tok-alice"), "acme", frozenset({"write"}))),
    "mallory": ("tok-mallory", TokenEntry(hash_token("tok-mallory"), "evil",
                                          frozenset({"write"}))),
}


def _session(client: Client, tokens: int = 10, seed: int = 1):
    """A new session, and the frames of its first append (not sent)."""
    sid = f"port-{uuid.uuid4().hex[:8]}"
    client.create_session(sid, LAYOUT, namespace=None)
    keys, values = random_kv(LAYOUT, tokens, seed)
    body, _ = append_body(client.session(sid), list(range(seed, seed + tokens)), None,
                           keys, values, None, None)
    return sid, body, split_kv(LAYOUT, keys, values)


def _port_stats(client: Client) -> dict:
    return client.stats()["gateway"]["block_port"]


def _raw(port: int, *frames: list) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    for chunks in frames:
        sock.sendall(b"".join(bytes(c) for c in chunks))
    return sock


def _reply(sock: socket.socket) -> dict | None:
    """The next frame's header off a raw socket (None: the gateway closed it)."""
    prefix = _recv_exact(sock, 8)
    if prefix is None:
        return None
    raw = _recv_exact(sock, int.from_bytes(prefix[4:], "little"))
    assert raw is not None
    return msgpack.unpackb(raw, raw=False)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            return None
        data += got
    return data


def _eventually(check, timeout_s: float = 10.0) -> None:
    """The gateway notices a closed connection on its own loop: wait for what follows."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the gateway did not get there in time"
        time.sleep(0.01)


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_client_finds_the_port_and_round_trips_exactly(gateway):
    with Client(gateway.url) as c:
        before = _port_stats(c)
        sid, _, expected = _session(c)
        keys, values = random_kv(LAYOUT, 10, 1)
        result = c.append_turn(sid, list(range(1, 11)), keys, values)
        assert c.block_path == "block port" and result.new_blocks == 3
        got = list(c.read_blocks(sid))
        assert [b.index for b in got] == [0, 1, 2]
        assert all(torch.equal(b.tensor, e) for b, e in zip(got, expected, strict=True))
        # Straight into caller buffers, as over HTTP.
        out = [torch.empty_like(e) for e in expected]
        list(c.read_blocks(sid, out=out))
        assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
        after = _port_stats(c)
        assert after["requests"]["append"] - before["requests"].get("append", 0) == 1
        assert after["requests"]["read"] - before["requests"].get("read", 0) == 2
    with Client(gateway.url, block_port=False) as http:
        assert [b.index for b in http.read_blocks(sid)] == [0, 1, 2]
        assert http.block_path == "http"


def test_pipelined_requests_are_answered_in_order(gateway):
    with Client(gateway.url) as c:
        sid, body, expected = _session(c, tokens=12, seed=2)
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            # Four requests on the wire before any reply is read.
            ids = [
                conn.send({"op": "append", "session_id": sid}, body),
                conn.send({"op": "read", "session_id": sid, "start": 1}),
                conn.send({"op": "read", "session_id": "port-missing"}),
                conn.send({"op": "ping"}),
            ]
            head, _ = conn.reply(ids[0])
            assert head.result["new_blocks"] == 3 and head.result["turn"] == 1
            _, reply_body = conn.reply(ids[1])
            blocks = list(read_block_frames(reply_body))
            assert [b.index for b in blocks] == [1, 2]
            assert torch.equal(blocks[0].tensor, expected[1])
            with pytest.raises(PortError) as missing:
                conn.reply(ids[2])
            assert missing.value.status == 404 and not conn.broken  # the connection goes on
            assert conn.reply(ids[3])[0].status == 200
        finally:
            conn.close()


def test_a_sessions_pipelined_turns_are_stored_in_order_and_read_back(gateway):
    """Turns sent back to back (each body read while the one before is stored) land
    in request order; a read sent after them sees all of them."""
    with Client(gateway.url) as c:
        sid, _, expected = _session(c, tokens=12, seed=31)
        other, other_body, other_expected = _session(c, tokens=8, seed=32)
        session, tokens = c.session(sid), list(range(31, 43))
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            ids = []
            for turn in range(3):
                body, _ = append_body(session, tokens[: 4 * (turn + 1)],
                                      expected[turn: turn + 1], None, None, turn, turn + 1)
                ids.append(conn.send({"op": "append", "session_id": sid}, body))
                if turn == 0:  # another session's append in between overlaps them
                    ids.append(conn.send({"op": "append", "session_id": other}, other_body))
            read = conn.send({"op": "read", "session_id": sid})
            turns = [conn.reply(i)[0].result for i in ids]
            assert [t["turn"] for t in turns] == [1, 1, 2, 3]
            assert [t["new_blocks"] for t in turns] == [1, 2, 1, 1]
            _, reply_body = conn.reply(read)
            blocks = list(read_block_frames(reply_body))
            assert [b.index for b in blocks] == [0, 1, 2]
            assert all(torch.equal(b.tensor, e) for b, e in zip(blocks, expected, strict=True))
        finally:
            conn.close()
        assert [b.index for b in c.read_blocks(other)] == [0, 1]
        assert torch.equal(next(iter(c.read_blocks(other, 1))).tensor, other_expected[1])


def test_blocks_by_key_come_over_the_port_and_the_connection_goes_on(gateway):
    with Client(gateway.url) as c:
        sid, body, expected = _session(c, tokens=12, seed=11)
        keys, values = random_kv(LAYOUT, 12, 11)
        c.append_turn(sid, list(range(11, 23)), keys, values)
        found = c.match(LAYOUT, None, list(range(11, 23)))
        before = _port_stats(c)["requests"].get("read_keys", 0)
        got = c.read_blocks_by_key(None, list(reversed(found.blocks)))
        assert all(torch.equal(b.tensor, e) for b, e in zip(got, expected[::-1], strict=True))
        assert _port_stats(c)["requests"]["read_keys"] == before + 1
        # Into the caller's buffers, over the port and over HTTP alike.
        for client in (c, Client(gateway.url, block_port=False)):
            out = [torch.empty_like(e) for e in expected]
            client.read_blocks_by_key(None, found.blocks, out=out)
            assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
            with pytest.raises(InvalidInputError, match="out buffers"):
                client.read_blocks_by_key(None, found.blocks, out=out[:1])
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            # A by-key reply runs to its end frame; the next reply follows it.
            first = conn.send({"op": "read_keys", "namespace": None, "keys": found.blocks[:1]})
            ping = conn.send({"op": "ping"})
            head, reply_body = conn.reply(first)
            assert head.until_end
            (block,) = read_block_frames(reply_body, body_ends=False)
            assert torch.equal(block.tensor, expected[0])
            assert conn.reply(ping)[0].status == 200
            with pytest.raises(PortError) as missing:
                conn.request({"op": "read_keys", "keys": [b"\x01" * 16]})
            assert missing.value.status == 404
            with pytest.raises(PortError) as bad:
                conn.request({"op": "read_keys", "keys": [b"short"]})
            assert bad.value.status == 422
        finally:
            conn.close()


def test_a_replayed_turn_and_a_conflicting_one_answer_as_over_http(gateway):
    with Client(gateway.url) as c:
        sid, body, _ = _session(c, seed=3)
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            first, _ = conn.request({"op": "append", "session_id": sid}, body)
            again, _ = conn.request({"op": "append", "session_id": sid}, body)
            assert again.result["replayed"] and again.result["chain"] == \
                first.result["chain"]
        finally:
            conn.close()


def test_a_bad_checksum_is_refused_and_nothing_is_stored(gateway):
    with Client(gateway.url) as c:
        sid, body, _ = _session(c, seed=4)
        payload = bytearray(bytes(body[2]))  # the first block's payload
        payload[0] ^= 0xFF
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            with pytest.raises(PortError) as bad:
                conn.request({"op": "append", "session_id": sid},
                             [*body[:2], payload, *body[3:]])
            assert bad.value.status == 422 and "checksum" in bad.value.error["message"]
            # The body was read to its end: the connection goes on.
            assert conn.request({"op": "ping"})[0].status == 200
        finally:
            conn.close()
        assert c.session(sid).turn == 0


def test_an_oversized_body_is_refused_before_it_is_read(gateway):
    with Client(gateway.url) as c:
        sid, _, _ = _session(c, seed=5)
        sock = _raw(gateway.block_port, encode_frame({"kind": "hello", "v": 1}),
                    encode_frame({"kind": "request", "id": 1, "op": "append",
                                  "session_id": sid, "body_bytes": 1 << 40}))
        try:
            assert _reply(sock)["kind"] == "welcome"
            reply = _reply(sock)
            assert reply["status"] == 413 and reply["id"] == 1 and reply["close"]
            assert _closed(sock)
        finally:
            sock.close()
        assert c.session(sid).turn == 0


def test_a_client_gone_mid_append_leaves_nothing_and_frees_its_staging(gateway):
    staging = gateway._staging
    free_before = staging._buddy.free_blocks() if staging is not None else None
    with Client(gateway.url) as c:
        sid, body, _ = _session(c, seed=6)
        length = sum(memoryview(x).nbytes for x in body)
        whole = b"".join(bytes(x) for x in body)
        sock = _raw(gateway.block_port, encode_frame({"kind": "hello", "v": 1}),
                    encode_frame({"kind": "request", "id": 1, "op": "append",
                                  "session_id": sid, "body_bytes": length}))
        assert _reply(sock)["kind"] == "welcome"
        sock.sendall(whole[: length // 2])
        sock.close()
        # Nothing was stored, the staging went back, and the session takes the turn.
        assert c.session(sid).turn == 0
        if staging is not None:
            _eventually(lambda: staging._buddy.free_blocks() == free_before)
        keys, values = random_kv(LAYOUT, 10, 6)
        assert c.append_turn(sid, list(range(6, 16)), keys, values).new_blocks == 3


def test_garbage_and_hostile_frames_close_the_connection_and_the_server_stays_up(gateway):
    rng = random.Random(7)
    hostile = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # HTTP on the block port
        b"MKVF" + (1 << 31).to_bytes(4, "little"),  # a header far over the limit
        b"MKVF" + (3).to_bytes(4, "little") + b"\xc1\xc1\xc1",  # not msgpack
        bytes(encode_frame({"kind": "hello", "v": 99})[0]),  # a version not served
        bytes(encode_frame({"kind": "request", "id": 1, "op": "read"})[0]),  # no hello
    ]
    hostile += [rng.randbytes(rng.randrange(1, 200)) for _ in range(20)]
    hostile += [b"MKVF" + rng.randbytes(rng.randrange(4, 64)) for _ in range(20)]
    for data in hostile:
        sock = socket.create_connection(("127.0.0.1", gateway.block_port), timeout=10)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            reply = _reply(sock)
            assert reply is None or reply.get("status", 200) >= 400
        except ConnectionResetError:
            pass
        finally:
            sock.close()
    # Still serving; after a bad request frame on a good connection too.
    conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
    try:
        with pytest.raises(PortError) as bad:
            conn.request({"op": "nonsense"})
        assert bad.value.status == 422
        with pytest.raises(PortError):
            conn.request({"op": "read"})  # no session id
        assert conn.request({"op": "ping"})[0].status == 200
    finally:
        conn.close()


def test_malformed_frames_after_the_hello_are_answered_then_the_connection_closes(
    gateway, caplog
):
    """[2/6] item 8: each is answered 4xx (its id unknown: 0) and the connection closes;
    the gateway logs one line, no traceback."""
    hello = encode_frame({"kind": "hello", "v": 1})
    prefix = b"MKVF"
    malformed = {
        "bad magic": [b"XXXX" + (3).to_bytes(4, "little") + b"\x80\x80\x80"],
        "not msgpack": [prefix + (3).to_bytes(4, "little") + b"\xc1\xc1\xc1"],
        "a list header": [bytes(encode_frame([1, 2, 3])[0])],  # type: ignore[arg-type]
        "an int header": [prefix + (1).to_bytes(4, "little") + msgpack.packb(7)],
        "deep msgpack": [prefix + (2001).to_bytes(4, "little") + b"\x91" * 2000 + b"\x00"],
        "a header over 64 KiB": [prefix + (65537).to_bytes(4, "little")],
        "id: true": encode_frame({"kind": "request", "id": True, "op": "ping"}),
        "a negative id": encode_frame({"kind": "request", "id": -1, "op": "ping"}),
    }
    caplog.set_level("INFO", logger="memkv.api.block_port")
    for what, frame in malformed.items():
        sock = _raw(gateway.block_port, hello, frame)
        try:
            assert _reply(sock)["kind"] == "welcome", what
            reply = _reply(sock)
            assert reply is not None and 400 <= reply["status"] < 500, (what, reply)
            assert reply["id"] == 0 and reply.get("close"), (what, reply)
            assert _closed(sock), what
        finally:
            sock.close()
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_connections_that_never_say_hello_are_bounded(gateway):
    """[2/6] item 7: 1,500 silent connections held 256 KiB each for 10 s; now a silent
    connection costs a 4 KiB buffer, and past MAX_AWAITING_HELLO they are closed at once."""
    from memkv.api.block_port import MAX_AWAITING_HELLO

    refused_before = gateway._app.state.block_port.stats.refused_connections
    silent = [socket.create_connection(("127.0.0.1", gateway.block_port), timeout=10)
              for _ in range(MAX_AWAITING_HELLO + 20)]
    try:
        _eventually(lambda: gateway._app.state.block_port.stats.refused_connections
                    >= refused_before + 20)
        # A client that says hello is served all the same once the silent ones go.
    finally:
        for sock in silent:
            sock.close()
    conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
    try:
        assert conn.request({"op": "ping"})[0].status == 200
    finally:
        conn.close()


def test_a_token_with_a_trailing_newline_is_refused(cluster):
    from memkv.api.server import GatewayServer

    auth = Authenticator([e for _, e in TOKENS.values()], open_metrics=False)
    with GatewayServer.start(cluster, host="127.0.0.1", port=0, auth=auth) as gw:
        with pytest.raises(UnauthorizedError):
            PortConnection("127.0.0.1", gw.block_port, token="tok-alice\n", timeout=10)
        PortConnection("127.0.0.1", gw.block_port, token="tok-alice", timeout=10).close()


def test_tokens_are_checked_once_per_connection_before_any_payload(cluster):
    from memkv.api.server import GatewayServer

    auth = Authenticator([e for _, e in TOKENS.values()], open_metrics=False)
    with GatewayServer.start(cluster, host="127.0.0.1", port=0, auth=auth) as gw:
        with pytest.raises(UnauthorizedError):
            PortConnection("127.0.0.1", gw.block_port, token="tok-wrong", timeout=10)
        with pytest.raises(UnauthorizedError):
            Client(gw.url, token="tok-wrong").read_blocks("x").__next__()
        # Refused at hello: the append behind it is never read.
        sock = _raw(gw.block_port, encode_frame({"kind": "hello", "v": 1}),
                    encode_frame({"kind": "request", "id": 1, "op": "append",
                                  "session_id": "s", "body_bytes": 1 << 30}))
        try:
            assert _reply(sock)["status"] == 401 and _closed(sock)
        finally:
            sock.close()
        with Client(gw.url, token="tok-alice") as alice, \
                Client(gw.url, token="tok-mallory") as mallory:
            sid, _, _ = _session(alice, seed=8)
            keys, values = random_kv(LAYOUT, 10, 8)
            alice.append_turn(sid, list(range(8, 18)), keys, values)
            assert alice.block_path == "block port"
            assert len(list(alice.read_blocks(sid))) == 3
            with pytest.raises(UnknownSessionError):  # her tenant has no such session
                list(mallory.read_blocks(sid))
            found = alice.match(LAYOUT, None, list(range(8, 18)))
            assert len(alice.read_blocks_by_key(None, found.blocks)) == 3
            with pytest.raises(UnknownBlockError):  # nor such blocks
                mallory.read_blocks_by_key(None, found.blocks)
            assert mallory.block_path == "block port"
        assert gw._app.state.block_port.stats.refused_connections >= 3


def test_a_stalled_body_times_out_and_lets_go_of_its_staging(cluster):
    from memkv.api.server import GatewayServer

    with GatewayServer.start(cluster, host="127.0.0.1", port=0, body_timeout_s=0.5) as gw:
        staging = gw._staging
        free_before = staging._buddy.free_blocks() if staging is not None else None
        with Client(gw.url) as c:
            sid, body, _ = _session(c, seed=9)
            length = sum(memoryview(x).nbytes for x in body)
            sock = _raw(gw.block_port, encode_frame({"kind": "hello", "v": 1}),
                        encode_frame({"kind": "request", "id": 1, "op": "append",
                                      "session_id": sid, "body_bytes": length}))
            try:
                assert _reply(sock)["kind"] == "welcome"
                sock.sendall(b"".join(bytes(x) for x in body)[: length - 10])
                reply = _reply(sock)  # nothing more is sent: the gateway gives up
                assert reply["status"] == 408 and _closed(sock)
            finally:
                sock.close()
            assert c.session(sid).turn == 0
        if staging is not None:
            _eventually(lambda: staging._buddy.free_blocks() == free_before)


def test_a_gateway_without_a_port_is_served_over_http(cluster):
    from memkv.api.server import GatewayServer

    with GatewayServer.start(cluster, host="127.0.0.1", port=0, block_port=None) as gw:
        assert gw.block_port is None
        with Client(gw.url) as c:
            sid, _, _ = _session(c, seed=10)
            keys, values = random_kv(LAYOUT, 10, 10)
            c.append_turn(sid, list(range(10, 20)), keys, values)
            assert c.block_path == "http" and len(list(c.read_blocks(sid))) == 3
            with pytest.raises(InvalidInputError):
                c.append_turn(sid, [1], blocks=[])  # errors as before


def test_the_async_client_pipelines_concurrent_calls_on_one_connection(gateway):
    import asyncio

    from memkv.client import AsyncClient

    with Client(gateway.url) as sync:
        sessions = [_session(sync, tokens=8, seed=20 + i) for i in range(4)]
        before = _port_stats(sync)

    async def main():
        async with AsyncClient(gateway.url) as c:
            async def one(i, sid):
                keys, values = random_kv(LAYOUT, 8, 20 + i)
                await c.append_turn(sid, list(range(20 + i, 28 + i)), keys, values)
                return [b async for b in c.read_blocks(sid)]

            got = await asyncio.gather(*(one(i, sid) for i, (sid, _, _) in enumerate(sessions)))
            assert c.block_path == "block port"
            return got

    got = asyncio.run(main())
    for blocks, (_, _, expected) in zip(got, sessions, strict=True):
        assert len(blocks) == 2
        assert all(torch.equal(b.tensor, e) for b, e in zip(blocks, expected, strict=True))
    with Client(gateway.url) as sync:
        after = _port_stats(sync)
    assert after["requests"]["append"] - before["requests"].get("append", 0) == 4
    assert after["connections"] - before["connections"] == 1  # all four on one connection
