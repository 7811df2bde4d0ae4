"""The one session-id rule."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memkv.errors import InvalidInputError
from memkv.protocol.ids import SESSION_ID_PATTERN, check_session_id


@pytest.mark.parametrize("sid", ["a", "chat-1", "agent.7", "t:u@v_w", "A" * 256, "0"])
def test_good_ids_pass(sid):
    assert check_session_id(sid) == sid


@pytest.mark.parametrize(
    "sid", ["", ".", "..", "../x", "a/b", "a b", "-x", "_x", "A" * 257, "é", "x\n", None, 7]
)
def test_bad_ids_are_refused_naming_the_rule(sid):
    with pytest.raises(InvalidInputError, match="A-Z a-z 0-9"):
        check_session_id(sid)


@given(st.from_regex(SESSION_ID_PATTERN, fullmatch=True))
def test_every_id_of_the_pattern_passes(sid):
    assert check_session_id(sid) == sid


def test_tenants_scope_session_ids_without_collisions():
    from memkv.protocol.ids import (
        check_stored_session_id,
        scoped_session_id,
        unscoped_session_id,
    )

    assert scoped_session_id(None, "s1") == "s1"
    assert scoped_session_id("acme", "a:b") == "acme/a:b"
    assert unscoped_session_id("acme/a:b") == "a:b"
    # '/' is in neither alphabet, so one (tenant, id) pair has one stored id.
    assert scoped_session_id("a", "b.c") != scoped_session_id("a.b", "c")
    for bad_tenant in ("", "a/b", "../x", "x" * 65, "-lead"):
        with pytest.raises(InvalidInputError, match="tenant"):
            scoped_session_id(bad_tenant, "s")
    assert check_stored_session_id("t/s") == "t/s"
    for bad in ("t/", "/s", "t/s/x", "t/../s", 7):
        with pytest.raises(InvalidInputError):
            check_stored_session_id(bad)
