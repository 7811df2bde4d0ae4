"""Work repeated on an event loop while a service runs (background prefetch, replica
repair, engine checks): one place for the loop, its start and its stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["Periodic"]

logger = logging.getLogger(__name__)


class Periodic:
    """``work()`` every ``interval_s`` on the running loop, from :meth:`ensure_running`
    until :meth:`cancel`. A round that raises is logged; the next one goes on.

    Args:
        name: what the log calls it.
    """

    def __init__(self, work: Callable[[], Awaitable[object]], interval_s: float,
                 name: str) -> None:
        self.work = work
        self.interval_s = interval_s
        self.name = name
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start the loop on the running event loop (once; again after it ended)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.work()
            except Exception as e:  # noqa: BLE001 - one round's failure must not end the loop
                # An actor's error carries its whole remote traceback: one line is enough
                # (a round that fails while the deployment stops is expected).
                cause = getattr(e, "cause", None) or e
                logger.warning("%s round failed: %s: %s", self.name, type(cause).__name__,
                               str(cause).splitlines()[0] if str(cause) else "")
