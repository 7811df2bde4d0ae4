"""A turn's lifecycle hints at the front door: ``memkv.pause`` and ``memkv.final``.

An agent that is about to wait on a human or a slow tool says so with its turn
(``extra_body={"memkv": {"pause": {"expected_s": 300}}}``), and one that is
done says ``{"memkv": {"final": true}}``. memkv acts on them after the answer
is sent:

- a pause of at least :data:`SUSPEND_AFTER_S` suspends the session (its blocks
  leave device memory for the cold tier, unless another active session holds
  them: the room goes to sessions that are working), and the session's next
  turn at the front door resumes it before the engine is asked (the blocks are
  activated and their head prefetched, so the engine's load finds them near);
  a shorter pause changes nothing (the blocks would be needed back before
  their move paid off);
- a final turn gives the session the ``background`` priority: its blocks are
  the first any tier evicts (a DELETE, or ``memkv.final`` on a later turn after
  all, ends it for good).

Hints are bounded: ``expected_s`` is a number from 0 to :data:`MAX_PAUSE_S`
(a day); anything else is refused with 422 before the engine is asked.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from memkv.api.context import Gateway
from memkv.api.engines.front_door import FrontDoor
from memkv.errors import InvalidInputError, MemkvError
from memkv.protocol.enums import Priority
from memkv.protocol.responses import OpenAIDocument

__all__ = ["MAX_PAUSE_S", "SUSPEND_AFTER_S", "TurnHints", "after_turn", "before_turn"]

logger = logging.getLogger(__name__)

#: Pauses at least this long suspend the session.
SUSPEND_AFTER_S = 60.0
#: The longest pause a hint may state.
MAX_PAUSE_S = 86_400.0


@dataclass(frozen=True)
class TurnHints:
    pause_s: float | None = None
    final: bool = False

    @classmethod
    def of(cls, body: OpenAIDocument) -> TurnHints:
        """The hints of a request's ``memkv`` field.

        Raises:
            InvalidInputError: a hint out of range or of the wrong type (named).
        """
        memkv = body.get("memkv")
        if not isinstance(memkv, dict):
            return cls()
        final = memkv.get("final", False)
        if not isinstance(final, bool):
            raise InvalidInputError("memkv.final must be true or false")
        pause = memkv.get("pause")
        if pause is None:
            return cls(final=final)
        expected = pause.get("expected_s") if isinstance(pause, dict) else None
        if (isinstance(expected, bool) or not isinstance(expected, int | float)
                or not math.isfinite(expected) or not 0 <= expected <= MAX_PAUSE_S):
            raise InvalidInputError(
                f"memkv.pause must be {{\"expected_s\": seconds from 0 to {MAX_PAUSE_S:g}}}, "
                f"got {pause!r:.80}")
        if final:
            raise InvalidInputError("a turn is either memkv.final or memkv.pause, not both")
        return cls(pause_s=float(expected))


async def before_turn(gw: Gateway, door: FrontDoor, sid: str) -> None:
    """A session this gateway suspended on a pause hint is resumed before its turn."""
    if door.paused.get(sid) is None:
        return
    door.paused.drop(sid)
    try:
        await gw.routers.service(sid).resume(sid)
    except MemkvError as e:  # the turn goes on; its engine loads from wherever they are
        logger.info("session %s not resumed before its turn: %s", sid, e)


async def after_turn(gw: Gateway, door: FrontDoor, sid: str, hints: TurnHints) -> None:
    """Act on a turn's hints once its answer is sent (never fails the turn)."""
    service = gw.routers.service(sid)
    try:
        if hints.final:
            await service.set_priority(sid, Priority.BACKGROUND)
        elif hints.pause_s is not None and hints.pause_s >= SUSPEND_AFTER_S:
            await service.suspend(sid)
            door.paused.put(sid, True)
    except MemkvError as e:  # no such session (an engine without memkv), or a restart
        logger.info("hints of session %s not applied: %s", sid, e)
