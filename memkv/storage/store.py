"""TieredStore: sessions over one block pool, in one process.

The single-process form of memkv (tests, the local demo, benchmarks of the
engine): a :class:`~memkv.storage.sessions.SessionTable` owns the sessions and
a :class:`~memkv.storage.block_pool.BlockPool` their blocks, the same two
pieces a cluster splits between the router (sessions) and a device actor
(blocks). An append is planned by the table, applied by the pool and then
committed by the table, under the pool's lock, so each call is one step.

* ``put_blocks`` / ``put_kv`` store a turn's KV; blocks already stored (an
  earlier turn, a prefix shared with another session) are deduplicated.
* ``suspend`` writes a session's blocks to the cold tier and frees the memory
  copies no active session needs; ``resume`` answers at once and blocks come
  back lazily as they are read (``read_session``), with read-ahead.
* A suspended session's record is kept in a journal beside the cold tier's
  segment files (:mod:`memkv.storage.suspended`), so a store reopened on the
  same directory serves it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from memkv.errors import (
    BlockLostError,
    CorruptDataError,
    InvalidInputError,
    UnknownSessionError,
)
from memkv.protocol.enums import Priority, SessionState, Tier
from memkv.protocol.hashing import BlockHash, chain_hashes, token_array
from memkv.storage.block_pool import (
    BlockLocation,
    BlockPool,
    FetchedBlock,
    PoolStats,
    TierStats,
)
from memkv.storage.config import StoreConfig
from memkv.storage.layout import KVLayout, block_token_count, split_kv
from memkv.storage.sessions import SessionInfo, SessionRecord, SessionTable, parse_priority
from memkv.storage.suspended import SESSIONS_DIR, SuspendedSessions
from memkv.storage.tiers import ColdBackend, ColdTier

__all__ = [
    "BlockLocation",
    "FetchedBlock",
    "PrefixMatch",
    "PutResult",
    "ResumeHandle",
    "SessionInfo",
    "SessionState",
    "StoreStats",
    "TierStats",
    "TieredStore",
]


@dataclass(frozen=True, slots=True)
class PutResult:
    """What one ``put`` did."""

    chain: tuple[BlockHash, ...]
    new_blocks: int
    deduplicated_blocks: int
    released_blocks: int  # blocks the session no longer holds (a replaced partial tail)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence."""

    tokens: int
    blocks: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class ResumeHandle:
    """Returned at once by ``resume``; blocks follow as ``read_session`` asks for them."""

    session_id: str
    tokens: int
    blocks: tuple[BlockLocation, ...]


@dataclass(frozen=True, slots=True)
class StoreStats(PoolStats):
    sessions: int = 0
    logical_bytes: int = 0  # sum over sessions of their blocks, in the model dtype


