"""Session calls as one msgpack document each way.

Ray's cost per argument is most of a session operation's (measured in the scale
suite's notes: a no-op method with create's seven arguments runs at the rate of
create itself, ~0.65x a bare call; one bytes argument at ~0.85x). The hot session
calls therefore travel packed: the caller packs the arguments, the router
unpacks them, calls the plain method and packs its answer.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["pack", "pack_answer", "unpack"]


def pack(*arguments: Any) -> bytes:
    """A call's arguments (plain: str, int, float, bytes, lists, dicts, None) as one document."""
    return bytes(msgpack.packb(list(arguments), use_bin_type=True))


def pack_answer(answer: Any) -> bytes:
    """A call's answer as one document."""
    return bytes(msgpack.packb(answer, use_bin_type=True))


def unpack(document: bytes) -> Any:
    """What :func:`pack` (the argument list) or :func:`pack_answer` packed."""
    return msgpack.unpackb(document, raw=False)
