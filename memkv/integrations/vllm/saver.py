"""Saves off the engine's thread: where a save's blocks are copied, and who stores them.

The forward pass copies each block to save out of the paged cache, layer by
layer, into a buffer this module chooses (:meth:`Saver.buffer`): slots the
session's device reserved in its shared memory (one copy in all), this host's
staging shared memory (the device copies once more), or this process's memory
(the bytes go over the socket). One background thread then appends them to
the session, in the order they were handed over, so a request's saves reach
memkv in order (each starts where the one before it ended).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from memkv.integrations.vllm.metrics import StatsRecorder
from memkv.integrations.vllm.plan import FAILURES, STAGING_QUARANTINE_S, Save, Staged
from memkv.integrations.vllm.transport import KVTransport
from memkv.protocol.layout import KVLayout

__all__ = ["Saver"]

logger = logging.getLogger(__name__)


class Saver:
    """Buffers for saves, and the thread that stores them.

    Args:
        layout: the engine's KV layout in memkv's terms.
        transport: memkv (made on first use).
        stats: the worker's counters.
        request_bytes: the most bytes one append sends (blocks not in shared memory).
        reserve_min_bytes: saves at least this big ask for a write reservation
            (None: never).
        on_done: called after each save is stored or has failed (the stats file).
    """

    def __init__(self, layout: KVLayout, transport: Callable[[], KVTransport],
                 stats: StatsRecorder, *, request_bytes: int, reserve_min_bytes: int | None,
                 on_done: Callable[[], None]) -> None:
        self.layout = layout
        self._transport = transport
        self._stats = stats
        self._request_bytes = request_bytes
        self._reserve_min_bytes = reserve_min_bytes
        self._on_done = on_done
        self._outbox: queue.Queue[tuple[Save, Staged] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.queued = 0  # saves handed to the thread
        self.done = 0  # saves it finished (stored or failed)

    def buffer(self, save: Save) -> Staged:
        """Where a save's blocks are copied out of the paged cache: slots the session's
        device reserved in its shared memory (the device keeps the bytes there: one
        copy in all), else this host's staging shared memory where the gateway is
        local (the device copies them once more), else memory of this process's."""
        count = len(save.block_ids)
        if self._reserve_min_bytes is not None \
                and count * self.layout.block_nbytes() >= self._reserve_min_bytes:
            reserved = self._reserved_buffer(save)
            if reserved is not None:
                return reserved
        shape = (count, *self.layout.block_shape())
        nbytes = count * self.layout.block_nbytes()
        try:
            slot = self._transport().save_slot(nbytes)
        except FAILURES as e:
            logger.debug("memkv save staging unusable, saving over the socket: %s", e)
            slot = None
        view = slot.take(nbytes) if slot is not None else None
        if slot is None or view is None:
            return Staged(torch.empty(shape, dtype=self.layout.torch_dtype))
        words = torch.frombuffer(view, dtype=torch.uint8)
        return Staged(words.view(self.layout.torch_dtype).view(shape), slot)

    def submit(self, save: Save, staged: Staged) -> None:
        """Store ``staged`` (the save's blocks, copied) in the background."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="memkv-saver", daemon=True)
            self._thread.start()
        self.queued += 1
        self._outbox.put((save, staged))

    def close(self, timeout_s: float = 30.0) -> None:
        """Store what was handed over (up to ``timeout_s``), then stop the thread."""
        if self._thread is not None:
            self._outbox.put(None)
            self._thread.join(timeout=timeout_s)

    # -- internals ----------------------------------------------------------------

    def _reserved_buffer(self, save: Save) -> Staged | None:
        count = len(save.block_ids)
        tokens = save.token_ids[: (save.start_block + count) * self.layout.block_tokens]
        try:
            reservation = self._transport().scoped(save.partition).reserve(
                save.session_id, save.priority, tokens, count)
        except FAILURES as e:
            logger.debug("memkv write reservation failed, staging instead: %s", e)
            return None
        if reservation is None or not reservation.writable:
            return None
        dtype, block_shape = self.layout.torch_dtype, self.layout.block_shape()
        run = reservation.run()
        if run is not None:  # back to back: a run of vLLM blocks is one copy
            words = torch.from_numpy(run).view(dtype)
            return Staged(words.view(count, *block_shape), reservation=reservation)
        return Staged([torch.from_numpy(reservation.slot(i)).view(dtype).view(block_shape)
                       for i in range(count)], reservation=reservation)

    def _store(self, save: Save, blocks: list[torch.Tensor], staged: Staged) -> None:
        """Append in requests of at most ``request_bytes``, each the tokens up to its end
        (one request for blocks in shared memory: their bytes are not in the body)."""
        if not blocks:  # by reference: the turn's tokens, every block memkv's already
            self._transport().scoped(save.partition).save(
                save.session_id, save.priority, save.token_ids, [], save.start_block)
            return
        per = len(blocks) if staged.in_shared_memory \
            else max(1, self._request_bytes // self.layout.block_nbytes())
        for i in range(0, len(blocks), per):
            chunk = blocks[i : i + per]
            first = save.start_block + i
            tokens = save.token_ids[: (first + len(chunk)) * self.layout.block_tokens]
            self._transport().scoped(save.partition).save(
                save.session_id, save.priority, tokens, chunk, first,
                reserved=staged.reservation)

    def _run(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            save, staged = item
            start = time.perf_counter()
            blocks = staged.block_list()
            try:
                self._store(save, blocks, staged)
            except FAILURES as e:
                logger.warning("memkv save of %d blocks of %s failed (a later miss): %s",
                               len(blocks), save.req_id, e)
                self._stats.add(save_failures=1, save_skipped_blocks=len(blocks),
                                save_skipped_blocks_memkv_error=len(blocks))
                staged.release(after_s=STAGING_QUARANTINE_S)  # a device may still read it
            else:
                staged.release()
                self._stats.add(
                    save_blocks=len(blocks),
                    save_blocks_staged=len(blocks) if staged.slot is not None else 0,
                    save_blocks_reserved=len(blocks) if staged.reservation is not None else 0,
                    save_bytes=staged.nbytes,
                    save_seconds=time.perf_counter() - start,
                    save_reference_appends=0 if blocks else 1,
                )
            self.done += 1
            self._on_done()
