import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.errors import InvalidInputError
from memkv.protocol.hashing import ROOT_HASH, chain_hashes, hash_block, token_array
from memkv.protocol.layout import KVLayout

LAYOUT = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4)
tokens_st = st.lists(st.integers(min_value=0, max_value=2**31), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(prefix=tokens_st, a=tokens_st, b=tokens_st)
def test_shared_prefix_gives_shared_chain(prefix, a, b):
    # Only whole blocks of the common prefix are shared.
    ha = chain_hashes(prefix + a, LAYOUT, "t")
    hb = chain_hashes(prefix + b, LAYOUT, "t")
    shared = len(prefix) // LAYOUT.block_tokens
    assert ha[:shared] == hb[:shared]
    assert all(len(h) == 16 for h in ha)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) > 0))
def test_chain_is_incremental(tokens):
    full = chain_hashes(tokens, LAYOUT, "t")
    cut = (len(tokens) - 1) // LAYOUT.block_tokens * LAYOUT.block_tokens
    head = chain_hashes(tokens[:cut], LAYOUT, "t")
    tail = chain_hashes(tokens[cut:], LAYOUT, "t", parent=head[-1] if head else ROOT_HASH)
    assert head + tail == full


def test_namespace_layout_and_parent_change_every_hash():
    tokens = list(range(10))
    base = chain_hashes(tokens, LAYOUT, "tenant-a")
    other_ns = chain_hashes(tokens, LAYOUT, "tenant-b")
    other_layout = chain_hashes(
        tokens, KVLayout("m", 1, 1, 4, dtype="bfloat16", block_tokens=4), "tenant-a"
    )
    assert not set(base) & set(other_ns)
    assert not set(base) & set(other_layout)
    # A changed early token changes every later hash (the chain).
    changed = chain_hashes([99] + tokens[1:], LAYOUT, "tenant-a")
    assert all(x != y for x, y in zip(base, changed, strict=True))


def test_chain_golden_value():
    # Pinned: a changed hash function silently orphans every archived block.
    last = chain_hashes([1, 2, 3, 4, 5], LAYOUT, "t")[-1]
    assert last.hex() == "ef766b7c9e84c25386deac99c1ea017b"


def test_partial_last_block_differs_from_full():
    assert chain_hashes([1, 2, 3], LAYOUT, "t") != chain_hashes([1, 2, 3, 0], LAYOUT, "t")
    assert len(chain_hashes([], LAYOUT, "t")) == 0


def test_namespace_is_length_prefixed():
    toks = token_array([1])
    a = hash_block(ROOT_HASH, toks, LAYOUT.fingerprint, "ab")
    b = hash_block(ROOT_HASH, toks, LAYOUT.fingerprint, "a")
    assert a != b


def test_token_array_accepts_numpy_and_refuses_bad_input():
    assert token_array(np.arange(3, dtype=np.int32)).dtype == np.dtype("<i8")
    with pytest.raises(InvalidInputError, match="1-d"):
        token_array([[1, 2]])
    with pytest.raises(InvalidInputError, match="integers"):
        token_array([1.5])
    with pytest.raises(InvalidInputError, match="non-negative"):
        token_array([-1])
    with pytest.raises(InvalidInputError, match="namespace"):
        chain_hashes([1], LAYOUT, 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="parent hash"):
        hash_block(b"x", toks := token_array([1]), LAYOUT.fingerprint, "t")
    del toks


def test_token_ids_of_2_to_the_63_and_above_are_refused_not_wrapped():
    """Item 10 of [1/5]: 2**63 became uint64 and the int64 cast wrapped it negative."""
    import pytest

    from memkv.errors import InvalidInputError
    from memkv.protocol.hashing import token_array

    assert token_array([2**63 - 1]).tolist() == [2**63 - 1]
    for bad in ([2**63], [1, 2**64 - 1], [2**64]):
        with pytest.raises(InvalidInputError):
            token_array(bad)
