"""What the gateway's JSON routes answer.

The session lifecycle's answers are the session service's own messages
(:mod:`memkv.protocol.services`: :class:`SessionView`, :class:`AppendAnswer`,
:class:`ResumeAnswer`), served in their HTTP form (:mod:`memkv.protocol.http_form`:
keys as hex) and described in the OpenAPI document from that same declaration; the
client decodes into the same structs. The gateway's own answers (leases, segments,
health) are response models here: FastAPI checks each against its model before it
leaves, and the OpenAPI document describes it.
"""

from __future__ import annotations

import msgspec
from fastapi import Response
from pydantic import BaseModel

from memkv.protocol import http_form
from memkv.protocol.messages import PlanEntry
from memkv.protocol.services import AppendAnswer, ResumeAnswer, SessionView

__all__ = [
    "MESSAGE_ANSWERS",
    "HealthOut",
    "LeaseOut",
    "LeasedBlockOut",
    "LeasesOut",
    "ReservationOut",
    "SegmentOut",
    "SegmentsOut",
    "MatchOut",
    "PrefetchOut",
    "message_answer",
    "documented",
]

#: The session service's messages the routes answer with, whose schemas the OpenAPI
#: document takes from their declarations (:func:`memkv.api.errors.openapi_with_errors`).
MESSAGE_ANSWERS: tuple[type[msgspec.Struct], ...] = (SessionView, AppendAnswer, ResumeAnswer)


def message_answer(message: msgspec.Struct, status_code: int = 200, **given: object) -> Response:
    """``message`` in its HTTP form (with ``given`` in place of its own fields: a tenant
    sees its own session id, not the router's scoped one)."""
    return Response(http_form.json_bytes(message, **given), status_code=status_code,
                    media_type="application/json")


#: A ``responses=`` entry: a description and a schema by media type.
ResponseDoc = dict[str, str | dict[str, dict[str, dict[str, str]]]]


def documented(kind: type[msgspec.Struct], description: str) -> ResponseDoc:
    """A ``responses=`` entry naming ``kind``'s schema."""
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}}}


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
