"""Tenants and tokens at the gateway, tried as users and attackers would: no Ray.

The real router and device classes behind fake handles, a real uvicorn and the
real client; every request goes over 127.0.0.1.
"""

import time

import httpx
import pytest
import torch

from memkv.api.app import create_app
from memkv.api.auth import (
    Authenticator,
    Principal,
    Quota,
    TokenEntry,
    deployment_authenticator,
    hash_token,
)
from memkv.client import Client
from memkv.config import AuthSettings
from memkv.errors import (
    CapacityError,
    ConfigError,
    ForbiddenError,
    InvalidInputError,
    OutOfRangeError,
    UnauthorizedError,
    UnknownBlockError,
    UnknownSessionError,
)
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv
from .fakes import FakeHandle, device_and_router
from .test_gateway_fakes import _Server

LAYOUT = KVLayout("auth-model", 2, 2, 8, block_tokens=4)
UNIT = 4096
PUBLIC = "shared-prompts"

TOKENS = {
    "alice": ("tok-alice", TokenEntry(hash_token("tok-alice"), "acme", frozenset({"write"}))),
    "mallory": (
        "tok-mallory",
        TokenEntry(
            hash_token("tok-mallory"), "evil", frozenset({"write"}), read=frozenset({PUBLIC})
        ),
    ),
    "publisher": (
        "tok-pub",
        TokenEntry(hash_token("tok-pub"), "ops", frozenset({"write"}), publish=frozenset({PUBLIC})),
    ),
    "reader": ("tok-reader", TokenEntry(hash_token("tok-reader"), "acme", frozenset({"read"}))),
    "admin": ("tok-admin", TokenEntry(hash_token("tok-admin"), "ops", frozenset({"admin"}))),
}


@pytest.fixture
def gateway(tmp_path):
    device, router, loop = device_and_router(
        tmp_path / "cold", f"auth-dev-{tmp_path.name[-10:]}", unit=UNIT
    )
    auth = Authenticator(
        [entry for _, entry in TOKENS.values()],
        open_metrics=False,
        owners={PUBLIC: ("ops",)},  # readers that name no publisher believe ops there
        quotas={"evil": Quota(max_sessions=3, max_bytes=3 * LAYOUT.block_nbytes())},
    )
    app = create_app(
        FakeHandle(router),
        max_body_bytes=1 << 20,
        same_node_reads=False,
        put_object=lambda payload: payload,
        auth=auth,
        body_timeout_s=1.0,
        max_json_bytes=64 << 10,
        max_inflight_body_bytes=1_500_000,
    )
    server = _Server(app)
    yield server
    server.stop()
    device.close()
    loop.close()


def client(server, who):
    return Client(server.url, token=TOKENS[who][0] if who else None)


def kv(tokens, seed=0):
    return random_kv(LAYOUT, tokens, seed)


