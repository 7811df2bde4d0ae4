"""The gateway against the real router and device classes behind fake handles: no Ray.

Every route is exercised through a real uvicorn on 127.0.0.1 with the real
client; the data paths are the in-cluster one (payloads by value) and, with
``same_node_reads``, the same-node one (this process maps the device's arenas).
"""

import asyncio

import numpy as np
import pytest

from memkv.actors.handles import DeviceHandle
from memkv.api.app import create_app
from memkv.client import Client
from memkv.errors import ConflictError, InvalidInputError, UnknownSessionError
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv
from .fakes import FakeHandle, device_and_router

LAYOUT = KVLayout("fake-model", 2, 2, 8, block_tokens=4)
UNIT = 4096


class _Server:
    """uvicorn serving an app in a thread (the GatewayServer's way, without a cluster)."""

    def __init__(self, app):
        import socket
        import threading

        import uvicorn

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(
            app, loop="asyncio", http="httptools", log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])), daemon=True
        )
        self._thread.start()
        import time

        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self):
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@pytest.fixture(params=[False, True], ids=["in-cluster", "same-node"])
def gateway(request, tmp_path):
    device, router, loop = device_and_router(
        tmp_path / "cold", f"fake-dev-{request.node.name[-12:]}", unit=UNIT, blocks=4
    )
    app = create_app(
        FakeHandle(router),
        max_body_bytes=1 << 20,
        same_node_reads=request.param,
        put_object=lambda payload: payload,
        node_id=device.node_id,
    )
    server = _Server(app)
    yield server, device
    server.stop()
    device.close()
    loop.close()


def kv(tokens, seed=0):
    return random_kv(LAYOUT, tokens, seed)


def test_a_session_round_trips_through_the_gateway_without_ray(gateway):
    server, device = gateway
    with Client(server.url) as client:
        client.create_session("s1", LAYOUT, namespace="t")
        keys, values = kv(10)
        r = client.append_turn("s1", list(range(10)), keys, values)
        assert (r.turn, r.new_blocks) == (1, 3)
        expected = split_kv(LAYOUT, keys, values)
        got = list(client.read_blocks("s1"))
        assert [g.array.tobytes() for g in got] == [e.numpy().tobytes() for e in expected]
        out = [np.empty(e.numel() * 2, dtype=np.uint8) for e in expected]
        again = list(client.read_blocks("s1", out=out))
        assert [o.tobytes() for o in out] == [e.numpy().tobytes() for e in expected]
        assert all(g.exact for g in again)
        stats = client.stats()["gateway"]
        assert stats["same_node_blocks"] + stats["in_cluster_blocks"] == 6
        with pytest.raises(ConflictError):
            client.append_turn("s1", list(range(10)), keys, values, turn=1 + 5)
        with pytest.raises(InvalidInputError):
            client.create_session("../x", LAYOUT)
        client.delete_session("s1")
        with pytest.raises(UnknownSessionError):
            client.session("s1")


def test_a_stale_view_of_a_recreated_session_never_stores_blocks_under_it(gateway):
    server, _ = gateway
    other = KVLayout("fake-model", 2, 2, 8, block_tokens=2)  # same id, other layout
    with Client(server.url) as a, Client(server.url) as b:
        a.create_session("s2", LAYOUT, namespace="t")
        keys, values = kv(4)
        a.append_turn("s2", list(range(4)), keys, values)
        b.delete_session("s2")
        b.create_session("s2", other, namespace="t")
        # a's gateway view says LAYOUT; the router has the new layout: refused.
        with pytest.raises((ConflictError, InvalidInputError)):
            a.append_turn("s2", list(range(8)), *kv(8), turn=2)
        assert a.session("s2").layout.layout() == other and a.session("s2").chain == ()


class _BrokenRouter:
    """A router whose calls fail the ways a cluster's can."""

    async def ping(self):
        return "ok"

    async def session(self, session_id):
        raise RuntimeError("boom at /srv/secret/path, pid 4242, actor 5f3a")

    async def read_route(self, session_id, start, end):
        from ray.exceptions import RayActorError

        raise RayActorError(error_msg="The actor 5f3a died, pid 4242 at 10.0.0.7")


