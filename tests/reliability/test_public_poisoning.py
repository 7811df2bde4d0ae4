"""Poisoning inside a public namespace: two publishers, one writing zeros for a
prompt before the other writes its real KV (before: the first writer won, and the
second publisher and every reader got zeros). And ([2/6] item 5) a reader that
names no publisher believes only the namespace's declared owners: before, it
believed every publisher, the first listed first, and got the poisoner's zeros."""

import json

import pytest
import torch

from memkv.api.app import create_app
from memkv.api.auth import Authenticator, TokenEntry, hash_token
from memkv.client import Client
from memkv.errors import ConfigError, UnknownBlockError
from memkv.storage.layout import KVLayout, split_kv

from ..api.fakes import FakeHandle, device_and_router
from ..api.test_gateway_fakes import _Server
from ..kvdata import random_kv

LAYOUT = KVLayout("poison-model", 2, 2, 8, block_tokens=4)
PUBLIC = "shared-prompts"
PROMPT = list(range(500, 508))  # two blocks

TOKENS = {
    "poisoner": TokenEntry(hash_token("tok-p1"), "ops1", frozenset({"write"}),
                           publish=frozenset({PUBLIC})),
    "honest": TokenEntry(hash_token("tok-p2"), "ops2", frozenset({"write"}),
                         publish=frozenset({PUBLIC})),
    # Trusts only the honest publisher's blocks.
    "careful": TokenEntry(hash_token("tok-careful"), "acme", frozenset({"read"}),
                          read=frozenset({PUBLIC}), trust={PUBLIC: ("ops2",)}),
    # Names no publisher: believes the namespace's declared owners (OWNERS) only.
    "trusting": TokenEntry(hash_token("tok-trusting"), "beta", frozenset({"read"}),
                           read=frozenset({PUBLIC})),
}
#: The namespace's declared owners (the token document's `namespaces`).
OWNERS = {PUBLIC: ("ops2",)}
SECRETS = {"poisoner": "tok-p1", "honest": "tok-p2", "careful": "tok-careful",
           "trusting": "tok-trusting"}


@pytest.fixture
def gateway(tmp_path):
    device, router, loop = device_and_router(tmp_path / "cold", "poison-dev", unit=4096)
    app = create_app(
        FakeHandle(router), max_body_bytes=1 << 20, same_node_reads=False,
        put_object=lambda payload: payload,
        auth=Authenticator(list(TOKENS.values()), owners=OWNERS),
    )
    server = _Server(app)
    yield server
    server.stop()
    device.close()
    loop.close()


def _bytes(blocks):
    return [b.array.tobytes() for b in blocks]


def test_a_second_publisher_keeps_its_own_bytes_and_readers_get_whom_they_trust(gateway):
    keys, values = random_kv(LAYOUT, 8, 3)
    real = [b.numpy().tobytes() for b in split_kv(LAYOUT, keys, values)]
    zeros = [torch.zeros_like(t) for t in keys]
    clients = {name: Client(gateway.url, token=SECRETS[name]) for name in TOKENS}
    try:
        poisoner, honest = clients["poisoner"], clients["honest"]
        poisoner.create_session("p", LAYOUT, namespace=PUBLIC)
        poisoner.append_turn("p", PROMPT, zeros, zeros)
        honest.create_session("h", LAYOUT, namespace=PUBLIC)
        stored = honest.append_turn("h", PROMPT, keys, values)
        assert stored.deduplicated_blocks == 0  # never folded into the first writer's
        assert _bytes(honest.read_blocks("h")) == real

        careful = clients["careful"].match(LAYOUT, PUBLIC, PROMPT)
        assert (careful.tokens, careful.publisher) == (8, "ops2")
        assert _bytes(clients["careful"].read_blocks_by_key(PUBLIC, careful.blocks)) == real
        # A reader that names no publisher gets the declared owner's blocks, never the
        # poisoner's (allowed to publish, but nobody declared it).
        default = clients["trusting"].match(LAYOUT, PUBLIC, PROMPT)
        assert (default.tokens, default.publisher) == (8, "ops2")
        assert _bytes(clients["trusting"].read_blocks_by_key(PUBLIC, default.blocks)) == real
        # The poisoner's blocks are no reader's, even by key.
        poisoned = clients["poisoner"].match(LAYOUT, PUBLIC, PROMPT)
        assert poisoned.publisher == "ops1"
        for reader in ("careful", "trusting"):
            with pytest.raises(UnknownBlockError):
                clients[reader].read_blocks_by_key(PUBLIC, poisoned.blocks)
        # Each publisher reads its own first.
        assert clients["honest"].match(LAYOUT, PUBLIC, PROMPT).publisher == "ops2"
        assert clients["poisoner"].match(LAYOUT, PUBLIC, PROMPT).publisher == "ops1"
    finally:
        for c in clients.values():
            c.close()


