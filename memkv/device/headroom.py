"""Demoting ahead of puts: a device's thread that keeps each memory tier's headroom free.

Without it a put into a full tier evicts on its way in: it copies each victim
down a tier and hands the warm tier's victims to the cold writer before its own
blocks land, all on the engine's save path (a 512 MiB append into a full CPU
device took ~0.5 s against ~0.1 s into free space). This thread makes that room
between requests instead, a few blocks per pass (see
:meth:`~memkv.storage.block_pool.BlockPool.demote_ahead`), so the pool's lock is
never held for long and puts and reads interleave with it.
"""

from __future__ import annotations

import logging
import threading

from memkv.errors import CapacityError, ClosedError
from memkv.storage.block_pool import BlockPool

__all__ = ["HeadroomKeeper"]

logger = logging.getLogger(__name__)

#: Blocks per pass: each is a copy of one block (~1 ms for 4 MiB), under the pool's lock.
PASS_BLOCKS = 2
#: How often an idle keeper looks without being nudged (reads that promote fill tiers too).
IDLE_CHECK_S = 1.0
#: After the cold tier refused a block: wait this long before trying again.
BACKOFF_S = 5.0


class HeadroomKeeper:
    """Demotes blocks of ``pool`` on its own thread whenever a tier is short of headroom.

    Args:
        pool: the device's block pool.
        pass_blocks: blocks moved per pass, between which the lock is released.
    """

    def __init__(self, pool: BlockPool, pass_blocks: int = PASS_BLOCKS) -> None:
        self._pool = pool
        self._pass_blocks = pass_blocks
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._nudges = 0  # a pass settles only if no put came in while it ran
        self._full = False  # the cold tier refused the last pass (warned once)
        #: Set while the tiers have their headroom (or nothing can move); tests wait on it.
        self.settled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memkv-headroom", daemon=True)

    def start(self) -> HeadroomKeeper:
        self._thread.start()
        return self

    def nudge(self) -> None:
        """Something was stored: look now rather than at the next idle check."""
        with self._lock:
            self._nudges += 1
            self.settled.clear()
        self._wake.set()

    def close(self) -> None:
        """Stop the thread (it finishes the pass it is in)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(IDLE_CHECK_S)
            self._wake.clear()
            with self._lock:
                nudges = self._nudges
            try:
                while not self._stop.is_set() and self._pool.demote_ahead(self._pass_blocks):
                    pass
            except ClosedError:
                return
            except CapacityError as e:
                # The cold tier is full: puts will say so to their callers; here there is
                # nothing to do but wait for room (sessions ending, compaction). Said once
                # a spell, not every BACKOFF_S.
                if not self._full:
                    logger.warning("cannot demote ahead: %s", e)
                self._full = True
                self.settled.set()
                self._stop.wait(BACKOFF_S)
                continue
            except Exception:  # noqa: BLE001 - the thread must outlive one bad pass
                logger.exception("demoting ahead failed")
                self._stop.wait(BACKOFF_S)
                continue
            self._full = False
            with self._lock:
                if self._nudges == nudges:
                    self.settled.set()
