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
