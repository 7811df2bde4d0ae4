"""Segments whose owner died, unlinked while the device runs.

Every memkv shared-memory segment (a device's warm pool, a gateway's or an
engine's staging) is paired with a lock file its owner holds (``flock``) for as
long as it lives; the kernel lets go of the lock when the owner dies, however
it dies. A killed vLLM engine leaves its connector's 1 GiB staging segment in
``/dev/shm``: populated memory no process uses. Reclaiming at start-up only
(as devices and clients did) left it there until the next memkv process
started on that host; the device now looks every ``interval_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from memkv.shm.ownership import reclaim_orphans

__all__ = ["SWEEP_INTERVAL_S", "OrphanSweeper"]

logger = logging.getLogger(__name__)

#: How often a device looks for segments whose owner died (seconds).
SWEEP_INTERVAL_S = 30.0


class OrphanSweeper:
    """Unlinks orphaned segments on its own thread, every ``interval_s``.

    Args:
        interval_s: seconds between sweeps.
        reclaim: the sweep (returns the names it unlinked); tests pass their own.
        also: run after each sweep too (a device gives back its idle memory).
    """

    def __init__(self, interval_s: float = SWEEP_INTERVAL_S,
                 reclaim: Callable[[], list[str]] = reclaim_orphans,
                 also: Callable[[], object] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._interval_s = interval_s
        self._reclaim = reclaim
        self._also = also
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memkv-shm-sweeper", daemon=True)
        self.reclaimed = 0  # segments unlinked so far

    def start(self) -> OrphanSweeper:
        self._thread.start()
        return self

    def sweep(self) -> list[str]:
        """One sweep now: the segments unlinked."""
        names = self._reclaim()
        if names:
            self.reclaimed += len(names)
            logger.info("unlinked %d shared-memory segment(s) whose owner died: %s",
                        len(names), ", ".join(names))
        return names

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sweep()
                if self._also is not None:
                    self._also()
            except OSError as e:  # /dev/shm unreadable for a moment: the next sweep retries
                logger.warning("shared-memory sweep failed: %s", e)
