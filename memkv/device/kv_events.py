"""A device's tier changes published as vLLM's KV events over ZMQ (``device.kv_events``).

A thread of the device process takes the pool's queued changes
(:class:`~memkv.storage.tier_events.TierEventLog`) every ``interval_s``, makes them
one ``KVEventBatch`` (:mod:`memkv.protocol.kv_events`: consecutive blocks of one
chain stored on one medium are one ``BlockStored``, as vLLM sends a request's
blocks), and sends it on a ZMQ PUB socket as vLLM's publisher does: the topic
(``memkv@<host>/<device id>``), the batch's sequence number (8 bytes, big
endian), the payload. A subscriber written for vLLM's engines reads it.
Sending never blocks the pool: the queue is taken under its own lock, the
socket is written by this thread alone.
"""

from __future__ import annotations

import logging
import threading
import time
from itertools import count

from memkv.protocol.kv_events import (
    MEDIUM_OF_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    topic_of,
)
from memkv.storage.tier_events import TierChange, TierEventLog

__all__ = ["KVEventPublisher", "batch_of"]

logger = logging.getLogger(__name__)

Event = BlockStored | BlockRemoved | AllBlocksCleared


def batch_of(cleared: bool, changes: list[TierChange], ts: float) -> KVEventBatch:
    """The KV events of ``changes`` (after ``AllBlocksCleared`` if some were lost)."""
    events: list[Event] = [AllBlocksCleared()] if cleared else []
    for change in changes:
        medium = MEDIUM_OF_TIER[change.tier.value]
        last = events[-1] if events else None
        if change.stored:
            if (isinstance(last, BlockStored) and last.medium == medium
                    and last.block_size == change.block_tokens
                    and change.parent == last.block_hashes[-1]):
                last.block_hashes.append(change.key)  # the next block of the same chain
                continue
            events.append(BlockStored(block_hashes=[change.key], parent_block_hash=change.parent,
                                      token_ids=[], block_size=change.block_tokens,
                                      lora_id=None, medium=medium, lora_name=None))
        else:
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.append(change.key)
                continue
            events.append(BlockRemoved(block_hashes=[change.key], medium=medium))
    return KVEventBatch(ts=ts, events=events)


class KVEventPublisher:
    """Publishes ``log``'s changes on ``endpoint``, every ``interval_s``.

    Args:
        endpoint: bound (``tcp://*:PORT``, ``tcp://127.0.0.1:0``, ``ipc://...``), or
            with ``connect``, a collector's to connect to.
        host, device_id: named in the topic.
    """

    def __init__(self, log: TierEventLog, endpoint: str, *, host: str, device_id: str,
                 interval_s: float = 0.05, connect: bool = False) -> None:
        import zmq

        self.log = log
        self.topic = topic_of(host, device_id).encode()
        self.batches = 0
        self._interval_s = interval_s
        self._seq = count()
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        if connect:
            self._socket.connect(endpoint)
        else:
            self._socket.bind(endpoint)
        #: Where subscribers connect (the bound port, if it was chosen by the system).
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._send = threading.Lock()  # (a ZMQ socket is one thread's at a time)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="memkv-kv-events")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.publish_pending()
        self.publish_pending()

    def publish_pending(self) -> int:
        """Send what is queued now as one batch; returns the events sent."""
        with self._send:
            cleared, changes = self.log.take()
            if not cleared and not changes:
                return 0
            batch = batch_of(cleared, changes, time.time())
            seq = next(self._seq)
            try:
                self._socket.send_multipart((self.topic, seq.to_bytes(8, "big"),
                                             encode_batch(batch)))
            except Exception:  # the publisher must never take the device down
                logger.exception("kv events batch %d not sent", seq)
                return 0
            self.batches += 1
            return len(batch.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
