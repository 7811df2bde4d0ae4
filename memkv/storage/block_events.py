"""The block pool's change log: every block stored into and removed from its table,
numbered, kept for a while, answered since any cursor (:class:`BlockEvents`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice

from memkv.protocol.events import BlockEvents

__all__ = ["DEFAULT_KEEP", "BlockEventLog"]

#: Changes kept for readers that are behind; one further back gets a snapshot.
DEFAULT_KEEP = 65_536


class BlockEventLog:
    """Numbered changes of one table (not thread-safe: the pool's lock guards it).

    Args:
        epoch: the table's identity (a new process, a new epoch).
        keep: how many changes are kept for readers that are behind.
    """

    def __init__(self, epoch: str, keep: int = DEFAULT_KEEP) -> None:
        self.epoch = epoch
        self._changes: deque[tuple[bytes, bool]] = deque(maxlen=keep)
        self._end = 0  # the cursor after the newest change

    @property
    def end(self) -> int:
        return self._end

    def stored(self, key: bytes) -> None:
        self._note(key, True)

    def removed(self, key: bytes) -> None:
        self._note(key, False)

    def _note(self, key: bytes, present: bool) -> None:
        self._changes.append((bytes(key), present))
        self._end += 1

    def since(self, cursor: int, epoch: str, table: Callable[[], Iterable[bytes]]) -> BlockEvents:
        """What changed after ``cursor`` (of ``epoch``); ``table``: every key held now, for
        a reader whose cursor the log no longer reaches (or of another epoch)."""
        first = self._end - len(self._changes)  # the cursor of the oldest change kept
        if epoch != self.epoch or not first <= cursor <= self._end:
            return BlockEvents(epoch=self.epoch, start=cursor, end=self._end,
                               stored=tuple(bytes(k) for k in table()), snapshot=True)
        # Net per key: only a key's last change in the window counts.
        # The newest first, from the right end: a reader that keeps up costs its own
        # changes, not the log's length.
        last: dict[bytes, bool] = {}
        for key, present in islice(reversed(self._changes), self._end - cursor):
            last.setdefault(key, present)
        changes = list(last.items())[::-1]  # in the order of each key's last change
        return BlockEvents(
            epoch=self.epoch, start=cursor, end=self._end,
            stored=tuple(k for k, present in changes if present),
            removed=tuple(k for k, present in changes if not present),
        )
