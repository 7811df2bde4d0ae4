"""TieredStore: memkv in one process — the session service over one device.

The single-process form of memkv (tests, benchmarks of the engine): the same
:class:`~memkv.router.service.SessionRouter` a cluster runs as an
actor owns the sessions, and a :class:`~memkv.device.service.DeviceService`
in this process keeps their blocks (:mod:`memkv.device.local`). This
class only makes the service's calls synchronous and reads blocks from the
device's pool directly, as a same-node reader does.

* ``put_blocks`` / ``put_kv`` store a turn's KV; blocks already stored (an
  earlier turn, a prefix shared with another session) are deduplicated.
* ``suspend`` writes a session's blocks to the cold tier and frees the memory
  copies no active session needs; ``resume`` answers at once and blocks come
  back lazily as they are read (``read_session``), with read-ahead.
* The session table is the router's journal beside the cold tier's segment
  files (``<archive.directory>/router``): a store reopened on the same
  directory serves each session again as far as the cold tier holds it (the
  router's recovery of a restarted device), archived.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
import torch

from memkv.device.local import LocalBlockStore, LocalDirectory
from memkv.device.service import DeviceService
from memkv.errors import BlockLostError, CorruptDataError, MemkvError, UnknownSessionError
from memkv.protocol.enums import Priority, SessionState, Tier
from memkv.protocol.hashing import BlockHash, token_array
from memkv.protocol.services import AppendTurn, CreateSession, LayoutSpec, SessionView
from memkv.router.service import SessionRouter
from memkv.router.sessions import parse_priority
from memkv.router.suspended import SESSIONS_DIR, SuspendedSessions
from memkv.storage.block_pool import (
    BlockLocation,
    BlockPool,
    FetchedBlock,
    PoolStats,
    TierStats,
)
from memkv.storage.config import StoreConfig
from memkv.storage.layout import KVLayout, block_token_count, split_kv
from memkv.storage.owned_dir import resolve_on_node
from memkv.storage.tiers import ColdBackend, ColdTier

__all__ = [
    "BlockLocation",
    "FetchedBlock",
    "PrefixMatch",
    "PutResult",
    "ResumeHandle",
    "SessionView",
    "SessionState",
    "StoreStats",
    "TierStats",
    "TieredStore",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
#: The one device's name (in the journal: a reopened store reattaches to it).
DEVICE_ID = "local"
#: The session service's journal, beside the segment files.
ROUTER_DIR = "router"


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
            (``config.archive``); sessions are then not kept across a restart.
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._check = config.debug_refcounts
        #: Sessions an earlier version kept that could not be served again, and why.
        self.lost_sessions: dict[str, str] = {}
        # The service's calls run on this loop, one caller at a time.
        self._loop = asyncio.new_event_loop()
        self._calls = threading.Lock()
        self._router: SessionRouter | None = None
        journal_dir = None
        if cold is None and config.archive is not None:
            journal_dir = resolve_on_node(config.archive.directory) / ROUTER_DIR
        # A scope of its own: stores of one process must not claim each other's segments.
        self.device = DeviceService(
            DEVICE_ID, config, cold_tier=(lambda _codecs: cold) if cold is not None else None,
            segment_scope=f"store-{uuid.uuid4().hex[:12]}", clock=clock,
        )
        self.pool: BlockPool = self.device.pool
        try:
            local = LocalBlockStore(self.device)
            self._router = SessionRouter(
                journal_dir=str(journal_dir) if journal_dir is not None else None,
                journal_fsync=config.archive is not None and config.archive.fsync != "never",
                head_blocks=config.prefetch.max_prefetch_blocks,
                directory=LocalDirectory(DEVICE_ID, local),
                background_prefetch_interval_s=float("inf"),
                clock=clock,
            )
            self._call(self._router.register_device(DEVICE_ID, local))
            if journal_dir is not None:
                self._migrate_sessions()
                # Cold blocks no session holds: left by sessions that were lost.
                for key in self.pool.cold_orphans():
                    self.pool.cold.remove(key)
        except BaseException:
            self.close()
            raise

    @property
    def service(self) -> SessionRouter:
        """The session service this store is a shell over."""
        assert self._router is not None
        return self._router

    def _call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        self.pool.ensure_open()
        with self._calls:
            return self._loop.run_until_complete(coroutine)

    # ------------------------------------------------------------------ lifecycle

    @property
    def prefault_done(self) -> Any:
        """Set once the arenas' pages are populated (a ``threading.Event``)."""
        return self.pool.prefault_done

    def close(self) -> None:
        """Flush the cold tier and release the arenas. Idempotent."""
        if self._loop.is_closed():
            return
        if self._router is not None:
            self._router.background.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))  # let the task end
            if self._router.state.journal is not None:
                self._router.state.journal.close()
        self._loop.close()
        self.device.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self.pool.closed

    def _migrate_sessions(self) -> None:
        """Sessions an earlier version kept (a journal of suspended sessions, or
        manifests in the segment files) move into the service's journal, archived."""
        assert self.config.archive is not None
        manifests: list[dict[str, Any]] = []
        backend = getattr(self.pool.cold, "backend", self.pool.cold)  # under a ColdWriter
        if isinstance(backend, ColdTier):
            manifests += backend.legacy_manifests()
        old_journal = resolve_on_node(self.config.archive.directory) / SESSIONS_DIR
        if old_journal.exists():
            suspended = SuspendedSessions(old_journal, fsync=False)
            try:
                manifests += suspended.manifests()
            finally:
                suspended.close()
        for m in manifests:
            try:
                session_id, chain = str(m["session_id"]), [BlockHash(bytes(k)) for k in m["chain"]]
                layout = KVLayout.from_dict(m["layout"])
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptDataError(
                    f"unreadable session record of an earlier version: {e}") from e
            try:
                self.adopt_session(session_id, layout, namespace=m["namespace"],
                                   priority=m.get("priority", "normal"), tokens=m["tokens"],
                                   turn=m["turn"], chain=chain)
            except MemkvError as e:  # lost, or taken: the others still move
                logger.warning("session %s of an earlier version is lost: %s", session_id, e)
                self.lost_sessions[session_id] = str(e)
        if isinstance(backend, ColdTier) and manifests:
            backend.drop_legacy_manifests()
        shutil.rmtree(old_journal, ignore_errors=True)

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
    ) -> SessionView:
        """Register an archived session whose blocks are all in the cold tier.

        Raises:
            BlockLostError: some block of the chain is not in the cold tier
                (the session is not registered).
            InvalidInputError: bad arguments; ConflictError: the id exists.
        """
        request = CreateSession(session_id=session_id, layout=LayoutSpec.of(layout),
                                namespace=namespace, priority=parse_priority(priority))
        self._call(self.service.adopt_session(request, [bytes(k) for k in chain], tokens, turn))
        self._debug_check()
        return self.session(session_id)

    def create_session(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str = "default",
        priority: Priority | str = Priority.NORMAL,
        exact_only: bool = False,
    ) -> SessionView:
        """Register a new, empty session.

        Args:
            exact_only: its blocks never take a lossy step (precision, codecs).

        Raises:
            InvalidInputError: bad id, namespace or priority; ConflictError: the id exists.
        """
        request = CreateSession(session_id=session_id, layout=LayoutSpec.of(layout),
                                namespace=namespace, priority=parse_priority(priority),
                                exact_only=exact_only)
        self._call(self.service.create_session(request))
        return self.session(session_id)

    def session(self, session_id: str) -> SessionView:
        self.pool.ensure_open()
        try:
            return self.service.state.get(session_id).view()
        except UnknownSessionError:
            if isinstance(session_id, str) and session_id in self.lost_sessions:
                raise BlockLostError(
                    f"session {session_id!r} is lost: {self.lost_sessions[session_id]}"
                ) from None
            raise

    def sessions(self) -> list[str]:
        return [r.session_id for r in self.service.state.sessions if not r.lost]

    def set_priority(self, session_id: str, priority: Priority | str) -> SessionView:
        """Change a session's class; its blocks move to that class's eviction queue."""
        self._call(self.service.set_priority(session_id, parse_priority(priority)))
        return self.session(session_id)

    def delete_session(self, session_id: str) -> None:
        """Forget a session; blocks no other session holds are freed from every tier."""
        self._call(self.service.delete_session(session_id))
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
        blocks = split_kv(self.session(session_id).layout.layout(), keys, values)
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
        request = AppendTurn(
            session_id=session_id,
            token_ids=AppendTurn.pack_tokens(token_array(token_ids)),
            start_block=start_block,
            chain=tuple(bytes(k) for k in chain) if chain is not None else None,
            checksums=tuple(checksums) if checksums is not None else None,
        )
        answer = self._call(self.service.put_blocks(request, list(blocks)))
        self._debug_check()
        return PutResult(tuple(BlockHash(k) for k in answer.chain), answer.new_blocks,
                         answer.deduplicated_blocks, answer.released_blocks)

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
        route = self._call(self.service.read_route(session_id, start, end))
        keys = [BlockHash(k) for k in route.keys]
        window = self.config.prefetch.lookahead_window
        for i, key in enumerate(keys):
            fetched = self.pool.fetch(key, stream=session_id)
            self.pool.prefetch(keys[i + 1 : i + 1 + window])
            yield fetched

    def match_prefix(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int] | np.ndarray
    ) -> PrefixMatch:
        """How many leading tokens of ``token_ids`` are cached (any session, same namespace)."""
        match = self._call(
            self.service.match_prefix(layout, namespace, [int(t) for t in token_array(token_ids)]))
        return PrefixMatch(match.tokens, tuple(BlockHash(k) for k in match.blocks))

    # ------------------------------------------------------------------ suspend / resume

    def suspend(self, session_id: str, *, offline: bool = False) -> SessionView:
        """Write the session's blocks to the cold tier and free what no active session needs.

        Args:
            offline: the user went away for long: unshared blocks may use the
                lossy cold codec (Delta+RL).
        """
        self._call(self.service.suspend(session_id, offline))
        self._debug_check()
        return self.session(session_id)

    def resume(self, session_id: str) -> ResumeHandle:
        """Mark a session active and answer at once with its chain and block locations.

        The service's resume brings the first ``max_prefetch_blocks`` blocks into
        free hot-tier space; the rest come as ``read_session``/``get`` ask for them.
        """
        answer = self._call(self.service.resume(session_id))
        # Where each block is now the head's prefetch ran (the answer says where it was).
        return ResumeHandle(session_id, answer.tokens, tuple(
            BlockLocation(BlockHash(b.key), self.pool.locate(BlockHash(b.key)) or Tier.COLD,
                          b.tokens)
            for b in answer.blocks))

    # ------------------------------------------------------------------ stats and checks

    def stats(self) -> StoreStats:
        self.pool.ensure_open()
        pool = self.pool.stats()
        records = list(self.service.state.sessions)
        logical = sum(
            r.layout.block_nbytes(n) for r in records
            for n in block_token_count(r.layout, r.tokens))
        values = {f.name: getattr(pool, f.name) for f in fields(PoolStats)}
        return StoreStats(**values, sessions=len(records), logical_bytes=logical)

    def refcount_snapshot(
        self,
    ) -> tuple[dict[BlockHash, tuple[int, int]], dict[str, list[BlockHash]]]:
        """(refcount, pins) per block and the chain per session, for the invariant checker."""
        return self.pool.refcounts(), self._chains()

    def check_invariants(self) -> None:
        """Raise :class:`~memkv.errors.InvariantViolationError` if the bookkeeping is broken."""
        self.pool.check_invariants(self._chains())

    # ------------------------------------------------------------------ internals

    def _debug_check(self) -> None:
        if self._check:
            self.check_invariants()

    def _chains(self) -> dict[str, list[BlockHash]]:
        return {r.session_id: [BlockHash(k) for k in r.chain]
                for r in self.service.state.sessions if not r.lost}
