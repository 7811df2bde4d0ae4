"""``gateway.workers``: several gateway processes on one HTTP and one block port.

Against the session's cluster: worker 0 in this process, worker 1 a Ray actor
on this node. Which worker a connection lands on is the kernel's choice, so
each client first asks ``/healthz`` (over the connection it then keeps).
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import httpx
import pytest

from memkv.api.workers import Gateway
from memkv.client import Client
from memkv.errors import UnknownBlockError
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv

LAYOUT = KVLayout("workers-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
# Fresh connections until both workers have answered: the kernel hashes each
# connection's source port, so 64 misses in a row would be a 2^-63 event.
_TRIES = 64


@pytest.fixture(scope="module")
def two_workers(cluster):
    with Gateway.start(cluster, workers=2, host="127.0.0.1", port=0,
                       max_body_bytes=8 << 20) as gw:
        yield gw


def _client_on(gw: Gateway, worker: int, **options) -> Client:
    """A client whose HTTP connection is served by ``worker``."""
    for _ in range(_TRIES):
        client = Client(gw.url, **options)
        if client.health()["worker"] == worker:
            return client
        client.close()
    raise AssertionError(f"no connection landed on worker {worker} in {_TRIES} tries")


def _wait_dead(actor, timeout_s: float = 30.0) -> None:
    """Until the actor answers RayActorError (a call sent just after ray.kill may still run)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.info.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the worker actor is still alive"


def _wait_exited(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.01)  # polling a pid: there is no event to wait on


def test_both_workers_serve_the_same_ports(two_workers):
    assert two_workers.workers == 2
    seen = set()
    for _ in range(_TRIES):
        with httpx.Client() as h:  # a new connection each time
            health = h.get(two_workers.url + "/healthz").json()
        seen.add(health["worker"])
        assert health["block_port"] == two_workers.block_port
        if seen == {0, 1}:
            break
    assert seen == {0, 1}


@pytest.mark.parametrize("block_port", [False, True], ids=["http", "block-port"])
def test_what_one_worker_stores_another_serves(two_workers, block_port):
    writer = _client_on(two_workers, 0, block_port=block_port)
    reader = _client_on(two_workers, 1, block_port=block_port)
    with writer, reader:
        sid = f"w-{uuid.uuid4().hex[:8]}"
        writer.create_session(sid, LAYOUT)
        keys, values = random_kv(LAYOUT, 12, seed=7)
        writer.append_turn(sid, list(range(12)), keys, values)
        expected = split_kv(LAYOUT, keys, values)
        got = list(reader.read_blocks(sid))
        assert [b.array.tobytes() for b in got] == [e.numpy().tobytes() for e in expected]
        assert reader.stats()["gateway"]["worker"] == 1


def test_a_lease_granted_by_one_worker_is_given_back_through_another(two_workers):
    grantor = _client_on(two_workers, 0)
    other = _client_on(two_workers, 1)
    with grantor, other:
        sid = f"wl-{uuid.uuid4().hex[:8]}"
        grantor.create_session(sid, LAYOUT, namespace="t-workers")
        keys, values = random_kv(LAYOUT, 8, seed=9)
        grantor.append_turn(sid, list(range(8)), keys, values)
        block_keys = grantor.match(LAYOUT, "t-workers", list(range(8))).blocks
        lease = grantor.lease_blocks("t-workers", block_keys)
        (plan,) = lease.plans
        other.release_lease(plan.lease_id)
        with pytest.raises(UnknownBlockError):
            grantor.release_lease(plan.lease_id)  # gone at the device, whoever asks


def test_stopping_closes_every_worker(cluster):
    gw = Gateway.start(cluster, workers=2, host="127.0.0.1", port=0, max_body_bytes=8 << 20)
    actors = list(gw.actors)
    gw.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", gw.port), timeout=2).close()

    for actor in actors:
        _wait_dead(actor)


def test_workers_must_be_at_least_one(cluster):
    with pytest.raises(ValueError, match="gateway.workers"):
        Gateway.start(cluster, workers=0, port=0)


def test_a_dead_worker_leaves_the_ports_to_the_others(cluster):
    import ray

    with Gateway.start(cluster, workers=2, host="127.0.0.1", port=0) as gw:
        (actor,) = gw.actors
        pid = ray.get(actor.info.remote()).pid
        ray.kill(actor, no_restart=True)
        _wait_dead(actor)
        _wait_exited(pid)  # its listening sockets close with the process
        for _ in range(16):  # every new connection lands on the worker that is left
            with httpx.Client() as h:
                assert h.get(gw.url + "/healthz").json()["worker"] == 0


def _http_on(gw: Gateway, worker: int) -> httpx.Client:
    """An HTTP client whose connection is served by ``worker``."""
    for _ in range(_TRIES):
        http = httpx.Client(base_url=gw.url, timeout=30)
        if http.get("/healthz").json()["worker"] == worker:
            return http
        http.close()
    raise AssertionError(f"no connection landed on worker {worker} in {_TRIES} tries")


def test_an_engine_registered_through_one_worker_is_routed_to_by_the_other(two_workers):
    from .engines.test_front_door import MODEL, FakeEngine

    engine = FakeEngine(f"shared-{uuid.uuid4().hex[:6]}")
    on_one, on_zero = _http_on(two_workers, 1), _http_on(two_workers, 0)
    try:
        made = on_one.post("/v1/engines", json={"url": engine.url, "engine_id": engine.name})
        assert made.status_code == 201, made.text
        # Worker 0 takes it from the shared book at its first use or its next check.
        deadline = time.monotonic() + 10
        while engine.name not in {e["id"] for e in on_zero.get("/v1/engines").json()["engines"]}:
            assert time.monotonic() < deadline, "worker 0 never learned of the engine"
            time.sleep(0.1)
        answer = on_zero.post("/v1/chat/completions", headers={"X-Memkv-Session": "w"},
                              json={"model": MODEL, "messages": []})
        assert answer.status_code == 200 and answer.headers["x-memkv-engine"] == engine.name
        assert engine.seen, "the engine never got the request"
        # Removed through worker 0: worker 1 stops routing to it.
        assert on_zero.delete(f"/v1/engines/{engine.name}").status_code == 204
        deadline = time.monotonic() + 10
        while engine.name in {e["id"] for e in on_one.get("/v1/engines").json()["engines"]}:
            assert time.monotonic() < deadline, "worker 1 still routes to a removed engine"
            time.sleep(0.1)
    finally:
        on_one.close()
        on_zero.close()
        engine.server.stop()
