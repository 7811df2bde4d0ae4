"""The storage tiers behind one interface, so the tier order is a list.

* :class:`MemoryTier` — a block copy lives in an :class:`~memkv.storage.arena.Arena`
  (device memory for *hot*, host shared memory for *warm*), raw or int8, with one
  eviction policy per priority class so background blocks go first and high
  priority blocks last.
* :class:`ColdTier` — codec frames in the append-only
  :class:`~memkv.storage.segments.SegmentStore`.

Each tier offers ``contains / load / put / remove / close``; memory tiers add
``pin / unpin / access / pop_victim``. The tiers know nothing of sessions or
refcounts: the :class:`~memkv.storage.block_pool.BlockPool` owns that bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch

from memkv.errors import CapacityError, CorruptDataError, InvalidInputError
from memkv.protocol.enums import EVICTION_ORDER, Priority, Tier
from memkv.protocol.hashing import HASH_BYTES
from memkv.storage.arena import Allocation, Arena, ArenaStats
from memkv.storage.codecs import decode_frame, encode_stored, peek_header
from memkv.storage.codecs.frame import CODEC_NAMES
from memkv.storage.config import ArchiveConfig, CodecConfig, EvictionConfig
from memkv.storage.eviction import EvictionPolicy, make_policy
from memkv.storage.precision import EncodedBlock, QuantizedBlock
from memkv.storage.segments import SegmentStore

__all__ = [
    "ColdBackend",
    "ColdStats",
    "ColdTier",
    "MemoryTier",
    "Priority",
    "StoredBlock",
    "Tier",
    "stored_data",
    "stored_nbytes",
]


#: A block as a memory tier holds it: raw in a float dtype, int8 with scales, or
#: a codec frame.
StoredBlock = torch.Tensor | QuantizedBlock | EncodedBlock


@dataclass(slots=True)
class _Resident:
    """One block copy in a memory tier."""

    data: Allocation
    shape: tuple[int, ...]
    dtype: torch.dtype  # dtype of the bytes in the arena (int8 when quantised)
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    float_dtype: torch.dtype  # what the block dequantises to
    priority: Priority
    parent: Hashable | None  # the previous block of its chain (for prefix-aware eviction)
    codec: str | None = None  # the bytes are a frame of this codec

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def stored_data(block: StoredBlock) -> torch.Tensor:
    """The tensor of a stored block that lives in an arena (scales are kept beside it)."""
    if isinstance(block, QuantizedBlock):
        return block.data
    if isinstance(block, EncodedBlock):
        return block.frame
    return block


def stored_nbytes(block: StoredBlock) -> int:
    """Bytes a stored block occupies in an arena."""
    data = stored_data(block)
    return data.numel() * data.element_size()


class MemoryTier:
    """A memory tier: an arena of block copies and its eviction policies.

    Args:
        tier: ``Tier.HOT`` or ``Tier.WARM``.
        arena: where the bytes live; the tier closes it on :meth:`close`.
        eviction: which policy ranks victims (one instance per priority class).
    """

    def __init__(self, tier: Tier, arena: Arena, eviction: EvictionConfig) -> None:
        if tier is Tier.COLD:
            raise InvalidInputError("a MemoryTier is hot or warm, not cold")
        self.tier = tier
        self.arena = arena
        self._residents: dict[Hashable, _Resident] = {}
        self._policies: dict[Priority, EvictionPolicy[Any]] = {
            p: make_policy(eviction) for p in EVICTION_ORDER
        }
        self.evictions = 0
        self._used_bytes = 0

    # -- queries -------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._residents

    def __len__(self) -> int:
        return len(self._residents)

    @property
    def capacity_bytes(self) -> int:
        return self.arena.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by resident blocks (what eviction frees)."""
        return self._used_bytes

    def arena_stats(self) -> ArenaStats:
        return self.arena.stats()

    def keys(self) -> list[Hashable]:
        return list(self._residents)

    # -- data ----------------------------------------------------------------

    def put(
        self,
        key: Hashable,
        block: StoredBlock,
        *,
        parent: Hashable | None,
        priority: Priority,
        now: float,
        reserve_bytes: int | None = None,
        write: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        placed: Allocation | None = None,
    ) -> bool:
        """Copy ``block`` into the arena. Returns False when there is no room (expected).

        Args:
            reserve_bytes: allocate this much (>= the block's size): a partial
                block takes a full block's slot so one size class serves a layout.
            write: ``write(dst, src)`` copies the block's data into its place (by
                default ``dst.copy_(src)``): the pool checksums the bytes as it copies.
            placed: the block's bytes already lie in this live allocation of the
                arena (a writer filled a reserved slot): it becomes the block's own,
                nothing is copied. ``block`` must be its view.

        Raises:
            InvalidInputError: the key is already resident, or ``placed`` is too small.
        """
        if key in self._residents:
            raise InvalidInputError(f"block {_short(key)} is already in the {self.tier} tier")
        data = stored_data(block)
        nbytes = stored_nbytes(block)
        if reserve_bytes is not None:
            if reserve_bytes < nbytes:
                raise InvalidInputError(
                    f"reserve_bytes ({reserve_bytes}) is less than the block's {nbytes} bytes"
                )
            nbytes = reserve_bytes
        if placed is not None:  # the writer put the bytes there: nothing to copy
            if placed.nbytes < nbytes:
                raise InvalidInputError(
                    f"a placed slot of {placed.nbytes} bytes cannot hold a block of {nbytes}")
            allocation = placed
        else:
            fresh = self.arena.allocate(nbytes)
            if fresh is None:
                return False
            allocation = fresh
            if write is None:
                self.arena.write(allocation, data, prefix=True)
            else:
                write(self.arena.view(allocation, data.shape, data.dtype, prefix=True), data)
        if isinstance(block, QuantizedBlock):
            k_scale: torch.Tensor | None = block.k_scale.cpu()
            v_scale: torch.Tensor | None = block.v_scale.cpu()
            float_dtype = block.dtype
        else:
            k_scale = v_scale = None
            float_dtype = block.dtype if isinstance(block, EncodedBlock) else data.dtype
        self._residents[key] = _Resident(
            allocation,
            tuple(data.shape),
            data.dtype,
            k_scale,
            v_scale,
            float_dtype,
            priority,
            parent,
            block.codec if isinstance(block, EncodedBlock) else None,
        )
        self._used_bytes += allocation.nbytes
        self._insert(key, self._residents[key], now)
        return True

    def _insert(self, key: Hashable, r: _Resident, now: float) -> None:
        # The policy links a child to its parent only within one priority class.
        policy = self._policies[r.priority]
        policy.insert(key, now, r.parent if r.parent in policy else None)

    def load(self, key: Hashable) -> StoredBlock:
        """The resident copy as views into the arena (no copy): valid until removed."""
        r = self._residents[key]
        data = self.arena.view(r.data, r.shape, r.dtype, prefix=True)
        if r.codec is not None:
            return EncodedBlock(frame=data, dtype=r.float_dtype, codec=r.codec)
        if r.k_scale is None or r.v_scale is None:
            return data
        return QuantizedBlock(data=data, k_scale=r.k_scale, v_scale=r.v_scale, dtype=r.float_dtype)

    def location(self, key: Hashable) -> tuple[int, tuple[int, ...], torch.dtype] | None:
        """Byte offset, shape and dtype of a raw resident copy; None for an int8 or
        encoded one.

        For readers that map the arena's segment themselves (the same-node path).
        """
        r = self._residents[key]
        if r.k_scale is not None or r.codec is not None:
            return None
        return r.data.offset, r.shape, r.dtype

    def stored_dtype(self, key: Hashable) -> torch.dtype:
        """The dtype the copy is kept in (``torch.int8`` when quantised)."""
        return self._residents[key].dtype

    def remove(self, key: Hashable) -> None:
        """Free the copy (the caller makes sure nobody reads it any more)."""
        r = self._residents.pop(key)
        self._policies[r.priority].remove(key)
        self.arena.free(r.data)
        self._used_bytes -= r.nbytes

    # -- policy --------------------------------------------------------------

    def access(self, key: Hashable, now: float) -> None:
        self._policies[self._residents[key].priority].access(key, now)

    def pin(self, key: Hashable) -> None:
        self._policies[self._residents[key].priority].pin(key)

    def unpin(self, key: Hashable) -> None:
        self._policies[self._residents[key].priority].unpin(key)

    def reclassify(self, key: Hashable, priority: Priority, now: float) -> None:
        """Move a resident block to another priority class (its history restarts)."""
        r = self._residents[key]
        if r.priority is priority:
            return
        self._policies[r.priority].remove(key)
        r.priority = priority
        self._insert(key, r, now)

    def pop_victim(self, now: float) -> Hashable | None:
        """Choose the next block to leave this tier, lowest priority class first.

        The victim is removed from the policy only; the caller moves its bytes and
        then calls :meth:`discard`.
        """
        for priority in EVICTION_ORDER:
            key = self._policies[priority].pop_victim(now)
            if key is not None:
                return key
        return None

    def discard(self, key: Hashable) -> None:
        """Free a victim returned by :meth:`pop_victim` (already out of its policy)."""
        r = self._residents.pop(key)
        self.arena.free(r.data)
        self._used_bytes -= r.nbytes
        self.evictions += 1

    def restore(self, key: Hashable, now: float) -> None:
        """Put a popped victim back into its policy (it could not be moved)."""
        self._insert(key, self._residents[key], now)

    def close(self) -> None:
        self._residents.clear()
        self.arena.close()


