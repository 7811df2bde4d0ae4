"""A session's next turn waits (briefly) for the save of its last one.

The connector saves a prompt's KV from a background thread, so decoding never
waits for the upload. An agent's next turn can arrive before that upload has
landed, typically when the reply was short: its lookup would then miss the
blocks the engine itself just saved and recompute them. The scheduler knows
which saves it issued (``build_connector_meta``), so a lookup that finds less
of a session than its last save covers is deferred (vLLM asks again on a later
step: ``get_num_new_matched_tokens`` answers None) until memkv has the blocks
or ``wait_s`` has passed; then the request computes what is missing, as it
would have.

Only sessions named in ``kv_transfer_params`` are tracked, and only the last
save of each: a lookup finds a prefix, and the last save covers the longest.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DEFAULT_SAVE_WAIT_S", "PendingSaves"]

#: The longest a resumed turn waits for its session's last save.
DEFAULT_SAVE_WAIT_S = 2.0
#: How often a deferred request asks memkv again (vLLM re-queries every step).
RECHECK_S = 0.02


class PendingSaves:
    """The saves this engine issued per session, until a lookup sees them.

    Args:
        wait_s: the longest a request is deferred for one save (0: never).
        recheck_s: the shortest time between two lookups of one deferred request.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, wait_s: float = DEFAULT_SAVE_WAIT_S, recheck_s: float = RECHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if wait_s < 0 or recheck_s < 0:
            raise ValueError(f"wait_s and recheck_s must be >= 0, got {wait_s}, {recheck_s}")
        self.wait_s = wait_s
        self.recheck_s = recheck_s
        self._clock = clock
        # session -> (tokens, issued at), oldest first: entries past wait_s are dropped as
        # new ones come (sessions that never return do not pile up).
        self._issued: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._asked: dict[str, float] = {}  # deferred request -> when memkv was last asked
        self.deferred = 0  # lookups answered "ask again later"

    def issued(self, session_id: str | None, tokens: int) -> None:
        """A save of the session's first ``tokens`` tokens was handed to the saver."""
        if not session_id or self.wait_s <= 0:
            return
        now = self._clock()
        self._issued.pop(session_id, None)
        self._issued[session_id] = (tokens, now)
        while self._issued:
            _, (_, since) = next(iter(self._issued.items()))
            if now - since < self.wait_s:
                break
            self._issued.popitem(last=False)

    def too_soon(self, request_id: str) -> bool:
        """Whether a deferred request was looked up less than ``recheck_s`` ago."""
        asked = self._asked.get(request_id)
        return asked is not None and self._clock() - asked < self.recheck_s

    def should_wait(self, request_id: str, session_id: str | None, hit: int,
                    usable: int, local: int = 0) -> bool:
        """Whether to defer a lookup that found ``hit`` of the ``usable`` tokens.

        True while the session's last save covers more of them than ``hit`` and
        than ``local`` (what the engine's own prefix cache holds: when it holds
        the saved blocks, the save brings nothing to wait for), and was issued
        less than ``wait_s`` ago; the save is forgotten otherwise.
        """
        entry = self._issued.get(session_id or "") if session_id else None
        if entry is not None:
            tokens, since = entry
            if min(tokens, usable) > max(hit, local) and \
                    self._clock() - since < self.wait_s:
                self._asked[request_id] = self._clock()
                self.deferred += 1
                return True
            del self._issued[session_id or ""]  # landed, or given up on
        self._asked.pop(request_id, None)
        return False

    def forget(self, request_id: str) -> None:
        self._asked.pop(request_id, None)