def test_identical_bytes_from_two_publishers_are_kept_by_each(gateway):
    keys, values = random_kv(LAYOUT, 8, 4)
    with Client(gateway.url, token="tok-p1") as one, Client(gateway.url, token="tok-p2") as two:
        one.create_session("a", LAYOUT, namespace=PUBLIC)
        one.append_turn("a", PROMPT, keys, values)
        two.create_session("b", LAYOUT, namespace=PUBLIC)
        two.append_turn("b", PROMPT, keys, values)
        one.delete_session("a")  # the other publisher's copy stays
        assert _bytes(two.read_blocks("b")) == [
            b.numpy().tobytes() for b in split_kv(LAYOUT, keys, values)
        ]


def test_trust_is_checked_in_the_token_document():
    base = {"sha256": "a" * 64, "tenant": "acme", "read": [PUBLIC]}
    entry = TokenEntry.parse({**base, "trust": {PUBLIC: ["ops2", "ops2"]}}, "tokens[0]")
    assert entry.trust == {PUBLIC: ("ops2",)}
    with pytest.raises(ConfigError, match="may not read"):
        TokenEntry.parse({**base, "trust": {"other": ["ops2"]}}, "tokens[0]")
    with pytest.raises(ConfigError, match="list of tenants"):
        TokenEntry.parse({**base, "trust": {PUBLIC: "ops2"}}, "tokens[0]")
    with pytest.raises(ConfigError, match="trusted tenant"):
        TokenEntry.parse({**base, "trust": {PUBLIC: ["no/slash"]}}, "tokens[0]")


def test_without_declared_owners_a_reader_believes_only_the_publishers_it_names(tmp_path):
    device, router, loop = device_and_router(tmp_path / "cold", "poison-dev-2", unit=4096)
    app = create_app(
        FakeHandle(router), max_body_bytes=1 << 20, same_node_reads=False,
        put_object=lambda payload: payload, auth=Authenticator(list(TOKENS.values())),
    )
    server = _Server(app)
    keys, values = random_kv(LAYOUT, 8, 5)
    try:
        with Client(server.url, token="tok-p1") as rogue, \
                Client(server.url, token="tok-trusting") as reader, \
                Client(server.url, token="tok-careful") as careful:
            rogue.create_session("p", LAYOUT, namespace=PUBLIC)
            rogue.append_turn("p", PROMPT, keys, values)
            assert reader.match(LAYOUT, PUBLIC, PROMPT).tokens == 0
            assert careful.match(LAYOUT, PUBLIC, PROMPT).tokens == 0  # it names ops2 only
    finally:
        server.stop()
        device.close()
        loop.close()


def test_declared_owners_are_checked_in_the_token_document():
    token = {"sha256": "b" * 64, "tenant": "ops2", "publish": [PUBLIC]}
    doc = {"tokens": [token], "namespaces": {PUBLIC: {"owners": ["ops2"]}}}
    assert Authenticator.from_document(json.dumps(doc), "t").owners == {PUBLIC: ("ops2",)}
    with pytest.raises(ConfigError, match="no token that may publish"):
        Authenticator.from_document(json.dumps(
            {**doc, "namespaces": {PUBLIC: {"owners": ["ops9"]}}}), "t")
    with pytest.raises(ConfigError, match="owners"):
        Authenticator.from_document(json.dumps({**doc, "namespaces": {PUBLIC: ["ops2"]}}), "t")
