"""The session service: what a session router answers, in typed messages.

Every request and answer is a frozen :class:`msgspec.Struct`. Between processes
a message travels as one msgpack document (:func:`encode`, :func:`decode`):
Ray's cost per argument is most of a session operation's (the scale suite
measures a no-op method with create's seven arguments at create's own rate,
one bytes argument at ~0.85x a bare call), and a typed decode names the field
that is wrong instead of failing three calls later. Fields travel by name: a
field added with a default is skipped by an older peer and defaulted by a newer one.

:class:`SessionService` is the interface itself: the router actor implements
it; callers reach it through :class:`memkv.actors.handles.SessionServiceHandle`,
which hides Ray (no ``.remote``, no method names as strings).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np

from memkv.errors import InvalidInputError
from memkv.protocol.enums import AckMode, Priority, SessionState, Tier
from memkv.protocol.layout import KVLayout

__all__ = [
    "AppendTurn",
    "AppendAnswer",
    "BlockCut",
    "BlockTier",
    "CreateSession",
    "CreateSessions",
    "Expected",
    "ForkSession",
    "LayoutSpec",
    "Quota",
    "ReserveSlots",
    "ResumeAnswer",
    "RewindSession",
    "SessionView",
    "SessionViews",
    "SessionService",
    "SlotsReserved",
    "decode",
    "encode",
]

_M = TypeVar("_M", bound=msgspec.Struct)


class _Message(msgspec.Struct, frozen=True, kw_only=True):
    """A control-plane message: immutable, every field named.

    Unknown fields are ignored rather than refused, so shards and gateways of
    two adjacent versions talk during a rolling upgrade.
    """


class LayoutSpec(_Message, frozen=True, kw_only=True):
    """A :class:`KVLayout` on the wire (its fields; the fingerprint is derived)."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutSpec:
        return cls(**layout.to_dict())

    def layout(self) -> KVLayout:
        """The layout, validated (:class:`InvalidInputError` naming what is wrong)."""
        return _kv_layout(self)


@functools.lru_cache(maxsize=256)
def _kv_layout(spec: LayoutSpec) -> KVLayout:
    # A client asks for its session's layout on every append: validated and
    # fingerprinted once per distinct spec (a few models per process).
    return KVLayout.from_dict(msgspec.structs.asdict(spec))


class Quota(_Message, frozen=True, kw_only=True):
    """A tenant's limits (None: no limit)."""

    max_sessions: int | None = None
    max_bytes: int | None = None

    @classmethod
    def of(cls, limits: tuple[int | None, int | None] | None) -> Quota | None:
        """From a principal's ``(max sessions, max bytes)``."""
        return None if limits is None else cls(max_sessions=limits[0], max_bytes=limits[1])

    def limits(self) -> tuple[int | None, int | None]:
        return self.max_sessions, self.max_bytes


class CreateSession(_Message, frozen=True, kw_only=True):
    """A new session.

    Attributes:
        ack: when its appends answer; None: the deployment's default.
        quota: the tenant's limits, checked across shards.
        exact_only: its blocks never take a lossy step (docs/durability.md).
        finite_only: appends holding NaN or inf are refused (docs/security.md).
        near_node: place it on a device of this Ray node (a unique prefix of its
            id will do) when that node has one (the engine's or the gateway's:
            reads there take the same-node path); anywhere otherwise.
    """

    session_id: str
    layout: LayoutSpec
    namespace: str = "default"
    priority: Priority = Priority.NORMAL
    ack: AckMode | None = None
    quota: Quota | None = None
    exact_only: bool = False
    finite_only: bool = False
    near_node: str | None = None


class BlockCut(msgspec.Struct, frozen=True):
    """A block made on the device from the first ``tokens`` tokens of block ``source``
    (the partial last block of a fork or rewind; its key, the hash of those tokens, is
    in the append's chain); it travels where an append's blocks do."""

    source: bytes
    tokens: int


class ForkSession(_Message, frozen=True, kw_only=True):
    """A new session sharing a prefix of another's blocks (no byte copied but a partial
    last block's, once): sent to the new session's router shard.

    Attributes:
        session: the new session (its id, tenant, layout: the parent's).
        chain: its blocks; all but a cut are the parent's, held on ``device_id``.
        tokens: the tokens they cover.
        device_id: the parent's device (the fork lives where the blocks are).
        cut: how its last block is made, when the fork ends inside a block.
        parent: the parent's id (for the error when its blocks moved meanwhile).
    """

    session: CreateSession
    chain: tuple[bytes, ...]
    tokens: int
    device_id: str
    cut: BlockCut | None = None
    parent: str = ""


class RewindSession(_Message, frozen=True, kw_only=True):
    """Drop a session's tail: keep its first ``tokens`` tokens (a new turn).
    ``tail_tokens``: the token ids of the block ``tokens`` ends inside, if it does
    (:func:`memkv.protocol.forks.prefix_of`)."""

    session_id: str
    tokens: int
    tail_tokens: tuple[int, ...] | None = None


class SessionView(_Message, frozen=True, kw_only=True):
    """A session as its owner knows it (the answer of create, get, suspend, priority)."""

    session_id: str
    namespace: str
    layout: LayoutSpec
    priority: Priority
    device_id: str | None
    chain: tuple[bytes, ...]
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


