"""A read response's frame headers, typed: what a reader decodes once per frame.

A read response is ``block`` frames then one ``end`` frame
(:mod:`memkv.protocol.wire`). Readers (the clients) decode each header straight
from its msgpack bytes into :class:`BlockHeader` or :class:`EndHeader`; a
field of the wrong type is named in the error, never read as something else.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from memkv.protocol.exactness import lossy_name
from memkv.protocol.wire import TIER_NAMES, FrameHeader, WireError

__all__ = ["BlockHeader", "EndHeader", "ResponseHeader", "decode_response_header",
           "response_header"]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class BlockHeader(msgspec.Struct, frozen=True, kw_only=True, tag="block", tag_field="kind"):
    """One block of a response: its key, dtype and shape, payload size and CRC32, its
    index in the session, and what is known of it (tier, exact, the lossy step)."""

    key: bytes
    dtype: str
    shape: list[NonNegative]
    nbytes: NonNegative = 0
    crc32: int | None = None
    index: NonNegative = 0
    #: A small int (memkv.protocol.wire.TIER_CODES) or, from older gateways, a name.
    tier: int | str | None = None
    exact: bool = True
    #: A small int (memkv.protocol.exactness.LOSSY_CODES) or a name.
    lossy: int | str | None = None

    @property
    def tier_name(self) -> str | None:
        if isinstance(self.tier, int):
            return TIER_NAMES.get(self.tier)
        return self.tier

    @property
    def lossy_name(self) -> str:
        return lossy_name(self.lossy)


class EndHeader(msgspec.Struct, frozen=True, kw_only=True, tag="end", tag_field="kind"):
    """The end of a response: how many blocks it held (a cut stream is detected)."""

    count: int


ResponseHeader = BlockHeader | EndHeader
_DECODER: msgspec.msgpack.Decoder[BlockHeader | EndHeader] = msgspec.msgpack.Decoder(
    ResponseHeader)


def decode_response_header(raw: bytes | memoryview) -> BlockHeader | EndHeader:
    """A response frame's header from its msgpack bytes.

    Raises:
        WireError: not msgpack, not a block or end frame, or a field of the wrong type.
    """
    try:
        return _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        raise WireError(f"a bad response frame header: {e}") from None
    except msgspec.DecodeError as e:
        raise WireError(f"frame header is not valid msgpack: {e}") from None


def response_header(header: FrameHeader) -> BlockHeader | EndHeader:
    """:func:`decode_response_header` of a header a :class:`FrameReader` parsed already."""
    try:
        typed: BlockHeader | EndHeader = msgspec.convert(
            header, ResponseHeader)
    except msgspec.ValidationError as e:
        raise WireError(f"a bad response frame header: {e}") from None
    return typed
