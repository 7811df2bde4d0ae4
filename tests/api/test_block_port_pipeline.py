"""The block port overlaps a connection's appends: body i+1 is read while append i
is stored (memkv.api.block_port), answers still in request order.

A stub app stands in for the gateway's append path, so the test holds a store
open with an event and sees what the port does meanwhile; the real gateway's
pipelined appends are in test_block_port.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from memkv.api.auth import Authenticator
from memkv.api.block_port import MAX_PIPELINED, BlockPortServer
from memkv.api.body_budget import BodyBudget, BodyHold
from memkv.errors import ConflictError
from memkv.port_connection import PortConnection, PortError
from memkv.protocol.services import AppendAnswer
from memkv.protocol.wire import encode_frame


class _Appends:
    """A stub ``receive_append``: reads the body, then waits until the test lets the
    session's store finish; records the order things happen in."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.fail: set[str] = set()

    def gate(self, name: str) -> asyncio.Event:
        return self.release.setdefault(name, asyncio.Event())

    async def __call__(self, who: Any, session_id: str, declared: int | None, read: Any) -> Any:
        hold = BodyHold("", declared or 0, BodyBudget(1 << 30), clock=lambda: 0.0)
        bodies = sum(e.startswith(f"body {session_id}#") for e in self.events)

        def allocate(nbytes: int) -> None:  # called as the port reads the payload
            self.events.append(f"body {session_id}#{bodies}")

        frames = await read(allocate, hold)  # returns in the session's order
        name = frames[0].header["name"]
        await self.gate(name).wait()
        self.events.append(f"stored {name}")
        if name in self.fail:
            raise ConflictError(f"{name} conflicts")
        # Named by its chain, so a test can tell which append an answer is for.
        return AppendAnswer(chain=(name.encode(),), turn=1, new_blocks=1,
                            deduplicated_blocks=0, released_blocks=0)


@pytest.fixture
def port() -> Iterator[tuple[int, _Appends, asyncio.AbstractEventLoop]]:
    appends = _Appends()
    app = SimpleNamespace(state=SimpleNamespace(
        limits={"max_body_bytes": 1 << 20, "body_timeout_s": 10.0},
        authenticator=Authenticator.disabled(), receive_append=appends))
    loop = asyncio.new_event_loop()
    server = BlockPortServer(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start(sock))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    appends.loop = loop
    yield server.stats.port, appends, loop

    async def stop() -> None:
        for gate in appends.release.values():
            gate.set()  # stores a test left waiting
        await server.stop()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _body(name: str) -> list[bytes | memoryview]:
    return encode_frame({"kind": "turn", "name": name}, memoryview(b"x" * 1000))


def _let(loop: asyncio.AbstractEventLoop, appends: _Appends, name: str) -> None:
    loop.call_soon_threadsafe(lambda: appends.gate(name).set())


def _wait_for(appends: _Appends, event: str) -> None:
    for _ in range(1000):
        if event in appends.events:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"never saw {event!r}: {appends.events}")


def _named(result: dict) -> dict:
    """Which append an answer is for (the stub names each by its chain)."""
    return {"name": bytes.fromhex(result["chain"][0]).decode()}


def test_the_next_body_is_read_while_an_append_is_stored(port):
    number, appends, loop = port
    conn = PortConnection("127.0.0.1", number, token=None, timeout=10)
    try:
        first = conn.send({"op": "append", "session_id": "a"}, _body("a1"))
        second = conn.send({"op": "append", "session_id": "b"}, _body("b1"))
        # a1 is held in its store; b1's body is read meanwhile, and (another
        # session) stored too, but answered only after a1.
        _wait_for(appends, "body b#0")
        _let(loop, appends, "b1")
        _wait_for(appends, "stored b1")
        assert "stored a1" not in appends.events
        _let(loop, appends, "a1")
        assert _named(conn.reply(first)[0].result) == {"name": "a1"}
        assert _named(conn.reply(second)[0].result) == {"name": "b1"}
    finally:
        conn.close()


def test_one_sessions_appends_are_stored_in_request_order(port):
    number, appends, loop = port
    conn = PortConnection("127.0.0.1", number, token=None, timeout=10)
    try:
        ids = [conn.send({"op": "append", "session_id": "s"}, _body(f"s{i}")) for i in range(3)]
        _wait_for(appends, "body s#2")  # every body is read ...
        for i in (2, 1):
            _let(loop, appends, f"s{i}")
        # ... but s1 and s2 wait for s0, the session's first append.
        threading.Event().wait(0.2)
        assert [e for e in appends.events if e.startswith("stored")] == []
        _let(loop, appends, "s0")
        answers = [_named(conn.reply(i)[0].result) for i in ids]
        assert answers == [{"name": f"s{i}"} for i in range(3)]
        assert [e for e in appends.events if e.startswith("stored")] == [
            "stored s0", "stored s1", "stored s2"]
    finally:
        conn.close()


def test_a_failed_append_is_answered_in_its_place_and_the_connection_goes_on(port):
    number, appends, loop = port
    appends.fail.add("f")
    for name in ("ok1", "f", "ok2"):
        _let(loop, appends, name)
    conn = PortConnection("127.0.0.1", number, token=None, timeout=10)
    try:
        ids = [conn.send({"op": "append", "session_id": n}, _body(n)) for n in ("ok1", "f", "ok2")]
        assert _named(conn.reply(ids[0])[0].result) == {"name": "ok1"}
        with pytest.raises(PortError) as failed:
            conn.reply(ids[1])
        assert failed.value.status == 409 and not conn.broken
        assert _named(conn.reply(ids[2])[0].result) == {"name": "ok2"}
        assert conn.reply(conn.send({"op": "ping"}))[0].status == 200
    finally:
        conn.close()


def test_reading_stops_while_a_connection_has_its_fill_of_appends_in_flight(port):
    number, appends, loop = port
    conn = PortConnection("127.0.0.1", number, token=None, timeout=10)
    try:
        names = [f"p{i}" for i in range(MAX_PIPELINED + 3)]
        ids = [conn.send({"op": "append", "session_id": n}, _body(n)) for n in names]
        # No answer can go out yet: the port takes MAX_PIPELINED requests and reads
        # no further until one is answered.
        _wait_for(appends, f"body p{MAX_PIPELINED - 1}#0")
        threading.Event().wait(0.2)
        assert f"body p{MAX_PIPELINED}#0" not in appends.events
        for n in names:
            _let(loop, appends, n)
        assert [_named(conn.reply(i)[0].result) for i in ids] == [{"name": n} for n in names]
    finally:
        conn.close()


def test_appends_in_flight_finish_when_the_client_goes_away(port):
    number, appends, loop = port
    conn = PortConnection("127.0.0.1", number, token=None, timeout=10)
    conn.send({"op": "append", "session_id": "g"}, _body("g1"))
    conn.send({"op": "append", "session_id": "g"}, _body("g2"))
    _wait_for(appends, "body g#1")
    conn.close()
    # The bodies were whole: both are stored (in order), with nobody to answer.
    _let(loop, appends, "g2")
    _let(loop, appends, "g1")
    _wait_for(appends, "stored g2")
    assert appends.events.index("stored g1") < appends.events.index("stored g2")
