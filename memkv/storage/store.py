"""TieredStore: one process's KV blocks across hot, warm and cold tiers.

The engine under every DeviceCacheActor. It owns the bookkeeping the tiers do
not: sessions and their block chains, refcounts across sessions (a shared
prefix is stored once), pins of blocks being read, where each block lives, and
the movement between tiers:

* ``put`` writes new blocks to the hot tier; blocks already stored anywhere are
  deduplicated by their :data:`~memkv.protocol.hashing.BlockHash`.
* Under pressure the hot tier demotes its victim to the warm tier (converted by
  the precision policy: fp16, or int8 for long-idle unshared blocks), and the
  warm tier writes its victim to the cold tier before freeing it: a block
  leaves memory only once a copy is safe on disk.
* ``get`` promotes a block back to the hot tier (hot and warm hold exclusive
  copies; the cold copy, once written, stays until the block dies).
* ``suspend`` writes a session's blocks to the cold tier and frees the memory
  copies no active session needs; ``resume`` answers at once and blocks come
  back lazily as they are read (``read_session``), with read-ahead.

All public methods are thread-safe (one re-entrant lock); the store is meant to
be driven by one actor, so the lock is rarely contended.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from memkv.errors import (
    BlockLostError,
    CapacityError,
    ClosedError,
    ConfigError,
    ConflictError,
    CorruptDataError,
    InvalidInputError,
    LayoutMismatchError,
    PrecisionOverflowError,
    UnknownBlockError,
    UnknownSessionError,
)
from memkv.protocol.checksum import crc32
from memkv.protocol.enums import PRIORITY_RANK, Priority, SessionState, Tier
from memkv.protocol.hashing import BlockHash, chain_hashes, token_array
from memkv.protocol.ids import check_session_id
from memkv.protocol.messages import PlanEntry
from memkv.storage.arena import DeviceArena, SharedHostArena
from memkv.storage.codecs import CODECS, CodecPolicy
from memkv.storage.config import StoreConfig
from memkv.storage.diagnostics import AccessStats, Leak, check_refcounts, find_leaks
from memkv.storage.layout import KVLayout, block_token_count, split_kv
from memkv.storage.precision import PrecisionPolicy, QuantizedBlock, convert, quantize_int8
from memkv.storage.prefetch import MarkovPrefetcher
from memkv.storage.tiers import ColdBackend, ColdTier, MemoryTier, StoredBlock

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


@dataclass(slots=True)
class _Block:
    """Per-block bookkeeping (one per distinct BlockHash)."""

    key: BlockHash
    parent: BlockHash | None
    layout: KVLayout
    tokens: int
    priority: Priority
    last_access: float
    refcount: int = 0  # sessions whose chain holds the block
    active_refs: int = 0  # of those, sessions that are active
    pins: int = 0  # readers holding a zero-copy view
    tier: Tier | None = None  # memory tier of the copy; None = cold only
    in_cold: bool = False
    cold_codec: str | None = None
    rounds: int = 0  # turns (puts) that included the block after the one that created it
    prefetched: bool = False  # brought to hot by prefetch and not read since
    # For a partial tail: how often its session's tail had been rewritten when
    # it was written (partial tails are replaced every turn; see _ensure_cold).
    rewrites: int = 0
    # CRC32 of the block's bytes in the model dtype: the writer's own checksum
    # while the block is exact; None until computed (or after a lossy step).
    crc32: int | None = None
    # False once the only copies left went through a lossy step (int8, fp16 of
    # an fp32 block, a lossy cold codec): reads then say so.
    exact: bool = True


@dataclass(slots=True)
class _Session:
    session_id: str
    layout: KVLayout
    namespace: str
    priority: Priority
    created_at: float
    last_access: float
    chain: list[BlockHash] = field(default_factory=list)
    tokens: int = 0
    turn: int = 0
    tail_rewrites: int = 0  # how often the partial last block was replaced
    state: SessionState = SessionState.ACTIVE


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A snapshot of a session."""

    session_id: str
    namespace: str
    layout: KVLayout
    priority: Priority
    state: SessionState
    tokens: int
    turn: int
    chain: tuple[BlockHash, ...]
    created_at: float
    last_access: float


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


class FetchedBlock(NamedTuple):
    """A block read from the store, and where it was found."""

    key: BlockHash
    block: torch.Tensor
    tier: Tier
    exact: bool = True  # False: the copy read went through a lossy step


@dataclass(frozen=True, slots=True)
class BlockLocation:
    key: BlockHash
    tier: Tier
    tokens: int


@dataclass(frozen=True, slots=True)
class ResumeHandle:
    """Returned at once by ``resume``; blocks follow as ``read_session`` asks for them."""

    session_id: str
    tokens: int
    blocks: tuple[BlockLocation, ...]


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: Tier
    capacity_bytes: int | None
    used_bytes: int
    blocks: int
    hits: int
    evictions: int
    fragmentation: float


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: dict[Tier, TierStats]
    sessions: int
    blocks: int
    logical_bytes: int  # sum over sessions of their blocks, in the model dtype
    unique_bytes: int  # each distinct block once, in the model dtype
    dedup_hits: int
    dedup_bytes_saved: int
    misses: int  # gets of keys in no tier
    promotions: int
    demotions: int
    prefetched: int
    prefetch_used: int
    precision_fallbacks: int  # demotions that kept the model dtype (value out of fp16 range)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tiers"
        }
        out["tiers"] = {
            t.value: {k: getattr(s, k) for k in s.__dataclass_fields__ if k != "tier"}
            for t, s in self.tiers.items()
        }
        return out


