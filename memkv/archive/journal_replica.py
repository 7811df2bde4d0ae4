"""An archive's copy of a router shard's journal, with the epoch that fences old routers.

A router's session table must outlive the router's node, so the router keeps
its journal on archives of other nodes (:mod:`memkv.actors.archive_journal`)
rather than on its own disk. Each archive keeps one :class:`JournalReplica` per
shard under ``<archive dir>/journals/<shard>``: a crash-safe
:class:`~memkv.storage.journal.Journal` whose records carry the router's
**epoch** (one per router start) and **sequence number**.

* A router starts by reading the replica with the highest ``(epoch, seq)``
  (a replica that missed records, or came back from an old node, loses), then
  writes a snapshot of that table under a new, higher epoch. The snapshot
  fences the replica: from then on it refuses appends of any older epoch, so a
  router that lost its node but still runs (a split) cannot acknowledge
  anything more; it learns it was superseded.
* Appends must follow on: a batch whose first sequence number is not the next
  one (the replica missed records) is refused as a gap, and the router sends
  the replica a snapshot instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memkv.errors import ClosedError, InvalidInputError
from memkv.storage.journal import Journal

__all__ = ["JOURNALS_DIR", "JournalReplica", "SupersededError", "check_journal_name"]

JOURNALS_DIR = "journals"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def check_journal_name(name: str) -> None:
    """A journal's name is its directory's: no path separators, no dots alone.

    Raises:
        InvalidInputError: anything else.
    """
    if not _NAME.match(name) or name in (".", ".."):
        raise InvalidInputError(f"journal names are 1-128 of [A-Za-z0-9_.-], got {name!r}")


class SupersededError(ClosedError):
    """A router of an older epoch wrote to a replica a newer router has fenced."""


class JournalReplica:
    """One shard's journal on this archive.

    Args:
        directory: the archive's directory (the replica lives in ``journals/<name>``).
        name: the router shard's name.
        fsync: fsync appends and snapshots before answering.
    """

    def __init__(self, directory: Path, name: str, *, fsync: bool = True) -> None:
        check_journal_name(name)
        self._journal = Journal(directory / JOURNALS_DIR / name, fsync=fsync)
        self.epoch, self.seq = 0, 0
        self._records: list[bytes] = []  # the table's records, as the router packed them
        for entry in self._journal.replay():
            self._apply(entry)

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, seq)``: which router wrote last, and how far."""
        return self.epoch, self.seq

    def read(self) -> tuple[int, int, list[bytes]]:
        """The position and every record since the last snapshot (the snapshot's first)."""
        return self.epoch, self.seq, list(self._records)

    def append(self, epoch: int, first_seq: int, payloads: list[bytes],
               fsync: bool = True) -> tuple[int, int]:
        """Records ``first_seq..`` of router ``epoch``: fsynced when this returns, or
        (``fsync`` False) written to the OS (they survive the router's crash, not a
        power loss of this node).

        Raises:
            SupersededError: ``epoch`` is older than this replica's (a newer router owns it).
            InvalidInputError: a gap or a new epoch without its snapshot (the router
                sends a snapshot then).
        """
        self._check_epoch(epoch)
        if epoch != self.epoch or first_seq != self.seq + 1:
            raise InvalidInputError(
                f"journal replica at epoch {self.epoch} seq {self.seq} cannot take records "
                f"{first_seq}.. of epoch {epoch}: it needs a snapshot"
            )
        for i, payload in enumerate(payloads):
            self._journal.append({"e": epoch, "s": first_seq + i, "r": payload})
        if fsync:
            self._journal.sync()
        self.seq = first_seq + len(payloads) - 1
        self._records.extend(payloads)
        return self.position

    def snapshot(self, epoch: int, seq: int, payloads: list[bytes]) -> tuple[int, int]:
        """Replace the replica by a table of router ``epoch`` at ``seq``; fences older epochs.

        Raises:
            SupersededError: ``epoch`` is older than this replica's.
        """
        self._check_epoch(epoch)
        self._journal.snapshot([{"e": epoch, "s": seq, "snapshot": True},
                                *({"e": epoch, "s": seq, "r": p} for p in payloads)])
        self.epoch, self.seq, self._records = epoch, seq, list(payloads)
        return self.position

    def close(self) -> None:
        self._journal.close()

    def _check_epoch(self, epoch: int) -> None:
        if epoch < self.epoch:
            raise SupersededError(
                f"router epoch {epoch} was superseded by epoch {self.epoch}: a newer router "
                f"owns this journal"
            )

    def _apply(self, entry: dict[str, Any]) -> None:
        if entry.get("snapshot"):
            self.epoch, self.seq, self._records = entry["e"], entry["s"], []
            return
        self.epoch = max(self.epoch, entry["e"])
        self.seq = max(self.seq, entry["s"])
        self._records.append(entry["r"])