def test_errors_keep_one_envelope_and_show_no_internals():
    import httpx

    server = _Server(create_app(FakeHandle(_BrokenRouter()), same_node_reads=False))
    try:
        r = httpx.get(server.url + "/v1/sessions/s")
        assert r.status_code == 500
        assert r.json() == {
            "error": {"type": "InternalError", "message": "internal error", "status": 500}
        }
        r = httpx.get(server.url + "/v1/sessions/s/blocks")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "4242" not in r.text and "5f3a" not in r.text
        r = httpx.post(
            server.url + "/v1/sessions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 422 and r.json()["error"]["type"] == "InvalidInputError"
    finally:
        server.stop()


def _wrapped_in_ray(cause):
    """``cause`` as it arrives from an actor: a RayTaskError carrying the remote traceback."""
    from ray.exceptions import RayTaskError

    return RayTaskError(
        "adopt",
        'Traceback (most recent call last):\n  File "/srv/memkv/storage/block_pool.py", '
        "line 443, in adopt\n    raise BlockLostError(...)",
        cause,
        proctitle="ray::DeviceCacheActor.adopt()",
        pid=4242,
        ip="127.0.0.1",
        actor_id="5f3a" * 8,
        actor_repr="<memkv.actors.device.DeviceCacheActor object at 0x7f00deadbeef>",
    ).as_instanceof_cause()


class _RestartedDevice:
    """The session's device after a restart: empty, and its adopt fails as a real one's
    does through Ray (the cause wrapped in the remote traceback)."""

    def __init__(self, device):
        self._device = device

    def ping(self):
        from memkv.protocol.members import DeviceInfo

        return DeviceInfo("dev-0", "after-restart")

    def adopt(self, *args, **kwargs):
        from memkv.errors import BlockLostError

        raise _wrapped_in_ray(BlockLostError("2 of 3 blocks are in no tier (first missing ab12)"))

    def __getattr__(self, name):
        return getattr(self._device, name)


def test_a_lost_session_says_why_in_plain_words(tmp_path):
    """Item 8 of [1/5]: the 410 body had ANSI escapes, a pid, an actor id, an object
    address, server paths and traceback lines (the stored reason was the RayTaskError's
    text). The body names the cause; the rest goes to the log."""
    import httpx

    device, router, loop = device_and_router(tmp_path / "cold", "fake-dev-lost", unit=UNIT)
    server = _Server(create_app(FakeHandle(router), same_node_reads=False,
                                put_object=lambda payload: payload))
    try:
        with Client(server.url) as client:
            client.create_session("s", LAYOUT, namespace="t")
            client.append_turn("s", list(range(10)), *kv(10))
        router.members.devices["dev-0"] = DeviceHandle(FakeHandle(_RestartedDevice(device)))
        router.members._checked.clear()
        r = httpx.get(server.url + "/v1/sessions/s/blocks")
        assert r.status_code == 410, r.text
        message = r.json()["error"]["message"]
        assert "2 of 3 blocks are in no tier" in message
        for leak in ("\x1b", "\\u001b", "pid=", "4242", "5f3a", "0x7f00", "/srv", "Traceback",
                     "ray::", "File "):
            assert leak not in r.text, (leak, r.text)
    finally:
        server.stop()
        device.close()
        loop.close()


def test_plain_message_keeps_the_cause_and_drops_the_rest():
    from memkv.errors import BlockLostError, plain_message

    wrapped = _wrapped_in_ray(BlockLostError("3 of 81 blocks are in no tier"))
    assert plain_message(wrapped) == "3 of 81 blocks are in no tier"
    assert plain_message(ValueError("\x1b[31mbad\x1b[0m file /etc/memkv/x.yaml\nmore")) == (
        "bad file <path>"
    )
    assert plain_message(ValueError("")) == "ValueError"
    assert len(plain_message(ValueError("x" * 5000))) == 500