class TieredStore:
    """Hot → warm → cold store of sessions' KV blocks, with dedup and demotion.

    Args:
        config: capacities and component settings.
        cold: the cold tier, when it is not the store's own segment files
            (``config.archive``); its owner keeps the sessions (they are not
            kept across a restart here).
        warm_name: name of the warm pool's shared-memory segment (another
            process on the node maps it by that name); None picks a unique one.
        clock: seconds, monotonic (injectable for tests of idle-time policies).

    Example:
        >>> store = TieredStore(config)                       # doctest: +SKIP
        >>> store.create_session("s1", layout, namespace="tenant-a")
        >>> store.put_kv("s1", token_ids, keys, values)
        >>> block = store.get(store.session("s1").chain[0])
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        cold: ColdBackend | None = None,
        warm_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        self.pool = BlockPool(config, cold=cold, warm_name=warm_name, clock=clock)
        self.sessions_table = SessionTable(clock)
        self._lock = self.pool.lock
        self._check = config.debug_refcounts
        self.lost_sessions: dict[str, str] = {}
        self._suspended: SuspendedSessions | None = None
        try:
            if cold is None and config.archive is not None:
                self._suspended = SuspendedSessions(
                    config.archive.directory / SESSIONS_DIR,
                    fsync=config.archive.fsync != "never",
                )
                self._recover_suspended(self._suspended)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    @property
    def prefault_done(self) -> Any:
        """Set once the arenas' pages are populated (a ``threading.Event``)."""
        return self.pool.prefault_done

    def close(self) -> None:
        """Flush the cold tier and release the arenas. Idempotent."""
        self.pool.close()
        if self._suspended is not None:
            self._suspended.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self.pool.closed

    def _recover_suspended(self, suspended: SuspendedSessions) -> None:
        """Serve again the sessions that were suspended when the store last closed.

        A session whose blocks are not all readable is marked lost (reads raise
        BlockLostError, never a partial cache); cold blocks that no session
        references are garbage from sessions that were active at a crash, and
        are deleted.
        """
        backend = getattr(self.pool.cold, "backend", self.pool.cold)  # under a ColdWriter
        if isinstance(backend, ColdTier):
            # A directory of an earlier version: its manifests move to the journal.
            legacy = backend.legacy_manifests()
            for manifest in legacy:
                suspended.suspended(manifest)
            if legacy:
                backend.drop_legacy_manifests()
        for manifest in suspended.manifests():
            try:
                record = self.sessions_table.restore(manifest, state=SessionState.ARCHIVED)
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptDataError(f"unreadable record in the session journal: {e}") from e
            try:
                self.pool.adopt(record.layout, record.chain, self._counts(record), record.priority)
            except BlockLostError as e:
                self.sessions_table.pop(record.session_id)
                self.lost_sessions[record.session_id] = str(e)
        for key in self.pool.cold_orphans():
            self.pool.cold.remove(key)

    # ------------------------------------------------------------------ sessions

    def adopt_session(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str,
        priority: Priority | str,
        tokens: int,
        turn: int,
        chain: Sequence[BlockHash],
    ) -> SessionInfo:
        """Register an archived session whose blocks are all in the cold tier.

        Raises:
            BlockLostError: some block of the chain is not in the cold tier
                (the session is not registered).
            InvalidInputError: bad arguments; ConflictError: the id exists.
        """
        manifest = {
            "session_id": session_id,
            "namespace": namespace,
            "layout": layout.to_dict(),
            "priority": parse_priority(priority).value,
            "tokens": tokens,
            "turn": turn,
            "chain": [bytes(k) for k in chain],
        }
        with self._lock:
            self.pool.ensure_open()
            try:
                record = self.sessions_table.restore(manifest, state=SessionState.ARCHIVED)
            except ValueError as e:
                raise InvalidInputError(str(e)) from e
            try:
                self.pool.adopt(record.layout, record.chain, self._counts(record), record.priority)
            except BlockLostError as e:
                self.sessions_table.pop(session_id)
                raise BlockLostError(f"session {session_id!r}: {e}") from e
            if self._suspended is not None:
                self._suspended.suspended(record.manifest())  # archived: kept across a restart
            self._debug_check()
            return SessionInfo.of(record)

    def create_session(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str = "default",
        priority: Priority | str = Priority.NORMAL,
        exact_only: bool = False,
    ) -> SessionInfo:
        """Register a new, empty session.

        Args:
            exact_only: its blocks never take a lossy step (precision, codecs).

        Raises:
            InvalidInputError: bad id, namespace or priority; ConflictError: the id exists.
        """
        with self._lock:
            self.pool.ensure_open()
            record = self.sessions_table.create(
                session_id, layout, namespace=namespace, priority=priority, exact_only=exact_only
            )
            return SessionInfo.of(record)

    def session(self, session_id: str) -> SessionInfo:
        with self._lock:
            return SessionInfo.of(self._session(session_id))

    def sessions(self) -> list[str]:
        with self._lock:
            return self.sessions_table.ids()

    def set_priority(self, session_id: str, priority: Priority | str) -> SessionInfo:
        """Change a session's class; its blocks move to that class's eviction queue."""
        with self._lock:
            record = self._session(session_id)
            record.priority = parse_priority(priority)
            self.pool.set_priority(record.chain, record.priority)
            return SessionInfo.of(record)

    def delete_session(self, session_id: str) -> None:
        """Forget a session; blocks no other session holds are freed from every tier."""
        with self._lock:
            record = self._session(session_id)
            self.pool.release(record.chain, active=record.active)
            self.sessions_table.pop(session_id)
            self._forget_suspended(session_id, durable=True)
            self._debug_check()

    # ------------------------------------------------------------------ writes

    def put_kv(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> PutResult:
        """Store a session's whole KV (per-layer K and V for every token so far).

        Blocks that are already stored (this session's earlier turns, or a
        prefix shared with another session) are not written again.
        """
        with self._lock:
            blocks = split_kv(self._session(session_id).layout, keys, values)
            return self.put_blocks(session_id, token_ids, blocks)

    def put_blocks(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        blocks: Sequence[torch.Tensor],
        *,
        start_block: int = 0,
        checksums: Sequence[int] | None = None,
        chain: Sequence[BlockHash] | None = None,
    ) -> PutResult:
        """Store KV blocks for a session whose tokens so far are ``token_ids``.

        Args:
            session_id: an existing session.
            token_ids: every token of the session so far (the chain is hashed over them).
            blocks: KV of blocks ``start_block ..`` up to the last (partial) block.
            start_block: index of the first block given; earlier blocks must
                already be stored (by this session or a shared prefix).
            checksums: the writer's CRC32 of each block's bytes (verified by the
                caller), kept and served with the block.
            chain: the chain of ``token_ids`` as the caller hashed it; hashed
                here when absent.

        Raises:
            UnknownSessionError: no such session.
            LayoutMismatchError: a block's shape/dtype disagrees with the layout
                or with the token count of its position.
            InvalidInputError: missing blocks, bad token ids. Nothing is changed.
        """
        with self._lock:
            record = self._session(session_id)
            tokens = token_array(token_ids)
            if chain is None:
                chain = chain_hashes(tokens, record.layout, record.namespace)
            update = self.sessions_table.plan_append(
                session_id, int(tokens.size), [bytes(k) for k in chain], start_block
            )
            outcome = self.pool.put(update, blocks, checksums=checksums)
            # A suspended session's record described it before this write.
            self._forget_suspended(session_id)
            self.sessions_table.commit_append(session_id, update)
            self._debug_check()
            return PutResult(
                tuple(BlockHash(k) for k in update.chain),
                outcome.new_blocks,
                outcome.deduplicated_blocks,
                outcome.released_blocks,
            )

    # ------------------------------------------------------------------ reads

    def contains(self, key: BlockHash) -> bool:
        return self.pool.contains(key)

    def locate(self, key: BlockHash) -> Tier | None:
        """Fastest tier holding ``key``, or None when it is not stored."""
        return self.pool.locate(key)

    def get(self, key: BlockHash, *, stream: str | None = None) -> torch.Tensor:
        """A copy of block ``key`` in its layout's dtype, promoted to the hot tier."""
        return self.pool.get(key, stream=stream)

    def fetch(self, key: BlockHash, *, stream: str | None = None) -> FetchedBlock:
        """Like :meth:`get`, and also the tier the block was found in."""
        return self.pool.fetch(key, stream=stream)

    def pinned_reads(self, keys: Sequence[BlockHash], *, stream: str | None = None) -> Any:
        """See :meth:`BlockPool.pinned_reads`."""
        return self.pool.pinned_reads(keys, stream=stream)

    def plan_reads(
        self,
        keys: Sequence[BlockHash],
        *,
        stream: str | None = None,
        ahead: Sequence[BlockHash] = (),
    ) -> Any:
        """See :meth:`BlockPool.plan_reads`."""
        return self.pool.plan_reads(keys, stream=stream, ahead=ahead)

    def unpin_blocks(self, keys: Sequence[BlockHash]) -> None:
        self.pool.unpin_blocks(keys)

    def prefetch(self, keys: Sequence[BlockHash]) -> int:
        """Bring blocks into free hot-tier space (never evicting for it). Returns how many."""
        return self.pool.prefetch(keys)

    def prefetch_predicted(self, key: BlockHash) -> int:
        return self.pool.prefetch_predicted(key)

    def read_session(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> Iterator[tuple[BlockHash, torch.Tensor]]:
        """Yield a session's ``(key, block)`` in order, promoting each as it is needed.

        Before each block is returned the next ``lookahead_window`` blocks are
        prefetched into free hot-tier space, so a lazy resume reads ahead of its
        consumer without evicting anything for it.
        """
        for fetched in self.iter_session(session_id, start, end):
            yield fetched.key, fetched.block

    def iter_session(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> Iterator[FetchedBlock]:
        """:meth:`read_session`, with the tier each block was found in."""
        with self._lock:
            chain = list(self._session(session_id).chain)
        stop = len(chain) if end is None else min(end, len(chain))
        window = self.config.prefetch.lookahead_window
        for i in range(max(start, 0), stop):
            fetched = self.pool.fetch(chain[i], stream=session_id)
            self.pool.prefetch(chain[i + 1 : min(i + 1 + window, stop)])
            yield fetched

    def match_prefix(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int] | np.ndarray
    ) -> PrefixMatch:
        """How many leading tokens of ``token_ids`` are cached (any session, same namespace)."""
        tokens, matched = self.pool.stored_prefix(chain_hashes(token_ids, layout, namespace))
        return PrefixMatch(tokens, tuple(matched))

    # ------------------------------------------------------------------ suspend / resume

    def suspend(self, session_id: str, *, offline: bool = False) -> SessionInfo:
        """Write the session's blocks to the cold tier and free what no active session needs.

        Args:
            offline: the user went away for long: unshared blocks may use the
                lossy cold codec (Delta+RL).
        """
        with self._lock:
            self.pool.ensure_open()
            record = self._session(session_id)
            in_memory = self.pool.deactivate(
                record.chain, offline=offline, was_active=record.active
            )
            record.state = SessionState.SUSPENDED if in_memory else SessionState.ARCHIVED
            if self._suspended is not None:
                self._suspended.suspended(record.manifest())
            self._debug_check()
            return SessionInfo.of(record)

    def resume(self, session_id: str, *, prefetch: bool = True) -> ResumeHandle:
        """Mark a session active and answer at once with its chain and block locations.

        Args:
            prefetch: bring the first ``max_prefetch_blocks`` blocks into free
                hot-tier space before answering. The rest come as
                ``read_session``/``get`` ask for them.
        """
        with self._lock:
            record = self._session(session_id)
            if not record.active:
                # An active session lives in memory: its record goes before it changes.
                self._forget_suspended(session_id)
                self.pool.activate(record.chain)
                record.state = SessionState.ACTIVE
            record.last_access = self._clock()
            chain = list(record.chain)
        if prefetch:
            self.pool.prefetch(chain[: self.config.prefetch.max_prefetch_blocks])
        with self._lock:
            locations = tuple(
                BlockLocation(k, self.pool.locate(k) or Tier.COLD, self.pool.tokens_of(k))
                for k in chain
            )
            return ResumeHandle(session_id, record.tokens, locations)

    # ------------------------------------------------------------------ stats and checks

    def stats(self) -> StoreStats:
        with self._lock:
            pool = self.pool.stats()
            logical = sum(
                r.layout.block_nbytes(n) for r in self.sessions_table for n in self._counts(r)
            )
            values = {f.name: getattr(pool, f.name) for f in fields(PoolStats)}
            return StoreStats(**values, sessions=len(self.sessions_table), logical_bytes=logical)

    def refcount_snapshot(
        self,
    ) -> tuple[dict[BlockHash, tuple[int, int]], dict[str, list[BlockHash]]]:
        """(refcount, pins) per block and the chain per session, for the invariant checker."""
        with self._lock:
            return self.pool.refcounts(), self._chains()

    def check_invariants(self) -> None:
        """Raise :class:`~memkv.errors.InvariantViolationError` if the bookkeeping is broken."""
        with self._lock:
            self.pool.check_invariants(self._chains())

    # ------------------------------------------------------------------ internals

    def _forget_suspended(self, session_id: str, *, durable: bool = False) -> None:
        if self._suspended is not None:
            self._suspended.forget(session_id, durable=durable)

    def _debug_check(self) -> None:
        if self._check:
            self.check_invariants()

    def _chains(self) -> dict[str, list[BlockHash]]:
        return {r.session_id: list(r.chain) for r in self.sessions_table}

    def _session(self, session_id: str) -> SessionRecord:
        self.pool.ensure_open()
        try:
            return self.sessions_table.get(session_id)
        except UnknownSessionError:
            if isinstance(session_id, str) and session_id in self.lost_sessions:
                raise BlockLostError(
                    f"session {session_id!r} is lost: {self.lost_sessions[session_id]}"
                ) from None
            raise

    @staticmethod
    def _counts(record: SessionRecord) -> list[int]:
        return block_token_count(record.layout, record.tokens)
