"""Diagnostics of the storage engine: the refcount-invariant checker."""

from __future__ import annotations

from collections import Counter
from typing import Any

from memkv.errors import InvariantViolationError

__all__ = ["check_refcounts"]


# =============================================================================
# Refcount invariants
# =============================================================================
#
# The store keeps, per block, how many sessions hold it (refcount) and how many
# readers have it pinned. Both are derived state: the session chains are the
# truth for refcounts. In debug mode the store re-derives them after every
# mutating operation and raises on the first disagreement, naming the sessions
# involved, so a bookkeeping bug surfaces where it happens rather than as a
# block freed under a reader or a leak found hours later.


def check_refcounts(blocks: dict[Any, tuple[int, int]], chains: dict[str, list[Any]]) -> None:
    """Check the refcount invariants; raise on the first violation.

    Invariants:
        * every block's refcount equals the number of sessions whose chain holds it;
        * pins are never negative;
        * a block with refcount 0 and no pins does not exist (it was freed);
        * every block a session holds exists.

    Raises:
        InvariantViolationError: naming the block and the sessions involved.
    """
    expected: Counter[Any] = Counter()
    holders: dict[Any, list[str]] = {}
    for session_id, chain in chains.items():
        for key in dict.fromkeys(chain):
            expected[key] += 1
            holders.setdefault(key, []).append(session_id)
            if key not in blocks:
                raise InvariantViolationError(
                    f"session {session_id!r} holds block {_hex(key)}, which does not exist"
                )
    for key, (refcount, pins) in blocks.items():
        if pins < 0:
            raise InvariantViolationError(f"block {_hex(key)} has {pins} pins")
        if refcount != expected[key]:
            raise InvariantViolationError(
                f"block {_hex(key)} has refcount {refcount} but is held by "
                f"{expected[key]} sessions {holders.get(key, [])}"
            )
        if refcount == 0 and pins == 0:
            raise InvariantViolationError(
                f"block {_hex(key)} is held by nobody and pinned by nobody but was not freed"
            )


def _hex(key: Any) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)
