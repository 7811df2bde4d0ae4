"""Stored responses on a router shard (memkv.router.responses): kept with their session,
journaled, rebuilt by a restarted router, folded into snapshots, gone with the session."""

import asyncio

import pytest

from memkv.errors import InvalidInputError
from memkv.protocol.responses import (
    StoredResponse,
    UnknownResponseError,
    new_response_id,
    session_of_response,
)
from memkv.router.responses import Responses
from memkv.router.state import RouterState
from memkv.storage.journal import Journal

from .test_router_state import LAYOUT, Clock


async def _no_commit(needed: bool) -> None:
    return None


def _responses(tmp_path):
    state = RouterState(clock=Clock(), journal=Journal(tmp_path / "router"))
    return state, Responses(state, _no_commit)


def test_a_response_id_names_its_session_and_nothing_else_parses():
    rid = new_response_id("agent-1")
    assert session_of_response(rid) == "agent-1"
    for bad in ("resp_x_agent-1", "agent-1", "resp_" + "0" * 32 + "_bad/id", 7):
        with pytest.raises(UnknownResponseError):
            session_of_response(bad)


def test_responses_survive_a_restart_and_a_snapshot_and_go_with_their_session(tmp_path):
    state, responses = _responses(tmp_path)
    state.create("t/kv", LAYOUT, "t", "normal")  # a session with KV
    kept = {sid: StoredResponse(response_id=new_response_id("kv" if sid == "t/kv" else "solo"),
                                document=f'{{"of": "{sid}"}}'.encode())
            for sid in ("t/kv", "t/solo")}  # "t/solo": no KV session (an engine without memkv)
    for sid, stored in kept.items():
        asyncio.run(responses.put(sid, stored))
    dropped = StoredResponse(response_id=new_response_id("solo"), document=b"{}")
    asyncio.run(responses.put("t/solo", dropped))
    asyncio.run(responses.delete("t/solo", dropped.response_id))
    with pytest.raises(InvalidInputError, match="not of session"):
        asyncio.run(responses.put("t/kv", dropped))
    state.journal.close()

    state, responses = _responses(tmp_path)  # a restarted router replays its journal
    for sid, stored in kept.items():
        assert asyncio.run(responses.get(sid, stored.response_id)) == stored
    with pytest.raises(UnknownResponseError):
        asyncio.run(responses.get("t/solo", dropped.response_id))
    with pytest.raises(UnknownResponseError):  # the same id under another tenant's scope
        asyncio.run(responses.get("u/kv", kept["t/kv"].response_id))
    state.compact_journal()  # folded into a snapshot
    state.delete("t/kv")
    state.journal.close()

    state, responses = _responses(tmp_path)
    with pytest.raises(UnknownResponseError):
        asyncio.run(responses.get("t/kv", kept["t/kv"].response_id))
    assert asyncio.run(responses.get("t/solo", kept["t/solo"].response_id)) == kept["t/solo"]
    assert len(state.responses) == 1 and state.responses.bytes > 0