class CreateSessions(_Message, frozen=True, kw_only=True):
    """Many sessions in one call (bulk work: a fleet starting up, a restore).

    ``indices``: each request's index in the caller's whole list (a client that
    split one list across shards), so an error names the caller's index.
    """

    requests: tuple[CreateSession, ...]
    indices: tuple[int, ...] | None = None


class SessionViews(_Message, frozen=True, kw_only=True):
    """The sessions a :class:`CreateSessions` made, in its order."""

    sessions: tuple[SessionView, ...]


class Expected(_Message, frozen=True, kw_only=True):
    """The ``layout`` and ``namespace`` a caller hashed a chain with (its cached view):
    a session that differs (deleted and created again) refuses the append."""

    layout: LayoutSpec
    namespace: str


class AppendTurn(_Message, frozen=True, kw_only=True):
    """One append's header; its blocks travel beside it (payloads, refs or staged
    descriptors are not msgpack values).

    Attributes:
        token_ids: every token of the session so far, int64 little-endian.
        start_block: index of the first block sent (earlier ones are stored).
        chain: the chain the caller hashed (None: the router hashes the tokens).
        turn: the turn this append creates; a retry of the last applied turn
            answers as before without storing anything. None skips the check.
        checksums: the writer's CRC32 of each block sent.
    """

    session_id: str
    token_ids: bytes
    start_block: int = 0
    chain: tuple[bytes, ...] | None = None
    turn: int | None = None
    checksums: tuple[int, ...] | None = None
    expect: Expected | None = None
    quota: Quota | None = None

    @staticmethod
    def pack_tokens(tokens: Any) -> bytes:
        return np.ascontiguousarray(tokens, dtype="<i8").tobytes()

    def tokens(self) -> np.ndarray:
        if len(self.token_ids) % 8:
            raise InvalidInputError(
                f"token_ids must be int64 values: {len(self.token_ids)} bytes is not a "
                f"multiple of 8"
            )
        return np.frombuffer(self.token_ids, dtype="<i8")


class AppendAnswer(_Message, frozen=True, kw_only=True):
    """What an append did: the chain after it and how many blocks it stored."""

    chain: tuple[bytes, ...]
    turn: int
    new_blocks: int
    deduplicated_blocks: int
    released_blocks: int
    replayed: bool = False


class BlockTier(msgspec.Struct, frozen=True):
    """One block of a resumed session and where it is (a map, not an array, so that the
    HTTP form names its fields; ~60 bytes a block)."""

    key: bytes
    tier: Tier
    tokens: int


class ResumeAnswer(_Message, frozen=True, kw_only=True):
    """A resumed session's chain and where each block is; the blocks follow lazily."""

    session_id: str
    device_id: str
    tokens: int
    blocks: tuple[BlockTier, ...]


class ReserveSlots(_Message, frozen=True, kw_only=True):
    """A write reservation for a session's next append: ``count`` block-sized slots
    in its device's shared memory, for a writer on Ray node ``node`` to fill
    (:mod:`memkv.device.reservations`). ``chain``: the blocks they are for,
    which place a new session by prefix like its first append would."""

    session_id: str
    count: int
    node: str
    chain: tuple[bytes, ...] = ()
    ttl_s: float = 30.0


class SlotsReserved(_Message, frozen=True, kw_only=True):
    """The reservation a device made (``reservation_id`` "": none, ``reason`` says why):
    the writer maps ``segment`` and copies block i to ``offsets[i]``."""

    reservation_id: str = ""
    reason: str = ""
    device_id: str = ""
    node_id: str = ""
    segment: str = ""
    segment_bytes: int = 0
    slot_bytes: int = 0
    offsets: tuple[int, ...] = ()
    ttl_s: float = 0.0


class SessionService(Protocol):
    """The session lifecycle, as every owner of sessions answers it."""

    async def create_session(self, request: CreateSession) -> SessionView: ...

    async def create_sessions(self, request: CreateSessions) -> SessionViews: ...

    async def session(self, session_id: str) -> SessionView: ...

    async def put_blocks(self, request: AppendTurn, blocks: list[Any]) -> AppendAnswer: ...

    async def reserve_slots(self, request: ReserveSlots) -> SlotsReserved: ...

    async def resume(self, session_id: str) -> ResumeAnswer: ...

    async def suspend(self, session_id: str, offline: bool = False) -> SessionView: ...

    async def set_priority(self, session_id: str, priority: Priority) -> SessionView: ...

    async def delete_session(self, session_id: str) -> None: ...

    async def fork_session(self, request: ForkSession) -> SessionView: ...

    async def rewind_session(self, request: RewindSession) -> SessionView: ...


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(message: msgspec.Struct) -> bytes:
    """A message as one msgpack document (fields by name)."""
    return _ENCODER.encode(message)


def decode(kind: type[_M], document: bytes) -> _M:
    """A message of ``kind`` from :func:`encode`'s document.

    Raises:
        InvalidInputError: the document is not a ``kind`` (names the field).
    """
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    try:
        message: _M = decoder.decode(document)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise InvalidInputError(f"not a {kind.__name__}: {e}") from e
    return message
