"""The block port's control frames, typed (docs/wire-format.md, "The block port").

A connection opens with :class:`Hello` and its :class:`Welcome`; then each
request is one of :data:`PortRequest` (a union tagged by its ``op``, as
vLLM's engine-core requests are by their type) and each answer a
:class:`Reply`. They travel as the headers of frames (:mod:`memkv.protocol.wire`)
and are decoded once, here, where they arrive: the gateway and the clients
read fields, never dictionaries.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

from memkv.protocol.wire import FrameHeader, WireError, encode_frame

__all__ = [
    "BLOCK_PORT_VERSION",
    "AppendRequest",
    "BadRequest",
    "Hello",
    "PingRequest",
    "PortOp",
    "PortRequest",
    "ReadKeysRequest",
    "ReadRequest",
    "Reply",
    "Welcome",
    "decode_control",
    "decode_request",
    "port_frame",
]

BLOCK_PORT_VERSION = 1

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class PortOp(str, enum.Enum):
    """What a request asks (its frame's ``op``)."""

    APPEND = "append"
    READ = "read"
    READ_KEYS = "read_keys"
    PING = "ping"


class _Control(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class Hello(_Control, frozen=True, kw_only=True, tag="hello", tag_field="kind"):
    """A connection's first frame: the protocol version and the bearer token."""

    v: int
    token: str | None = None


class Welcome(_Control, frozen=True, kw_only=True, tag="welcome", tag_field="kind"):
    """The gateway's answer to a hello it accepted."""

    v: int
    tenant: str | None = None
    max_body_bytes: NonNegative = 0


class _Request(_Control, frozen=True, kw_only=True, tag_field="op"):
    """A request frame (its header's ``kind`` is "request", written by :func:`port_frame`)."""

    id: NonNegative

    @property
    def op(self) -> PortOp:
        return PortOp(self.__struct_config__.tag)


class AppendRequest(_Request, frozen=True, kw_only=True, tag="append"):
    """An append: ``body_bytes`` of frames follow (the HTTP route's body)."""

    session_id: str
    body_bytes: NonNegative = 0


class ReadRequest(_Request, frozen=True, kw_only=True, tag="read"):
    """A session's blocks ``start .. end`` (as its ``turn``, if given)."""

    session_id: str
    start: NonNegative = 0
    end: NonNegative | None = None
    turn: NonNegative | None = None


class ReadKeysRequest(_Request, frozen=True, kw_only=True, tag="read_keys"):
    """Blocks by key, in a namespace (None: the caller's own)."""

    keys: list[bytes]
    namespace: str | None = None


class PingRequest(_Request, frozen=True, kw_only=True, tag="ping"):
    """Nothing: answered in its turn (a liveness check, a pipeline's fence)."""


PortRequest = AppendRequest | ReadRequest | ReadKeysRequest | PingRequest


class Reply(_Control, frozen=True, kw_only=True, tag="reply", tag_field="kind"):
    """The answer to request ``id``: its status, then a body of ``body_bytes`` (or of
    frames up to an end frame: ``until_end``). ``close``: the gateway closes the
    connection after it; ``error``: the HTTP API's error document."""

    id: NonNegative
    status: int
    close: bool = False
    error: dict[str, Any] | None = None
    body_bytes: NonNegative | None = None
    until_end: bool = False
    #: An append's answer (the HTTP route's JSON).
    result: dict[str, Any] | None = None


class BadRequest(WireError):
    """A request frame that does not decode. ``request_id``: its id if it had a valid
    one; ``fatal``: the connection cannot go on (its stream position is unknown:
    no valid id, or an append whose body length is not known)."""

    def __init__(self, message: str, *, request_id: int | None, op: str, fatal: bool) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.op = op
        self.fatal = fatal


class _Head(msgspec.Struct):
    kind: Any = None
    id: Any = None
    op: Any = None


_OPS = {op.value for op in PortOp}
_CONTROL = Hello | Welcome | Reply


def decode_request(header: FrameHeader) -> PortRequest:
    """A request frame's header as its typed request.

    Raises:
        BadRequest: naming the field that is wrong.
    """
    head = msgspec.convert(header, _Head)
    rid = head.id
    valid_id = isinstance(rid, int) and not isinstance(rid, bool) and rid >= 0
    op = head.op if isinstance(head.op, str) else repr(head.op)
    if head.kind != "request" or not valid_id:
        raise BadRequest("expected a 'request' frame with a non-negative int 'id'",
                         request_id=None, op=op, fatal=True)
    if head.op not in _OPS:
        raise BadRequest(f"unknown op {head.op!r}; expected append, read, read_keys or ping",
                         request_id=rid, op=op, fatal=False)
    try:
        request: PortRequest = msgspec.convert(header, PortRequest)
    except msgspec.ValidationError as e:
        raise BadRequest(f"a bad {op} request: {e}", request_id=rid, op=op,
                         fatal=head.op == PortOp.APPEND.value) from None
    return request


def decode_control(header: FrameHeader) -> Hello | Welcome | Reply:
    """A hello, welcome or reply frame's header, typed.

    Raises:
        WireError: another kind of frame, or a field of the wrong type (named).
    """
    try:
        control: Hello | Welcome | Reply = msgspec.convert(header, _CONTROL)
    except msgspec.ValidationError as e:
        raise WireError(f"a bad control frame: {e}") from None
    return control


def port_frame(message: _Control | FrameHeader) -> list[bytes | memoryview]:
    """A control message (or a raw header, for tests of malformed ones) as a frame."""
    if isinstance(message, _Request):
        header = {"kind": "request", **msgspec.to_builtins(message, builtin_types=(bytes,))}
    elif isinstance(message, _Control):
        header = msgspec.to_builtins(message, builtin_types=(bytes,))
    else:
        header = message
    return encode_frame(header)
