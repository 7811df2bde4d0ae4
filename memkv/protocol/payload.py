"""Blocks as they cross process boundaries inside the cluster.

Ray moves numpy arrays through the node's object store without a copy (a
reader gets a read-only view), but torch tensors and bfloat16 have no such
path, so a block travels as its raw bits in a numpy array plus its dtype name
(memkv.storage.payloads converts tensors). Never pickle tensors across the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["READ_BATCH_BLOCKS", "READ_WINDOW_BATCHES", "BlockPayload", "StagedBlock"]

#: Readers fetch a session in batches of this many blocks, with this many
#: batches in flight: lazy (nothing is promoted far ahead of the reader) and,
#: measured here, ~3x the throughput of one streamed Ray object per block
#: (1.5 vs 0.5 GB/s for 1 MiB blocks).
READ_BATCH_BLOCKS = 4
READ_WINDOW_BATCHES = 2


@dataclass(frozen=True, slots=True)
class BlockPayload:
    """One block: its key, dtype name and raw data (shape kept by the array)."""

    key: bytes
    dtype: str
    data: np.ndarray
    tier: str | None = None  # where the block was found when read (hot, warm, cold)
    exact: bool = True  # False: the bytes went through a lossy step (int8, fp16 of fp32, ...)
    lossy: str = ""  # which one (memkv.protocol.exactness)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True, slots=True)
class StagedBlock:
    """A block a gateway or client left in a staging segment (memkv.shm.staging) for a
    device to copy, or (``reservation``) in a slot the device reserved, to adopt.

    Only a process on ``node_id`` can map the segment; a device elsewhere
    refuses it (WrongNodeError) and the sender falls back to the object store.
    """

    key: bytes
    dtype: str
    shape: tuple[int, ...]
    segment: str
    segment_bytes: int
    incarnation: str
    offset: int
    nbytes: int
    node_id: str
    #: The device's write reservation the slot at ``offset`` belongs to ("": a
    #: staging segment's bytes, which the device copies).
    reservation: str = ""