def test_every_route_but_the_probes_needs_a_token(gateway):
    url = gateway.url
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.get(url + "/readyz").status_code == 200
    assert httpx.get(url + "/openapi.json").status_code == 200  # open_docs
    for method, path in [
        ("GET", "/metrics"),  # closed by this deployment's config
        ("GET", "/v1/stats"),
        ("POST", "/v1/sessions"),
        ("GET", "/v1/sessions/x"),
        ("GET", "/v1/sessions/x/blocks"),
        ("POST", "/v1/blocks/read"),
        ("POST", "/v1/match"),
    ]:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic x"}):
            r = httpx.request(method, url + path, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "UnauthorizedError"
    with client(gateway, None) as anonymous, pytest.raises(UnauthorizedError):
        anonymous.create_session("s", LAYOUT)


def test_sessions_are_scoped_by_tenant_and_others_look_missing(gateway):
    keys, values = kv(8)
    with client(gateway, "alice") as alice, client(gateway, "mallory") as mallory:
        created = alice.create_session("chat", LAYOUT)
        assert created.session_id == "chat" and created.namespace == "acme"
        alice.append_turn("chat", list(range(8)), keys, values)
        # Mallory knows the id: every route answers as for a missing session.
        for probe in (
            lambda: mallory.session("chat"),
            lambda: list(mallory.read_blocks("chat")),
            lambda: mallory.suspend("chat"),
            lambda: mallory.delete_session("chat"),
        ):
            with pytest.raises(UnknownSessionError):
                probe()
        # Creating the same id is no existence oracle: it is Mallory's own session.
        assert mallory.create_session("chat", LAYOUT).namespace == "evil"
        assert mallory.session("chat").tokens == 0
        got = [b.array.tobytes() for b in alice.read_blocks("chat")]
        assert got == [b.numpy().tobytes() for b in split_kv(LAYOUT, keys, values)]


def test_namespaces_come_from_the_token_and_poisoning_fails(gateway):
    prompt = list(range(8))
    keys, values = kv(8, seed=1)
    with (
        client(gateway, "alice") as alice,
        client(gateway, "mallory") as mallory,
        client(gateway, "publisher") as publisher,
    ):
        # Mallory may not write under Alice's namespace nor into the public one.
        for namespace in ("acme", PUBLIC):
            with pytest.raises(ForbiddenError):
                mallory.create_session("poison", LAYOUT, namespace=namespace)
        # What she writes under her own namespace never reaches Alice.
        mallory.create_session("poison", LAYOUT)
        garbage = [torch.zeros_like(t) for t in keys]
        mallory.append_turn("poison", prompt, garbage, garbage)
        assert alice.match(LAYOUT, None, prompt).tokens == 0
        with pytest.raises(ForbiddenError):
            alice.match(LAYOUT, "evil", prompt)
        # Alice stores the real prompt; it is not deduplicated against Mallory's.
        alice.create_session("a", LAYOUT)
        assert alice.append_turn("a", prompt, keys, values).deduplicated_blocks == 0
        # Mallory cannot read Alice's blocks by key, even knowing their hashes.
        alice_keys = [
            bytes.fromhex(k) if isinstance(k, str) else k for k in alice.session("a").chain
        ]
        with pytest.raises(UnknownBlockError):
            mallory.read_blocks_by_key(None, alice_keys)
        with pytest.raises(ForbiddenError):
            mallory.read_blocks_by_key("acme", alice_keys)
        # The publisher shares a prompt; a token allowed to read the namespace finds it.
        publisher.create_session("sys", LAYOUT, namespace=PUBLIC)
        publisher.append_turn("sys", prompt, keys, values)
        shared = mallory.match(LAYOUT, PUBLIC, prompt)
        assert shared.tokens == 8
        blocks = mallory.read_blocks_by_key(PUBLIC, shared.blocks + shared.blocks)  # dup collapsed
        assert [b.array.tobytes() for b in blocks] == [
            b.numpy().tobytes() for b in split_kv(LAYOUT, keys, values)
        ]
        with pytest.raises(ForbiddenError):
            alice.match(LAYOUT, PUBLIC, prompt)  # alice's token may not read it


def test_roles_decide_what_a_token_may_do(gateway):
    keys, values = kv(4)
    with (
        client(gateway, "alice") as alice,
        client(gateway, "reader") as reader,
        client(gateway, "admin") as admin,
    ):
        alice.create_session("r", LAYOUT)
        alice.append_turn("r", list(range(4)), keys, values)
        assert len(list(reader.read_blocks("r"))) == 1  # same tenant, read role
        for change in (
            lambda: reader.create_session("r2", LAYOUT),
            lambda: reader.append_turn("r", list(range(8)), *kv(8), turn=2),
            lambda: reader.suspend("r"),
            lambda: reader.delete_session("r"),
        ):
            with pytest.raises(ForbiddenError):
                change()
        with pytest.raises(ForbiddenError):
            alice.stats()
        assert admin.stats()["sessions"] == 1
        r = httpx.get(gateway.url + "/metrics", headers={"authorization": "Bearer tok-admin"})
        assert r.status_code == 200 and "memkv_http_requests" in r.text


def test_token_documents_are_checked_and_dev_tokens_are_private(tmp_path):
    ok = Authenticator.from_document(
        '{"tokens": [{"sha256": "%s", "tenant": "t1", "roles": ["read"]}]}' % hash_token("x"),
        "doc",
    )
    assert ok.authenticate("Bearer x") == Principal("t1", frozenset({"read"}))
    quotas = Authenticator.from_document(
        '{"tokens": [{"sha256": "%s", "tenant": "t1"}], "tenants": {"t1": {"max_sessions": 5}}}'
        % hash_token("q"),
        "doc",
    )
    assert quotas.authenticate("Bearer q").quota == (5, None)
    for bad, message in [
        ("tokens: []\ntenants: {t1: {max_sessions: -1}}", ">= 0"),
        ("tokens: []\ntenants: {t1: {sessions: 1}}", "max_sessions and max_bytes"),
        ("tokens: []\nextra: 1", "unknown keys"),
        ("tokens: 3", "'tokens' list"),
        ("tokens: [{sha256: abc, tenant: t}]", "64-hex-digit"),
        ('tokens: [{sha256: "%s", tenant: "a/b"}]' % ("0" * 64), "tenant"),
        ('tokens: [{sha256: "%s", tenant: t, roles: [root]}]' % ("0" * 64), "roles"),
        ('tokens: [{sha256: "%s", tenant: t, extra: 1}]' % ("0" * 64), "unknown keys"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Authenticator.from_document(bad, "doc")
    with pytest.raises(ConfigError, match="no tokens are configured"):
        Authenticator.load(None, environ={})
    env = {"MEMKV_TOKENS": '{"tokens": [{"sha256": "%s", "tenant": "e"}]}' % hash_token("y")}
    assert Authenticator.load(None, environ=env).authenticate("Bearer y").tenant == "e"
    auth, path = deployment_authenticator(AuthSettings(), tmp_path, environ={})
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    token = path.read_text().strip()
    assert auth.authenticate(f"Bearer {token}").roles == {"write", "admin"}
    again, _ = deployment_authenticator(AuthSettings(), tmp_path, environ={})
    assert again.authenticate(f"Bearer {token}").tenant == "default"  # reused, not replaced
    off, none = deployment_authenticator(AuthSettings(enabled=False), tmp_path, environ={})
    assert none is None and off.authenticate(None) == Principal.trusted()


def test_layouts_are_strict_and_bounded_and_leave_nothing_behind(gateway):
    good = LAYOUT.to_dict()
    headers = {"authorization": "Bearer tok-alice"}
    for field, value in [
        ("num_layers", "4"),  # a string is not an int
        ("num_layers", 2**70),
        ("head_dim", 0),
        ("block_tokens", 10**9),
        ("dtype", "int4"),
        ("model_id", ""),
    ]:
        body = {"session_id": "bad", "layout": {**good, field: value}}
        r = httpx.post(gateway.url + "/v1/sessions", json=body, headers=headers)
        assert r.status_code == 422, (field, value, r.text)
        assert r.json()["error"]["type"] == "InvalidInputError"
    # Each size within bounds, but the block would be 2 TiB: refused by KVLayout.
    huge = {**good, "num_layers": 1024, "num_kv_heads": 1024, "head_dim": 4096}
    r = httpx.post(
        gateway.url + "/v1/sessions", json={"session_id": "bad", "layout": huge}, headers=headers
    )
    assert r.status_code == 422 and "bytes" in r.json()["error"]["message"]
    with client(gateway, "alice") as alice, pytest.raises(UnknownSessionError):
        alice.session("bad")


def _raw_post(url, path, head: bytes, body: bytes, *, timeout=10.0) -> bytes:
    """Send a request by hand (a client that lies or stalls); return the answer's bytes."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head_part, _, rest = answer.partition(b"\r\n\r\n")
        length = int(head_part.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += sock.recv(65536)
        return head_part + b"\r\n\r\n" + rest


def test_lying_frame_headers_and_stalled_bodies_are_refused(gateway):
    from memkv.protocol.wire import encode_frame

    with client(gateway, "alice") as alice:
        alice.create_session("lie", LAYOUT)
    turn = encode_frame({"kind": "turn", "tokens": [1, 2, 3, 4]})
    # A block frame whose header declares 1 GiB of payload, in a 300-byte body.
    lie = encode_frame({"kind": "block", "key": b"k" * 16, "dtype": "float16", "nbytes": 1 << 30})
    body = b"".join(bytes(c) for c in (*turn, *lie))[:300]
    head = (
        f"POST /v1/sessions/lie/turns HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer tok-alice\r\nContent-Type: application/x-memkv-frames\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    answer = _raw_post(gateway.url, "/v1/sessions/lie/turns", head, body)
    assert answer.startswith(b"HTTP/1.1 422") and b"exceeds" in answer
    # A body that promises 1 MiB and stops after 10 bytes: 408 once it stalls.
    # While it stalls, the gateway holds its 1 MB against the bodies it takes at
    # once (1.5 MB here): a second such upload waits its turn (503, Retry-After).
    import socket
    import threading

    stalled = head.replace(f"Content-Length: {len(body)}".encode(), b"Content-Length: 1000000")
    answers = []
    first = threading.Thread(
        target=lambda: answers.append(_raw_post(gateway.url, "", stalled, body[:10]))
    )
    first.start()
    time.sleep(0.2)  # the first upload is being received
    host, port = gateway.url.removeprefix("http://").split(":")
    second = stalled  # another 1 MB
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(second)
        busy = sock.recv(65536)
    assert busy.startswith(b"HTTP/1.1 503") and b"retry-after" in busy.lower()
    first.join(timeout=10)
    assert answers and answers[0].startswith(b"HTTP/1.1 408") and b"stalled" in answers[0]
    # A block whose shape's product overflows int64 is a 422, never a 500.
    huge = encode_frame(
        {
            "kind": "block",
            "index": 0,
            "key": b"k" * 16,
            "dtype": "float16",
            "shape": [2**32, 2**32, 1, 1, 1],
            "crc32": 0,
        }
    )
    body = b"".join(bytes(c) for c in (*turn, *huge))
    head = head.split(b"Content-Length:")[0] + f"Content-Length: {len(body)}\r\n\r\n".encode()
    answer = _raw_post(gateway.url, "", head, body)
    assert answer.startswith(b"HTTP/1.1 422") and b"shape" in answer
    with client(gateway, "alice") as alice:
        assert alice.session("lie").turn == 0  # nothing was stored


def test_tenant_quotas_refuse_with_507_and_store_nothing(gateway):
    with client(gateway, "mallory") as mallory, client(gateway, "alice") as alice:
        for i in range(3):
            mallory.create_session(f"q{i}", LAYOUT)
        with pytest.raises(CapacityError, match="quota is 3"):
            mallory.create_session("q3", LAYOUT)
        alice.create_session("q3", LAYOUT)  # another tenant's quota is its own
        keys, values = kv(8, seed=4)  # two blocks
        mallory.append_turn("q0", list(range(8)), keys, values)
        with pytest.raises(CapacityError, match="quota"):
            mallory.append_turn("q1", list(range(100, 108)), keys, values)  # 4 > 3 blocks
        assert mallory.session("q1").turn == 0
        r = httpx.post(
            gateway.url + "/v1/sessions",
            json={"session_id": "q9", "layout": LAYOUT.to_dict()},
            headers={"authorization": "Bearer tok-mallory"},
        )
        assert r.status_code == 507 and r.json()["error"]["type"] == "CapacityError"
        mallory.delete_session("q0")  # frees both its sessions and its bytes
        mallory.append_turn("q1", list(range(100, 108)), keys, values)
        mallory.create_session("q4", LAYOUT)


def test_json_bodies_are_capped(gateway):
    headers = {"authorization": "Bearer tok-alice"}
    big = {"layout": LAYOUT.to_dict(), "token_ids": list(range(40_000))}  # ~250 KB of JSON
    r = httpx.post(gateway.url + "/v1/match", json=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["type"] == "PayloadTooLarge"
    chunks = (b"x" * 1024 for _ in range(100))  # no Content-Length: cut off as it streams
    r = httpx.post(gateway.url + "/v1/match", content=chunks, headers=headers)
    assert r.status_code == 413


def test_open_metrics_name_no_tenant_and_a_metrics_token_sees_them(tmp_path):
    """Item 9 of [1/5]: the open /metrics named every tenant with its sessions and bytes."""
    device, router, loop = device_and_router(tmp_path / "cold", "auth-dev-metrics", unit=UNIT)
    scraper = TokenEntry(hash_token("tok-scrape"), "ops", frozenset({"metrics"}))
    auth = Authenticator([*(entry for _, entry in TOKENS.values()), scraper], open_metrics=True)
    server = _Server(create_app(FakeHandle(router), same_node_reads=False,
                                put_object=lambda payload: payload, auth=auth))
    try:
        with client(server, "alice") as alice:
            alice.create_session("s", LAYOUT)
            alice.append_turn("s", list(range(8)), *kv(8))
        for token in (None, "tok-alice", "nope"):  # open, a tenant's own, an invalid one
            headers = {"authorization": f"Bearer {token}"} if token else {}
            r = httpx.get(server.url + "/metrics", headers=headers)
            assert r.status_code == 200, token
            assert "memkv_sessions" in r.text
            assert "memkv_tenant" not in r.text and "acme" not in r.text, token
        for token in ("tok-scrape", "tok-admin"):
            r = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {token}"})
            assert 'memkv_tenant_sessions{tenant="acme"} 1.0' in r.text, token
        with Client(server.url, token="tok-scrape") as scrape, pytest.raises(ForbiddenError):
            scrape.create_session("x", LAYOUT)  # a metrics token does nothing else
    finally:
        server.stop()
        device.close()
        loop.close()


def test_strict_types_and_roles_of_item_10(gateway):
    """Item 10 of [1/5]: ``exact_only: "yes"`` was taken as true, a frame's
    ``nbytes: true`` as 1, and a read-only token could trigger prefetches."""
    from memkv.protocol.wire import FrameReader, WireError, encode_frame

    headers = {"authorization": "Bearer tok-alice"}
    body = {"session_id": "strict", "layout": LAYOUT.to_dict()}
    for bad in ("yes", 1, "true"):
        r = httpx.post(gateway.url + "/v1/sessions", json={**body, "exact_only": bad},
                       headers=headers)
        assert r.status_code == 422 and "exact_only" in r.text, (bad, r.text)
    assert httpx.post(gateway.url + "/v1/sessions", json={**body, "exact_only": True},
                      headers=headers).status_code == 201
    frame = b"".join(bytes(c) for c in encode_frame({"kind": "block", "nbytes": True}))
    with pytest.raises(WireError, match="nbytes"):
        list(FrameReader(max_payload_bytes=1 << 20).feed(frame))
    with client(gateway, "alice") as alice:
        alice.append_turn("strict", list(range(4)), *kv(4))
    r = httpx.post(gateway.url + "/v1/sessions/strict/input-end",
                   headers={"authorization": "Bearer tok-reader"})
    assert r.status_code == 403, r.text
    r = httpx.post(gateway.url + "/v1/sessions/strict/input-end", headers=headers)
    assert r.status_code == 200, r.text


def test_non_finite_kv_is_stored_as_sent_unless_the_session_refuses_it(gateway):
    """Item 10 of [1/5]: NaN and inf are a decision, not an accident. By default a
    block is stored as sent, bit for bit; a session created ``finite_only`` refuses
    it (422, naming the block) and keeps what it had."""
    keys, values = kv(8)
    keys[0][0, 1, 2] = float("nan")
    values[1][1, 5, 3] = float("inf")
    with client(gateway, "alice") as alice:
        alice.create_session("as-sent", LAYOUT)
        alice.append_turn("as-sent", list(range(8)), keys, values)
        got = [b.tensor for b in alice.read_blocks("as-sent")]
        want = split_kv(LAYOUT, keys, values)
        assert [g.numpy().tobytes() for g in got] == [w.numpy().tobytes() for w in want]
        assert int(torch.isnan(got[0]).sum()) == 1 and int(torch.isinf(got[1]).sum()) == 1

        strict = alice.create_session("finite", LAYOUT, finite_only=True)
        assert strict.finite_only
        clean_keys, clean_values = kv(4, seed=2)
        alice.append_turn("finite", list(range(4)), clean_keys, clean_values)
        with pytest.raises(InvalidInputError, match=r"block 1 holds 1 NaN or infinite"):
            alice.append_turn("finite", list(range(8)), keys, values, turn=2)
        assert alice.session("finite").tokens == 4  # what it had, untouched
        assert len(list(alice.read_blocks("finite"))) == 1


def test_a_turn_of_no_tokens_is_refused_and_changes_nothing(gateway):
    """Item 10 of [1/5]: an append of 0 tokens dropped the session's whole chain."""
    with client(gateway, "alice") as alice:
        alice.create_session("zero", LAYOUT)
        alice.append_turn("zero", list(range(8)), *kv(8))
        empty = [torch.zeros(2, 0, 8, dtype=torch.float16)] * 2
        with pytest.raises(InvalidInputError, match="at least one token"):
            alice.append_turn("zero", [], empty, empty, turn=2)
        assert alice.session("zero").tokens == 8
        assert len(list(alice.read_blocks("zero"))) == 2


def test_a_session_without_blocks_conflicts_rather_than_being_invalid(gateway):
    """schemathesis: a valid suspend/resume/input-end of an empty session answered 422
    (invalid input); the request is fine, the session's state is not: 409."""
    from memkv.errors import ConflictError

    with client(gateway, "alice") as alice:
        alice.create_session("empty", LAYOUT)
        for call in (alice.suspend, alice.resume):
            with pytest.raises(ConflictError, match="no blocks yet"):
                call("empty")
    r = httpx.post(gateway.url + "/v1/sessions/empty/input-end",
                   headers={"authorization": "Bearer tok-alice"})
    assert r.status_code == 409, r.text


def test_partitions_of_a_tenants_namespace_hash_apart_and_are_its_own(gateway):
    """[2/6] item 6: ``#<partition>`` is a part of the caller's own namespace whose blocks
    are hashed apart (an engine shared by tenants keeps each one's KV in its own: its
    connector uses vLLM's cache_salt); nobody can name another tenant's partition."""
    prompt = list(range(100, 108))
    keys, values = kv(8, seed=5)
    with client(gateway, "alice") as alice, client(gateway, "mallory") as mallory:
        alice.create_session("in-p1", LAYOUT, namespace="#p1")
        alice.append_turn("in-p1", prompt, keys, values)
        assert alice.match(LAYOUT, "#p1", prompt).tokens == 8
        assert alice.match(LAYOUT, None, prompt).tokens == 0  # apart from her other blocks
        assert alice.match(LAYOUT, "#p2", prompt).tokens == 0
        found = alice.match(LAYOUT, "#p1", prompt)
        assert len(alice.read_blocks_by_key("#p1", found.blocks)) == 2
        with pytest.raises(UnknownBlockError):
            alice.read_blocks_by_key(None, found.blocks)
        # Mallory's "#p1" is hers: Alice's blocks are not in it.
        assert mallory.match(LAYOUT, "#p1", prompt).tokens == 0
        with pytest.raises(UnknownBlockError):
            mallory.read_blocks_by_key("#p1", found.blocks)
        with pytest.raises(InvalidInputError):  # a full name with a partition: refused
            mallory.match(LAYOUT, "acme#p1", prompt)


def test_forks_and_rewinds_are_a_tenants_own(gateway):
    keys, values = kv(10)
    blocks = split_kv(LAYOUT, keys, values)
    with client(gateway, "alice") as alice, client(gateway, "mallory") as mallory:
        alice.create_session("trunk", LAYOUT)
        alice.append_turn("trunk", list(range(10)), keys, values)
        branch = alice.fork_session("trunk", "branch", at_tokens=6, token_ids=list(range(10)))
        assert (branch.session_id, branch.namespace, branch.tokens) == ("branch", "acme", 6)
        got = [b.array.tobytes() for b in alice.read_blocks("branch")]
        first6 = split_kv(LAYOUT, [k[:, :6] for k in keys], [v[:, :6] for v in values])
        assert got == [b.numpy().tobytes() for b in first6]
        # Another tenant's fork or rewind of it is a 404, and makes nothing.
        with pytest.raises(UnknownSessionError):
            mallory.fork_session("trunk", "stolen")
        with pytest.raises(UnknownSessionError):
            mallory.rewind_session("trunk", 1)
        with pytest.raises(UnknownSessionError):
            mallory.session("stolen")
        # Out of range, or a cut without its block's own tokens: refused, nothing changed.
        with pytest.raises(InvalidInputError, match="not the tokens of block 1"):
            alice.fork_session("trunk", "lying", at_tokens=6, token_ids=list(range(20, 30)))
        with pytest.raises(OutOfRangeError, match="between 1 and the session's 10"):
            alice.fork_session("trunk", "too-far", at_tokens=11)
        for bad in (0, -3):
            with pytest.raises(OutOfRangeError):
                alice.rewind_session("trunk", bad)
        with httpx.Client(base_url=gateway.url, headers={
                "Authorization": f"Bearer {TOKENS['alice'][0]}"}) as http:
            for path, body in (("fork", {"new_id": "x", "at_tokens": 11}),
                               ("fork", {"new_id": "x", "at_tokens": 0}),
                               ("rewind", {"tokens": -1}), ("rewind", {"tokens": 11})):
                answer = http.post(f"/v1/sessions/trunk/{path}", json=body)
                assert answer.status_code == 400, (path, body, answer.text)
                assert answer.json()["error"]["type"] == "OutOfRangeError"
        assert alice.rewind_session("trunk", 4).tokens == 4
        got = [b.array.tobytes() for b in alice.read_blocks("trunk")]
        assert got == [blocks[0].numpy().tobytes()]
        assert len(list(alice.read_blocks("branch"))) == 2  # its blocks stayed
