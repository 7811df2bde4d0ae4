"""Forks and rewinds: sessions that share, or give back, blocks already stored.

A fork is a new session whose chain is a prefix of another's: it is placed on
that session's device and its first turn holds those blocks (their reference
counts go up; no byte moves), except a partial last block, which the device
cuts once from the parent's (:class:`~memkv.protocol.services.BlockCut`). A
rewind is a turn that keeps a session's first tokens: the blocks after them
are released like any block an append drops (freed once no session, and no
read in flight, holds them). Both are turns of the session, under its append
lock, journaled as appends are.
"""

from __future__ import annotations

from memkv.errors import ClosedError, ConflictError, PrefixNotStoredError, UnknownBlockError
from memkv.protocol.forks import prefix_of
from memkv.protocol.services import ForkSession, RewindSession, SessionView
from memkv.router.admission import Admission
from memkv.router.appends import Appends
from memkv.router.state import RouterState

__all__ = ["Forks"]


class Forks:
    """Forks into, and rewinds of, one router shard's sessions."""

    def __init__(self, state: RouterState, admission: Admission, appends: Appends) -> None:
        self._state = state
        self._admission = admission
        self._appends = appends

    async def fork(self, request: ForkSession) -> SessionView:
        """Create ``request.session`` holding the parent's blocks (:class:`ForkSession`).

        Raises:
            ConflictError: the id exists, or the parent's blocks moved or were
                dropped since its view was read (nothing is created; retry).
            CapacityError: the tenant's session quota.
        """
        record = await self._admission.admit(request.session, {})
        session_id = record.session_id
        try:
            if not self._state.is_live(request.device_id):
                raise ClosedError(f"device {request.device_id!r} of session {request.parent!r} "
                                  f"is not taking sessions now (moving or recovering); retry")
            self._state.move(session_id, request.device_id)  # where the blocks are
            async with self._appends.holding(session_id):
                await self._appends.hold(session_id, request.tokens, request.chain, request.cut)
        except (PrefixNotStoredError, UnknownBlockError) as e:
            self._state.delete(session_id)
            raise ConflictError(
                f"session {request.parent!r} changed while it was forked ({e}); retry the fork"
            ) from e
        except BaseException:
            self._state.delete(session_id)
            raise
        return self._state.get(session_id).view()

    async def rewind(self, request: RewindSession) -> SessionView:
        """Keep the session's first ``request.tokens`` tokens (a new turn); the blocks
        after them are released.

        Raises:
            InvalidInputError: ``tokens`` is not between 1 and the session's count.
            ConflictError: the session has no blocks yet.
        """
        session_id = request.session_id
        async with self._appends.holding(session_id):
            record = self._state.get(session_id)
            if not record.chain:
                raise ConflictError(f"session {session_id!r} has no blocks yet: nothing to rewind")
            chain, cut = prefix_of(record.layout, record.namespace, record.chain,
                                   record.tokens, request.tokens, "rewind",
                                   request.tail_tokens)
            if request.tokens < record.tokens:
                await self._appends.hold(session_id, request.tokens, chain, cut)
        return self._state.get(session_id).view()
