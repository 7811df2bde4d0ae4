"""Where a fork or rewind ends: whole blocks shared, a partial last block cut."""

from __future__ import annotations

import pytest

from memkv.errors import ConflictError, InvalidInputError
from memkv.protocol.enums import AckMode, Priority, SessionState
from memkv.protocol.forks import fork_request, prefix_of, tail_of
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import BlockCut, LayoutSpec, SessionView

LAYOUT = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4)
TOKENS = list(range(100, 110))
CHAIN = [bytes(k) for k in chain_hashes(TOKENS, LAYOUT, "t")]  # 4 + 4 + 2 tokens


@pytest.mark.parametrize(("at", "blocks"), [(10, 3), (8, 2), (4, 1)])
def test_ends_where_the_sessions_own_blocks_end_share_them_whole(at, blocks) -> None:
    assert prefix_of(LAYOUT, "t", CHAIN, 10, at, "fork") == (tuple(CHAIN[:blocks]), None)
    assert tail_of(LAYOUT, 10, at, TOKENS) is None


@pytest.mark.parametrize(("at", "source", "kept"), [(9, 2, 1), (6, 1, 2), (1, 0, 1)])
def test_an_end_inside_a_block_cuts_it_under_the_hash_of_its_tokens(at, source, kept) -> None:
    tail = tail_of(LAYOUT, 10, at, TOKENS)
    assert tail == tuple(TOKENS[source * 4: min(source * 4 + 4, 10)])
    chain, cut = prefix_of(LAYOUT, "t", CHAIN, 10, at, "rewind", tail)
    assert cut == BlockCut(CHAIN[source], kept)
    # Every key is the hash of its tokens, the cut's too: a lookup by tokens finds it.
    assert chain == tuple(bytes(k) for k in chain_hashes(TOKENS[:at], LAYOUT, "t"))


def test_a_cut_needs_the_blocks_own_tokens() -> None:
    with pytest.raises(InvalidInputError, match="ends inside block 1 .*send that block's 4"):
        prefix_of(LAYOUT, "t", CHAIN, 10, 6, "fork")
    lying = (100, 101, 102, 103)  # block 0's tokens, offered as block 1's
    with pytest.raises(InvalidInputError, match="not the tokens of block 1"):
        prefix_of(LAYOUT, "t", CHAIN, 10, 6, "fork", lying)
    with pytest.raises(InvalidInputError, match="not the tokens of block 1"):
        prefix_of(LAYOUT, "other-tenant", CHAIN, 10, 6, "fork", TOKENS[4:8])
    with pytest.raises(InvalidInputError, match="first 8"):
        tail_of(LAYOUT, 10, 6, TOKENS[:7])


@pytest.mark.parametrize("at", [0, 11, -1, True, 2.0])
def test_an_end_outside_the_session_is_refused(at) -> None:
    with pytest.raises(InvalidInputError, match="between 1 and the session's 10 tokens"):
        prefix_of(LAYOUT, "t", CHAIN, 10, at, "fork")


def _view(chain, tokens, device="dev-0") -> SessionView:
    return SessionView(
        session_id="t/parent", namespace="t", layout=LayoutSpec.of(LAYOUT),
        priority=Priority.HIGH, device_id=device, chain=tuple(chain), tokens=tokens, turn=3,
        state=SessionState.SUSPENDED, ack=AckMode.ARCHIVE, exact_only=True, finite_only=False,
        archived=False, hotness=0.0,
    )


def test_a_fork_takes_the_parents_options_and_device() -> None:
    request = fork_request(_view(CHAIN, 10), "t/child", 6, tail_tokens=TOKENS[4:8])
    new = request.session
    assert (new.session_id, new.namespace, new.priority, new.ack, new.exact_only) == (
        "t/child", "t", Priority.HIGH, AckMode.ARCHIVE, True)
    assert (request.device_id, request.tokens, request.parent) == ("dev-0", 6, "t/parent")
    assert request.cut == BlockCut(CHAIN[1], 2)
    assert fork_request(_view(CHAIN, 10), "t/all").tokens == 10
    with pytest.raises(ConflictError, match="no blocks yet"):
        fork_request(_view((), 0, device=None), "t/child")
