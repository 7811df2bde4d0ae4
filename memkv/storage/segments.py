"""Append-only segment files: the cold tier's crash-safe on-disk format.

A directory holds segment files named only from integers (``seg-00000001.log``),
never from user-supplied strings. Each segment is a sequence of records::

    offset size field
    0      4    magic b"MKVR"
    4      1    format version (1)
    5      1    kind: 1 PUT, 2 DELETE (tombstone), 3 MANIFEST (compaction commit)
    6      1    key length (1..64; 0 only for MANIFEST)
    7      1    flags (0; reserved so a later version can add features)
    8      2    codec id (u16)
    10     8    sequence number (u64, global, increasing)
    18     8    payload length (u64)
    26     16   layout fingerprint
    42     4    CRC32 of the payload
    46     4    CRC32 of bytes 0..46 and the key
    50     k    key
    50+k   n    payload (an encoded codec frame; opaque here)

All integers are little-endian. Two checksums rather than one: the header CRC
validates the lengths *before* anything is read through them, so a damaged length
can never send the scanner off into the payload, and opening a store only has to
read headers (payloads are verified on every read instead).

**Latest wins by sequence number**, not by position: compaction copies records
byte for byte into a new, higher-numbered segment, so position no longer says
which record is newer, and a copy and its original (same sequence number) are
interchangeable.

**Compaction is atomic.** Live records of the chosen segments are written to
``seg-N.compacting``, fsynced, renamed to ``seg-N.log`` (rename is atomic) and the
directory fsynced; only then are the inputs unlinked. The output's first record is
a MANIFEST naming its inputs: on open, inputs a manifest names are unlinked if they
are still there (a crash between rename and unlink), and leftover ``.compacting``
files are deleted (a crash before rename). Removing a set of segments is therefore
all-or-nothing, which is what lets compaction drop tombstones safely. A tombstone
is dropped once no other file holds a value it hides. Outputs are sealed from birth:
appends continue in the active segment, and roll over to a file numbered above all.

**Opening** scans every segment in order. The active segment is the newest file that
is not a compaction output; only it can hold a torn write (outputs are fsynced before
they get their name). A record that fails a check at its tail is a torn write: the
file is truncated back to the last good record so appends continue cleanly. Damage
anywhere else is skipped, logged and counted; the scanner resynchronises on the next
magic whose record verifies, so every intact record still reads back.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from memkv.errors import ClosedError, CorruptDataError, InvalidInputError, UnknownBlockError
from memkv.protocol.checksum import crc32
from memkv.storage.config import ArchiveConfig
from memkv.storage.owned_dir import DirectoryLock, resolve_on_node

__all__ = [
    "CODEC_ID_MAX",
    "FINGERPRINT_BYTES",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "KEY_MAX_BYTES",
    "KEY_MIN_BYTES",
    "MAGIC",
    "CompactionStats",
    "FsyncPolicy",
    "RecordKind",
    "RecordMeta",
    "SegmentStats",
    "SegmentStore",
    "segment_name",
]

log = logging.getLogger(__name__)

MAGIC = b"MKVR"
FORMAT_VERSION = 1
KEY_MIN_BYTES = 1
KEY_MAX_BYTES = 64
#: Equal to ``memkv.storage.layout.FINGERPRINT_BYTES``; not imported from there so the
#: archive (and the ArchiveActor) does not pull in torch.
FINGERPRINT_BYTES = 16
CODEC_ID_MAX = 0xFFFF

# magic, version, kind, key_len, flags, codec_id, seq, payload_len, fingerprint, payload_crc
_FIXED = struct.Struct("<4sBBBBHQQ16sI")
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _FIXED.size + _HEADER_CRC.size
_NO_FLAGS = 0
#: The active segment is compacted (sealed first) once it holds this much garbage at
#: the configured ratio: a slowly written store reclaims its dead records too.
ACTIVE_COMPACT_MIN_BYTES = 1 << 20
_NO_FINGERPRINT = bytes(FINGERPRINT_BYTES)
_NO_CODEC = 0
_EMPTY_CRC = crc32(b"")
# Manifests are not key records; seq 0 is never given to a key record.
_MANIFEST_SEQ = 0
_FIRST_SEQ = 1
_FIRST_SEGMENT = 1
# MANIFEST payload: the input segment numbers, u64 each.
_SEGMENT_NUMBER = struct.Struct("<Q")

# How much of a file the resynchronising scanner reads at a time.
_RESYNC_CHUNK = 1 << 20
# One pread/pwrite moves at most this much (Linux caps a single call just under 2 GiB).
_IO_CHUNK = 1 << 30
_FILE_MODE = 0o644

_SEGMENT_RE = re.compile(r"^seg-(\d{8,})\.log$")
_TEMP_RE = re.compile(r"^seg-(\d{8,})\.compacting$")


def segment_name(number: int) -> str:
    """The file name of segment ``number`` (``seg-00000001.log``)."""
    return f"seg-{number:08d}.log"


def _temp_name(number: int) -> str:
    return f"seg-{number:08d}.compacting"


class RecordKind(enum.IntEnum):
    """What a record says."""

    PUT = 1
    DELETE = 2
    MANIFEST = 3


_KIND_VALUES = frozenset(int(k) for k in RecordKind)


class FsyncPolicy(enum.StrEnum):
    """When appended records are forced to disk (``ArchiveConfig.fsync``)."""

    ALWAYS = "always"
    BATCH = "batch"
    NEVER = "never"


# Records per automatic fsync under each policy; None = the OS decides.
_SYNC_EVERY: dict[FsyncPolicy, Callable[[ArchiveConfig], int | None]] = {
    FsyncPolicy.ALWAYS: lambda config: 1,
    FsyncPolicy.BATCH: lambda config: config.fsync_batch,
    FsyncPolicy.NEVER: lambda config: None,
}


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """Where and how one key's latest record is stored.

    Attributes:
        key: the record's key.
        fingerprint: the layout fingerprint stored with it.
        codec_id: the codec that encoded the payload.
        payload_len: payload bytes.
        segment: number of the segment file holding it.
        offset: byte offset of the record in that file.
    """

    key: bytes
    fingerprint: bytes
    codec_id: int
    payload_len: int
    segment: int
    offset: int


@dataclass(frozen=True, slots=True)
class SegmentStats:
    """A snapshot of the store's files.

    ``live_bytes + tombstone_bytes + dead_bytes == bytes_on_disk``; all byte counts
    are whole records (header, key and payload).

    Attributes:
        segments: segment files.
        live_records: keys with a live value.
        live_bytes: bytes of the live records.
        tombstones: deletions still kept (they hide older values on disk).
        tombstone_bytes: bytes of those tombstones.
        dead_bytes: superseded records, spent manifests and damaged regions.
        corrupt_records: damaged regions skipped (on open or found while compacting).
        bytes_on_disk: total size of the segment files.
    """

    segments: int
    live_records: int
    live_bytes: int
    tombstones: int
    tombstone_bytes: int
    dead_bytes: int
    corrupt_records: int
    bytes_on_disk: int


@dataclass(frozen=True, slots=True)
class CompactionStats:
    """What one :meth:`SegmentStore.compact` call did.

    Attributes:
        segments_in: segments removed (rewritten or dropped).
        segments_out: segments written.
        records_copied: live records and kept tombstones rewritten.
        tombstones_dropped: tombstones no longer needed, not rewritten.
        corrupt_dropped: live records found damaged while copying (now deleted).
        bytes_before: bytes on disk before.
        bytes_after: bytes on disk after.
        seconds: wall time.
    """

    segments_in: int
    segments_out: int
    records_copied: int
    tombstones_dropped: int
    corrupt_dropped: int
    bytes_before: int
    bytes_after: int
    seconds: float

    @property
    def bytes_reclaimed(self) -> int:
        """Bytes on disk freed."""
        return self.bytes_before - self.bytes_after


@dataclass(slots=True)
class _Entry:
    """The latest record of one key (a value or a tombstone)."""

    kind: RecordKind
    seq: int
    segment: int
    offset: int
    key_len: int
    payload_len: int
    payload_crc: int
    codec_id: int
    fingerprint: bytes

    @property
    def size(self) -> int:
        return HEADER_BYTES + self.key_len + self.payload_len

    @property
    def payload_offset(self) -> int:
        return self.offset + HEADER_BYTES + self.key_len


@dataclass(slots=True)
class _Segment:
    """One open segment file and what its bytes are worth."""

    number: int
    path: Path
    fd: int
    size: int = 0
    live_records: int = 0
    live_bytes: int = 0
    tombstones: int = 0
    tombstone_bytes: int = 0
    dead_bytes: int = 0
    corrupt_records: int = 0
    # Keys whose latest record (value or tombstone) lives here.
    keys: set[bytes] = field(default_factory=set)
    # Keys with a superseded value here (see SegmentStore._stale).
    stale_keys: set[bytes] = field(default_factory=set)

    @property
    def garbage_ratio(self) -> float:
        # An empty file holds nothing worth keeping.
        return self.dead_bytes / self.size if self.size else 1.0


@dataclass(frozen=True, slots=True)
class _Probe:
    """A record found at some offset whose header verified."""

    kind: RecordKind
    key: bytes
    seq: int
    codec_id: int
    fingerprint: bytes
    payload_len: int
    payload_crc: int
    size: int
    # False when the payload was read and failed its CRC.
    payload_ok: bool


def _pack_header(
    kind: RecordKind,
    key: bytes,
    seq: int,
    payload_len: int,
    payload_crc: int,
    fingerprint: bytes,
    codec_id: int,
) -> bytes:
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        kind,
        len(key),
        _NO_FLAGS,
        codec_id,
        seq,
        payload_len,
        fingerprint,
        payload_crc,
    )
    crc = crc32(key, crc32(fixed))
    return fixed + _HEADER_CRC.pack(crc) + key


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    """Read ``size`` bytes at ``offset``; fewer only at end of file."""
    data = os.pread(fd, min(size, _IO_CHUNK), offset)
    if len(data) == size or len(data) < min(size, _IO_CHUNK):
        return data
    parts = [data]
    got = len(data)
    while got < size:
        part = os.pread(fd, min(size - got, _IO_CHUNK), offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write every buffer back to back at ``offset``, however the kernel splits it."""
    pending = [b for b in buffers if len(b)]
    while pending:
        written = os.pwritev(fd, pending, offset)
        if written <= 0:
            raise OSError(f"pwritev wrote nothing at offset {offset}")
        offset += written
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]


