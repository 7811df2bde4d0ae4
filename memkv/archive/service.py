"""The cold tier of a cluster: one ArchiveService per node with an NVMe path
(its actor: :mod:`memkv.actors.archive`).

It stores codec frames (already encoded by the device that demoted the block)
in a :class:`~memkv.storage.segments.SegmentStore`. Blocks are
content-addressed, so a frame that is already stored is not written again:
sessions on different devices that share a prefix share its archived copy.
Blocks are deleted only when the router says no session anywhere holds them.

On a restart (Ray restarts the actor) the segment store rebuilds its index
from the files on disk, so everything that was archived is served again.

A full disk, or ``capacity_bytes`` reached, refuses a write with
:class:`~memkv.errors.StorageFullError` and keeps everything stored: the device
writing the copy takes another archive (:mod:`memkv.actors.cold_replicas`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Sequence

from memkv.archive.identity import claim_directory
from memkv.archive.journal_replica import JOURNALS_DIR, JournalReplica, check_journal_name
from memkv.errors import CorruptDataError, InvalidInputError, StorageFullError, UnknownBlockError
from memkv.protocol.hashing import HASH_BYTES
from memkv.protocol.stats import ArchiveStats
from memkv.storage.codecs import verify_frame
from memkv.storage.codecs.frame import CODEC_NAMES
from memkv.storage.config import ArchiveConfig
from memkv.storage.owned_dir import resolve_on_node
from memkv.storage.segments import CompactionStats, SegmentStore

__all__ = ["ArchiveService"]

logger = logging.getLogger(__name__)

#: A write failing with one of these means the disk (or the user's quota on it) is full.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class ArchiveService:
    """Batched frame storage over one segment store.

    Args:
        config: the segment directory and fsync/compaction settings.
        compact_interval_s: run compaction in a background thread this often
            (None: only when :meth:`compact` is called).
        capacity_bytes: the most its segment files may hold on disk (None: the
            disk's size); a write past it is refused like one on a full disk.

    Raises:
        ConfigError: the directory belongs to another host's archive
            (:mod:`memkv.archive.identity`).
    """

    def __init__(
        self,
        config: ArchiveConfig,
        *,
        compact_interval_s: float | None = None,
        capacity_bytes: int | None = None,
    ) -> None:
        self.incarnation = uuid.uuid4().hex
        self.node_id = os.environ.get("MEMKV_NODE_ID", "local")
        self._config = config
        self.capacity_bytes = capacity_bytes
        self._journals: dict[str, JournalReplica] = {}
        self._journals_lock = threading.RLock()  # opening one, and its writes
        self.corrupt_reads = 0  # damaged frames a replica was asked for instead
        self.refused_writes = 0  # put_frames calls refused for want of room
        # Whose directory this is, before a byte of it is read as ours.
        self.identity = claim_directory(resolve_on_node(config.directory))
        self._segments = SegmentStore(config)
        self._stop = threading.Event()
        self._compactor: threading.Thread | None = None
        if compact_interval_s is not None:
            self._compactor = threading.Thread(
                target=self._compact_loop,
                args=(compact_interval_s,),
                daemon=True,
                name="memkv-archive-compactor",
            )
            self._compactor.start()

    def ping(self) -> str:
        """The incarnation id (changes when the actor restarts)."""
        return self.incarnation

    def put_frames(self, items: Sequence[tuple[bytes, bytes, bytes]], durable: bool = False) -> int:
        """Store ``(key, frame, fingerprint)`` triples; keys already stored are skipped.

        Args:
            durable: fsync before answering. Group-committed: concurrent callers
                share an fsync (the segment store skips one that has nothing
                left to force), so throughput holds.

        Returns:
            Frames written.

        Raises:
            InvalidInputError: a key is not a 16-byte block hash.
            CorruptDataError: a frame fails its own checksum (never stored).
            StorageFullError: the disk or ``capacity_bytes`` is full. The frames
                before the one refused are stored (content-addressed: a retry
                elsewhere, or here, is harmless).
        """
        written = 0
        used = None if self.capacity_bytes is None else self._segments.stats().bytes_on_disk
        try:
            for key, frame, fingerprint in items:
                _check_key(key)
                if key in self._segments:
                    continue
                header = verify_frame(frame)  # a frame damaged on the way is never kept
                if used is not None:
                    used += len(frame)
                    self._check_budget(used)
                self._segments.put(key, frame, fingerprint=fingerprint, codec_id=header.codec_id)
                written += 1
            if durable:
                self._segments.flush()
        except OSError as e:
            if e.errno not in _DISK_FULL:
                raise
            self.refused_writes += 1
            raise StorageFullError(
                f"archive on node {self.node_id} cannot write: its disk is full "
                f"({os.strerror(e.errno)}; {written} of {len(items)} frames written)"
            ) from None
        return written

    def _check_budget(self, used: int) -> None:
        assert self.capacity_bytes is not None
        if used > self.capacity_bytes:
            self.refused_writes += 1
            raise StorageFullError(
                f"archive on node {self.node_id} is full: {used} bytes would exceed its "
                f"archive.capacity_bytes of {self.capacity_bytes} (compaction reclaims "
                f"the blocks no session holds)"
            )

    def codecs(self, keys: Sequence[bytes], missing_ok: bool = False) -> list[str | None]:
        """The codec of each stored frame, from the index.

        Args:
            missing_ok: None for a key not stored (else UnknownBlockError).
        """
        out: list[str | None] = []
        for key in keys:
            if missing_ok and _check_key(key) not in self._segments:
                out.append(None)
                continue
            out.append(CODEC_NAMES[self._segments.meta(_check_key(key)).codec_id])
        return out

    def keys(self) -> list[bytes]:
        """Every stored block's key (the router collects those no session holds)."""
        return list(self._segments.keys())

    def get_frames(self, keys: Sequence[bytes], missing_ok: bool = False) -> list[bytes | None]:
        """Frames of ``keys``, verified.

        Args:
            missing_ok: None for a key not stored here, or stored damaged (a
                replica serves it instead; the damage is logged and counted).
                Otherwise those raise UnknownBlockError and CorruptDataError.
        """
        if not missing_ok:
            return [self._segments.get(_check_key(k)) for k in keys]
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self._segments.get(_check_key(key)))
            except UnknownBlockError:
                out.append(None)
            except CorruptDataError as e:
                self.corrupt_reads += 1
                logger.error("archive frame not served: %s", e)
                out.append(None)
        return out

    def get_records(self, keys: Sequence[bytes]) -> list[tuple[bytes, bytes] | None]:
        """``(frame, fingerprint)`` of each key, verified; None where it is not
        stored here whole (what replica repair copies to another archive)."""
        out: list[tuple[bytes, bytes] | None] = []
        for key, frame in zip(keys, self.get_frames(keys, missing_ok=True), strict=True):
            if frame is None:
                out.append(None)
                continue
            try:
                out.append((frame, self._segments.meta(key).fingerprint))
            except UnknownBlockError:  # deleted since (the collector)
                out.append(None)
        return out

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._segments for k in keys]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks no session holds any more. Returns how many existed."""
        return sum(1 for k in keys if self._segments.delete(_check_key(k)))

    def compact(self, force: bool = False) -> CompactionStats:
        return self._segments.compact(force=force)

    def flush(self) -> None:
        self._segments.flush()

    def stats(self) -> ArchiveStats:
        s = self._segments.stats()
        return ArchiveStats(
            blocks=s.live_records,
            live_bytes=s.live_bytes,
            dead_bytes=s.dead_bytes,
            bytes_on_disk=s.bytes_on_disk,
            segments=s.segments,
            corrupt_records=s.corrupt_records,
            capacity_bytes=self.capacity_bytes,
            disk_free_bytes=shutil.disk_usage(self._segments.directory).free,
            refused_writes=self.refused_writes,
            archive_id=self.identity.archive_id,
            host=self.identity.host,
        )

    # -- router journals (:mod:`memkv.archive.journal_replica`) --------------------------

    def node(self) -> str:
        """The node this archive runs on (``$MEMKV_NODE_ID``; a router keeps its
        journal's replicas off its own node)."""
        return self.node_id

    def journal_names(self) -> list[str]:
        """The router journals this archive holds a copy of."""
        root = self._segments.directory / JOURNALS_DIR
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def journal_position(self, name: str) -> tuple[int, int]:
        """``(epoch, seq)`` of router shard ``name``'s journal here ((0, 0): none)."""
        replica = self._journal(name, create=False)
        return (0, 0) if replica is None else replica.position

    def journal_read(self, name: str) -> tuple[int, int, list[bytes]]:
        replica = self._journal(name, create=False)
        return (0, 0, []) if replica is None else replica.read()

    def journal_append(self, name: str, epoch: int, first_seq: int,
                       payloads: list[bytes], fsync: bool = True) -> tuple[int, int]:
        with self._journals_lock:
            return self._writable(name).append(epoch, first_seq, payloads, fsync)

    def journal_snapshot(self, name: str, epoch: int, seq: int,
                         payloads: list[bytes]) -> tuple[int, int]:
        with self._journals_lock:
            return self._writable(name).snapshot(epoch, seq, payloads)

    def _journal(self, name: str, *, create: bool = True) -> JournalReplica | None:
        """Router shard ``name``'s journal here; one not on disk yet is made only to write
        it (``create``): asking after a journal leaves no trace, so the names listed
        (and the shard counts read from them) are only those of journals written."""
        with self._journals_lock:
            replica = self._journals.get(name)
            if replica is None:
                check_journal_name(name)
                if not create and not (self._segments.directory / JOURNALS_DIR / name).is_dir():
                    return None
                replica = JournalReplica(self._segments.directory, name,
                                         fsync=self._config.fsync != "never")
                self._journals[name] = replica
            return replica

    def _writable(self, name: str) -> JournalReplica:
        replica = self._journal(name)
        assert replica is not None  # (made when missing)
        return replica

    def close(self) -> None:
        for replica in self._journals.values():
            replica.close()
        self._stop.set()
        if self._compactor is not None:
            self._compactor.join(timeout=5)
        self._segments.close()

    def _compact_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            stats = self._segments.compact()
            if stats.segments_in:
                logger.info(
                    "compacted %d segments, %d bytes reclaimed",
                    stats.segments_in,
                    stats.bytes_reclaimed,
                )


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes) or len(key) != HASH_BYTES:
        raise InvalidInputError(f"block keys are {HASH_BYTES}-byte hashes, got {key!r:.40}")
    return key
