"""A crash-safe journal of records: append, group-committed fsync, snapshot, replay.

The router keeps its session table in one, the single-process store its
suspended sessions (:mod:`memkv.router.suspended`): ``journal.log`` beside a
``snapshot.bin`` in its directory, so the table survives a restart of the
process, or of the whole machine. Each record is framed as::

    | length u32 | crc32 u32 | msgpack payload (length bytes) |

A crash can tear only the last record; replay stops at the first record that is
short or fails its CRC and truncates the file there (everything before it was
written completely). A snapshot is written to a temporary file, fsynced, renamed
over the old one (atomic) and the directory fsynced before the journal is
emptied, so at every instant snapshot + journal hold the whole table.

Appends are buffered by the OS; :meth:`Journal.sync` forces them to disk. It is
a group commit: a caller whose records an fsync that started after them already
covered returns at once, so concurrent writers share one fsync.
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import msgpack

from memkv.errors import CorruptDataError
from memkv.protocol.checksum import crc32
from memkv.storage.owned_dir import resolve_on_node
from memkv.storage.segments import fsync_dir

__all__ = ["Journal", "TableJournal"]

_FRAME = struct.Struct("<II")
_LOG = "journal.log"
_SNAPSHOT = "snapshot.bin"
# A record larger than this is corruption, not a session (a chain of a million
# blocks is 16 MiB of keys).
_MAX_RECORD_BYTES = 64 << 20


class TableJournal(Protocol):
    """Where a table's records go: :class:`Journal` on this node's disk, or a
    router's journal on archives of other nodes
    (:class:`memkv.actors.archive_journal.ArchiveJournal`)."""

    #: Records appended since the last snapshot (the table rewrites one past a bound).
    records_since_snapshot: int
    #: The journal asks for a snapshot now, whatever the count (a new replica needs it).
    wants_snapshot: bool
    #: Records wait in this process: :meth:`flush` before answering the change.
    buffered: bool

    def append(self, record: dict[str, Any]) -> int: ...

    def flush(self) -> None:
        """Records out of this process (they survive its crash), not fsynced."""
        ...

    async def commit(self, *, fsync: bool) -> None:
        """:meth:`sync` (``fsync``) or :meth:`flush`, from an event loop without blocking it."""
        ...

    def sync(self, upto: int | None = None) -> None: ...

    def snapshot(self, records: list[dict[str, Any]]) -> None: ...

    async def snapshot_async(self, make_records: Callable[[], list[dict[str, Any]]]) -> None:
        """:meth:`snapshot` from an event loop; ``make_records`` is called when it starts."""
        ...

    def replay(self) -> Iterator[dict[str, Any]]: ...

    def close(self) -> None: ...


class Journal:
    """Records of a table, crash-safe.

    Args:
        directory: created if missing; one journal per directory.
        fsync: False skips fsync (tests, throwaway deployments); records then
            survive a process crash but not a power loss.
    """

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self._dir = resolve_on_node(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._lock = threading.Lock()  # appends and truncation
        self._sync_lock = threading.Lock()  # one fsync at a time
        self._written = 0  # records appended
        self._synced = 0  # records known to be on disk
        self._log_path = self._dir / _LOG
        self._snapshot_path = self._dir / _SNAPSHOT
        self._fd = os.open(self._log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self.records_since_snapshot = 0
        self.wants_snapshot = False  # (a local journal never asks)
        self.buffered = False  # appends go to the OS at once

    # -- writing ---------------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> int:
        """Append one record (buffered); returns its sequence number for :meth:`sync`."""
        payload = msgpack.packb(record, use_bin_type=True)
        frame = _FRAME.pack(len(payload), crc32(payload)) + payload
        with self._lock:
            os.write(self._fd, frame)
            self._written += 1
            self.records_since_snapshot += 1
            return self._written

    def flush(self) -> None:
        """Nothing to do: :meth:`append` writes to the OS."""

    async def commit(self, *, fsync: bool) -> None:
        """:meth:`sync` in a thread (an fsync blocks); nothing to do without ``fsync``."""
        if fsync:
            await asyncio.to_thread(self.sync)

    def sync(self, upto: int | None = None) -> None:
        """Make records up to ``upto`` (default: all appended so far) durable."""
        with self._lock:
            target = self._written if upto is None else upto
        if not self._fsync or self._synced >= target:
            return
        with self._sync_lock:
            if self._synced >= target:
                return  # an fsync that started after our append covered it
            with self._lock:
                covering = self._written
            os.fsync(self._fd)
            self._synced = max(self._synced, covering)

    async def snapshot_async(self, make_records: Callable[[], list[dict[str, Any]]]) -> None:
        """:meth:`snapshot`, here and now: a file on this node's disk, written while appends
        wait (they go to the log it truncates)."""
        self.snapshot(make_records())

    def snapshot(self, records: list[dict[str, Any]]) -> None:
        """Replace snapshot + journal by ``records`` (the whole table, as records to replay)."""
        tmp = self._dir / (_SNAPSHOT + ".tmp")
        with open(tmp, "wb") as f:
            for record in records:
                payload = msgpack.packb(record, use_bin_type=True)
                f.write(_FRAME.pack(len(payload), crc32(payload)) + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snapshot_path)
        fsync_dir(self._dir)
        with self._lock:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            self._synced = self._written
            self.records_since_snapshot = 0

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                if self._fsync:
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1

    # -- reading ---------------------------------------------------------------------

    def replay(self) -> Iterator[dict[str, Any]]:
        """The snapshot's records, then the journal's, in order.

        A torn record at the end of the journal (a crash mid-append) ends the
        replay, and the journal is truncated there so new records follow the
        last whole one.

        Raises:
            CorruptDataError: the snapshot is damaged (it is written atomically:
                damage there is not a crash but a disk fault).
        """
        if self._snapshot_path.exists():
            data = self._snapshot_path.read_bytes()
            records, end = _decode(data)
            if end != len(data):
                raise CorruptDataError(
                    f"journal snapshot {self._snapshot_path} is damaged at byte {end}"
                )
            yield from records
        with self._lock:
            data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        records, end = _decode(data)
        if end != len(data):
            with self._lock:
                os.ftruncate(self._fd, end)
        self.records_since_snapshot = len(records)
        yield from records


def _decode(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """Whole records of ``data`` and where the first incomplete or damaged one starts."""
    out: list[dict[str, Any]] = []
    pos = 0
    view = memoryview(data)
    while pos + _FRAME.size <= len(data):
        length, check = _FRAME.unpack_from(data, pos)
        start, end = pos + _FRAME.size, pos + _FRAME.size + length
        if length > _MAX_RECORD_BYTES or end > len(data) or crc32(view[start:end]) != check:
            break
        out.append(msgpack.unpackb(view[start:end], raw=False))
        pos = end
    return out, pos