def fsync_dir(directory: Path) -> None:
    # A new or removed file name is durable only once its directory is fsynced.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _probe(fd: int, pos: int, file_size: int, verify_payload: bool) -> _Probe | None:
    """The record at ``pos`` if its header verifies and it fits in the file, else None.

    The payload is read and checked only when ``verify_payload`` (or for manifests,
    whose payload is needed anyway).
    """
    head = os.pread(fd, HEADER_BYTES + KEY_MAX_BYTES, pos)
    if len(head) < HEADER_BYTES:
        return None
    magic, version, kind, key_len, flags, codec_id, seq, payload_len, fp, payload_crc = (
        _FIXED.unpack_from(head)
    )
    if (
        magic != MAGIC
        or version != FORMAT_VERSION
        or flags != _NO_FLAGS
        or kind not in _KIND_VALUES
        or key_len > KEY_MAX_BYTES
        or len(head) < HEADER_BYTES + key_len
    ):
        return None
    (stored_crc,) = _HEADER_CRC.unpack_from(head, _FIXED.size)
    key = head[HEADER_BYTES : HEADER_BYTES + key_len]
    if crc32(key, crc32(head[: _FIXED.size])) != stored_crc:
        return None
    record_kind = RecordKind(kind)
    if record_kind is RecordKind.MANIFEST:
        if key_len != 0 or payload_len % _SEGMENT_NUMBER.size:
            return None
    elif key_len < KEY_MIN_BYTES or (record_kind is RecordKind.DELETE and payload_len):
        return None
    size = HEADER_BYTES + key_len + payload_len
    if pos + size > file_size:
        return None
    payload_ok = True
    if verify_payload or record_kind is RecordKind.MANIFEST:
        payload = _pread_exact(fd, payload_len, pos + HEADER_BYTES + key_len)
        payload_ok = len(payload) == payload_len and crc32(payload) == payload_crc
    return _Probe(record_kind, key, seq, codec_id, fp, payload_len, payload_crc, size, payload_ok)


