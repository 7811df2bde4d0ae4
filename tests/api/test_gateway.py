"""HTTP end to end: a real uvicorn on 127.0.0.1 over the embedded cluster."""

import asyncio
import itertools

import httpx
import pytest
import torch

from memkv.client import AsyncClient, Client
from memkv.errors import (
    ConflictError,
    InvalidInputError,
    LayoutMismatchError,
    MemkvError,
    UnknownSessionError,
)
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.wire import encode_frame
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv

LAYOUT = KVLayout("gateway-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
FRAMES = {"content-type": "application/x-memkv-frames"}
_ids = itertools.count()


def kv(tokens, seed):
    return random_kv(LAYOUT, tokens, seed)


@pytest.fixture
def client(gateway):
    with Client(gateway.url) as c:
        yield c


def new_id():
    return f"http-{next(_ids)}"


def same(blocks, expected):
    return len(blocks) == len(expected) and all(
        torch.equal(a, b) for a, b in zip(blocks, expected, strict=True)
    )


def test_session_lifecycle_end_to_end(client):
    sid = new_id()
    created = client.create_session(sid, LAYOUT, namespace="t-life", priority="normal")
    assert created.state == "active" and created.turn == 0 and created.chain == ()
    keys, values = kv(30, seed=1)  # turn 1: 14 tokens, turn 2: 30 tokens
    tokens = list(range(1000, 1030))
    r1 = client.append_turn(
        sid, tokens[:14], [k[:, :14] for k in keys], [v[:, :14] for v in values]
    )
    assert (r1.turn, r1.new_blocks) == (1, 4)
    r2 = client.append_turn(sid, tokens, keys, values)
    assert r2.turn == 2 and r2.released_blocks == 1  # the partial tail was replaced
    expected = split_kv(LAYOUT, keys, values)
    assert same([b.tensor for b in client.read_blocks(sid)], expected)
    assert [b.index for b in client.read_blocks(sid, start=2, end=4)] == [2, 3]

    m = client.match(LAYOUT, "t-life", tokens)
    assert m.tokens == 30 and len(m.blocks) == 8
    # A longer input matches whole blocks only: the stored partial tail (tokens
    # 28..29) is not the input's block 7 (tokens 28..31).
    longer = client.match(LAYOUT, "t-life", tokens + [5, 6, 7])
    assert longer.tokens == 28 and longer.blocks == m.blocks[:7]
    assert client.match(LAYOUT, "other-tenant", tokens).tokens == 0
    by_key = client.read_blocks_by_key("t-life", m.blocks[:3])
    assert same([b.tensor for b in by_key], expected[:3])

    suspended = client.suspend(sid)  # gives back the read plans the gateway held
    assert suspended.state == "archived"
    resumed = client.resume(sid)
    assert resumed.tokens == 30 and {b.tier for b in resumed.blocks} == {"cold"}
    streamed = list(client.read_blocks(sid))
    assert same([b.tensor for b in streamed], expected)
    assert all(b.tier in ("hot", "warm", "cold") for b in streamed)

    client.delete_session(sid)
    with pytest.raises(UnknownSessionError):
        client.session(sid)


def test_append_is_idempotent_by_turn(client):
    sid = new_id()
    client.create_session(sid, LAYOUT, namespace="t-idem")
    keys, values = kv(8, seed=2)
    first = client.append_turn(sid, list(range(8)), keys, values, turn=1)
    again = client.append_turn(sid, list(range(8)), keys, values, turn=1)
    assert again.replayed and again.chain == first.chain and again.turn == 1
    with pytest.raises(ConflictError, match="out of order"):
        client.append_turn(sid, list(range(8)), keys, values, turn=3)
    with pytest.raises(ConflictError, match="already applied"):
        client.append_turn(sid, list(range(100, 108)), keys, values, turn=1)
    assert client.session(sid).turn == 1


def raw_turn(sid, tokens, blocks, *, start=0, turn=1, layout=LAYOUT, namespace="t-bad"):
    chain = chain_hashes(tokens, layout, namespace)
    body = b"".join(
        encode_frame(
            {
                "kind": "turn",
                "turn": turn,
                "tokens": list(tokens),
                "start_block": start,
                "layout": layout.to_dict(),
                "blocks": len(blocks),
            }
        )
    )
    for i, b in enumerate(blocks, start=start):
        import zlib

        data = memoryview(b.contiguous().numpy()).cast("B")
        body += b"".join(
            bytes(c)
            for c in encode_frame(
                {
                    "kind": "block",
                    "index": i,
                    "key": bytes(chain[i]),
                    "dtype": "float16",
                    "shape": list(b.shape),
                    "crc32": zlib.crc32(data),
                },
                data,
            )
        )
    return body


def test_bad_input_gets_its_status_and_changes_nothing(gateway, client):
    sid = new_id()
    client.create_session(sid, LAYOUT, namespace="t-bad")
    keys, values = kv(8, seed=3)
    client.append_turn(sid, list(range(8)), keys, values)
    before = client.session(sid)
    expected = split_kv(LAYOUT, keys, values)
    url = f"/v1/sessions/{sid}/turns"
    new_blocks = split_kv(LAYOUT, *kv(12, seed=4))
    good = raw_turn(sid, list(range(12)), new_blocks, turn=2)

    with httpx.Client(base_url=gateway.url) as http:
        cases = {
            "garbage": (b"not a frame at all", 422),
            "truncated": (good[:-10], 422),
            "checksum": (good[:-1] + bytes([good[-1] ^ 1]), 422),
            "too few blocks": (raw_turn(sid, list(range(12)), new_blocks[:2], turn=2), 422),
            "oversized": (b"\0" * (9 << 20), 413),
        }
        for name, (body, status) in cases.items():
            r = http.post(url, content=body, headers=FRAMES)
            assert r.status_code == status, (name, r.text)
            assert "error" in r.json()
        other = KVLayout("other-model", 2, 2, 8, block_tokens=4)
        r = http.post(
            url,
            content=raw_turn(sid, list(range(8)), expected, turn=2, layout=other),
            headers=FRAMES,
        )
        assert r.status_code == 409 and r.json()["error"]["type"] == "ConflictError"
        shape_lies = raw_turn(sid, list(range(12)), new_blocks, turn=2).replace(
            b"\x95\x02\x02\x02\x04\x08", b"\x95\x02\x02\x02\x04\x09", 1
        )
        assert http.post(url, content=shape_lies, headers=FRAMES).status_code == 422
        assert http.post("/v1/sessions/nope/turns", content=good, headers=FRAMES).status_code == 404
        assert http.get("/v1/sessions/nope").status_code == 404
        assert (
            http.post(
                "/v1/sessions", json={"session_id": sid, "layout": LAYOUT.to_dict()}
            ).status_code
            == 409
        )
        assert (
            http.post(
                "/v1/sessions", json={"session_id": "x", "layout": {"model_id": "m"}}
            ).status_code
            == 422
        )
        assert (
            http.post("/v1/match", json={"layout": LAYOUT.to_dict(), "token_ids": [-1]}).status_code
            == 422
        )

    after = client.session(sid)
    assert (after.turn, after.tokens, after.chain) == (before.turn, before.tokens, before.chain)
    assert same([b.tensor for b in client.read_blocks(sid)], expected)
    with pytest.raises(LayoutMismatchError):
        client.append_turn(sid, list(range(8)), [k.float() for k in keys], values)
    with pytest.raises(InvalidInputError):
        client.append_turn(sid, list(range(8)), blocks=expected[:1])


def test_health_metrics_and_docs(gateway, client):
    assert client.health() == {"status": "ok", "worker": 0, "block_port": gateway.block_port}
    assert client.ready()
    with httpx.Client(base_url=gateway.url) as http:
        metrics = http.get("/metrics").text
        assert "memkv_http_requests_total" in metrics
        spec = http.get("/openapi.json").json()
        assert "/v1/sessions/{session_id}/turns" in spec["paths"]
        assert http.get("/docs").status_code == 200
    stats = client.stats()
    assert len(stats["devices"]) == 2 and stats["sessions"] >= 1


def test_metrics_carry_the_engines_figures_and_errors_by_type(gateway, client):
    from prometheus_client.parser import text_string_to_metric_families

    sid = new_id()
    client.create_session(sid, LAYOUT, namespace="t-metrics")
    keys, values = kv(8, seed=91)
    client.append_turn(sid, list(range(8)), keys, values)
    list(client.read_blocks(sid))
    with pytest.raises(UnknownSessionError):
        client.session("no-such-session")
    with httpx.Client(base_url=gateway.url) as http:
        text = http.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in ("memkv_tier_used_bytes", "memkv_tier_hits", "memkv_block_misses",
                 "memkv_demotions", "memkv_prefetch_issued", "memkv_dedup_bytes_saved",
                 "memkv_lossy_conversions", "memkv_leases_granted", "memkv_sessions",
                 "memkv_tenant_bytes", "memkv_archive_blocks", "memkv_http_request_seconds",
                 "memkv_http_errors"):
        assert name in names, name
    errors = [
        s for f in text_string_to_metric_families(text) if f.name == "memkv_http_errors"
        for s in f.samples if s.name.endswith("_total")
    ]
    assert any(s.labels["type"] == "UnknownSessionError" and s.value >= 1 for s in errors)
    hot_used = [
        s.value for f in text_string_to_metric_families(text) if f.name == "memkv_tier_used_bytes"
        for s in f.samples if s.labels["tier"] == "hot"
    ]
    assert len(hot_used) == 2 and sum(hot_used) > 0  # two devices, the session's blocks in hot
    assert "http" in client.stats()["gateway"]


def test_async_client(gateway):
    async def flow():
        async with AsyncClient(gateway.url) as c:
            sid = new_id()
            await c.create_session(sid, LAYOUT, namespace="t-async")
            keys, values = kv(9, seed=5)
            await c.append_turn(sid, list(range(9)), keys, values)
            blocks = [b.tensor async for b in c.read_blocks(sid)]
            assert same(blocks, split_kv(LAYOUT, keys, values))
            assert (await c.match(LAYOUT, "t-async", list(range(9)))).tokens == 9
            await c.delete_session(sid)
            with pytest.raises(UnknownSessionError):
                await c.session(sid)

    asyncio.run(flow())


def test_async_client_appends_on_the_view_it_has_and_refreshes_a_stale_one(gateway):
    sid = new_id()
    asked: list[str] = []

    class Counting(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request):
            if request.method == "GET" and request.url.path == f"/v1/sessions/{sid}":
                asked.append(request.url.path)
            return await super().handle_async_request(request)

    async def flow() -> int:
        async with AsyncClient(gateway.url, transport=Counting()) as c:
            await c.create_session(sid, LAYOUT, namespace="t-async-known")
            await c.append_turn(sid, list(range(9)), *kv(9, seed=5))
            await c.append_turn(sid, list(range(13)), *kv(13, seed=6))
            assert asked == []  # the create's answer and each append's kept the view
            async with AsyncClient(gateway.url) as other:  # another writer: our view goes stale
                await other.append_turn(sid, list(range(17)), *kv(17, seed=7))
            result = await c.append_turn(sid, list(range(21)), *kv(21, seed=8))
            assert asked == [f"/v1/sessions/{sid}"]  # refreshed once, on the conflict
            return result.turn

    assert asyncio.run(flow()) == 4


def test_client_retries_idempotent_calls_only():
    calls = []

    def handler(request):
        calls.append(request.method)
        if len(calls) == 1:
            return httpx.Response(503, json={"error": {"type": "ClosedError", "message": "x"}})
        return httpx.Response(200, json={"status": "ok"})

    with Client("http://test", transport=httpx.MockTransport(handler)) as c:
        assert c.health() == {"status": "ok"}
    assert calls == ["GET", "GET"]

    calls.clear()
    with Client("http://test", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(MemkvError):
            c.delete_session("s")  # not idempotent: no retry
    assert calls == ["DELETE"]


def test_resume_over_http_is_lazy(client):
    sid = new_id()
    client.create_session(sid, LAYOUT, namespace="t-lazy")
    keys, values = kv(64, seed=6)  # 16 blocks
    client.append_turn(sid, list(range(64)), keys, values)
    client.suspend(sid)
    resumed = client.resume(sid)
    assert [b.tier for b in resumed.blocks] == ["cold"] * 16  # answered before any promotion
    stream = client.read_blocks(sid)
    first = next(stream)
    assert first.index == 0
    rest = list(stream)
    # Each block carries the tier it was found in when the reader's fetch reached
    # it: the tail was still in the archive, so nothing promoted it ahead of need.
    assert rest[-1].tier == "cold"
    assert same([first.tensor] + [b.tensor for b in rest], split_kv(LAYOUT, keys, values))


def test_reads_on_the_devices_node_come_from_shared_memory(client):
    sid = new_id()
    client.create_session(sid, LAYOUT, namespace="t-shm")
    keys, values = kv(16, seed=9)
    client.append_turn(sid, list(range(16)), keys, values)
    before = client.stats()["gateway"]
    got = list(client.read_blocks(sid))
    after = client.stats()["gateway"]
    assert same([b.tensor for b in got], split_kv(LAYOUT, keys, values))
    assert all(b.exact for b in got)
    assert after["same_node_blocks"] - before["same_node_blocks"] == len(got)
    assert after["leases_lost"] == before["leases_lost"]


def test_reads_land_in_the_callers_buffers(client):
    sid = new_id()
    client.create_session(sid, LAYOUT, namespace="t-out")
    keys, values = kv(10, seed=4)
    client.append_turn(sid, list(range(10)), keys, values)
    expected = split_kv(LAYOUT, keys, values)
    out = [torch.empty_like(b) for b in expected]
    got = list(client.read_blocks(sid, out=out))
    assert same(out, expected)
    assert all(b.tensor.data_ptr() == o.data_ptr() for b, o in zip(got, out, strict=True))
    with pytest.raises(InvalidInputError, match="holds"):
        list(client.read_blocks(sid, out=[torch.empty(3)] * len(expected)))
    # Served again from the plans the gateway held on to (no device call).
    before = client.stats()["gateway"]["plan_cache"]["hits"]
    list(client.read_blocks(sid))
    assert client.stats()["gateway"]["plan_cache"]["hits"] > before


def test_a_gateway_without_same_node_reads_serves_in_cluster(cluster):
    from memkv.api.server import GatewayServer

    with GatewayServer.start(cluster, host="127.0.0.1", port=0, same_node_reads=False) as gw:
        with Client(gw.url) as c:
            sid = new_id()
            c.create_session(sid, LAYOUT, namespace="t-ray")
            keys, values = kv(12, seed=8)
            c.append_turn(sid, list(range(12)), keys, values)
            assert same([b.tensor for b in c.read_blocks(sid)], split_kv(LAYOUT, keys, values))
            stats = c.stats()["gateway"]
            assert stats["same_node_blocks"] == 0 and stats["in_cluster_blocks"] == 3
            c.delete_session(sid)


@pytest.mark.parametrize("bad", ["../x", ".", "..", "a b", "x/y", "-lead", "é"])
def test_session_ids_follow_one_rule_at_create(gateway, bad):
    r = httpx.post(
        f"{gateway.url}/v1/sessions",
        json={"session_id": bad, "layout": LAYOUT.to_dict(), "namespace": "t-ids"},
    )
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "InvalidInputError"


def test_appends_are_staged_in_shared_memory_on_the_devices_node(client):
    sid = new_id()
    client.create_session(sid, LAYOUT, namespace="t-stage")
    before = client.stats()["gateway"]
    assert before["staging_bytes"] > 0  # the test devices run on the gateway's node
    keys, values = kv(16, seed=12)
    client.append_turn(sid, list(range(16)), keys, values)
    expected = split_kv(LAYOUT, keys, values)
    after = client.stats()["gateway"]
    assert after["staged_bytes"] - before["staged_bytes"] == sum(
        b.numel() * b.element_size() for b in expected)
    # The slot was reused by later appends: what the device kept is its own copy.
    other = new_id()
    client.create_session(other, LAYOUT, namespace="t-stage")
    k2, v2 = kv(16, seed=13)
    client.append_turn(other, list(range(100, 116)), k2, v2)  # other tokens: no dedup
    assert same([b.tensor for b in client.read_blocks(sid)], expected)
    assert same([b.tensor for b in client.read_blocks(other)], split_kv(LAYOUT, k2, v2))
    client.delete_session(sid)
    client.delete_session(other)


def test_a_device_on_another_node_gets_staged_blocks_by_value(cluster):
    """A gateway whose node is not the device's: the device refuses the staged
    blocks (it cannot map the segment) and the append goes by the object store."""
    from memkv.api.app import create_app
    from memkv.shm.staging import PutStaging

    staging = PutStaging(1 << 20)
    try:
        app = create_app(cluster.router, node_id="a-node-elsewhere", staging=staging,
                         same_node_reads=False)

        async def go() -> tuple[int, dict, dict]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
                sid = new_id()
                r = await c.post("/v1/sessions", json={
                    "session_id": sid, "layout": LAYOUT.to_dict(), "namespace": "t-bad"})
                assert r.status_code in (200, 201), r.text
                keys, values = kv(8, seed=14)
                blocks = split_kv(LAYOUT, keys, values)
                first = await c.post(f"/v1/sessions/{sid}/turns",
                                     content=raw_turn(sid, list(range(7000, 7008)), blocks),
                                     headers=FRAMES)
                assert first.status_code == 200, first.text
                stats = (await c.get("/v1/stats")).json()["gateway"]
                session = (await c.get(f"/v1/sessions/{sid}")).json()
                await c.delete(f"/v1/sessions/{sid}")
                return first.json()["new_blocks"], stats, session

        new_blocks, stats, session = asyncio.run(go())
        assert new_blocks == 2 and session["tokens"] == 8
        assert stats["staged_bytes"] == 0 and stats["staging_bytes"] == 1 << 20
    finally:
        staging.close()


@pytest.mark.parametrize("same_node", [False, True], ids=["in-cluster", "same-node"])
def test_a_read_that_got_its_head_sends_every_block_though_the_session_is_deleted(
    cluster, same_node
):
    """A delete racing a read (before: the stream ended after the 200 head once the
    read's next batch found its blocks gone). The read pins what it announced."""
    import ray

    from memkv.api.app import create_app
    from memkv.protocol.wire import FrameReader

    app = create_app(cluster.router, same_node_reads=same_node,
                     node_id=ray.get_runtime_context().get_node_id())
    keys, values = kv(64, seed=15)  # 16 blocks: four device batches
    blocks = split_kv(LAYOUT, keys, values)

    async def go() -> tuple[dict, bytes, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            sid = new_id()
            r = await c.post("/v1/sessions", json={
                "session_id": sid, "layout": LAYOUT.to_dict(), "namespace": "t-bad"})
            assert r.status_code in (200, 201), r.text
            r = await c.post(f"/v1/sessions/{sid}/turns", headers=FRAMES,
                             content=raw_turn(sid, list(range(8000, 8064)), blocks))
            assert r.status_code == 200, r.text
            head: dict = {}
            body: list[bytes] = []

            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    head.update(message)
                    return
                body.append(bytes(message.get("body", b"")))
                if len(body) == 1:  # the first block is out: delete the session now
                    deleted = await c.delete(f"/v1/sessions/{sid}")
                    assert deleted.status_code in (200, 204), deleted.text

            async def receive() -> dict:
                return {"type": "http.request", "body": b"", "more_body": False}

            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": "GET", "scheme": "http", "path": f"/v1/sessions/{sid}/blocks",
                "raw_path": f"/v1/sessions/{sid}/blocks".encode(), "query_string": b"",
                "root_path": "", "headers": [(b"host", b"gw")],
                "client": ("127.0.0.1", 1), "server": ("gw", 80), "state": {},
            }
            await app(scope, receive, send)
            after = await c.get(f"/v1/sessions/{sid}/blocks")
            return head, b"".join(body), after.status_code

    head, body, after = asyncio.run(go())
    assert head["status"] == 200
    assert int(dict(head["headers"])[b"content-length"]) == len(body)
    frames = list(FrameReader(max_payload_bytes=1 << 20).feed(body))
    assert [f.kind for f in frames] == ["block"] * 16 + ["end"]
    assert [bytes(f.payload) for f in frames[:16]] == [b.numpy().tobytes() for b in blocks]
    assert after == 404  # and the session is gone