class TieredStore:
    """Hot → warm → cold block store with sessions, dedup and demotion.

    Args:
        config: capacities and component settings.
        cold: the cold tier, when it is not the store's own segment files
            (``config.archive``): a cluster's archive actor.
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
        if cold is None:
            if config.archive is None:
                raise ConfigError("a TieredStore needs config.archive or a cold backend")
            archive = config.archive
        self.config = config
        self._clock = clock
        self._lock = threading.RLock()
        unit = config.allocator.min_unit_bytes
        hot_bytes = _whole_units(config.hot_capacity_bytes, unit, "hot")
        # A CPU "device" keeps its hot tier in shared memory too, so that a
        # reader on the node (the same-node path) can copy straight out of it.
        hot_arena: DeviceArena | SharedHostArena = (
            SharedHostArena(hot_bytes, unit, name=hot_segment_name(warm_name))
            if config.device == "cpu"
            else DeviceArena(hot_bytes, unit, device=config.device)
        )
        self._hot = MemoryTier(Tier.HOT, hot_arena, config.eviction)
        pin_warm = config.device.startswith("cuda")
        try:
            warm_arena = SharedHostArena(
                _whole_units(config.warm_capacity_bytes, unit, "warm"),
                unit,
                name=warm_name,
                pin=pin_warm,
            )
            self._warm = MemoryTier(Tier.WARM, warm_arena, config.eviction)
            self._cold: ColdBackend = (
                cold
                if cold is not None
                else ColdTier(archive, config.codecs, config.cold_capacity_bytes)
            )
        except BaseException:
            self._hot.close()
            with contextlib.suppress(NameError):
                warm_arena.close()
            raise
        self._precision: dict[str, PrecisionPolicy] = {}
        self._codec_policy = CodecPolicy(config.codecs)
        self._prefetcher: MarkovPrefetcher[BlockHash] = MarkovPrefetcher(config.prefetch)
        self.access_stats = AccessStats()
        self._blocks: dict[BlockHash, _Block] = {}
        self._sessions: dict[str, _Session] = {}
        self._hits: Counter[Tier] = Counter()
        self._counters: Counter[str] = Counter()
        self._closed = False
        self._check = config.debug_refcounts
        self._recover_cold_index()
        self.prefault_done = threading.Event()
        if config.prefault:
            # Off the caller's path: a fresh page costs a fault on first write.
            threading.Thread(target=self._prefault, name="memkv-prefault", daemon=True).start()
        else:
            self.prefault_done.set()

    def _prefault(self) -> None:
        try:
            for tier in (self._hot, self._warm):
                tier.arena.prefault()
        finally:
            self.prefault_done.set()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Flush the cold tier and release the arenas. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cold.close()
            self._warm.close()
            self._hot.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _recover_cold_index(self) -> None:
        """Rebuild suspended sessions from the manifests in the cold tier.

        A suspended session's manifest and all its blocks are on disk, so a
        store reopened on the same directory serves it again. A manifest whose
        blocks are not all readable marks that session lost (reads raise
        BlockLostError, never a partial cache); cold blocks that no manifest
        references are garbage from sessions that were active at a crash, and
        are deleted.
        """
        self.lost_sessions: dict[str, str] = {}
        if not self._cold.owns_sessions:
            return  # a shared cold tier (cluster archive): the router owns recovery
        for manifest in self._cold.manifests():
            try:
                session_id = str(manifest["session_id"])
                self.adopt_session(
                    session_id,
                    KVLayout.from_dict(manifest["layout"]),
                    namespace=str(manifest["namespace"]),
                    priority=Priority(manifest["priority"]),
                    tokens=int(manifest["tokens"]),
                    turn=int(manifest["turn"]),
                    chain=[BlockHash(bytes(k)) for k in manifest["chain"]],
                )
            except BlockLostError as e:
                self.lost_sessions[session_id] = str(e)
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptDataError(f"unreadable session manifest in the cold tier: {e}") from e
        for raw_key in list(self._cold.block_keys()):
            if BlockHash(raw_key) not in self._blocks:
                self._cold.remove(raw_key)

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

        Used when a store restarts (from its manifests) and, in a cluster, when
        the router moves a dead device's archived sessions to a live one.

        Raises:
            BlockLostError: some block of the chain is not in the cold tier
                (the session is not registered).
            InvalidInputError: bad arguments, or the id exists.
        """
        with self._lock:
            self._ensure_open()
            check_session_id(session_id)
            if session_id in self._sessions:
                raise ConflictError(f"session {session_id!r} already exists")
            counts = block_token_count(layout, tokens)
            if len(counts) != len(chain):
                raise InvalidInputError(
                    f"{tokens} tokens make {len(counts)} blocks, but the chain has {len(chain)}"
                )
            missing = self._cold.missing([k for k in chain if k not in self._blocks])
            if missing:
                raise BlockLostError(
                    f"session {session_id!r}: {len(missing)} of {len(chain)} blocks are in no "
                    f"tier (first missing {bytes(missing[0]).hex()})"
                )
            now = self._clock()
            prio = _priority(priority)
            s = _Session(
                session_id,
                layout,
                namespace,
                prio,
                created_at=now,
                last_access=now,
                chain=list(chain),
                tokens=tokens,
                turn=turn,
                state=SessionState.ARCHIVED,
            )
            for i, key in enumerate(chain):
                entry = self._blocks.get(key)
                if entry is None:
                    entry = _Block(
                        key,
                        chain[i - 1] if i else None,
                        layout,
                        counts[i],
                        prio,
                        last_access=now,
                        in_cold=True,
                    )
                    self._blocks[key] = entry
                self._incref(entry, s, active=False, now=now)
            self._sessions[session_id] = s
            self._debug_check()
            return self._info(s)

    # ------------------------------------------------------------------ sessions

    def create_session(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str = "default",
        priority: Priority | str = Priority.NORMAL,
    ) -> SessionInfo:
        """Register a new, empty session.

        Raises:
            InvalidInputError: bad id, namespace or priority, or the id exists.
        """
        with self._lock:
            self._ensure_open()
            check_session_id(session_id)
            if not isinstance(layout, KVLayout):
                raise InvalidInputError(f"layout must be a KVLayout, got {type(layout).__name__}")
            if not isinstance(namespace, str) or not namespace:
                raise InvalidInputError(f"namespace must be a non-empty str, got {namespace!r}")
            prio = _priority(priority)
            if session_id in self._sessions:
                raise ConflictError(f"session {session_id!r} already exists")
            now = self._clock()
            s = _Session(session_id, layout, namespace, prio, created_at=now, last_access=now)
            self._sessions[session_id] = s
            return self._info(s)

    def session(self, session_id: str) -> SessionInfo:
        with self._lock:
            return self._info(self._session(session_id))

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def set_priority(self, session_id: str, priority: Priority | str) -> SessionInfo:
        """Change a session's class; its blocks move to that class's eviction queue."""
        with self._lock:
            s = self._session(session_id)
            s.priority = _priority(priority)
            now = self._clock()
            for key in s.chain:
                self._raise_priority(self._blocks[key], s.priority, now, force=True)
            return self._info(s)

    def delete_session(self, session_id: str) -> None:
        """Forget a session; blocks no other session holds are freed from every tier."""
        with self._lock:
            s = self._session(session_id)
            active = s.state is SessionState.ACTIVE
            for key in dict.fromkeys(s.chain):
                self._decref(key, active=active)
            del self._sessions[session_id]
            if not active:
                self._cold.remove_manifest(session_id)
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
            s = self._session(session_id)
            blocks = split_kv(s.layout, keys, values)
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
                caller), kept and served with the block; computed on first read
                when absent.
            chain: the chain of ``token_ids`` as the caller hashed it (the
                gateway hashes once, at the trust boundary); hashed here when
                absent.

        Returns:
            The new chain and what was written, deduplicated and released.

        Raises:
            UnknownSessionError: no such session.
            LayoutMismatchError: a block's shape/dtype disagrees with the layout
                or with the token count of its position.
            InvalidInputError: missing blocks, bad token ids. Nothing is changed.
        """
        with self._lock:
            self._ensure_open()
            s = self._session(session_id)
            tokens = token_array(token_ids)
            counts = block_token_count(s.layout, int(tokens.size))
            if isinstance(start_block, bool) or not isinstance(start_block, int):
                raise InvalidInputError(f"start_block must be an int, got {start_block!r}")
            if not 0 <= start_block <= len(counts):
                raise InvalidInputError(
                    f"start_block must be in [0, {len(counts)}] for {tokens.size} tokens, "
                    f"got {start_block}"
                )
            if len(blocks) != len(counts) - start_block:
                raise InvalidInputError(
                    f"{tokens.size} tokens make {len(counts)} blocks; from block {start_block} "
                    f"expected {len(counts) - start_block} blocks, got {len(blocks)}"
                )
            if checksums is not None and len(checksums) != len(blocks):
                raise InvalidInputError(
                    f"{len(blocks)} blocks came with {len(checksums)} checksums"
                )
            for i, block in enumerate(blocks, start=start_block):
                n = s.layout.check_block(block)
                if n != counts[i]:
                    raise LayoutMismatchError(f"block {i} must hold {counts[i]} tokens, got {n}")
            if chain is None:
                chain = chain_hashes(tokens, s.layout, s.namespace)
            elif len(chain) != len(counts):
                raise InvalidInputError(
                    f"{tokens.size} tokens make {len(counts)} blocks, the chain given has "
                    f"{len(chain)}"
                )
            chain = [BlockHash(bytes(k)) for k in chain]
            for i in range(start_block):
                if chain[i] not in self._blocks:
                    raise InvalidInputError(
                        f"block {i} was not sent and is not stored; send blocks from index {i}"
                    )
            # Validation is over: from here on the store changes.
            now = self._clock()
            old_chain = s.chain
            old_set = set(old_chain)
            active = s.state is SessionState.ACTIVE
            created = self._admit_new_blocks(s, chain, counts, blocks, start_block, now, checksums)
            new = len(created)
            dedup = 0
            for i, key in enumerate(chain):
                entry = self._blocks[key]
                if i >= start_block and key not in old_set and key not in created:
                    dedup += 1
                    self._counters["dedup_bytes_saved"] += s.layout.block_nbytes(entry.tokens)
                if key not in old_set:
                    self._incref(entry, s, active=active, now=now)
                else:
                    entry.rounds += 1
            new_set = set(chain)
            released = 0
            for key in dict.fromkeys(old_chain):
                if key not in new_set:
                    self._decref(key, active=active)
                    released += 1
            if old_chain and old_chain[-1] not in new_set and len(old_chain) <= len(chain):
                s.tail_rewrites += 1
            if counts and counts[-1] < s.layout.block_tokens:
                tail = self._blocks[chain[-1]]
                tail.rewrites = max(tail.rewrites, s.tail_rewrites)
            s.chain = chain
            s.tokens = int(tokens.size)
            s.turn += 1
            s.last_access = now
            if s.state is not SessionState.ACTIVE:
                self._set_active(s, now)
            self._counters["dedup_hits"] += dedup
            self._debug_check()
            return PutResult(tuple(chain), new, dedup, released)

    def _admit_new_blocks(
        self,
        s: _Session,
        chain: list[BlockHash],
        counts: list[int],
        blocks: Sequence[torch.Tensor],
        start_block: int,
        now: float,
        checksums: Sequence[int] | None = None,
    ) -> set[BlockHash]:
        """Store the blocks of ``chain`` not stored yet; all or nothing."""
        created: list[BlockHash] = []
        try:
            for i in range(start_block, len(chain)):
                key = chain[i]
                if key in self._blocks:
                    continue
                entry = _Block(
                    key=key,
                    parent=chain[i - 1] if i else None,
                    layout=s.layout,
                    tokens=counts[i],
                    priority=s.priority,
                    last_access=now,
                    crc32=None if checksums is None else checksums[i - start_block],
                )
                self._blocks[key] = entry
                created.append(key)
                self._admit(entry, blocks[i - start_block], now)
        except BaseException:
            # e.g. CapacityError from a full cold tier: undo this put's new blocks
            # so nothing half-stored stays behind (older blocks were not touched).
            for key in reversed(created):
                entry = self._blocks[key]
                if entry.tier is not None or entry.in_cold:
                    self._free(entry)
                else:
                    del self._blocks[key]
            raise
        return set(created)

    # ------------------------------------------------------------------ reads

    def contains(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._blocks

    def locate(self, key: BlockHash) -> Tier | None:
        """Fastest tier holding ``key``, or None when it is not stored."""
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                return None
            return entry.tier if entry.tier is not None else Tier.COLD

    def get(self, key: BlockHash, *, stream: str | None = None) -> torch.Tensor:
        """A copy of block ``key`` in its layout's dtype, promoted to the hot tier.

        Args:
            key: the block hash.
            stream: the reader (session id) for the prefetcher's transition model.

        Raises:
            UnknownBlockError: not stored.
            CorruptDataError: the only copy failed its checksum (never served).
        """
        return self.fetch(key, stream=stream).block

    def fetch(self, key: BlockHash, *, stream: str | None = None) -> FetchedBlock:
        """Like :meth:`get`, and also the tier the block was found in."""
        with self._lock:
            entry, found, now = self._count_read(key)
            block = self._materialize(entry)
            if found is Tier.HOT:
                self._hot.access(key, now)
            elif entry.pins == 0 and self._promote(entry, block, now):
                self._note_materialized(entry, block)
            self._prefetcher.observe(key, stream)
            return FetchedBlock(key, block, found, entry.exact)

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
            fetched = self.fetch(chain[i], stream=session_id)
            self.prefetch(chain[i + 1 : min(i + 1 + window, stop)])
            yield fetched

    def match_prefix(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int] | np.ndarray
    ) -> PrefixMatch:
        """How many leading tokens of ``token_ids`` are cached (any session, same namespace)."""
        with self._lock:
            matched: list[BlockHash] = []
            tokens = 0
            for key in chain_hashes(token_ids, layout, namespace):
                entry = self._blocks.get(key)
                if entry is None:
                    break
                matched.append(key)
                tokens += entry.tokens
            return PrefixMatch(tokens, tuple(matched))

    @contextlib.contextmanager
    def pinned_reads(
        self, keys: Sequence[BlockHash], *, stream: str | None = None
    ) -> Iterator[list[FetchedBlock]]:
        """Blocks read as :meth:`fetch` reads them, pinned while the ``with`` block runs.

        Each block is a zero-copy view of its arena where it sits there raw in
        the model dtype (the usual case after promotion), else a decoded copy;
        the views must not be used after the block ends.
        """
        taken: list[_Block] = []
        out: list[FetchedBlock] = []
        try:
            with self._lock:
                for key in keys:
                    found = self._access(key, stream)
                    entry = self._blocks[key]
                    self._pin(entry)
                    taken.append(entry)
                    out.append(FetchedBlock(key, self._view(entry), found, entry.exact))
            yield out
        finally:
            with self._lock:
                for entry in taken:
                    self._unpin(entry)

    def plan_reads(
        self,
        keys: Sequence[BlockHash],
        *,
        stream: str | None = None,
        ahead: Sequence[BlockHash] = (),
    ) -> list[PlanEntry | None]:
        """Pin blocks where a reader can map them, and say where (the same-node path).

        Each block is promoted to the hot tier as :meth:`fetch` would; a block
        whose memory copy is raw in the model dtype in a shared-memory arena is
        pinned and planned. A block that is not (int8 in the warm tier with the
        hot tier full of pinned blocks, or a device arena on a GPU) answers None:
        the caller serves it another way. All or nothing on errors: nothing
        stays pinned when this raises.

        ``ahead`` are blocks a reader will probably want next (read-ahead):
        they are planned, after ``keys``, only where they sit in memory already,
        never promoted or counted as read, so read-ahead never makes a lazy
        resume eager. Their entries follow those of ``keys`` (None: not planned).

        Raises:
            UnknownBlockError: a key is not stored.
        """
        planned: list[PlanEntry | None] = []
        pinned: list[_Block] = []
        with self._lock:
            try:
                for key in keys:
                    found = self._access(key, stream)
                    entry = self._blocks[key]
                    plan = self._plan(entry, found)
                    if plan is not None:
                        self._pin(entry)
                        pinned.append(entry)
                    planned.append(plan)
                for key in ahead:
                    held = self._blocks.get(key)
                    plan = None
                    if held is not None and held.tier is not None:
                        plan = self._plan(held, held.tier)
                    if held is not None and plan is not None:
                        self._pin(held)
                        pinned.append(held)
                    planned.append(plan)
            except BaseException:
                for entry in pinned:
                    self._unpin(entry)
                raise
        return planned

    def unpin_blocks(self, keys: Sequence[BlockHash]) -> None:
        """Release the pins :meth:`plan_reads` took (once per planned key)."""
        with self._lock:
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None or entry.pins == 0:
                    raise_invariant(f"unpin of block {key.hex()} that holds no pin")
                    return
                self._unpin(entry)

    def _access(self, key: BlockHash, stream: str | None) -> Tier:
        """Count a read of ``key`` and bring it to the hot tier where room can be made."""
        entry, found, now = self._count_read(key)
        if found is Tier.HOT:
            self._hot.access(key, now)
        elif entry.pins == 0:
            block = self._materialize(entry)
            if self._promote(entry, block, now):
                self._note_materialized(entry, block)
        self._prefetcher.observe(key, stream)
        return found

    def _count_read(self, key: BlockHash) -> tuple[_Block, Tier, float]:
        """Account a read of ``key`` (hits, access statistics, prefetch use).

        Raises:
            UnknownBlockError: not stored (counted as a miss).
        """
        self._ensure_open()
        entry = self._blocks.get(key)
        if entry is None:
            self._counters["misses"] += 1
            self.access_stats.record(key, None, self._clock())
            raise UnknownBlockError(f"no block {key.hex()} in this store")
        now = self._clock()
        found = entry.tier if entry.tier is not None else Tier.COLD
        self._hits[found] += 1
        self.access_stats.record(key, found.value, now)
        if entry.prefetched:
            entry.prefetched = False
            self._counters["prefetch_used"] += 1
        entry.last_access = now
        return entry, found, now

    def _note_demoted(self, entry: _Block, *, lossy: bool) -> None:
        """The copy that remains went through a lossy step: reads are no longer exact."""
        if lossy:
            entry.exact = False
            entry.crc32 = None

    def _note_materialized(self, entry: _Block, block: torch.Tensor) -> None:
        """The hot copy was rebuilt from a lossy copy: its checksum is of the new bytes."""
        if not entry.exact:
            entry.crc32 = None

    def _plan(self, entry: _Block, found: Tier) -> PlanEntry | None:
        if entry.tier is None:
            return None
        tier = self._tier(entry.tier)
        segment = getattr(tier.arena, "name", None)
        where = tier.location(entry.key)
        if segment is None or where is None:
            return None
        offset, shape, dtype = where
        if dtype != entry.layout.torch_dtype:
            return None
        nbytes = entry.layout.block_nbytes(entry.tokens)
        if entry.crc32 is None:
            stored = tier.load(entry.key)
            if isinstance(stored, QuantizedBlock):
                return None
            entry.crc32 = _crc32(stored)
        return PlanEntry(
            bytes(entry.key),
            found,  # a Tier, which is a str
            str(segment),
            tier.capacity_bytes,
            offset,
            nbytes,
            shape,
            entry.layout.dtype,
            entry.crc32,
            entry.exact,
        )

    def prefetch(self, keys: Sequence[BlockHash]) -> int:
        """Bring blocks into free hot-tier space (never evicting for it). Returns how many."""
        moved = 0
        with self._lock:
            if self._closed:
                return 0
            now = self._clock()
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None or entry.tier is Tier.HOT or entry.pins:
                    continue
                need = entry.layout.block_nbytes()
                if self._hot.capacity_bytes - self._hot.used_bytes < need:
                    break
                block = self._materialize(entry)
                if self._promote(entry, block, now, evict=False):
                    self._note_materialized(entry, block)
                    entry.prefetched = True
                    moved += 1
            self._counters["prefetched"] += moved
        return moved

    def prefetch_predicted(self, key: BlockHash) -> int:
        """Prefetch what the Markov model expects to follow ``key``."""
        with self._lock:
            predicted = [k for k, _ in self._prefetcher.predict(key)]
        return self.prefetch(predicted)

    # ------------------------------------------------------------------ suspend / resume

    def suspend(self, session_id: str, *, offline: bool = False) -> SessionInfo:
        """Write the session's blocks to the cold tier and free what no active session needs.

        Args:
            offline: the user went away for long: unshared blocks may use the
                lossy cold codec (Delta+RL).
        """
        with self._lock:
            self._ensure_open()
            s = self._session(session_id)
            if s.state is SessionState.ACTIVE:
                for key in dict.fromkeys(s.chain):
                    self._blocks[key].active_refs -= 1
            # One batched cold write for the whole session (one archive call, not
            # one per block), then the memory copies no active session needs go.
            pending = [
                self._blocks[key] for key in dict.fromkeys(s.chain) if not self._blocks[key].in_cold
            ]
            self._ensure_cold_many(pending, offline=offline)
            for key in dict.fromkeys(s.chain):
                entry = self._blocks[key]
                if entry.active_refs == 0 and entry.pins == 0 and entry.tier is not None:
                    self._tier(entry.tier).remove(key)
                    entry.tier = None
                    self._counters["demotions"] += 1
                    # The cold copy is the one left: a lossy codec makes reads inexact.
                    self._note_demoted(entry, lossy=not CODECS[entry.cold_codec or "none"].lossless)
            in_memory = any(self._blocks[k].tier is not None for k in s.chain)
            s.state = SessionState.SUSPENDED if in_memory else SessionState.ARCHIVED
            self._cold.put_manifest(session_id, self._manifest(s))
            self._debug_check()
            return self._info(s)

    def resume(self, session_id: str, *, prefetch: bool = True) -> ResumeHandle:
        """Mark a session active and answer at once with its chain and block locations.

        Args:
            prefetch: bring the first ``max_prefetch_blocks`` blocks into free
                hot-tier space before answering (an actor passes False and
                prefetches in a separate call, so the answer is immediate).
                The rest come as ``read_session``/``get`` ask for them.
        """
        with self._lock:
            s = self._session(session_id)
            now = self._clock()
            if s.state is not SessionState.ACTIVE:
                self._set_active(s, now)
            s.last_access = now
            head = s.chain[: self.config.prefetch.max_prefetch_blocks]
        if prefetch:
            self.prefetch(head)
        with self._lock:
            locations = tuple(
                BlockLocation(k, self.locate(k) or Tier.COLD, self._blocks[k].tokens)
                for k in s.chain
            )
            return ResumeHandle(session_id, s.tokens, locations)

    # ------------------------------------------------------------------ stats

    def stats(self) -> StoreStats:
        with self._lock:
            self._ensure_open()
            tiers: dict[Tier, TierStats] = {}
            for tier in (self._hot, self._warm):
                arena = tier.arena_stats()
                tiers[tier.tier] = TierStats(
                    tier.tier,
                    tier.capacity_bytes,
                    tier.used_bytes,
                    len(tier),
                    self._hits[tier.tier],
                    tier.evictions,
                    arena.external_fragmentation,
                )
            cold = self._cold.stats()
            tiers[Tier.COLD] = TierStats(
                Tier.COLD,
                self._cold.capacity_bytes,
                cold.live_bytes,
                cold.blocks,
                self._hits[Tier.COLD],
                0,
                cold.dead_bytes / max(1, cold.live_bytes + cold.dead_bytes),
            )
            unique = sum(b.layout.block_nbytes(b.tokens) for b in self._blocks.values())
            logical = sum(
                self._blocks[k].layout.block_nbytes(self._blocks[k].tokens)
                for s in self._sessions.values()
                for k in s.chain
            )
            c = self._counters
            return StoreStats(
                tiers=tiers,
                sessions=len(self._sessions),
                blocks=len(self._blocks),
                logical_bytes=logical,
                unique_bytes=unique,
                dedup_hits=c["dedup_hits"],
                dedup_bytes_saved=c["dedup_bytes_saved"],
                misses=c["misses"],
                promotions=c["promotions"],
                demotions=c["demotions"],
                prefetched=c["prefetched"],
                prefetch_used=c["prefetch_used"],
                precision_fallbacks=c["precision_fallbacks"],
            )

    # ------------------------------------------------------------------ diagnostics hooks

    def refcount_snapshot(
        self,
    ) -> tuple[dict[BlockHash, tuple[int, int]], dict[str, list[BlockHash]]]:
        """(refcount, pins) per block and the chain per session, for the invariant checker."""
        with self._lock:
            blocks = {k: (b.refcount, b.pins) for k, b in self._blocks.items()}
            chains = {sid: list(s.chain) for sid, s in self._sessions.items()}
            return blocks, chains

    def leak_report(self) -> list[Leak]:
        """Blocks still referenced or pinned, with the sessions holding them.

        Empty once every session is deleted and every reader has finished;
        anything listed then is a leak.
        """
        with self._lock:
            return find_leaks(*self.refcount_snapshot())

    def check_invariants(self) -> None:
        """Raise :class:`~memkv.errors.InvariantViolationError` if the bookkeeping is broken."""
        with self._lock:
            blocks, chains = self.refcount_snapshot()
            check_refcounts(blocks, chains)
            for key, entry in self._blocks.items():
                present = entry.tier is not None and key in self._tier(entry.tier)
                if entry.tier is not None and not present:
                    raise_invariant(f"block {key.hex()} thinks it is {entry.tier} but is not")
                if entry.tier is None and not entry.in_cold:
                    raise_invariant(f"block {key.hex()} is in no tier")

    # ------------------------------------------------------------------ internals

    def _debug_check(self) -> None:
        if self._check:
            self.check_invariants()

    def _ensure_open(self) -> None:
        if self._closed:
            raise ClosedError("the TieredStore is closed")

    def _session(self, session_id: str) -> _Session:
        self._ensure_open()
        s = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None:
            if session_id in self.lost_sessions:
                raise BlockLostError(
                    f"session {session_id!r} is lost: {self.lost_sessions[session_id]}"
                )
            raise UnknownSessionError(f"no session {session_id!r}")
        return s

    def _info(self, s: _Session) -> SessionInfo:
        return SessionInfo(
            s.session_id,
            s.namespace,
            s.layout,
            s.priority,
            s.state,
            s.tokens,
            s.turn,
            tuple(s.chain),
            s.created_at,
            s.last_access,
        )

    def _tier(self, tier: Tier) -> MemoryTier:
        return self._hot if tier is Tier.HOT else self._warm

    def _precision_for(self, layout: KVLayout) -> PrecisionPolicy:
        policy = self._precision.get(layout.dtype)
        if policy is None:
            policy = PrecisionPolicy(self.config.precision, layout.dtype)
            self._precision[layout.dtype] = policy
        return policy

    def _manifest(self, s: _Session) -> dict[str, Any]:
        return {
            "session_id": s.session_id,
            "namespace": s.namespace,
            "layout": s.layout.to_dict(),
            "priority": s.priority.value,
            "tokens": s.tokens,
            "turn": s.turn,
            "chain": list(s.chain),
        }

    def _set_active(self, s: _Session, now: float) -> None:
        # The manifest describes the session as suspended; once it changes again
        # the manifest would go stale, so it goes (an active session lives in
        # memory and is re-registered by its owner after a crash).
        self._cold.remove_manifest(s.session_id)
        s.state = SessionState.ACTIVE
        for key in dict.fromkeys(s.chain):
            self._blocks[key].active_refs += 1

    def _incref(self, entry: _Block, s: _Session, *, active: bool, now: float) -> None:
        entry.refcount += 1
        if active:
            entry.active_refs += 1
        self._raise_priority(entry, s.priority, now)

    def _raise_priority(
        self, entry: _Block, priority: Priority, now: float, force: bool = False
    ) -> None:
        # A shared block belongs to the highest class of the sessions holding it.
        if not force and PRIORITY_RANK[priority] <= PRIORITY_RANK[entry.priority]:
            return
        entry.priority = priority
        if entry.tier is not None and entry.pins == 0:
            self._tier(entry.tier).reclassify(entry.key, priority, now)

    def _decref(self, key: BlockHash, *, active: bool) -> None:
        entry = self._blocks[key]
        entry.refcount -= 1
        if active:
            entry.active_refs -= 1
        if entry.refcount == 0 and entry.pins == 0:
            self._free(entry)

    def _free(self, entry: _Block) -> None:
        if entry.tier is not None:
            self._tier(entry.tier).remove(entry.key)
        if entry.in_cold:
            self._cold.remove(entry.key)
        del self._blocks[entry.key]

    def _pin(self, entry: _Block) -> None:
        entry.pins += 1
        if entry.pins == 1 and entry.tier is not None:
            self._tier(entry.tier).pin(entry.key)

    def _unpin(self, entry: _Block) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            if entry.tier is not None:
                self._tier(entry.tier).unpin(entry.key)
            if entry.refcount == 0:
                self._free(entry)

    def _view(self, entry: _Block) -> torch.Tensor:
        if entry.tier is None:
            # Not in memory (no room even after eviction): a decoded copy.
            return self._materialize(entry)
        stored = self._tier(entry.tier).load(entry.key)
        if isinstance(stored, QuantizedBlock) or stored.dtype != entry.layout.torch_dtype:
            return self._materialize(entry)
        return stored

    def _load_stored(self, entry: _Block) -> StoredBlock:
        if entry.tier is not None:
            return self._tier(entry.tier).load(entry.key)
        return self._cold.load(entry.key)

    def _materialize(self, entry: _Block) -> torch.Tensor:
        """An owned copy of the block in its layout's dtype, on the CPU."""
        stored = self._load_stored(entry)
        dtype = entry.layout.torch_dtype
        if isinstance(stored, QuantizedBlock):
            from memkv.storage.precision import dequantize_int8

            return dequantize_int8(stored, dtype).cpu()
        if stored.dtype == dtype:
            return stored.to("cpu", copy=True)
        return stored.to(device="cpu", dtype=dtype)

    def _admit(self, entry: _Block, block: torch.Tensor, now: float) -> None:
        """Place a new block: hot if room can be made, else warm, else cold."""
        if self._put_memory(self._hot, entry, block, now):
            entry.tier = Tier.HOT
            return
        warm = self._to_warm_precision(entry, block, now)
        if self._put_memory(self._warm, entry, warm, now):
            entry.tier = Tier.WARM
            self._note_demoted(entry, lossy=warm is not block)
            return
        self._ensure_cold(entry, block)
        entry.tier = None
        self._note_demoted(entry, lossy=not CODECS[entry.cold_codec or "none"].lossless)

    def _put_memory(
        self, tier: MemoryTier, entry: _Block, block: StoredBlock, now: float, evict: bool = True
    ) -> bool:
        # A partial block reserves a full block's slot (see Arena.view).
        data = block.data if isinstance(block, QuantizedBlock) else block
        reserve = entry.layout.block_nbytes(itemsize=data.element_size())
        while True:
            if tier.put(
                entry.key,
                block,
                parent=entry.parent,
                priority=entry.priority,
                now=now,
                reserve_bytes=reserve,
            ):
                return True
            if not evict or not self._evict_one(tier, now):
                return False

    def _evict_one(self, tier: MemoryTier, now: float) -> bool:
        """Move the tier's victim one tier down. False when nothing can be evicted."""
        victim = tier.pop_victim(now)
        if victim is None:
            return False
        key = BlockHash(cast(bytes, victim))
        entry = self._blocks[key]
        stored = tier.load(key)
        try:
            if tier is self._hot:
                warm = self._to_warm_precision(entry, stored, now)
                if self._put_memory(self._warm, entry, warm, now):
                    entry.tier = Tier.WARM
                    self._note_demoted(entry, lossy=warm is not stored)
                else:
                    self._ensure_cold(entry, stored)
                    entry.tier = None
            else:
                self._ensure_cold(entry, stored)
                entry.tier = None
            if entry.tier is None:
                lossless = CODECS[entry.cold_codec or "none"].lossless
                self._note_demoted(entry, lossy=not lossless)
        except CapacityError:
            tier.restore(key, now)
            raise
        tier.discard(key)
        self._counters["demotions"] += 1
        return True

    def _to_warm_precision(self, entry: _Block, block: StoredBlock, now: float) -> StoredBlock:
        if isinstance(block, QuantizedBlock):
            return block
        choice = self._precision_for(entry.layout).choose(
            turn=entry.rounds,
            refcount=entry.refcount,
            idle_seconds=max(0.0, now - entry.last_access),
        )
        try:
            if choice == "int8":
                return quantize_int8(block)
            if block.dtype == _TORCH_DTYPES[choice]:
                return block
            return convert(block, choice)
        except PrecisionOverflowError:
            # Values outside fp16's range: keep the model dtype rather than corrupt them.
            self._counters["precision_fallbacks"] += 1
            return block

    def _ensure_cold(self, entry: _Block, stored: StoredBlock, offline: bool = False) -> None:
        if entry.in_cold:
            return
        codec = self._cold_codec(entry, offline)
        self._cold.put(entry.key, stored, fingerprint=entry.layout.fingerprint, codec=codec)
        self._mark_cold(entry, stored, codec)

    def _ensure_cold_many(self, entries: Sequence[_Block], *, offline: bool) -> None:
        """Cold copies of ``entries`` in one batch of the cold backend."""
        items = []
        for entry in entries:
            if entry.in_cold:
                continue
            items.append((entry, self._load_stored(entry), self._cold_codec(entry, offline)))
        if not items:
            return
        self._cold.put_many(
            [(e.key, stored, e.layout.fingerprint, codec) for e, stored, codec in items]
        )
        for entry, stored, codec in items:
            self._mark_cold(entry, stored, codec)

    def _cold_codec(self, entry: _Block, offline: bool) -> str:
        # Partial tails are rewritten every turn; the policy stores often
        # rewritten ones uncompressed (compression would be wasted on them).
        return self._codec_policy.choose(
            "cold",
            update_count=entry.rewrites,
            offline=offline and entry.refcount <= 1,
            turns_old=entry.rounds,
        )

    @staticmethod
    def _mark_cold(entry: _Block, stored: StoredBlock, codec: str) -> None:
        entry.in_cold = True
        # An int8 block goes down as its codes and scales (the int8 codec), never
        # dequantised first: its cold frame is no larger than its warm copy.
        entry.cold_codec = "int8" if isinstance(stored, QuantizedBlock) else codec

    def _promote(self, entry: _Block, block: torch.Tensor, now: float, evict: bool = True) -> bool:
        """Move a block to the hot tier (``block`` is its materialised copy)."""
        source = entry.tier
        if source is Tier.HOT:
            return True
        # Pin the source copy so the evictions we may trigger cannot pick it.
        if source is not None:
            self._tier(source).pin(entry.key)
        try:
            placed = self._put_memory(self._hot, entry, block, now, evict=evict)
        finally:
            if source is not None:
                self._tier(source).unpin(entry.key)
        if not placed:
            return False
        if source is not None:
            self._tier(source).remove(entry.key)
        entry.tier = Tier.HOT
        self._counters["promotions"] += 1
        return True


_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _crc32(block: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes (no copy)."""
    raw = block.view(torch.int16) if block.dtype is torch.bfloat16 else block
    return crc32(raw.numpy().data.cast("B"))


def hot_segment_name(warm_name: str | None) -> str | None:
    """The shared-memory name of a CPU hot arena beside the warm pool ``warm_name``."""
    return None if warm_name is None else f"{warm_name}-hot"


def raise_invariant(message: str) -> None:
    from memkv.errors import InvariantViolationError

    raise InvariantViolationError(message)


def _whole_units(capacity: int, unit: int, tier: str) -> int:
    # Round down: a tier never takes more memory than it was given.
    if capacity < unit:
        raise ConfigError(
            f"{tier}_capacity_bytes ({capacity}) must be at least one allocator unit ({unit})"
        )
    return capacity // unit * unit


def _priority(p: Priority | str) -> Priority:
    try:
        return Priority(p)
    except ValueError:
        raise InvalidInputError(
            f"priority must be one of {[x.value for x in Priority]}, got {p!r}"
        ) from None
