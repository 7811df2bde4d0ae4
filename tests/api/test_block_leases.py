"""``/v1/blocks/lease``: a client on the gateway's host copies blocks out of shared memory.

Against the session's real cluster (same-node reads on) and gateway, and a
second gateway with tokens for the tenant checks.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from memkv.api.auth import Authenticator, TokenEntry, hash_token
from memkv.client import Client
from memkv.errors import ForbiddenError, UnknownBlockError
from memkv.protocol.checksum import crc32
from memkv.shm.same_node import SegmentMaps, copy_entries, shm_identity
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv

LAYOUT = KVLayout("lease-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)


def _stored(client: Client, namespace: str, tokens: int, seed: int):
    sid = f"lease-{uuid.uuid4().hex[:8]}"
    client.create_session(sid, LAYOUT, namespace=namespace)
    keys, values = random_kv(LAYOUT, tokens, seed)
    client.append_turn(sid, list(range(seed, seed + tokens)), keys, values)
    match = client.match(LAYOUT, namespace, list(range(seed, seed + tokens)))
    return sid, match.blocks, split_kv(LAYOUT, keys, values)


def test_a_client_on_the_host_copies_leased_blocks_and_gives_the_leases_back(gateway):
    with Client(gateway.url) as c:
        _, keys, expected = _stored(c, "t-lease", 12, seed=3)
        lease = c.lease_blocks("t-lease", keys, ttl_s=10)
        assert lease.local and lease.host == shm_identity()
        assert all(b is not None for b in lease.blocks)
        maps = SegmentMaps()
        for (plan, entry), want in zip(lease.blocks, expected, strict=True):
            (copy,) = copy_entries(maps, plan, [entry])
            assert crc32(copy) == entry.crc32
            assert copy.tobytes() == want.numpy().tobytes()
        live = c.stats()["gateway"]["client_leases"]
        assert live["live"] >= 1 and live["pinned_bytes"] >= sum(e.nbytes for _, e in lease.blocks)
        for plan in lease.plans:
            c.release_lease(plan.lease_id)
            with pytest.raises(UnknownBlockError):
                c.release_lease(plan.lease_id)  # once only
        maps.close()


def test_keys_not_stored_answer_404_and_pin_nothing(gateway):
    with Client(gateway.url) as c:
        before = c.stats()["gateway"]["client_leases"]["pinned_bytes"]
        with pytest.raises(UnknownBlockError):
            c.lease_blocks("t-lease", [b"\x01" * 16])
        assert c.stats()["gateway"]["client_leases"]["pinned_bytes"] == before


def test_bad_requests_name_what_was_expected(gateway):
    for body, needle in [
        ({"keys": ["zz"]}, "keys"),
        ({"keys": ["00" * 16], "ttl_s": 0}, "ttl_s"),
        ({"keys": ["00" * 16], "ttl_s": 3600}, "ttl_s"),
    ]:
        r = httpx.post(gateway.url + "/v1/blocks/lease", json=body)
        assert r.status_code == 422, body
        assert needle in r.text


def test_over_the_lease_bound_blocks_are_answered_unplanned(cluster):
    from memkv.api.server import GatewayServer

    with GatewayServer.start(cluster, host="127.0.0.1", port=0) as gw:
        with Client(gw.url) as c:
            _, keys, expected = _stored(c, "t-bound", 8, seed=5)
            # With no room left none is leased; read over HTTP they are all there.
            gw._app.state.client_leases.max_bytes = 0
            lease = c.lease_blocks("t-bound", keys)
            assert lease.plans == () and lease.blocks == (None, None)
            assert c.stats()["gateway"]["client_leases"]["refused_over_budget"] >= 1
            got = c.read_blocks_by_key("t-bound", keys)
            assert [b.array.tobytes() for b in got] == [e.numpy().tobytes() for e in expected]


TOKENS = {
    "alice": ("tok-alice", TokenEntry(hash_token("tok-alice"), "acme", frozenset({"write"}))),
    "mallory": ("tok-mallory", TokenEntry(hash_token("tok-mallory"), "evil",
                                          frozenset({"write"}))),
}


def test_leases_follow_the_token_tenant_and_cannot_be_released_by_another(cluster):
    from memkv.api.server import GatewayServer

    auth = Authenticator([e for _, e in TOKENS.values()], open_metrics=False)
    with GatewayServer.start(cluster, host="127.0.0.1", port=0, auth=auth) as gw:
        with Client(gw.url, token="tok-alice") as alice, \
                Client(gw.url, token="tok-mallory") as mallory:
            _, keys, _ = _stored(alice, None, 8, seed=11)
            with pytest.raises(UnknownBlockError):
                mallory.lease_blocks(None, keys)  # her tenant has no such blocks
            with pytest.raises(ForbiddenError):
                mallory.lease_blocks("acme", keys)
            lease = alice.lease_blocks(None, keys)
            assert all(b is not None for b in lease.blocks)
            (plan,) = lease.plans
            with pytest.raises(UnknownBlockError):
                mallory.release_lease(plan.lease_id)  # another tenant's: as if missing
            # Through another gateway (a worker that did not grant it) the device
            # itself checks the tenant: refused for mallory, done for alice.
            with GatewayServer.start(cluster, host="127.0.0.1", port=0, auth=auth) as gw2:
                with Client(gw2.url, token="tok-mallory") as mallory2, \
                        Client(gw2.url, token="tok-alice") as alice2:
                    with pytest.raises(UnknownBlockError):
                        mallory2.release_lease(plan.lease_id)
                    alice2.release_lease(plan.lease_id)
            with pytest.raises(UnknownBlockError):
                alice.release_lease(plan.lease_id)  # given back already
        r = httpx.post(gw.url + "/v1/blocks/lease", json={"keys": [k.hex() for k in keys]})
        assert r.status_code == 401


def test_an_answer_from_another_host_is_not_local():
    from memkv.shm.same_node import HostLease

    doc = {"host": "some-other-boot/12", "leases": [], "blocks": [None]}
    lease = HostLease.from_json(doc)
    assert not lease.local and lease.blocks == (None,)
