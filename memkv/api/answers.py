"""What the gateway's JSON routes answer, as response models.

Each route returns one of these instead of a hand-built dict: the OpenAPI
document describes every answer (clients can be generated from it), a field
renamed here is renamed for mypy at every route that fills it, and FastAPI
checks each answer against its model before it leaves. The routes build them
from the session service's messages (:mod:`memkv.protocol.services`); keys
travel as hex, as everywhere in the HTTP API.
"""

from __future__ import annotations

import msgspec
from pydantic import BaseModel

from memkv.protocol.enums import AckMode, Priority, SessionState, Tier
from memkv.protocol.messages import PlanEntry
from memkv.protocol.services import AppendAnswer, ResumeAnswer, SessionView

__all__ = [
    "AppendOut",
    "BlockTierOut",
    "HealthOut",
    "LayoutOut",
    "LeaseOut",
    "LeasedBlockOut",
    "LeasesOut",
    "ReservationOut",
    "SegmentOut",
    "SegmentsOut",
    "MatchOut",
    "PrefetchOut",
    "ResumeOut",
    "SessionOut",
]


def _fields(message: SessionView | AppendAnswer, **given: object) -> dict[str, object]:
    """A message's fields by name as JSON values, its chain's keys as hex (the HTTP
    API's form of a key), with ``given`` in place of the message's own."""
    fields: dict[str, object] = msgspec.to_builtins(message, builtin_types=(bytes,))
    return {**fields, "chain": [bytes(k).hex() for k in message.chain], **given}


class LayoutOut(BaseModel):
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int


class SessionOut(BaseModel):
    """A session as its tenant sees it (its own id, not the router's scoped one)."""

    session_id: str
    namespace: str
    layout: LayoutOut
    priority: Priority
    device_id: str | None
    chain: list[str]
    tokens: int
    turn: int
    state: SessionState
    ack: AckMode
    exact_only: bool
    finite_only: bool
    archived: bool
    hotness: float
    lost_reason: str | None = None
    lost_tokens: int = 0
    partial_reason: str | None = None

    @classmethod
    def of(cls, view: SessionView, session_id: str) -> SessionOut:
        return cls.model_validate(_fields(view, session_id=session_id))


class AppendOut(BaseModel):
    """A stored turn: the session's whole chain and what this append added."""

    chain: list[str]
    turn: int
    new_blocks: int
    deduplicated_blocks: int
    released_blocks: int
    replayed: bool = False

    @classmethod
    def of(cls, answer: AppendAnswer) -> AppendOut:
        return cls.model_validate(_fields(answer))


class BlockTierOut(BaseModel):
    key: str
    tier: Tier
    tokens: int


class ResumeOut(BaseModel):
    """A resumed session's chain and the tier each block is in; blocks follow lazily."""

    session_id: str
    device_id: str
    tokens: int
    blocks: list[BlockTierOut]

    @classmethod
    def of(cls, answer: ResumeAnswer, session_id: str) -> ResumeOut:
        return cls(
            session_id=session_id, device_id=answer.device_id, tokens=answer.tokens,
            blocks=[BlockTierOut(key=b.key.hex(), tier=b.tier, tokens=b.tokens)
                    for b in answer.blocks],
        )


class PrefetchOut(BaseModel):
    prefetched: int


class MatchOut(BaseModel):
    """The longest cached prefix: its tokens, block keys, and whose it is (a publisher's
    tenant in a public namespace, else None)."""

    tokens: int
    blocks: list[str]
    publisher: str | None


class LeaseOut(BaseModel):
    """One device's lease: give it back with ``DELETE /v1/blocks/lease/{id}``."""

    id: str
    device_id: str
    incarnation: str
    expires_at: float


class LeasedBlockOut(BaseModel):
    """Where one leased block's bytes are in this host's shared memory."""

    lease: int  # the index of its lease in ``leases``
    key: str
    found: str
    segment: str
    segment_bytes: int
    offset: int
    nbytes: int
    shape: list[int]
    dtype: str
    crc32: int
    exact: bool
    lossy: str

    @classmethod
    def of(cls, entry: PlanEntry, lease: int) -> LeasedBlockOut:
        return cls(
            lease=lease, key=entry.key.hex(), found=entry.found, segment=entry.segment,
            segment_bytes=entry.segment_bytes, offset=entry.offset, nbytes=entry.nbytes,
            shape=list(entry.shape), dtype=entry.dtype, crc32=entry.crc32,
            exact=entry.exact, lossy=entry.lossy,
        )


class ReservationOut(BaseModel):
    """Slots of the session's device's shared memory to copy an append's blocks into
    (``id`` None: none, ``reason`` says why; send or stage the blocks instead).

    A client on this host (``host`` equals its :func:`memkv.shm.same_node.shm_identity`)
    maps ``segment`` (``segment_bytes`` long) writable, copies block i to
    ``offsets[i]`` and names it in its append as ``staged: {segment, offset,
    reservation: id}``; the device keeps the bytes where they are. Slots not
    named within ``ttl_s`` go back: never write into them after that."""

    id: str | None
    reason: str = ""
    host: str = ""
    device_id: str = ""
    segment: str = ""
    segment_bytes: int = 0
    slot_bytes: int = 0
    offsets: list[int] = []
    ttl_s: float = 0.0


class SegmentOut(BaseModel):
    device_id: str
    incarnation: str  # the device process's (a restarted device makes new segments)
    segment: str
    segment_bytes: int
    reservable: bool  # write reservations are made in it


class SegmentsOut(BaseModel):
    """The devices' shared-memory segments on this gateway's node (a client on this
    ``host`` maps them at start, so that its first load or save pays no page faults)."""

    host: str
    segments: list[SegmentOut]


class LeasesOut(BaseModel):
    """Blocks pinned in this host's shared memory (None: not here, read it instead)."""

    host: str
    leases: list[LeaseOut]
    blocks: list[LeasedBlockOut | None]


class HealthOut(BaseModel):
    status: str
    worker: int
    #: Where this gateway's block port listens (None: it has none).
    block_port: int | None = None
