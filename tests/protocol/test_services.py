"""The session service's messages: what crosses between a gateway and a router shard."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from memkv.actors.handles import SessionServiceHandle
from memkv.errors import InvalidInputError
from memkv.protocol.enums import AckMode, Priority, SessionState, Tier, parse_ack
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    BlockTier,
    CreateSession,
    LayoutSpec,
    Quota,
    ResumeAnswer,
    SessionView,
    decode,
    encode,
)

from ..api.fakes import FakeHandle

LAYOUT = KVLayout("services-model", 2, 2, 8, block_tokens=4)


def test_a_create_travels_as_one_document_and_comes_back_equal():
    request = CreateSession(session_id="s", layout=LayoutSpec.of(LAYOUT), namespace="t",
                            priority=Priority.HIGH, ack=AckMode.ARCHIVE,
                            quota=Quota(max_bytes=1 << 20), exact_only=True)
    document = encode(request)
    assert isinstance(document, bytes)
    assert decode(CreateSession, document) == request
    assert decode(CreateSession, document).layout.layout() == LAYOUT


def test_a_wrong_field_is_named_in_the_error():
    document = msgspec.msgpack.encode({"session_id": "s", "layout": msgspec.structs.asdict(
        LayoutSpec.of(LAYOUT)), "priority": "urgent"})
    with pytest.raises(InvalidInputError, match=r"CreateSession.*\$\.priority"):
        decode(CreateSession, document)
    with pytest.raises(InvalidInputError, match="missing required field `layout`"):
        decode(CreateSession, msgspec.msgpack.encode({"session_id": "s"}))


def test_a_field_an_older_peer_does_not_know_is_skipped():
    document = msgspec.msgpack.encode({"session_id": "s", "token_ids": b"", "added_later": 1})
    assert decode(AppendTurn, document).session_id == "s"


def test_token_ids_travel_as_int64_and_a_torn_buffer_is_refused():
    tokens = [0, 1, 2**40]
    turn = AppendTurn(session_id="s", token_ids=AppendTurn.pack_tokens(tokens))
    assert decode(AppendTurn, encode(turn)).tokens().tolist() == tokens
    with pytest.raises(InvalidInputError, match="multiple of 8"):
        AppendTurn(session_id="s", token_ids=b"\x00" * 7).tokens()


def test_a_session_view_travels_whole():
    view = SessionView(session_id="s", namespace="t", layout=LayoutSpec.of(LAYOUT),
                       priority=Priority.NORMAL, device_id=None, chain=(b"\x01" * 16,), tokens=4,
                       turn=1, state=SessionState.LOST, ack=AckMode.MEMORY, exact_only=False,
                       finite_only=False, archived=False, hotness=0.5, lost_reason="gone")
    back = decode(SessionView, encode(view))
    assert back == view and back.state is SessionState.LOST and back.layout.layout() == LAYOUT


def test_block_tiers_are_typed():
    answer = ResumeAnswer(session_id="s", device_id="d", tokens=4,
                          blocks=(BlockTier(b"\x02" * 16, Tier.WARM, 4),))
    back = decode(ResumeAnswer, encode(answer))
    assert back.blocks[0].tier is Tier.WARM and back == answer


def test_parse_ack_names_the_choices():
    assert parse_ack(None) is None and parse_ack("archive") is AckMode.ARCHIVE
    with pytest.raises(InvalidInputError, match=r"\['memory', 'archive'\]"):
        parse_ack("disk")


class _Service:
    """Answers as a router shell does: documents in, documents out."""

    def __init__(self) -> None:
        self.seen: list[AppendTurn] = []

    async def put_blocks_wire(self, request: bytes, blocks: list) -> bytes:
        turn = decode(AppendTurn, request)
        self.seen.append(turn)
        return encode(AppendAnswer(chain=turn.chain or (), turn=1, new_blocks=len(blocks),
                                   deduplicated_blocks=0, released_blocks=0))


def test_the_handle_sends_typed_messages_and_answers_typed_ones():
    service = _Service()
    handle = SessionServiceHandle(FakeHandle(service))
    turn = AppendTurn(session_id="s", token_ids=AppendTurn.pack_tokens(np.arange(4)),
                      chain=(b"\x03" * 16,))

    async def call() -> AppendAnswer:
        return await handle.put_blocks(turn, ["block"])

    answer = asyncio.run(call())
    assert isinstance(answer, AppendAnswer) and answer.new_blocks == 1
    assert answer.chain == (b"\x03" * 16,) and service.seen == [turn]
