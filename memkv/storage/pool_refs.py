"""References: which blocks are held, by how many sessions of which owner, and
which of those are active; an append applied, a session suspended or released,
a restarted owner's references replaced. A block no holder references and no
reader pins is freed from every tier."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from memkv.errors import (
    BlockLostError,
    InvalidInputError,
    LayoutMismatchError,
    PrefixNotStoredError,
    UnknownBlockError,
)
from memkv.protocol.enums import PRIORITY_RANK, Priority
from memkv.protocol.events import BlockEvents
from memkv.protocol.hashing import BlockHash
from memkv.protocol.members import Holder, StoredBlocks
from memkv.protocol.messages import ChainUpdate
from memkv.storage.arena import Allocation
from memkv.storage.block_table import BlockTable, PoolGuard
from memkv.storage.diagnostics import check_refcounts
from memkv.storage.layout import KVLayout
from memkv.storage.pool_core import (
    _Block,
    _codec_step,
    _crc32,
    raise_invariant,
)
from memkv.storage.pool_ladder import TierLadder


class References:
    """The references the pool's owner tells it of, per owner, and their invariants.

    Args:
        guard: the pool's lock and open state.
        table: the block table the references are counted in.
        ladder: the tiers a new block is admitted to and a freed one leaves.
        clock: seconds, monotonic.
        counters: the pool's event counters (dedup hits, bytes saved, demotions).
        check: check every invariant after each change (tests; slow).
    """

    def __init__(self, guard: PoolGuard, table: BlockTable, ladder: TierLadder,
                 clock: Callable[[], float], counters: Counter[str], check: bool) -> None:
        self.guard = guard
        self.table = table
        self.ladder = ladder
        self.clock = clock
        self.counters = counters
        self._check = check

    def put(
        self,
        update: ChainUpdate,
        blocks: Sequence[torch.Tensor],
        *,
        checksums: Sequence[int] | None = None,
        durable: bool = False,
        owner: str = "",
        placed: dict[int, Allocation] | None = None,
    ) -> StoredBlocks:
        """Apply one append: store its new blocks and count the references it moves.

        Args:
            update: what the append changes (from the session's owner).
            blocks: KV of ``update.chain[update.start_block:]``; those already
                stored are deduplicated, not written again.
            checksums: the writer's CRC32 of each block's bytes (verified by the
                caller), kept and served with the block; computed on first read
                when absent.
            durable: return only once every block of the chain has a cold copy
                forced to disk (the ``archive`` acknowledgement mode), written
                with the lossless online codec.
            owner: whose references these are (a router shard; "" for one owner).
            placed: blocks whose bytes lie in slots reserved in a memory tier
                (:meth:`BlockPool.reserve_slots`), by index into ``blocks``: a new
                block there is adopted in place (no copy) and taken out of the dict;
                the caller frees what is left (duplicates, or after an error).

        Raises:
            LayoutMismatchError: a block's shape/dtype disagrees with the layout
                or with the token count of its position.
            InvalidInputError: a wrong number of blocks or checksums, or a block
                before ``start_block`` that is not stored. Nothing is changed.
            CapacityError: no tier can take a new block (nothing is changed).
        """
        with self.guard.lock:
            self.guard.ensure_open()
            layout, counts, start = update.layout, update.tokens, update.start_block
            if len(blocks) != len(counts) - start:
                raise InvalidInputError(
                    f"{sum(counts)} tokens make {len(counts)} blocks; from block {start} "
                    f"expected {len(counts) - start} blocks, got {len(blocks)}"
                )
            if checksums is not None and len(checksums) != len(blocks):
                raise InvalidInputError(
                    f"{len(blocks)} blocks came with {len(checksums)} checksums"
                )
            for i, block in enumerate(blocks, start=start):
                n = layout.check_block(block)
                if n != counts[i]:
                    raise LayoutMismatchError(f"block {i} must hold {counts[i]} tokens, got {n}")
            chain = [BlockHash(k) for k in update.chain]
            for i in range(start):
                if chain[i] not in self.table:
                    raise PrefixNotStoredError(
                        f"block {i} was not sent and is not stored; send blocks from index {i}",
                        i)
            # Validation is over: from here on the pool changes.
            now = self.clock()
            created = self._admit_new_blocks(update, chain, blocks, now, checksums, placed)
            self.ladder.note_put(len(created) * layout.block_nbytes())
            held = set(update.hold)
            dedup = 0
            for key in dict.fromkeys(chain[start:]):
                if key in held and key not in created:
                    dedup += 1
                    self.counters["dedup_bytes_saved"] += layout.block_nbytes(
                        self.table[key].tokens
                    )
            for held_key in update.hold:
                entry = self.table[BlockHash(held_key)]
                self._hold(entry, update.priority, update.was_active, now, update.exact_only,
                           owner)
            for kept_key in update.kept:
                self.table[BlockHash(kept_key)].rounds += 1
            for dropped_key in update.drop:
                self._release(BlockHash(dropped_key), active=update.was_active, owner=owner)
            if counts and counts[-1] < layout.block_tokens:
                tail = self.table[chain[-1]]
                tail.rewrites = max(tail.rewrites, update.tail_rewrites)
            if not update.was_active:
                self._activate(chain, owner)
            if durable:
                entries = [self.table[k] for k in dict.fromkeys(chain)]
                self.ladder.ensure_cold_many(entries, offline=False, durable=True)
            self.counters["dedup_hits"] += dedup
            self._debug_check()
            return StoredBlocks(len(created), dedup, len(update.drop))

    def adopt(
        self,
        layout: KVLayout,
        chain: Sequence[bytes],
        tokens: Sequence[int],
        priority: Priority,
        exact_only: bool = False,
        owner: str = "",
        keep_prefix: bool = False,
    ) -> int:
        """Hold, for an inactive holder, a chain whose blocks are all in the cold tier.

        Used when an owner registers an archived session again: after a
        restart (from its manifest), or when the router moves a dead device's
        archived sessions to a live one.

        Args:
            keep_prefix: where some block is in no tier, hold the blocks before
                the first such one (a partial session beats a lost one: the
                engine recomputes the rest).

        Returns:
            How many leading blocks of the chain are held (all of them unless
            ``keep_prefix``).

        Raises:
            BlockLostError: some block is in no tier (without ``keep_prefix``),
                or the first one is (nothing is held).
        """
        with self.guard.lock:
            self.guard.ensure_open()
            keys = [BlockHash(bytes(k)) for k in chain]
            missing = set(self.ladder.cold.missing([k for k in keys if k not in self.table]))
            if missing:
                first = next(i for i, k in enumerate(keys) if k in missing)
                if not keep_prefix or first == 0:
                    raise BlockLostError(
                        f"{len(missing)} of {len(keys)} blocks are in no tier "
                        f"(first missing: block {first}, {bytes(keys[first]).hex()})"
                    )
                keys, tokens = keys[:first], list(tokens)[:first]
            self.hold_chain(
                layout, keys, tokens, priority, False, exact_only, self.clock(), owner
            )
            self._debug_check()
            return len(keys)

    def resync(self, holders: Sequence[Holder], owner: str = "") -> list[int]:
        """Set ``owner``'s references from its table, after the owner restarted.

        The owner may have died between this pool applying an append and the
        owner recording it; its table is the truth. Other owners' references
        (the other shards of a sharded table) stay as they are. Blocks no
        holder of any owner lists and no reader pins are freed; a holder's
        block that is only in the cold tier gets a cold-only entry (as
        :meth:`adopt` does).

        Args:
            holders: every session the owner places on this pool.
            owner: whose table it is ("" for one owner).

        Returns:
            Indices of holders with a block in no tier (those hold nothing).
        """
        with self.guard.lock:
            self.guard.ensure_open()
            wanted = [[BlockHash(bytes(k)) for k in h.chain] for h in holders]
            unknown = list(
                dict.fromkeys(k for chain in wanted for k in chain if k not in self.table)
            )
            missing = set(self.ladder.cold.missing(unknown)) if unknown else set()
            # The new references are taken before the old ones go, so a block
            # both hold is never freed in between.
            previous = self.table.take_shares(owner)
            now = self.clock()
            lost: list[int] = []
            try:
                for i, (chain, holder) in enumerate(zip(wanted, holders, strict=True)):
                    if any(k in missing for k in chain):
                        lost.append(i)
                        continue
                    self.hold_chain(
                        holder.layout,
                        chain,
                        holder.tokens,
                        holder.priority,
                        holder.active,
                        holder.exact_only,
                        now,
                        owner,
                    )
            except BaseException:
                self._undo_holds(owner, previous, created=unknown)
                raise
            for key, (refs, active) in previous.items():
                entry = self.table[key]
                entry.refcount -= refs
                entry.active_refs -= active
            for key in [k for k, e in self.table.items() if e.refcount == 0 and e.pins == 0]:
                self.ladder.free(self.table[key])
            self._debug_check()
            return lost

    def release(self, keys: Sequence[bytes], *, active: bool, owner: str = "") -> int:
        """Drop one reference to each key (a holder went); blocks left unheld are freed.

        Returns how many blocks were freed (unpinned ones at once, pinned ones
        when their last reader lets go).
        """
        with self.guard.lock:
            self.guard.ensure_open()
            before = len(self.table)
            for key in dict.fromkeys(BlockHash(bytes(k)) for k in keys):
                self._release(key, active=active, owner=owner)
            self._debug_check()
            return before - len(self.table)

    def deactivate(
        self,
        keys: Sequence[bytes],
        *,
        offline: bool = False,
        was_active: bool = True,
        owner: str = "",
    ) -> bool:
        """An active holder of ``keys`` went idle (a session suspended).

        Writes the blocks to the cold tier in one batch (one archive call, not
        one per block), then frees the memory copies no active holder needs.

        Args:
            offline: the user went away for long: unshared blocks may use the
                lossy cold codec (Delta+RL).
            was_active: False for a holder that was idle already (suspended
                again): no active reference is dropped, the memory copies
                brought back meanwhile (prefetch) go again.

        Returns:
            Whether some of the blocks are still in memory (held by an active
            holder, or pinned by a reader).
        """
        with self.guard.lock:
            self.guard.ensure_open()
            unique = list(dict.fromkeys(BlockHash(bytes(k)) for k in keys))
            if was_active:
                for key in unique:
                    self.table[key].active_refs -= 1
                    self.table.count(owner, key, 0, -1)
            self.ladder.ensure_cold_many(
                [self.table[k] for k in unique if not self.table[k].in_cold], offline=offline
            )
            for key in unique:
                entry = self.table[key]
                if entry.active_refs == 0 and entry.pins == 0 and entry.tier is not None:
                    self.ladder.tier(entry.tier).remove(key)
                    self.ladder.set_tier(entry, None)
                    self.counters["demotions"] += 1
                    # The cold copy is the one left: a lossy codec makes reads inexact.
                    self.ladder.note_demoted(entry, lossy=_codec_step(entry.cold_codec))
            self._debug_check()
            return any(self.table[k].tier is not None for k in unique)

    def activate(self, keys: Sequence[bytes], owner: str = "") -> None:
        """An idle holder of ``keys`` is active again (a session resumed)."""
        with self.guard.lock:
            self.guard.ensure_open()
            self._activate([BlockHash(bytes(k)) for k in keys], owner)
            self._debug_check()

    def set_priority(self, keys: Sequence[bytes], priority: Priority) -> None:
        """Move blocks to ``priority``'s eviction queue (a session changed its class)."""
        with self.guard.lock:
            now = self.clock()
            for key in dict.fromkeys(BlockHash(bytes(k)) for k in keys):
                self._raise_priority(self.table[key], priority, now, force=True)

    def stored_prefix(self, keys: Sequence[BlockHash]) -> tuple[int, list[BlockHash]]:
        """Tokens and keys of the leading run of ``keys`` that is stored."""
        with self.guard.lock:
            matched: list[BlockHash] = []
            tokens = 0
            for key in keys:
                entry = self.table.get(key)
                if entry is None:
                    break
                matched.append(key)
                tokens += entry.tokens
            return tokens, matched

    def tokens_of(self, key: BlockHash) -> int:
        """Tokens of a stored block.

        Raises:
            UnknownBlockError: not stored.
        """
        with self.guard.lock:
            entry = self.table.get(key)
            if entry is None:
                raise UnknownBlockError(f"no block {key.hex()} in this store")
            return entry.tokens

    def cold_orphans(self) -> list[bytes]:
        """Keys in the cold tier that no block entry knows (left by a crash)."""
        with self.guard.lock:
            return [k for k in self.ladder.cold.block_keys() if BlockHash(k) not in self.table]

    def _admit_new_blocks(
        self,
        update: ChainUpdate,
        chain: list[BlockHash],
        blocks: Sequence[torch.Tensor],
        now: float,
        checksums: Sequence[int] | None = None,
        placed: dict[int, Allocation] | None = None,
    ) -> set[BlockHash]:
        """Store the blocks of ``chain`` not stored yet; all or nothing."""
        created: list[BlockHash] = []
        start_block = update.start_block
        try:
            for i in range(start_block, len(chain)):
                key = chain[i]
                if key in self.table:
                    continue
                entry = _Block(
                    key=key,
                    parent=chain[i - 1] if i else None,
                    layout=update.layout,
                    tokens=update.tokens[i],
                    priority=update.priority,
                    last_access=now,
                    # Without the writer's, made as the block is copied into memory.
                    crc32=checksums[i - start_block] if checksums is not None else None,
                    turn_created=update.turn,
                )
                self.table.add(entry)
                created.append(key)
                block = blocks[i - start_block]
                if placed and (slot := placed.get(i - start_block)) is not None \
                        and self.ladder.adopt_placed(entry, block, slot, now):
                    del placed[i - start_block]  # the block's own now: freed with it
                    continue
                self.ladder.admit(entry, block, now)
                if entry.crc32 is None and entry.exact:  # went to the cold tier as it is
                    entry.crc32 = _writer_crc32(block)
        except BaseException:
            # e.g. CapacityError from a full cold tier: undo this put's new blocks
            # so nothing half-stored stays behind (older blocks were not touched).
            for key in reversed(created):
                entry = self.table[key]
                if entry.tier is not None or entry.in_cold:
                    self.ladder.free(entry)
                else:
                    self.table.drop(key)
            raise
        return set(created)

    def hold_chain(
        self,
        layout: KVLayout,
        chain: Sequence[BlockHash],
        tokens: Sequence[int],
        priority: Priority,
        active: bool,
        exact_only: bool,
        now: float,
        owner: str = "",
    ) -> None:
        """One holder's reference to each block of ``chain``; blocks not in memory get
        cold-only entries (the caller made sure the cold tier has them).

        A cold-only entry's exactness comes from its frame's codec: its memory
        copies went with the process that wrote it, and a block archived by
        the lossy offline codec, or as int8, must not be served as exact.
        """
        fresh = list(dict.fromkeys(k for k in chain if k not in self.table))
        codecs = dict(zip(fresh, self.ladder.cold.codecs(fresh), strict=True)) if fresh else {}
        seen: set[BlockHash] = set()
        for i, key in enumerate(chain):
            if key in seen:
                continue
            seen.add(key)
            entry = self.table.get(key)
            if entry is None:
                codec = codecs[key]
                entry = _Block(
                    key,
                    chain[i - 1] if i else None,
                    layout,
                    tokens[i],
                    priority,
                    last_access=now,
                    in_cold=True,
                    cold_codec=codec,
                    lossy=("int8" if codec == "int8" else _codec_step(codec)) or "",
                )
                self.table.add(entry)
                self.ladder.note_cold(entry)
            self._hold(entry, priority, active, now, exact_only, owner)

    def _hold(
        self,
        entry: _Block,
        priority: Priority,
        active: bool,
        now: float,
        exact_only: bool = False,
        owner: str = "",
    ) -> None:
        self.table.hold(entry, active, exact_only, owner)
        self._raise_priority(entry, priority, now)

    def _activate(self, keys: Sequence[BlockHash], owner: str = "") -> None:
        for key in dict.fromkeys(keys):
            self.table[key].active_refs += 1
            self.table.count(owner, key, 0, 1)

    def _undo_holds(
        self, owner: str, previous: dict[BlockHash, list[int]], created: Sequence[BlockHash]
    ) -> None:
        """Take back the holds a failed :meth:`resync` made; ``owner``'s old ones stand."""
        for key, (refs, active) in self.table.take_shares(owner).items():
            entry = self.table[key]
            entry.refcount -= refs
            entry.active_refs -= active
        self.table.put_shares(owner, previous)
        for key in created:  # cold-only entries it made: the cold copy stays
            made = self.table.get(key)
            if made is not None and made.refcount == 0 and made.pins == 0:
                self.table.drop(key)

    def _raise_priority(
        self, entry: _Block, priority: Priority, now: float, force: bool = False
    ) -> None:
        # A shared block belongs to the highest class of the sessions holding it.
        if not force and PRIORITY_RANK[priority] <= PRIORITY_RANK[entry.priority]:
            return
        entry.priority = priority
        if entry.tier is not None and entry.pins == 0:
            self.ladder.tier(entry.tier).reclassify(entry.key, priority, now)

    def _release(self, key: BlockHash, *, active: bool, owner: str = "") -> None:
        entry = self.table[key]
        entry.refcount -= 1
        if active:
            entry.active_refs -= 1
        self.table.count(owner, key, -1, -int(active))
        if entry.refcount == 0 and entry.pins == 0:
            self.ladder.free(entry)

    def block_events(self, cursor: int = 0, epoch: str = "") -> BlockEvents:
        """The blocks stored into and removed from this pool's table after ``cursor``
        (of ``epoch``; another epoch, or one too far back: a snapshot of the table)."""
        with self.guard.lock:
            return self.table.events_since(cursor, epoch)

    def refcounts(self) -> dict[BlockHash, tuple[int, int]]:
        """(refcount, pins) per block, for an owner's invariant and leak checks."""
        with self.guard.lock:
            return self.table.refcounts()

    def check_invariants(self, chains: dict[str, list[BlockHash]] | None = None) -> None:
        """Raise :class:`~memkv.errors.InvariantViolationError` if the bookkeeping is broken.

        Args:
            chains: the owner's chain per session: refcounts must match them.
                Without them only what the pool knows alone is checked (tiers,
                pins, no unheld block left behind).
        """
        with self.guard.lock:
            blocks = self.refcounts()
            if chains is not None:
                check_refcounts(blocks, chains)
            for key, (refcount, pins) in blocks.items():
                if pins < 0 or refcount < 0 or (refcount == 0 and pins == 0):
                    raise_invariant(f"block {key.hex()} has refcount {refcount} and {pins} pins")
            for key, entry in self.table.items():
                if entry.active_refs < 0 or entry.active_refs > entry.refcount:
                    raise_invariant(
                        f"block {key.hex()} has {entry.active_refs} active of "
                        f"{entry.refcount} references"
                    )
                present = entry.tier is not None and key in self.ladder.tier(entry.tier)
                if entry.tier is not None and not present:
                    raise_invariant(f"block {key.hex()} thinks it is {entry.tier} but is not")
                if entry.tier is None and not entry.in_cold:
                    raise_invariant(f"block {key.hex()} is in no tier")
            self.table.check_shares(raise_invariant)

    def _debug_check(self) -> None:
        if self._check:
            self.check_invariants()


def _writer_crc32(block: torch.Tensor) -> int | None:
    """The CRC32 of a block that came without its writer's and was not checksummed as it
    was copied into a memory tier (made on first read otherwise, on that read's time):
    None where it cannot be made here (a CUDA block, a strided view)."""
    if block.device.type != "cpu" or not block.is_contiguous():
        return None
    return _crc32(block)
