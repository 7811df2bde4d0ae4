"""The HTTP form of the session service's answers: the gateway serves the protocol's
structs, the client decodes into the same structs, keys travel as hex."""

from __future__ import annotations

import json

import msgspec
import pytest

from memkv.protocol import http_form
from memkv.protocol.enums import AckMode, Priority, SessionState, Tier
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import (
    AppendAnswer,
    BlockTier,
    LayoutSpec,
    ResumeAnswer,
    SessionView,
)

LAYOUT = KVLayout("http-form", 2, 2, 8, block_tokens=4)
VIEW = SessionView(session_id="tenant/s", namespace="t", layout=LayoutSpec.of(LAYOUT),
                   priority=Priority.HIGH, device_id="d0", chain=(b"\x01" * 16, b"\xfe" * 16),
                   tokens=8, turn=2, state=SessionState.ACTIVE, ack=AckMode.ARCHIVE,
                   exact_only=False, finite_only=True, archived=False, hotness=0.25)


def test_a_session_view_round_trips_with_hex_keys_and_the_tenants_own_id():
    document = json.loads(http_form.json_bytes(VIEW, session_id="s"))
    assert document["chain"] == ["01" * 16, "fe" * 16]
    assert document["session_id"] == "s" and document["priority"] == "high"
    back = http_form.from_builtins(document, SessionView)
    assert back == msgspec.structs.replace(VIEW, session_id="s")
    assert back.state is SessionState.ACTIVE and back.layout.layout() == LAYOUT


def test_nested_keys_and_answers_round_trip():
    resume = ResumeAnswer(session_id="s", device_id="d", tokens=5,
                          blocks=(BlockTier(b"\xab" * 16, Tier.COLD, 4),
                                  BlockTier(b"\xcd" * 16, Tier.HOT, 1)))
    document = json.loads(http_form.json_bytes(resume))
    assert document["blocks"][0] == {"key": "ab" * 16, "tier": "cold", "tokens": 4}
    assert http_form.from_builtins(document, ResumeAnswer) == resume
    append = AppendAnswer(chain=(b"\x00" * 16,), turn=1, new_blocks=1, deduplicated_blocks=0,
                          released_blocks=0)
    assert http_form.from_builtins(http_form.to_builtins(append), AppendAnswer) == append


def test_a_malformed_answer_names_the_field():
    document = json.loads(http_form.json_bytes(VIEW))
    with pytest.raises(msgspec.ValidationError, match=r"hex block key.*\$\.chain\[1\]"):
        http_form.from_builtins({**document, "chain": ["00", "zz"]}, SessionView)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.turn"):
        http_form.from_builtins({**document, "turn": "two"}, SessionView)


def test_the_schema_comes_from_the_declaration_with_keys_as_hex():
    components = http_form.schema_components((SessionView, ResumeAnswer))
    view = components["SessionView"]
    assert set(view["required"]) >= {"session_id", "chain", "layout", "state"}
    assert view["properties"]["chain"]["items"] == http_form.HEX_KEY_SCHEMA
    assert components["BlockTier"]["properties"]["key"] == http_form.HEX_KEY_SCHEMA
    assert "LayoutSpec" in components and "base64" not in json.dumps(components)
