"""Fork and rewind through the real actors: blocks shared, not copied (a partial last
block cut once), exact KV for exactly the tokens kept, released when nobody holds them.

On the suite's cluster (``debug_refcounts`` is on there: every reference count is
checked on every device operation).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from memkv.errors import ConflictError, InvalidInputError, UnknownSessionError
from memkv.protocol.hashing import chain_hashes
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv

LAYOUT = KVLayout("fork-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
_ids = itertools.count()


def _session(cluster, tokens: int, seed: int):
    sid = f"fork-{next(_ids)}"
    cluster.create_session(sid, LAYOUT, namespace="forks")
    token_ids = [1000 * seed + i for i in range(tokens)]
    keys, values = random_kv(LAYOUT, tokens, seed)
    cluster.put_kv(sid, token_ids, keys, values)
    return sid, token_ids, (keys, values)


def _first(kv, tokens: int) -> list[torch.Tensor]:
    """The blocks of the first ``tokens`` tokens of ``kv`` (what a recompute stores)."""
    keys, values = kv
    return split_kv(LAYOUT, [k[:, :tokens] for k in keys], [v[:, :tokens] for v in values])


def _read(cluster, sid) -> list[torch.Tensor]:
    return [block.clone() for _, block in cluster.read_session(sid)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _blocks_on(cluster, sid) -> int:
    return cluster.stats().devices[cluster.device_of(sid)].blocks


def test_a_fork_shares_every_block_and_cuts_only_a_partial_last_one(cluster) -> None:
    parent, token_ids, kv = _session(cluster, 10, seed=1)  # blocks of 4, 4, 2 tokens
    stored = _blocks_on(cluster, parent)
    whole = f"fork-{next(_ids)}"
    view = cluster.fork_session(parent, whole)
    assert (view.tokens, view.chain) == (10, cluster.session(parent).chain)
    assert cluster.device_of(whole) == cluster.device_of(parent)
    at_boundary = f"fork-{next(_ids)}"
    assert cluster.fork_session(parent, at_boundary, 8).chain == view.chain[:2]
    assert _blocks_on(cluster, parent) == stored  # nothing copied
    # Inside a block: its first tokens, cut once, under the hash of those tokens (the
    # same cut is not made twice).
    inside, again = f"fork-{next(_ids)}", f"fork-{next(_ids)}"
    with pytest.raises(InvalidInputError, match="send that block's 4 token ids"):
        cluster.fork_session(parent, inside, 6)
    cut = cluster.fork_session(parent, inside, 6, token_ids)
    assert cut.tokens == 6
    assert cut.chain == tuple(bytes(k) for k in chain_hashes(token_ids[:6], LAYOUT, "forks"))
    assert cluster.fork_session(parent, again, 6, token_ids).chain == cut.chain
    assert _blocks_on(cluster, parent) == stored + 1
    for sid, tokens in ((whole, 10), (at_boundary, 8), (inside, 6), (again, 6)):
        assert _same(_read(cluster, sid), _first(kv, tokens)), sid
    # The parent is untouched, and the forks outlive it.
    cluster.delete_session(parent)
    assert _same(_read(cluster, whole), _first(kv, 10))
    for sid in (whole, at_boundary, inside, again):
        cluster.delete_session(sid)


def test_a_rewind_keeps_exact_kv_for_the_tokens_kept_and_the_session_goes_on(cluster) -> None:
    sid, token_ids, kv = _session(cluster, 10, seed=2)
    sibling = f"fork-{next(_ids)}"
    cluster.fork_session(sid, sibling)  # holds the blocks the rewind lets go of
    view = cluster.rewind_session(sid, 5, token_ids)
    assert (view.tokens, view.turn, len(view.chain)) == (5, 2, 2)
    assert _same(_read(cluster, sid), _first(kv, 5))
    assert _same(_read(cluster, sibling), _first(kv, 10))  # shared blocks stay
    # Rewinding to where it is changes nothing; the next turn appends after the kept.
    assert cluster.rewind_session(sid, 5).turn == 2
    keys, values = random_kv(LAYOUT, 12, 3)
    keys = [torch.cat([k[:, :5], n[:, 5:]], dim=1) for k, n in zip(kv[0], keys, strict=True)]
    values = [torch.cat([v[:, :5], n[:, 5:]], dim=1) for v, n in zip(kv[1], values, strict=True)]
    cluster.put_kv(sid, token_ids[:5] + [7, 8, 9, 10, 11, 12, 13], keys, values)
    assert _same(_read(cluster, sid), split_kv(LAYOUT, keys, values))
    cluster.delete_session(sibling)
    cluster.delete_session(sid)


def test_forks_and_rewinds_refuse_what_does_not_fit(cluster) -> None:
    sid, _, _ = _session(cluster, 6, seed=4)
    with pytest.raises(InvalidInputError, match="between 1 and the session's 6 tokens"):
        cluster.fork_session(sid, f"fork-{next(_ids)}", 7)
    with pytest.raises(InvalidInputError, match="between 1 and the session's 6"):
        cluster.rewind_session(sid, 0)
    taken = f"fork-{next(_ids)}"
    cluster.fork_session(sid, taken, 4)
    with pytest.raises(ConflictError, match="already exists"):
        cluster.fork_session(sid, taken, 4)
    with pytest.raises(UnknownSessionError):
        cluster.fork_session("fork-nobody", f"fork-{next(_ids)}")
    empty = f"fork-{next(_ids)}"
    cluster.create_session(empty, LAYOUT, namespace="forks")
    with pytest.raises(ConflictError, match="no blocks yet"):
        cluster.fork_session(empty, f"fork-{next(_ids)}")
    # Nothing was made by the refused forks: the ids are free.
    assert cluster.session(sid).tokens == 6
    for s in (sid, taken, empty):
        cluster.delete_session(s)