def _resync(fd: int, start: int, file_size: int) -> int | None:
    """Offset of the first fully verified record at or after ``start``, or None."""
    pos = start
    while pos < file_size:
        chunk = os.pread(fd, min(_RESYNC_CHUNK, file_size - pos), pos)
        if not chunk:
            return None
        hit = chunk.find(MAGIC)
        while hit != -1:
            probe = _probe(fd, pos + hit, file_size, verify_payload=True)
            if probe is not None and probe.payload_ok:
                return pos + hit
            hit = chunk.find(MAGIC, hit + 1)
        # Step back so a magic split across two chunks is still found.
        pos += max(len(chunk) - (len(MAGIC) - 1), 1)
    return None


def _read_manifest(fd: int, file_size: int) -> list[int] | None:
    """Input segments named by the manifest this file starts with (None: no manifest)."""
    # _probe always verifies a manifest's payload; a value's is not worth reading here.
    probe = _probe(fd, 0, file_size, verify_payload=False)
    if probe is None or probe.kind is not RecordKind.MANIFEST or not probe.payload_ok:
        return None
    payload = _pread_exact(fd, probe.payload_len, HEADER_BYTES)
    return [n for (n,) in _SEGMENT_NUMBER.iter_unpack(payload)]


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise InvalidInputError(f"key must be bytes, got {type(key).__name__}")
    if not KEY_MIN_BYTES <= len(key) <= KEY_MAX_BYTES:
        raise InvalidInputError(
            f"key must be {KEY_MIN_BYTES}..{KEY_MAX_BYTES} bytes, got {len(key)}"
        )
    return key


