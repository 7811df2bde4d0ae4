"""Write-behind for the cold tier: one writer thread per block pool.

A block demoted to cold used to be encoded and written while the pool's lock
was held (for a cluster: one archive actor call per block), so every append
that had to make room paid the codec and the round trip, one block at a time,
and every other caller of the pool waited behind it. :class:`ColdWriter` wraps
the pool's cold backend: a demotion hands it a copy of the block and returns;
one thread encodes and writes what is queued in batches, one backend call per
batch, outside the pool's lock.

Ordering, so the backend ends as the calls ordered it:

* Reads never wait behind writes: until a block's write has landed the writer
  keeps its copy, and ``load``, ``contains`` and ``missing`` answer from it.
* A delete cancels the queued write of its key, and a batch applies its
  deletes before its writes (a key freed and then demoted again ends present).
* Synchronous callers (durable appends, suspend, ``sync``, ``block_keys``,
  ``close``) wait for the queue to drain first, so what they write or report
  comes after every earlier demotion. ``stats`` does not wait (the pool asks for
  it under its lock): it counts queued writes at their raw size.

Backpressure: the copies held are bounded by ``max_pending_bytes``; a demotion
past it waits for the writer. A backend with a capacity is checked when a block
is queued (counting the queued blocks at their raw size, an upper bound), so a
full cold tier raises :class:`CapacityError` to the demotion, as an inline
write would. A batch that fails stays queued (its blocks still readable here);
its error is raised to the next demotion or flush, and the batch is retried
then. What a failed writer still holds at close is logged, never dropped
silently.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from memkv.errors import CapacityError, UnknownBlockError
from memkv.protocol.enums import Tier
from memkv.storage.codecs import CODECS, decode_frame, encode_stored
from memkv.storage.config import CodecConfig
from memkv.storage.precision import EncodedBlock, QuantizedBlock
from memkv.storage.tiers import ColdBackend, ColdStats, StoredBlock, stored_nbytes

__all__ = ["ColdWriter", "WriterStats"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Write:
    key: bytes
    block: StoredBlock  # the writer's own copy, on the CPU
    fingerprint: bytes
    codec: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class WriterStats:
    """What the cold writer has done (for the pool's stats and the benchmarks)."""

    batches: int
    blocks_written: int
    deletes: int
    pending_blocks: int
    pending_bytes: int
    backpressure_waits: int
    failures: int
    write_seconds: float  # spent in backend calls, off the pool's lock


def _owned_copy(block: StoredBlock) -> StoredBlock:
    """A CPU copy of ``block`` that outlives the arena slot it is leaving."""
    if isinstance(block, QuantizedBlock):
        return QuantizedBlock(
            data=block.data.to("cpu", copy=True),
            k_scale=block.k_scale.to("cpu", copy=True),
            v_scale=block.v_scale.to("cpu", copy=True),
            dtype=block.dtype,
        )
    if isinstance(block, EncodedBlock):
        return EncodedBlock(block.frame.to("cpu", copy=True), block.dtype, block.codec)
    return block.to("cpu", copy=True)


class ColdWriter:
    """A :class:`ColdBackend` that writes demoted blocks behind the caller.

    Args:
        backend: the cold tier written to (local segment files or an archive).
        codecs: codec parameters (to serve a queued lossy write as the backend would).
        max_pending_bytes: copies held for queued writes before a demotion waits.
        max_batch_blocks: blocks per backend call.
    """

    tier = Tier.COLD

    def __init__(
        self,
        backend: ColdBackend,
        codecs: CodecConfig,
        *,
        max_pending_bytes: int,
        max_batch_blocks: int,
    ) -> None:
        self.backend = backend
        self.owns_sessions = backend.owns_sessions
        self.capacity_bytes = backend.capacity_bytes
        self._codecs = codecs
        self._max_pending_bytes = max_pending_bytes
        self._max_batch = max_batch_blocks
        self._cv = threading.Condition()
        # Writes not yet landed, by key (queued or in flight); the queue keeps
        # their order, and a queue entry no longer in _writes was cancelled.
        self._writes: dict[bytes, _Write] = {}
        self._queue: collections.deque[_Write] = collections.deque()
        self._deletes: list[bytes] = []
        self._deleting: collections.Counter[bytes] = collections.Counter()
        self._pending_bytes = 0
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        # One caller of the backend's mutating calls at a time (the thread, or
        # a synchronous caller after the queue drained).
        self._io = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="memkv-cold-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, block: StoredBlock, *, fingerprint: bytes, codec: str) -> int:
        """Queue a block's cold write. Returns its raw size (the frame is not made yet).

        Raises:
            CapacityError: the backend's capacity cannot take it, counting queued blocks.
            Exception: an earlier batch failed (its blocks stay queued and are retried).
        """
        nbytes = stored_nbytes(block)
        # The copy is made before the writer's lock is taken: its thread need not
        # wait for a 4 MiB memcpy to record a batch.
        write = _Write(bytes(key), _owned_copy(block), fingerprint, codec, nbytes)
        with self._cv:
            self._raise_pending_error()
            self._check_capacity(nbytes)
            if self._pending_bytes and self._pending_bytes + nbytes > self._max_pending_bytes:
                self._counts["backpressure_waits"] += 1
                while (
                    self._pending_bytes
                    and self._pending_bytes + nbytes > self._max_pending_bytes
                    and self._error is None
                ):
                    self._cv.wait()
                self._raise_pending_error()
            replaced = self._writes.pop(write.key, None)
            if replaced is not None:
                self._pending_bytes -= replaced.nbytes
            self._writes[write.key] = write
            self._queue.append(write)
            self._pending_bytes += nbytes
            self._cv.notify_all()
        return nbytes

    def put_many(
        self, items: Sequence[tuple[bytes, StoredBlock, bytes, str]], *, durable: bool = False
    ) -> list[int]:
        """Write ``items`` now, after everything queued (the durable and suspend paths)."""
        self.flush()
        with self._io:
            return self.backend.put_many(items, durable=durable)

    def remove(self, key: bytes) -> None:
        """Cancel ``key``'s queued write and queue its delete (applied before later writes)."""
        key = bytes(key)
        with self._cv:
            cancelled = self._writes.pop(key, None)
            if cancelled is not None:
                self._pending_bytes -= cancelled.nbytes
            self._deletes.append(key)
            self._deleting[key] += 1
            self._cv.notify_all()

    def sync(self) -> None:
        self.flush()
        with self._io:
            self.backend.sync()

    def flush(self, *, raise_errors: bool = True) -> None:
        """Wait until every queued write and delete has reached the backend.

        Raises:
            Exception: a batch failed (with ``raise_errors``); it stays queued.
        """
        with self._cv:
            while (self._queue or self._deletes or self._busy) and self._error is None:
                self._cv.wait()
            if raise_errors:
                self._raise_pending_error()

    # ------------------------------------------------------------------ reads

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes | bytearray):
            return False
        key = bytes(key)
        # Held across the backend's answer: a write leaves _writes only after
        # it landed, so a key is always found in one place or the other.
        with self._cv:
            if key in self._writes:
                return True
            if self._deleting[key]:
                return False
            return key in self.backend

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        with self._cv:
            unknown = [bytes(k) for k in keys if bytes(k) not in self._writes]
            asked = [k for k in unknown if not self._deleting[k]]
            absent = set(self.backend.missing(asked)) if asked else set()
            return [k for k in unknown if self._deleting[k] or k in absent]

    def load_many(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """As :meth:`load` each; those not queued come from the backend in one call."""
        keys = [bytes(k) for k in keys]
        with self._cv:
            landed = [k for k in keys if k not in self._writes and not self._deleting[k]]
        found = dict(zip(landed, self.backend.load_many(landed), strict=True)) if landed else {}
        return [found[k] if k in found else self.load(k) for k in keys]

    def codecs(self, keys: Sequence[bytes]) -> list[str]:
        with self._cv:
            queued = {
                bytes(k): self._writes[bytes(k)].codec for k in keys if bytes(k) in self._writes
            }
        rest = [bytes(k) for k in keys if bytes(k) not in queued]
        found = dict(zip(rest, self.backend.codecs(rest), strict=True)) if rest else {}
        return [queued.get(bytes(k)) or found[bytes(k)] for k in keys]

    def load(self, key: bytes) -> torch.Tensor:
        """The block as the backend will serve it: from the queued copy until it lands."""
        key = bytes(key)
        with self._cv:
            write = self._writes.get(key)
            if write is None and self._deleting[key]:
                raise UnknownBlockError(f"block {key.hex()[:12]} was deleted from the cold tier")
        if write is None:
            return self.backend.load(key)
        if isinstance(write.block, torch.Tensor) and CODECS[write.codec].lossless:
            return write.block
        # Served exactly as the cold frame will decode (int8 codes, frames, lossy codecs).
        return decode_frame(encode_stored(self._codecs, write.codec, write.block))

    def block_keys(self) -> Iterator[bytes]:
        self.flush()
        return iter(list(self.backend.block_keys()))

    # ------------------------------------------------------------------ state

    def stats(self) -> ColdStats:
        """The backend's figures plus the queued writes (at their raw size, an upper bound).

        Never waits for the queue: the pool asks under its lock, and a drain can
        take a while. A batch landing meanwhile may be counted twice for an instant;
        queued deletes are not subtracted until they are applied.
        """
        landed = self.backend.stats()
        with self._cv:
            return ColdStats(
                landed.blocks + len(self._writes),
                landed.live_bytes + self._pending_bytes,
                landed.dead_bytes,
            )

    def live_bytes(self) -> int:
        with self._cv:
            pending = self._pending_bytes
        return self.backend.live_bytes() + pending

    def writer_stats(self) -> WriterStats:
        with self._cv:
            c = self._counts
            return WriterStats(
                batches=c["batches"],
                blocks_written=c["blocks_written"],
                deletes=c["deletes"],
                pending_blocks=len(self._writes),
                pending_bytes=self._pending_bytes,
                backpressure_waits=c["backpressure_waits"],
                failures=c["failures"],
                write_seconds=c["write_us"] / 1e6,
            )

    def close(self) -> None:
        """Drain the queue, stop the thread, close the backend. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        with self._cv:
            if self._writes or self._deletes:
                logger.error(
                    "cold writer closed with %d blocks (%d bytes) unwritten and %d deletes "
                    "unapplied: %r",
                    len(self._writes),
                    self._pending_bytes,
                    len(self._deletes),
                    self._error,
                )
        self.backend.close()

    # ------------------------------------------------------------------ internals

    def _raise_pending_error(self) -> None:
        # Called with _cv held. Clearing the error lets the thread retry the batch.
        if self._error is not None:
            error, self._error = self._error, None
            self._cv.notify_all()
            raise error

    def _check_capacity(self, nbytes: int) -> None:
        if self.capacity_bytes is None:
            return
        live = self.backend.live_bytes()
        if live + self._pending_bytes + nbytes > self.capacity_bytes:
            raise CapacityError(
                f"cold tier full: {live} of {self.capacity_bytes} bytes live and "
                f"{self._pending_bytes} queued, cannot add a {nbytes}-byte block"
            )

    def _has_work(self) -> bool:
        return bool(self._queue or self._deletes)

    def _take_batch(self) -> tuple[list[bytes], list[_Write]]:
        deletes, self._deletes = self._deletes, []
        writes: list[_Write] = []
        while self._queue and len(writes) < self._max_batch:
            write = self._queue.popleft()
            if self._writes.get(write.key) is write:  # else cancelled or replaced
                writes.append(write)
        return deletes, writes

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not (self._has_work() and self._error is None):
                    self._cv.wait()
                if self._error is not None or not self._has_work():
                    return  # closed: drained, or stopped by a failure nobody collected
                deletes, writes = self._take_batch()
                self._busy = True
            started = time.perf_counter()
            try:
                with self._io:
                    for key in deletes:
                        self.backend.remove(key)
                    if writes:
                        self.backend.put_many(
                            [(w.key, w.block, w.fingerprint, w.codec) for w in writes]
                        )
            except BaseException as e:  # kept, and raised to the next caller
                logger.warning("cold write of %d blocks failed (kept queued): %r", len(writes), e)
                with self._cv:
                    self._busy = False
                    self._deletes[:0] = deletes  # deletes are idempotent: all again
                    self._queue.extendleft(reversed(writes))
                    self._error = e
                    self._counts["failures"] += 1
                    self._cv.notify_all()
                continue
            with self._cv:
                self._busy = False
                for key in deletes:
                    self._deleting[key] -= 1
                    if self._deleting[key] <= 0:
                        del self._deleting[key]
                for write in writes:
                    if self._writes.get(write.key) is write:
                        del self._writes[write.key]
                        self._pending_bytes -= write.nbytes
                self._counts["batches"] += 1
                self._counts["blocks_written"] += len(writes)
                self._counts["deletes"] += len(deletes)
                self._counts["write_us"] += int((time.perf_counter() - started) * 1e6)
                self._cv.notify_all()
