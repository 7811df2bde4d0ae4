"""What the sync and async clients share beyond their I/O: the sessions they know,
and the shared memory they stage appends in.

An append needs the session's layout, namespace, chain and turn. A client keeps
the view of every session it created, read or appended to, so an append costs
one request, not two; a view gone stale (another writer appended meanwhile) is
refreshed once on the ConflictError it causes, and the append tried again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from memkv.client.views import after_append
from memkv.errors import ConflictError, PrefixNotStoredError
from memkv.protocol.hashing import token_array
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import AppendAnswer, SessionView

if TYPE_CHECKING:
    from memkv.shm.staging import PutStaging

__all__ = ["AppendStaging", "KnownSessions", "fork_body", "layout_conflict", "rewind_body"]

logger = logging.getLogger(__name__)


def fork_body(new_id: str, at_tokens: int | None,
              tail: Sequence[int] | None) -> dict[str, object]:
    """The JSON body of ``POST /v1/sessions/{id}/fork``."""
    body: dict[str, object] = {"new_id": new_id}
    if at_tokens is not None:
        body["at_tokens"] = at_tokens
    if tail is not None:
        body["tail_tokens"] = list(tail)
    return body


def rewind_body(tokens: int, tail: Sequence[int] | None) -> dict[str, object]:
    """The JSON body of ``POST /v1/sessions/{id}/rewind``."""
    return {"tokens": tokens} if tail is None else {"tokens": tokens, "tail_tokens": list(tail)}


def layout_conflict(session: SessionView, layout: KVLayout | None) -> ConflictError | None:
    """The error an append of blocks computed in ``layout`` meets when ``session`` holds
    another layout's KV (None: no layout given, or the same): refused rather than
    stored under the session's model's hashes."""
    if layout is None or session.layout.layout() == layout:
        return None
    stored = msgspec.structs.asdict(session.layout)
    return ConflictError(f"session {session.session_id!r} holds KV of layout {stored}; "
                         f"these blocks are of {layout.to_dict()}")


class AppendStaging:
    """A client's staging segment (``Client.staging``) and whether appends may name
    blocks in it: until a gateway answers that it cannot see this host's memory."""

    def __init__(self) -> None:
        self.segment: PutStaging | None = None
        self._usable = True
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> PutStaging | None:
        """The segment, made on the first call (of ``nbytes``, its pages populated)."""
        with self._lock:
            if self.segment is None:
                from memkv.shm.staging import client_staging  # numpy and torch: only when used

                self.segment = client_staging(nbytes)
                if self.segment is not None:
                    self.segment.prefault()
            return self.segment

    @property
    def active(self) -> PutStaging | None:
        """The segment appends name blocks in now (None: send the bytes)."""
        return self.segment if self._usable else None

    def refused(self, error: Exception) -> None:
        """The gateway cannot map this host's memory: send the bytes from now on."""
        logger.info("memkv appends send their bytes: %s", error)
        self._usable = False

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class KnownSessions:
    """Session views by id, as this client last saw them."""

    def __init__(self) -> None:
        self._views: dict[str, SessionView] = {}

    def get(self, session_id: str) -> SessionView | None:
        return self._views.get(session_id)

    def remember(self, view: SessionView) -> SessionView:
        self._views[view.session_id] = view
        return view

    def forget(self, session_id: str) -> None:
        self._views.pop(session_id, None)

    def appended(
        self, session: SessionView, result: AppendAnswer, token_ids: Sequence[int] | np.ndarray
    ) -> None:
        """The view after an append this client made."""
        self.remember(after_append(session, result, int(token_array(token_ids).size)))

    def worth_refreshing(self, error: BaseException, session_id: str, turn: int | None,
                         resendable: bool = False) -> bool:
        """Whether an append's error may come from a stale view of ours (then the caller
        refreshes it and tries once more): a conflict on a turn the client did not pin,
        or (``resendable``: the caller gave every token's KV) blocks our view counted as
        stored that a partial loss took since; the fresh view says where to send from."""
        if turn is not None:
            return False
        if isinstance(error, PrefixNotStoredError):
            return resendable
        return isinstance(error, ConflictError) and session_id in self._views

    def read_turn(self, session_id: str) -> int | None:
        """The turn to name in a read: a gateway at it or later answers from its own view."""
        view = self._views.get(session_id)
        return view.turn if view is not None else None
