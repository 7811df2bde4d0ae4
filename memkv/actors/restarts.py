"""Asking an actor again while Ray restarts it.

An actor with ``max_restarts`` comes back after a crash (an archive rebuilds its
index, a router replays its journal); a call sent meanwhile fails with
:class:`~ray.exceptions.RayActorError`. For calls that change nothing a second
call would change again (reads, recoveries, puts of content-addressed data),
sending them again until the actor answers is safe, and is what every caller
of such a call wants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ray.exceptions import RayActorError
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

__all__ = ["through_restarts"]

T = TypeVar("T")


def through_restarts(call: Callable[[], T], *, timeout_s: float, wait_s: float = 0.2) -> T:
    """``call()``'s answer, ``call()`` made again every ``wait_s`` while its actor
    restarts, for up to ``timeout_s``.

    Raises:
        RayActorError: the actor did not come back in time (the last error).
    """
    for attempt in Retrying(retry=retry_if_exception_type(RayActorError),
                            stop=stop_after_delay(timeout_s), wait=wait_fixed(wait_s),
                            reraise=True):
        with attempt:
            return call()
    raise AssertionError("unreachable: Retrying reraises")  # pragma: no cover
