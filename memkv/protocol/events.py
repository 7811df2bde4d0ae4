"""What changed in a device's block table: blocks stored and removed, since a cursor.

The device's block pool is the one owner of which blocks a device holds; it
numbers every change (a block entering its table, a block leaving it) and
answers them since any cursor, in the manner of vLLM's ``BlockStored`` /
``BlockRemoved`` KV events. A reader (a router shard's block index) keeps a
cursor per device and applies the answers: it never counts references itself.
"""

from __future__ import annotations

import msgspec

__all__ = ["BlockEvents"]


class BlockEvents(msgspec.Struct, frozen=True, kw_only=True):
    """The changes of one device's block table from cursor ``start`` to ``end``.

    Attributes:
        epoch: the table's identity (the device process's incarnation): cursors
            of another epoch mean nothing here, so a reader that held one gets a
            snapshot.
        start, end: the cursors this answer spans; the reader's next is ``end``.
        stored: blocks in the table now that were not at ``start`` (or every
            block, in a snapshot).
        removed: blocks that were at ``start`` and are gone.
        snapshot: the log no longer reaches back to ``start`` (or the epoch
            changed): ``stored`` is the whole table, and a reader forgets what it
            knew of this device before applying it.
    """

    epoch: str
    start: int
    end: int
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    snapshot: bool = False
