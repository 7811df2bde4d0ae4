"""The block table: one record per stored block, each owner's share of the
references to it, and the numbered events readers follow the table by.

The table is the one piece of state every part of a
:class:`~memkv.storage.block_pool.BlockPool` reads (as vLLM's block pool reads its
hash map): the tier ladder finds a victim's record here, references count here,
reads look blocks up here. It knows nothing of tiers or bytes. The pool's lock
(:class:`PoolGuard`) serialises every call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, ItemsView, Iterator, KeysView, ValuesView

from memkv.errors import ClosedError
from memkv.protocol.events import BlockEvents
from memkv.protocol.hashing import BlockHash
from memkv.storage.block_events import BlockEventLog
from memkv.storage.pool_core import _Block

__all__ = ["BlockTable", "PoolGuard"]

#: One owner's share of each block's references: block -> [refs, active refs].
Shares = dict[BlockHash, list[int]]


class PoolGuard:
    """The pool's lock and whether it is open: what every part of the pool checks
    before it acts (one re-entrant lock; an owner may take it around several calls)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.closed = False

    def ensure_open(self) -> None:
        """Raise ClosedError once the pool is closed."""
        if self.closed:
            raise ClosedError("the block pool is closed")


class BlockTable:
    """Records by key, references per owner, and the events of every change."""

    def __init__(self, epoch: str) -> None:
        self._blocks: dict[BlockHash, _Block] = {}
        # Every change of the table, numbered: readers follow the table by it.
        self._events = BlockEventLog(epoch)
        # Each owner's share of the references. One owner unless the session table is
        # sharded (memkv.protocol.shards): then every router shard holds its own
        # sessions' references, and a restarted shard resets only its own.
        self._owner_refs: dict[str, Shares] = {}

    # -- records --------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, key: BlockHash) -> _Block:
        return self._blocks[key]

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._blocks)

    def get(self, key: BlockHash) -> _Block | None:
        return self._blocks.get(key)

    def keys(self) -> KeysView[BlockHash]:
        return self._blocks.keys()

    def values(self) -> ValuesView[_Block]:
        return self._blocks.values()

    def items(self) -> ItemsView[BlockHash, _Block]:
        return self._blocks.items()

    def add(self, entry: _Block) -> None:
        self._blocks[entry.key] = entry
        self._events.stored(entry.key)

    def drop(self, key: BlockHash) -> None:
        """Forget a block, and every owner's share of it.

        No references are left, but an owner's active count may be: a release that
        said "active" for a holder the pool had as idle (its suspend failed after the
        pool applied it). The record takes that miscount with it; its shares go too,
        or a block stored again under the key would inherit it.
        """
        del self._blocks[key]
        self._events.removed(key)
        for shares in self._owner_refs.values():
            shares.pop(key, None)

    def events_since(self, cursor: int, epoch: str) -> BlockEvents:
        """Blocks stored and removed after ``cursor`` (of ``epoch``; another epoch, or
        one too far back: a snapshot of the table)."""
        return self._events.since(cursor, epoch, self._blocks.keys)

    # -- references -----------------------------------------------------------------------

    def hold(self, entry: _Block, active: bool, exact_only: bool, owner: str) -> None:
        """One more reference to ``entry`` from ``owner`` (active or not)."""
        entry.refcount += 1
        entry.exact_only = entry.exact_only or exact_only
        if active:
            entry.active_refs += 1
        self.count(owner, entry.key, 1, int(active))

    def count(self, owner: str, key: BlockHash, refs: int, active: int) -> None:
        """Move ``owner``'s share of ``key``'s references (kept beside the totals)."""
        shares = self._owner_refs.setdefault(owner, {})
        share = shares.setdefault(key, [0, 0])
        share[0] += refs
        share[1] += active
        if share == [0, 0]:
            del shares[key]

    def take_shares(self, owner: str) -> Shares:
        """``owner``'s shares, taken out of the table (a resync replaces them)."""
        return self._owner_refs.pop(owner, {})

    def put_shares(self, owner: str, shares: Shares) -> None:
        """Give ``owner`` back the shares :meth:`take_shares` took."""
        self._owner_refs[owner] = shares

    def refcounts(self) -> dict[BlockHash, tuple[int, int]]:
        """(refcount, pins) per block."""
        return {k: (b.refcount, b.pins) for k, b in self._blocks.items()}

    def check_shares(self, fail: Callable[[str], None]) -> None:
        """Call ``fail`` with a message where the owners' shares do not add up to the
        records' references, or a freed block still has shares."""
        shared: Shares = {}
        for shares in self._owner_refs.values():
            for key, (refs, active) in shares.items():
                total = shared.setdefault(key, [0, 0])
                total[0] += refs
                total[1] += active
        for key, entry in self._blocks.items():
            if shared.pop(key, [0, 0]) != [entry.refcount, entry.active_refs]:
                fail(f"block {key.hex()}: the owners' shares do not add up to its "
                     f"{entry.refcount} references ({entry.active_refs} active)")
        if shared:
            fail(f"{len(shared)} freed blocks still have owners' references")
