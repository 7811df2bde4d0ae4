"""The suspended-session journal of the last version's single-process store.

Read only to move its sessions into the session service's journal
(:meth:`memkv.store.TieredStore._migrate_sessions`); a store now keeps
the router's journal. What it was:

A suspended (or archived) session of a :class:`~memkv.store.TieredStore`
outlives its process: its record (:meth:`SessionRecord.manifest`: chain,
tokens, turn, layout, priority) goes into a :class:`~memkv.storage.journal.Journal`
in ``sessions/`` beside the cold tier's segment files, and a store reopened on
that directory serves the session again. It is the journal the router keeps
its table in, so the cold tier, here as in a cluster, holds blocks only.

Records: ``{"op": "suspended", "session": manifest}`` when a session is
suspended, ``{"op": "forget", "session_id": id}`` when it is resumed, written
to or deleted. Only suspended sessions are recorded: an active session lives
in memory and is gone with the process, as its blocks are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memkv.errors import CorruptDataError
from memkv.storage.journal import Journal

__all__ = ["SESSIONS_DIR", "SuspendedSessions"]

#: The journal's directory, under the cold tier's.
SESSIONS_DIR = "sessions"
# Rewrite the journal as a snapshot of the suspended sessions past this many
# records (a resume and suspend per turn would otherwise grow it without end).
_SNAPSHOT_RECORDS = 4096


class SuspendedSessions:
    """The manifests of the store's suspended sessions, crash-safe.

    Args:
        directory: the journal's directory (created if missing).
        fsync: make each suspend and delete durable before it returns (False:
            the OS decides; tests and benchmarks).
    """

    def __init__(self, directory: Path, *, fsync: bool) -> None:
        self._journal = Journal(directory, fsync=fsync)
        self._manifests: dict[str, dict[str, Any]] = {}
        for entry in self._journal.replay():
            self._apply(entry)

    def manifests(self) -> list[dict[str, Any]]:
        """The suspended sessions' manifests, as the last run left them."""
        return list(self._manifests.values())

    def suspended(self, manifest: dict[str, Any]) -> None:
        """Record a session as suspended (durable when this returns)."""
        self._write({"op": "suspended", "session": manifest})
        self._journal.sync()

    def forget(self, session_id: str, *, durable: bool = False) -> None:
        """The session is no longer suspended (resumed, written to, deleted).

        ``durable``: sync before returning (a delete: the session must not come
        back after a crash). A resume or a write need not wait: a crash loses
        what memory held since, and the manifest still names blocks of the cold
        tier, so the session is served as it was suspended, or said to be lost.
        """
        if session_id not in self._manifests:
            return
        self._write({"op": "forget", "session_id": session_id})
        if durable:
            self._journal.sync()

    def close(self) -> None:
        self._journal.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._apply(record)
        self._journal.append(record)
        if self._journal.records_since_snapshot > _SNAPSHOT_RECORDS:
            self._journal.snapshot(
                [{"op": "suspended", "session": m} for m in self._manifests.values()]
            )

    def _apply(self, record: dict[str, Any]) -> None:
        try:
            if record["op"] == "suspended":
                manifest = record["session"]
                self._manifests[str(manifest["session_id"])] = manifest
            elif record["op"] == "forget":
                self._manifests.pop(str(record["session_id"]), None)
            else:
                raise ValueError(f"unknown op {record['op']!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptDataError(f"unreadable record in the store's session journal: {e}") from e
