"""What the sync and async clients share beyond their I/O: the sessions they know.

An append needs the session's layout, namespace, chain and turn. A client keeps
the view of every session it created, read or appended to, so an append costs
one request, not two; a view gone stale (another writer appended meanwhile) is
refreshed once on the ConflictError it causes, and the append tried again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memkv.client.views import SessionView, TurnResult, after_append
from memkv.errors import ConflictError
from memkv.protocol.hashing import token_array

__all__ = ["KnownSessions"]


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
        self, session: SessionView, result: TurnResult, token_ids: Sequence[int] | np.ndarray
    ) -> None:
        """The view after an append this client made."""
        self.remember(after_append(session, result, int(token_array(token_ids).size)))

    def worth_refreshing(self, error: BaseException, session_id: str, turn: int | None) -> bool:
        """Whether an append's error may come from a stale view of ours (then the caller
        refreshes it and tries once more): a conflict on a turn the client did not pin."""
        return isinstance(error, ConflictError) and turn is None and session_id in self._views

    def read_turn(self, session_id: str) -> int | None:
        """The turn to name in a read: a gateway at it or later answers from its own view."""
        view = self._views.get(session_id)
        return view.turn if view is not None else None