@dataclass(frozen=True, slots=True)
class ColdStats:
    blocks: int
    live_bytes: int
    dead_bytes: int


class ColdBackend(Protocol):
    """What the store needs of a cold tier: local segment files, or a remote archive.

    ``owns_sessions`` says whether the backend belongs to this store alone: then
    the store deletes the blocks it frees; a shared archive (a cluster's)
    leaves that to the router, which sees every session. Sessions themselves
    are never kept here (a journal keeps them: the router's, or the
    single-process store's :mod:`memkv.router.suspended`).
    """

    tier: Tier
    capacity_bytes: int | None
    owns_sessions: bool

    def __contains__(self, key: object) -> bool: ...
    def missing(self, keys: Sequence[bytes]) -> list[bytes]: ...
    def put(self, key: bytes, block: StoredBlock, *, fingerprint: bytes, codec: str) -> int: ...
    def put_many(
        self, items: Sequence[tuple[bytes, StoredBlock, bytes, str]], *, durable: bool = False
    ) -> list[int]: ...
    def sync(self) -> None: ...
    def load(self, key: bytes) -> torch.Tensor: ...
    def load_many(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """:meth:`load` of each key, in one call to the backend (a remote archive: one
        round trip for a reader's whole batch)."""
        ...

    def codecs(self, keys: Sequence[bytes]) -> list[str]:
        """The codec each stored block's frame was written with (from the index: no
        read). A store that holds blocks again after a restart learns from it which
        lossy step their only copy went through."""
        ...

    def remove(self, key: bytes) -> None: ...
    def block_keys(self) -> Iterator[bytes]: ...
    def stats(self) -> ColdStats: ...
    def live_bytes(self) -> int: ...
    def close(self) -> None: ...


class ColdTier:
    """Codec frames of blocks in append-only segment files.

    Args:
        archive: where and how the segment files are written.
        codecs: codec parameters (levels, bits).
        capacity_bytes: live bytes allowed on disk; None = limited by the disk.
    """

    tier = Tier.COLD
    owns_sessions = True

    def __init__(
        self, archive: ArchiveConfig, codecs: CodecConfig, capacity_bytes: int | None = None
    ) -> None:
        self.segments = SegmentStore(archive)
        self._codec_config = codecs
        self.capacity_bytes = capacity_bytes
        self.writes = 0
        self.bytes_written = 0

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and len(key) == HASH_BYTES and key in self.segments

    def __len__(self) -> int:
        return sum(1 for _ in self.block_keys())

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of ``keys`` that are not stored."""
        return [k for k in keys if k not in self]

    def block_keys(self) -> Iterator[bytes]:
        """Keys of the blocks on disk (manifests excluded)."""
        return (k for k in self.segments.keys() if len(k) == HASH_BYTES)

    # -- session manifests of earlier versions, kept here beside the blocks: read
    # once, into the store's session journal, then deleted.

    def legacy_manifests(self) -> list[dict[str, Any]]:
        """The session manifests an earlier version wrote into the segments."""
        found = []
        for key in list(self.segments.keys()):
            if key.startswith(_MANIFEST_PREFIX) and len(key) == len(_MANIFEST_PREFIX) + HASH_BYTES:
                try:
                    manifest = msgpack.unpackb(self.segments.get(key), raw=False)
                except (ValueError, msgpack.UnpackException) as e:
                    raise CorruptDataError(f"undecodable session manifest: {e}") from e
                if not isinstance(manifest, dict):
                    raise CorruptDataError("a session manifest is not a map")
                found.append(manifest)
        return found

    def drop_legacy_manifests(self) -> None:
        for key in list(self.segments.keys()):
            if key.startswith(_MANIFEST_PREFIX):
                self.segments.delete(key)
        self.segments.flush()

    def put(self, key: bytes, block: StoredBlock, *, fingerprint: bytes, codec: str) -> int:
        """Encode ``block`` with ``codec`` (int8 blocks as they are) and append it.

        Returns the frame's size.

        Raises:
            CapacityError: the cold tier would exceed ``capacity_bytes``.
        """
        frame = encode_stored(self._codec_config, codec, block)
        if self.capacity_bytes is not None:
            live = self.segments.stats().live_bytes
            if live + len(frame) > self.capacity_bytes:
                raise CapacityError(
                    f"cold tier full: {live} of {self.capacity_bytes} bytes live, "
                    f"cannot add a {len(frame)}-byte frame"
                )
        codec_id = peek_header(frame).codec_id
        self.segments.put(key, frame, fingerprint=fingerprint, codec_id=codec_id)
        self.writes += 1
        self.bytes_written += len(frame)
        return len(frame)

    def put_many(
        self, items: Sequence[tuple[bytes, StoredBlock, bytes, str]], *, durable: bool = False
    ) -> list[int]:
        """:meth:`put` of ``(key, block, fingerprint, codec)`` items, in order.

        ``durable``: fsync before returning (one fsync for the batch).
        """
        sizes = [self.put(k, b, fingerprint=fp, codec=c) for k, b, fp, c in items]
        if durable:
            self.sync()
        return sizes

    def sync(self) -> None:
        """Force every block written so far to disk."""
        self.segments.flush()

    def load(self, key: bytes) -> torch.Tensor:
        """Read, verify and decode a block (in the dtype it was encoded from)."""
        return decode_frame(self.segments.get(key))

    def load_many(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        return [self.load(k) for k in keys]

    def codecs(self, keys: Sequence[bytes]) -> list[str]:
        return [CODEC_NAMES[self.segments.meta(bytes(k)).codec_id] for k in keys]

    def stats(self) -> ColdStats:
        seg = self.segments.stats()
        return ColdStats(len(self), seg.live_bytes, seg.dead_bytes)

    def live_bytes(self) -> int:
        """Bytes of live frames (cheap: no walk over the keys)."""
        return self.segments.stats().live_bytes

    def remove(self, key: bytes) -> None:
        self.segments.delete(key)

    def close(self) -> None:
        self.segments.close()


# Keys of earlier versions' session manifests (prefix + blake2b of the id):
# longer than block keys, so the two never collide.
_MANIFEST_PREFIX = b"session-manifest"


def _short(key: object) -> str:
    return key.hex()[:12] if isinstance(key, bytes) else repr(key)
