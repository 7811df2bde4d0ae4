"""A router shard's journal on archives of other nodes: the table outlives the router's node.

A journal on the router's own disk dies with its node; Ray restarts the router
elsewhere, with nothing to rebuild from. :class:`ArchiveJournal` keeps the
records on ``replicas`` archives instead (archives of nodes other than the
router's first), each an :class:`~memkv.archive.journal_replica.JournalReplica`:

* **Start**: ask every reachable archive where its copy stands and replay the
  one with the highest ``(epoch, seq)``; this router's epoch is one past the
  highest seen. Its first snapshot goes to every reachable archive: each is
  then fenced, and a router of an older epoch that still runs (its node cut
  off, not dead) can acknowledge nothing more (:class:`SupersededError`).
* **Appends** are buffered; :meth:`sync` sends them to the replicas together
  and returns once each has fsynced them. A replica that is lost, or missed
  records, makes the journal ask for a snapshot (``wants_snapshot``), which the
  router writes before it answers (``SessionRouter._durable``: sync, then
  compact), so an acknowledged change is on ``replicas`` archives (or on every
  live one, when fewer are left).
* **Upgrades**: a shard whose archives hold no journal yet replays the local
  journal it had (``local``), and its first snapshot moves it to the archives.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
from ray.exceptions import ActorUnschedulableError

from memkv.actors.restarts import through_restarts
from memkv.actors.waiting import wait_for
from memkv.archive.journal_replica import SupersededError
from memkv.errors import InvalidInputError, MemberLostError
from memkv.storage.journal import TableJournal

__all__ = ["ArchiveJournal", "SupersededError", "journal_name", "journal_shard_counts"]

logger = logging.getLogger(__name__)

#: How long a call waits for an archive Ray is restarting.
ARCHIVE_RESTART_WAIT_S = 60.0


def journal_name(router_name: str, shard: int, shards: int) -> str:
    """The name shard ``shard`` of ``shards`` keeps its journal under on each archive
    (the count in it: journals of another shard count are never replayed)."""
    return f"{router_name}.{shard}-of-{shards}"


def journal_shard_counts(names: Sequence[str], router_name: str) -> set[int]:
    """The shard counts the journals ``names`` (of one archive) were written with."""
    prefix = f"{router_name}."
    return {int(n.rsplit("-of-", 1)[1]) for n in names
            if n.startswith(prefix) and n.rsplit("-of-", 1)[-1].isdigit()}


class ArchiveJournal:
    """The :class:`~memkv.storage.journal.TableJournal` of router shard ``name``.

    Args:
        name: the shard's name (one journal per shard on each archive).
        archives: ``(name, handle)`` of every archive.
        replicas: copies of the journal (capped by the archives there are).
        own_node: the router's node (its archive is the last choice).
        local: the shard's journal on local disk before it moved to the archives.
        resolve: waits for an actor call's answer (memkv.actors.waiting).
    """

    def __init__(
        self,
        name: str,
        archives: Sequence[tuple[str, Any]],
        *,
        replicas: int = 2,
        own_node: str = "",
        local: TableJournal | None = None,
        resolve: Callable[[Any], Any] = wait_for,
    ) -> None:
        if not archives:
            raise InvalidInputError("a journal on archives needs at least one archive")
        self.name = name
        self.replicas = max(1, replicas)
        self._archives = dict(archives)
        self._resolve = resolve
        self._local = local
        self._lock = threading.Lock()  # appends, and what is sent in which order
        self._pending: list[bytes] = []
        self._unsynced = False  # records flushed to the replicas but not fsynced there
        self._commit_lock: asyncio.Lock | None = None  # made in the router's event loop
        self.lost: set[str] = set()
        self.records_since_snapshot = 0
        # A new epoch starts with a snapshot to every reachable archive (it fences).
        self.wants_snapshot = True
        self._fence_all = True

        positions: dict[str, tuple[int, int]] = {}
        nodes: dict[str, str] = {}
        for archive in self._archives:
            try:
                positions[archive] = tuple(self._ask(archive, "journal_position", name))
                nodes[archive] = self._ask(archive, "node")
            except ActorUnschedulableError as e:
                self._lose(archive, e)
        if not positions:
            raise MemberLostError(f"no archive answered for router journal {name!r}")
        self._source = max(positions, key=lambda a: positions[a])
        self.epoch = max(e for e, _ in positions.values()) + 1
        self.seq = positions[self._source][1]
        if positions[self._source] == (0, 0):
            self._source = ""  # no copy anywhere yet
        # Archives of other nodes first: the router's node may be the one lost.
        self._order = sorted(positions, key=lambda a: (nodes[a] == own_node, a))
        logger.info("router journal %s: epoch %d from %s at seq %d", name, self.epoch,
                    self._source or "nowhere (new)", self.seq)

    # -- TableJournal -----------------------------------------------------------------

    def replay(self) -> Iterator[dict[str, Any]]:
        if self._source:
            _, _, payloads = self._ask(self._source, "journal_read", self.name)
            self.records_since_snapshot = len(payloads)
            for payload in payloads:
                yield msgpack.unpackb(payload, raw=False)
        elif self._local is not None:
            yield from self._local.replay()

    def append(self, record: dict[str, Any]) -> int:
        """Buffer one record; returns its sequence number."""
        payload = msgpack.packb(record, use_bin_type=True)
        with self._lock:
            self._pending.append(payload)
            self.seq += 1
            self.records_since_snapshot += 1
            return self.seq

    @property
    def buffered(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Send buffered records to every replica, written there (not fsynced): they
        survive this process's crash (a change of a ``memory``-mode session)."""
        self._send(fsync=False)

    def sync(self, upto: int | None = None) -> None:
        """Send buffered records to every replica; return once each has fsynced them.

        Raises:
            SupersededError: a newer router owns the journal (this one must stop).
            MemberLostError: no archive is left.
        """
        self._send(fsync=True)

    async def commit(self, *, fsync: bool) -> None:
        """:meth:`sync` (``fsync``) or :meth:`flush` for the router's event loop: the
        replicas' answers are awaited, not blocked on. One commit at a time; the
        records of those that wait meanwhile go out together in the next (a group
        commit, as the local journal's fsync is)."""
        if self._commit_lock is None:
            self._commit_lock = asyncio.Lock()
        async with self._commit_lock:
            sent = self._start(fsync)
            if sent is not None:
                answers = await asyncio.gather(*sent.values(), return_exceptions=True)
                self._settle(dict(zip(sent, answers, strict=True)))

    def _send(self, *, fsync: bool) -> None:
        sent = self._start(fsync)
        if sent is None:
            return
        answers: dict[str, object] = {}
        for archive, ref in sent.items():
            try:
                answers[archive] = self._resolve(ref)
            except Exception as e:  # noqa: BLE001 - settled below, as the async path does
                answers[archive] = e
        self._settle(answers)

    def _start(self, fsync: bool) -> dict[str, Any] | None:
        """Send what is buffered to the replicas; their answers' references (None: nothing
        to send)."""
        with self._lock:
            if not self._pending and not (fsync and self._unsynced):
                return None
            # (nothing pending but records flushed unsynced: an empty batch fsyncs them)
            payloads, self._pending = self._pending, []
            self._unsynced = not fsync
            first = self.seq - len(payloads) + 1
            return {a: self._archives[a].journal_append.remote(self.name, self.epoch, first,
                                                                payloads, fsync)
                    for a in self._targets()}

    def _settle(self, answers: dict[str, object]) -> None:
        """A lost replica or one that missed records asks for a snapshot; a newer router
        stops this one; anything else is raised."""
        for archive, answer in answers.items():
            if isinstance(answer, ActorUnschedulableError):
                self._lose(archive, answer)
                self.wants_snapshot = True  # its stand-in needs the whole table
            elif isinstance(answer, SupersededError):
                raise answer
            elif isinstance(answer, InvalidInputError):  # it missed records
                logger.warning("router journal replica %s: %s", archive, answer)
                self.wants_snapshot = True
            elif isinstance(answer, BaseException):
                raise answer

    def snapshot(self, records: list[dict[str, Any]]) -> None:
        """The whole table, to the replicas (to every reachable archive at a new epoch)."""
        payloads = [msgpack.packb(r, use_bin_type=True) for r in records]
        with self._lock:
            self._pending = []  # the table includes them
            point = self._snapshot_point()
            self._snapshot_done(self._write_snapshot(*point, payloads), point[2])

    async def snapshot_async(self, make_records: Callable[[], list[dict[str, Any]]]) -> None:
        """:meth:`snapshot` for the router's event loop, which goes on serving meanwhile:
        the archives' answers are waited for on a thread (a restarting archive can take
        up to ``ARCHIVE_RESTART_WAIT_S``; a large table's snapshot, tens of
        milliseconds). Records appended meanwhile are buffered; commits wait for the
        snapshot, since a replica must have it before the records after it.

        ``make_records``: the table as records, taken when the snapshot starts (the
        records buffered until then are in it).
        """
        if self._commit_lock is None:
            self._commit_lock = asyncio.Lock()
        async with self._commit_lock:
            # No await between taking the table and dropping the buffered records:
            # nothing on the loop changes the table in between.
            records = make_records()
            with self._lock:
                self._pending = []  # the table includes them
                point = self._snapshot_point()
            payloads = [msgpack.packb(r, use_bin_type=True) for r in records]
            written = await asyncio.to_thread(self._write_snapshot, *point, payloads)
            with self._lock:
                self._snapshot_done(written, point[2])

    def _snapshot_point(self) -> tuple[list[str], int, int]:
        """Where a snapshot goes (every reachable archive at a new epoch) and the
        ``(epoch, seq)`` it stands at."""
        targets = [a for a in self._order if a not in self.lost] if self._fence_all \
            else self._targets()
        return targets, self.epoch, self.seq

    def _write_snapshot(self, targets: list[str], epoch: int, seq: int,
                        payloads: list[bytes]) -> int:
        """The snapshot to each of ``targets``; how many took it."""
        written = 0
        for archive in targets:
            try:
                self._ask(archive, "journal_snapshot", self.name, epoch, seq, payloads)
                written += 1
            except ActorUnschedulableError as e:
                self._lose(archive, e)
        return written

    def _snapshot_done(self, written: int, seq: int) -> None:
        """The snapshot at ``seq`` landed on ``written`` archives."""
        if not written:
            raise MemberLostError(f"no archive took router journal {self.name!r}")
        self._fence_all = False
        self._unsynced = False  # what was sent before it is in it; what came after is not sent
        self.wants_snapshot = False
        self.records_since_snapshot = self.seq - seq  # appended while it was written

    def close(self) -> None:
        if self._local is not None:
            self._local.close()

    # -- internals --------------------------------------------------------------------

    def _targets(self) -> list[str]:
        live = [a for a in self._order if a not in self.lost]
        if not live:
            raise MemberLostError(
                f"every archive of router journal {self.name!r} is lost "
                f"({', '.join(sorted(self.lost))})")
        return live[: self.replicas]

    def _ask(self, archive: str, method: str, *args: Any) -> Any:
        """An archive's answer, waiting out a restart (Ray restarts a crashed archive)."""
        return through_restarts(
            lambda: self._resolve(getattr(self._archives[archive], method).remote(*args)),
            timeout_s=ARCHIVE_RESTART_WAIT_S)

    def _lose(self, archive: str, error: BaseException) -> None:
        if archive not in self.lost:
            logger.warning("router journal %s: archive %s is lost (%s)", self.name, archive,
                           error)
            self.lost.add(archive)
