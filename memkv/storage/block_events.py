"""The block pool's change log: every block stored into and removed from its table,
numbered, kept for a while, answered since any cursor (:class:`BlockEvents`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

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
        last: dict[bytes, bool] = {}
        for key, present in list(self._changes)[cursor - first:]:
            last[key] = present
        return BlockEvents(
            epoch=self.epoch, start=cursor, end=self._end,
            stored=tuple(k for k, present in last.items() if present),
            removed=tuple(k for k, present in last.items() if not present),
        )