def _check_payload(payload: object) -> memoryview:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise InvalidInputError(
            f"payload must be bytes, bytearray or memoryview, got {type(payload).__name__}"
        )
    view = memoryview(payload)
    if not view.c_contiguous:
        raise InvalidInputError("payload memoryview must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_fingerprint(fingerprint: object) -> bytes:
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
        if isinstance(fingerprint, bytes):
            got = f"{len(fingerprint)} bytes"
        else:
            got = type(fingerprint).__name__
        raise InvalidInputError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {got}")
    return fingerprint


def _check_codec_id(codec_id: object) -> int:
    if isinstance(codec_id, bool) or not isinstance(codec_id, int):
        raise InvalidInputError(f"codec_id must be an int, got {type(codec_id).__name__}")
    if not 0 <= codec_id <= CODEC_ID_MAX:
        raise InvalidInputError(f"codec_id must be in 0..{CODEC_ID_MAX}, got {codec_id}")
    return codec_id


def _short(key: bytes) -> str:
    return key.hex()[:16]


class SegmentStore:
    """Append-only, crash-safe store of opaque payloads under short byte keys.

    Args:
        config: directory, segment size, fsync policy, compaction threshold.
        verify_on_open: (default: ``config.verify_on_open``) also verify the payload CRC
            of every record of the sealed segments while opening (reads the whole
            store). By default only headers are read there, and payloads are verified
            on every :meth:`get`; the active segment, the only one a crash can tear,
            is always fully verified.

    Raises:
        InvalidInputError: ``config`` is not an :class:`ArchiveConfig`.
        OSError: the directory cannot be created or read.

    Example:
        >>> import tempfile
        >>> with SegmentStore(ArchiveConfig(directory=tempfile.mkdtemp())) as store:
        ...     _ = store.put(b"k", b"frame", fingerprint=bytes(16), codec_id=1)
        ...     store.get(b"k")
        b'frame'
    """

    def __init__(self, config: ArchiveConfig, *, verify_on_open: bool | None = None) -> None:
        if not isinstance(config, ArchiveConfig):
            raise InvalidInputError(f"expected an ArchiveConfig, got {type(config).__name__}")
        self._config = config
        self._dir = resolve_on_node(config.directory)
        self._sync_every = _SYNC_EVERY[FsyncPolicy(config.fsync)](config)
        self._verify_on_open = config.verify_on_open if verify_on_open is None else verify_on_open
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._index: dict[bytes, _Entry] = {}  # keys with a live value
        self._tombs: dict[bytes, _Entry] = {}  # keys whose latest record is a tombstone
        # key -> segments still holding a superseded value of it. A tombstone is
        # needed exactly while a value it hides is on disk in another file.
        self._stale: dict[bytes, set[int]] = {}
        self._next_seq = _FIRST_SEQ
        self._next_segment = _FIRST_SEGMENT
        self._unsynced = 0
        self._dir_dirty = False
        self._state = _State.OPEN
        self._dir.mkdir(parents=True, exist_ok=True)
        # One store per directory: two writers would both append to the newest
        # segment and both name the next one.
        self._dir_lock = DirectoryLock(self._dir, "segment store")
        try:
            self._recover()
        except BaseException:
            self._close_fds()
            raise

    # ------------------------------------------------------------------ open/rebuild

    def _recover(self) -> None:
        numbers: list[int] = []
        for entry in os.scandir(self._dir):
            if m := _TEMP_RE.match(entry.name):
                # A compaction that crashed before its rename: the inputs are intact.
                log.info("removing unfinished compaction output %s", entry.name)
                os.unlink(entry.path)
                self._next_segment = max(self._next_segment, int(m.group(1)) + 1)
                self._dir_dirty = True
            elif m := _SEGMENT_RE.match(entry.name):
                numbers.append(int(m.group(1)))
        numbers.sort()
        present = set(numbers)
        outputs: set[int] = set()
        # Finish compactions that crashed between rename and unlinking their inputs.
        for n in numbers:
            if n not in present:
                continue
            path = self._dir / segment_name(n)
            fd = os.open(path, os.O_RDONLY)
            try:
                inputs = _read_manifest(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            if inputs is None:
                continue
            outputs.add(n)
            for i in inputs:
                if i in present and i < n:
                    log.info("removing %s, already compacted into %s", segment_name(i), path.name)
                    os.unlink(self._dir / segment_name(i))
                    present.discard(i)
                    self._dir_dirty = True
        numbers = [n for n in numbers if n in present]
        self._sync_dir_if_dirty()
        # Compaction outputs are complete and fsynced before they get their name, and
        # never appended to: the file appends went to is the newest other one.
        active = max((n for n in numbers if n not in outputs), default=None)
        for n in numbers:
            path = self._dir / segment_name(n)
            fd = os.open(path, os.O_RDWR if n == active else os.O_RDONLY)
            seg = _Segment(number=n, path=path, fd=fd)
            self._segments[n] = seg
            self._scan(seg, active=n == active)
            self._next_segment = max(self._next_segment, n + 1)
        if active is not None:
            self._active = self._segments[active]

    def _scan(self, seg: _Segment, active: bool) -> None:
        file_size = os.fstat(seg.fd).st_size
        verify = active or self._verify_on_open
        pos = 0
        while pos < file_size:
            probe = _probe(seg.fd, pos, file_size, verify)
            if probe is not None and probe.payload_ok:
                self._replay(seg, probe, pos)
                pos += probe.size
                continue
            # A record that verified its header but not its payload is still framed:
            # the next record starts right after it.
            resume = pos + probe.size if probe is not None else pos + 1
            nxt = _resync(seg.fd, resume, file_size)
            if nxt is None and active:
                log.info(
                    "%s: torn write at offset %d; truncating %d bytes",
                    seg.path.name,
                    pos,
                    file_size - pos,
                )
                os.ftruncate(seg.fd, pos)
                os.fsync(seg.fd)
                file_size = pos
                break
            end = file_size if nxt is None else nxt
            log.warning("%s: skipping %d damaged bytes at offset %d", seg.path.name, end - pos, pos)
            seg.dead_bytes += end - pos
            seg.corrupt_records += 1
            pos = end
        seg.size = file_size

    def _replay(self, seg: _Segment, probe: _Probe, pos: int) -> None:
        if probe.kind is RecordKind.MANIFEST:
            # Its work is done (the inputs were removed before scanning).
            seg.dead_bytes += probe.size
            return
        entry = _Entry(
            kind=probe.kind,
            seq=probe.seq,
            segment=seg.number,
            offset=pos,
            key_len=len(probe.key),
            payload_len=probe.payload_len,
            payload_crc=probe.payload_crc,
            codec_id=probe.codec_id,
            fingerprint=probe.fingerprint,
        )
        self._next_seq = max(self._next_seq, probe.seq + 1)
        self._apply(probe.key, entry)

    # ------------------------------------------------------------------ bookkeeping

    def _apply(self, key: bytes, entry: _Entry) -> None:
        """Make ``entry`` the key's latest record unless a newer one is known."""
        old = self._index.get(key) or self._tombs.get(key)
        seg = self._segments[entry.segment]
        if old is not None:
            if old.seq >= entry.seq:
                # Only while replaying: a compaction copy (same seq) or an older record.
                seg.dead_bytes += entry.size
                if entry.kind is RecordKind.PUT:
                    self._note_stale(key, seg)
                return
            self._retire(key, old)
        seg.keys.add(key)
        if entry.kind is RecordKind.PUT:
            self._index[key] = entry
            seg.live_records += 1
            seg.live_bytes += entry.size
        else:
            self._tombs[key] = entry
            seg.tombstones += 1
            seg.tombstone_bytes += entry.size

    def _retire(self, key: bytes, old: _Entry) -> None:
        """``old`` is superseded: its bytes become garbage."""
        seg = self._segments[old.segment]
        seg.keys.discard(key)
        seg.dead_bytes += old.size
        if old.kind is RecordKind.PUT:
            del self._index[key]
            self._note_stale(key, seg)
            seg.live_records -= 1
            seg.live_bytes -= old.size
        else:
            del self._tombs[key]
            seg.tombstones -= 1
            seg.tombstone_bytes -= old.size

    def _note_stale(self, key: bytes, seg: _Segment) -> None:
        self._stale.setdefault(key, set()).add(seg.number)
        seg.stale_keys.add(key)

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise ClosedError(f"segment store at {self._dir} is closed")

    # ------------------------------------------------------------------ writing

    def _new_segment(self) -> _Segment:
        number = self._next_segment
        self._next_segment += 1
        path = self._dir / segment_name(number)
        # O_EXCL: numbers are never reused, so an existing file means someone else
        # writes this directory.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        seg = _Segment(number=number, path=path, fd=fd)
        self._segments[number] = seg
        self._dir_dirty = True
        return seg

    def _seal_active(self) -> None:
        if self._active is None:
            return
        if self._sync_every is not None:
            self._sync_active()
        self._unsynced = 0
        self._active = None

    def _writable_segment(self, record_size: int) -> _Segment:
        active = self._active
        if active is not None and (
            active.size == 0 or active.size + record_size <= self._config.segment_max_bytes
        ):
            return active
        self._seal_active()
        self._active = self._new_segment()
        return self._active

    def _append(
        self,
        kind: RecordKind,
        key: bytes,
        payload: memoryview,
        fingerprint: bytes,
        codec_id: int,
    ) -> _Entry:
        seq = self._next_seq
        self._next_seq += 1
        payload_crc = crc32(payload)
        header = _pack_header(kind, key, seq, len(payload), payload_crc, fingerprint, codec_id)
        size = len(header) + len(payload)
        seg = self._writable_segment(size)
        offset = seg.size
        try:
            _pwrite_all(seg.fd, [memoryview(header), payload], offset)
        except OSError:
            # Cut a partial record off so the file still ends on a record boundary.
            os.ftruncate(seg.fd, offset)
            raise
        seg.size += size
        entry = _Entry(
            kind=kind,
            seq=seq,
            segment=seg.number,
            offset=offset,
            key_len=len(key),
            payload_len=len(payload),
            payload_crc=payload_crc,
            codec_id=codec_id,
            fingerprint=fingerprint,
        )
        self._apply(key, entry)
        self._unsynced += 1
        if self._sync_every is not None and self._unsynced >= self._sync_every:
            self._sync_active()
        return entry

    def _sync_active(self) -> None:
        if self._active is not None and self._unsynced:
            os.fsync(self._active.fd)
        self._unsynced = 0
        self._sync_dir_if_dirty()

    def _sync_dir_if_dirty(self) -> None:
        if self._dir_dirty:
            fsync_dir(self._dir)
            self._dir_dirty = False

    # ------------------------------------------------------------------ public API

    def put(
        self, key: bytes, payload: bytes | memoryview, *, fingerprint: bytes, codec_id: int
    ) -> RecordMeta:
        """Append a value for ``key``; the latest put wins.

        Args:
            key: 1..64 opaque bytes.
            payload: the encoded frame (bytes, bytearray or a contiguous memoryview);
                written without an intermediate copy.
            fingerprint: the 16-byte layout fingerprint stored with the record.
            codec_id: the codec of the frame, 0..65535.

        Returns:
            Where the record was written.

        Raises:
            InvalidInputError: a bad key, payload, fingerprint or codec id.
            ClosedError: the store is closed.
            OSError: the write failed (the file is cut back to its previous end).
        """
        key = _check_key(key)
        view = _check_payload(payload)
        fingerprint = _check_fingerprint(fingerprint)
        codec_id = _check_codec_id(codec_id)
        with self._lock:
            self._check_open()
            entry = self._append(RecordKind.PUT, key, view, fingerprint, codec_id)
            return self._meta(key, entry)

    def get(self, key: bytes) -> bytes:
        """Read and verify the latest value of ``key``.

        Raises:
            UnknownBlockError: no live value for ``key``.
            CorruptDataError: the stored payload fails its checksum (it is not served).
            InvalidInputError: ``key`` is not 1..64 bytes.
            ClosedError: the store is closed.
        """
        key = _check_key(key)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None:
                raise UnknownBlockError(f"no record for key {_short(key)} in {self._dir}")
            seg = self._segments[entry.segment]
            data = _pread_exact(seg.fd, entry.payload_len, entry.payload_offset)
        # The CRC runs outside the lock: other callers need not wait for it.
        if len(data) != entry.payload_len or crc32(data) != entry.payload_crc:
            raise CorruptDataError(
                f"record of key {_short(key)} in {seg.path.name} at offset {entry.offset} "
                f"failed its checksum ({len(data)} of {entry.payload_len} bytes read)"
            )
        return data

    def meta(self, key: bytes) -> RecordMeta:
        """Metadata of the latest value of ``key`` (no payload read).

        Raises:
            UnknownBlockError: no live value for ``key``.
            InvalidInputError: ``key`` is not 1..64 bytes.
            ClosedError: the store is closed.
        """
        key = _check_key(key)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None:
                raise UnknownBlockError(f"no record for key {_short(key)} in {self._dir}")
            return self._meta(key, entry)

    @staticmethod
    def _meta(key: bytes, entry: _Entry) -> RecordMeta:
        return RecordMeta(
            key=key,
            fingerprint=entry.fingerprint,
            codec_id=entry.codec_id,
            payload_len=entry.payload_len,
            segment=entry.segment,
            offset=entry.offset,
        )

    def __contains__(self, key: object) -> bool:
        with self._lock:
            self._check_open()
            return isinstance(key, bytes) and key in self._index

    def __len__(self) -> int:
        with self._lock:
            self._check_open()
            return len(self._index)

    def keys(self) -> Iterator[bytes]:
        """The keys with a live value (a snapshot: later changes are not seen)."""
        with self._lock:
            self._check_open()
            return iter(list(self._index))

    def delete(self, key: bytes) -> bool:
        """Delete ``key`` by appending a tombstone.

        Returns:
            True if it had a live value, False if it was absent (nothing written).

        Raises:
            InvalidInputError: ``key`` is not 1..64 bytes.
            ClosedError: the store is closed.
        """
        key = _check_key(key)
        with self._lock:
            self._check_open()
            if key not in self._index:
                return False
            self._append(RecordKind.DELETE, key, memoryview(b""), _NO_FINGERPRINT, _NO_CODEC)
            return True

    def flush(self) -> None:
        """Force appended records (and new file names) to disk.

        Does nothing under the ``never`` fsync policy.

        Raises:
            ClosedError: the store is closed.
        """
        with self._lock:
            self._check_open()
            if self._sync_every is not None:
                self._sync_active()

    @property
    def directory(self) -> Path:
        """The store's directory, resolved on this node."""
        return self._dir

    def stats(self) -> SegmentStats:
        """Counts and byte totals over every segment (O(segments)).

        Raises:
            ClosedError: the store is closed.
        """
        with self._lock:
            self._check_open()
            segs = self._segments.values()
            return SegmentStats(
                segments=len(self._segments),
                live_records=len(self._index),
                live_bytes=sum(s.live_bytes for s in segs),
                tombstones=len(self._tombs),
                tombstone_bytes=sum(s.tombstone_bytes for s in segs),
                dead_bytes=sum(s.dead_bytes for s in segs),
                corrupt_records=sum(s.corrupt_records for s in segs),
                bytes_on_disk=sum(s.size for s in segs),
            )

    # ------------------------------------------------------------------ compaction

    def compact(self, *, force: bool = False) -> CompactionStats:
        """Rewrite the live records of sealed segments that are mostly garbage.

        A sealed segment is compacted when its dead share reaches
        ``config.compact_garbage_ratio``, and so is the active one (sealed first) once
        its dead bytes are also at least ``ACTIVE_COMPACT_MIN_BYTES``; with ``force``
        the active segment is sealed and every segment is compacted. Segments holding
        neither values nor tombstones are simply unlinked; the others are rewritten in groups whose
        live bytes fit one segment, each group atomically (see the module
        docstring), so a crash at any point reopens to the same live set. Every
        copied payload is verified; a damaged one is replaced by a tombstone.
        Compaction always fsyncs, whatever the fsync policy: it must never lose
        data that was already durable.

        Returns:
            What was done.

        Raises:
            ClosedError: the store is closed.
            OSError: a file operation failed; the files stay consistent.
        """
        with self._lock:
            self._check_open()
            started = time.perf_counter()
            before = sum(s.size for s in self._segments.values())
            active = self._active
            if active is not None and active.size and (force or (
                    active.garbage_ratio >= self._config.compact_garbage_ratio
                    and active.dead_bytes >= ACTIVE_COMPACT_MIN_BYTES)):
                # A store written slowly may keep one segment active for days: once it
                # is mostly garbage (and that garbage worth a pass) it is sealed and
                # compacted too, not left until it fills.
                self._seal_active()
            candidates = [
                s
                for s in self._segments.values()
                if s is not self._active
                and (force or s.garbage_ratio >= self._config.compact_garbage_ratio)
            ]
            # Removing values that are superseded, or tombstones that are superseded,
            # never changes what reads back: such files can go one at a time.
            alone = [s for s in candidates if not s.live_records and not s.tombstones]
            rewrite = [s for s in candidates if s.live_records or s.tombstones]
            for seg in alone:
                self._remove_segments([seg])
            if alone:
                fsync_dir(self._dir)
            copied = dropped = corrupt = 0
            groups = self._group(rewrite)
            for group in groups:
                c, d, k = self._compact_group(group)
                copied, dropped, corrupt = copied + c, dropped + d, corrupt + k
            return CompactionStats(
                segments_in=len(alone) + len(rewrite),
                segments_out=len(groups),
                records_copied=copied,
                tombstones_dropped=dropped,
                corrupt_dropped=corrupt,
                bytes_before=before,
                bytes_after=sum(s.size for s in self._segments.values()),
                seconds=time.perf_counter() - started,
            )

    def _group(self, segments: list[_Segment]) -> list[list[_Segment]]:
        """Split ``segments`` into groups whose kept bytes fit one segment."""
        groups: list[list[_Segment]] = []
        current: list[_Segment] = []
        kept = 0
        for seg in segments:
            size = seg.live_bytes + seg.tombstone_bytes
            if current and kept + size > self._config.segment_max_bytes:
                groups.append(current)
                current, kept = [], 0
            current.append(seg)
            kept += size
        if current:
            groups.append(current)
        return groups

    def _compact_group(self, group: list[_Segment]) -> tuple[int, int, int]:
        """Rewrite one group into a new segment; returns (copied, dropped, corrupt)."""
        numbers = {s.number for s in group}
        records = sorted(
            ((self._index.get(key) or self._tombs[key], key) for seg in group for key in seg.keys),
            key=lambda pair: (pair[0].segment, pair[0].offset),
        )
        number = self._next_segment
        self._next_segment += 1
        temp = self._dir / _temp_name(number)
        final = self._dir / segment_name(number)
        manifest_payload = b"".join(_SEGMENT_NUMBER.pack(s.number) for s in group)
        manifest = _pack_header(
            RecordKind.MANIFEST,
            b"",
            _MANIFEST_SEQ,
            len(manifest_payload),
            crc32(manifest_payload),
            _NO_FINGERPRINT,
            _NO_CODEC,
        )
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
        placed: list[tuple[bytes, _Entry, _Entry]] = []  # (key, old entry, its copy)
        dropped: list[bytes] = []
        try:
            _pwrite_all(fd, [memoryview(manifest), memoryview(manifest_payload)], 0)
            pos = len(manifest) + len(manifest_payload)
            for old, key in records:
                # A tombstone whose hidden values all lie in this group goes with them
                # (atomically, thanks to the manifest).
                if old.kind is RecordKind.DELETE and self._stale.get(key, set()) <= numbers:
                    dropped.append(key)
                    continue
                new = self._copy_record(fd, number, pos, key, old)
                placed.append((key, old, new))
                pos += new.size
            os.fsync(fd)
            os.rename(temp, final)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        fsync_dir(self._dir)
        # The output is durable: switch the index over, then remove the inputs.
        out = _Segment(number=number, path=final, fd=fd, size=pos)
        out.dead_bytes = len(manifest) + len(manifest_payload)
        self._segments[number] = out
        for key in dropped:
            del self._tombs[key]
        corrupt = 0
        for key, old, new in placed:
            if new.kind is not old.kind:
                corrupt += 1
                out.corrupt_records += 1
            # The old entry's file is about to go: forget it, then account the copy.
            (self._index if old.kind is RecordKind.PUT else self._tombs).pop(key)
            self._apply(key, new)
        self._remove_segments(group)
        fsync_dir(self._dir)
        return len(placed), len(dropped), corrupt

    def _copy_record(self, fd: int, number: int, pos: int, key: bytes, old: _Entry) -> _Entry:
        """Write ``old`` (of ``key``) at ``pos`` of segment ``number`` (open as ``fd``).

        Returns the copy's entry.

        The header is rebuilt from the index (verified when it was read) rather than
        copied, so damage to a header after opening is not carried over; the payload
        is verified, and a damaged value becomes a tombstone with the same sequence
        number, which keeps any older value of the key hidden.
        """
        new = _Entry(
            kind=old.kind,
            seq=old.seq,
            segment=number,
            offset=pos,
            key_len=old.key_len,
            payload_len=old.payload_len,
            payload_crc=old.payload_crc,
            codec_id=old.codec_id,
            fingerprint=old.fingerprint,
        )
        payload = b""
        if old.kind is RecordKind.PUT:
            src = self._segments[old.segment].fd
            payload = _pread_exact(src, old.payload_len, old.payload_offset)
            if len(payload) != old.payload_len or crc32(payload) != old.payload_crc:
                log.warning(
                    "record of key %s in segment %d failed its checksum while compacting; "
                    "it is deleted",
                    _short(key),
                    old.segment,
                )
                payload = b""
                new.kind = RecordKind.DELETE
                new.payload_len = 0
                new.payload_crc = _EMPTY_CRC
                new.codec_id = _NO_CODEC
                new.fingerprint = _NO_FINGERPRINT
        header = _pack_header(
            new.kind, key, new.seq, new.payload_len, new.payload_crc, new.fingerprint, new.codec_id
        )
        _pwrite_all(fd, [memoryview(header), memoryview(payload)], pos)
        return new

    def _remove_segments(self, segments: list[_Segment]) -> None:
        # Forget them all before unlinking any, so a failed unlink cannot leave the
        # tables half updated (a crash-leftover input is removed on open by the manifest).
        for seg in segments:
            del self._segments[seg.number]
            os.close(seg.fd)
        for seg in segments:
            for key in seg.stale_keys:
                homes = self._stale[key]
                homes.discard(seg.number)
                if not homes:
                    del self._stale[key]
        for seg in segments:
            seg.path.unlink()

    # ------------------------------------------------------------------ lifecycle

    def _close_fds(self) -> None:
        for seg in self._segments.values():
            os.close(seg.fd)
        self._segments.clear()
        self._active = None
        self._dir_lock.release()

    def close(self) -> None:
        """Sync (per the fsync policy) and close every file. Idempotent."""
        with self._lock:
            if self._state is _State.CLOSED:
                return
            try:
                if self._sync_every is not None:
                    self._sync_active()
            finally:
                self._state = _State.CLOSED
                self._close_fds()
                self._index.clear()
                self._tombs.clear()
                self._stale.clear()

    def __enter__(self) -> SegmentStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SegmentStore({str(self._dir)!r}, {self._state.value})"
