"""The one public exception hierarchy of memkv.

Every error memkv raises on purpose is a :class:`MemkvError`. Expected outcomes
(a cache miss, a full pool) are *return values*, not exceptions.

::

    MemkvError
    ├── InvalidInputError (ValueError)      caller mistake; nothing stored changed
    │   ├── LayoutMismatchError             tensor shape/dtype/fingerprint vs layout
    │   ├── PrecisionOverflowError          value not representable in the target dtype
    │   ├── AllocatorMisuseError            double free, foreign offset, bad size
    │   ├── ConfigError                     invalid configuration value
    │   ├── WrongNodeError                  a same-node read plan used on another node
    │   ├── PrefixNotStoredError            an append starts after blocks no tier holds
    │   │                                   (send from the first one missing)
    │   └── ConflictError                   clashes with what is stored (id taken,
    │                                       layout differs, turn out of order)
    ├── NotFoundError (LookupError)
    │   ├── UnknownBlockError               no block with that key
    │   └── UnknownSessionError             no session with that id
    ├── CorruptDataError                    checksum/magic/format check failed
    ├── CapacityError                       cannot make room (everything pinned, too big)
    │   └── StorageFullError                a disk or its budget is full (an archive)
    ├── BlockLostError                      a block is gone from every tier
    ├── LeaseExpiredError                   a read plan's lease ran out before it was released
    ├── InvariantViolationError             debug mode found broken bookkeeping (a bug)
    └── ClosedError (RuntimeError)          the component was closed
        └── MemberGoneError                 a device, archive or router shard did not
                                            answer (its process died; it may come back)

Only the gateway maps these to HTTP status codes.
"""

from __future__ import annotations

import re

__all__ = [
    "AllocatorMisuseError",
    "BlockLostError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "ConflictError",
    "OutOfRangeError",
    "CorruptDataError",
    "ForbiddenError",
    "InvalidInputError",
    "InvariantViolationError",
    "LayoutMismatchError",
    "LeaseExpiredError",
    "MemberGoneError",
    "MemkvError",
    "NotFoundError",
    "PrecisionOverflowError",
    "PrefixNotStoredError",
    "StorageFullError",
    "UnauthorizedError",
    "UnknownBlockError",
    "UnknownSessionError",
    "WrongNodeError",
    "plain_message",
]

# ANSI colour codes (Ray colours the remote traceback it wraps a cause in).
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# Absolute paths of two or more components: where the server's files are is its own
# business (a message that needs one names it relative, or by its setting).
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)+[\w.+-]*")
_MESSAGE_LIMIT = 500


class MemkvError(Exception):
    """Base class of every error memkv raises on purpose."""


class InvalidInputError(MemkvError, ValueError):
    """The caller passed something memkv cannot accept; nothing stored was changed."""


class LayoutMismatchError(InvalidInputError):
    """A tensor or record does not match the KV layout it is stored under."""


class PrecisionOverflowError(InvalidInputError):
    """A value cannot be represented in the requested precision (e.g. > 65504 in fp16)."""


class AllocatorMisuseError(InvalidInputError):
    """An allocator was used incorrectly: double free, foreign offset, bad size."""


class ConfigError(InvalidInputError):
    """A configuration value is invalid."""


class WrongNodeError(InvalidInputError):
    """A same-node read plan reached a process on another node: it cannot map the segments."""


class PrefixNotStoredError(InvalidInputError):
    """An append sends blocks from ``start_block``, but a block before it is not stored
    (a partial loss since the writer last saw the session): send from ``first_missing``."""

    def __init__(self, message: str, first_missing: int = 0) -> None:
        super().__init__(message)
        self.first_missing = first_missing

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # across Ray, with its field
        return (type(self), (str(self), self.first_missing))


class OutOfRangeError(InvalidInputError):
    """A position outside what it names: a fork or rewind past a session's tokens, or
    below its first (HTTP 400, as OpenAI-style APIs answer a bad request)."""


class ConflictError(InvalidInputError):
    """The request clashes with the current state: the id is taken, the layout differs
    from the session's, or a turn index is out of order."""


class UnauthorizedError(MemkvError):
    """No credentials, or credentials that name no one (HTTP 401)."""


class ForbiddenError(MemkvError):
    """The credentials are valid but may not do this (HTTP 403)."""


class NotFoundError(MemkvError, LookupError):
    """The requested object does not exist."""


class UnknownBlockError(NotFoundError):
    """No block is stored under the given key."""


class UnknownSessionError(NotFoundError):
    """No session exists with the given id."""


class CorruptDataError(MemkvError):
    """Stored data failed an integrity check (checksum, magic, format); it is never served."""


class CapacityError(MemkvError):
    """No room can be made: the data is larger than the tier, or everything is pinned."""


class StorageFullError(CapacityError):
    """A disk, or the budget set for it, is full: an archive cannot take a write.

    Another archive takes the copy where one can; a client sees it (HTTP 507)
    only when none can. What was stored before stays stored.
    """


class BlockLostError(MemkvError):
    """A block is in no tier any more (e.g. its device died before it reached the archive)."""


class LeaseExpiredError(MemkvError):
    """A read plan's lease ran out (or its device restarted) before the reader released it.

    The blocks may have moved while they were copied: what was read is
    discarded, never returned. Ask for a new plan.
    """


class InvariantViolationError(MemkvError):
    """Debug mode found memkv's own bookkeeping broken (refcounts, pins): a bug, never input."""


class ClosedError(MemkvError, RuntimeError):
    """The component was closed and cannot be used any more."""


class MemberGoneError(ClosedError):
    """A member of the cluster (a device, an archive, a router shard) did not answer:
    its process died. Ray may be restarting it; the caller retries or recovers."""


class MemberLostError(MemberGoneError):
    """A member that will not come back: its node is gone and Ray cannot place it
    anywhere else (it is pinned to that node). Its callers stop waiting for it."""


def plain_message(exc: BaseException) -> str:
    """What a client may read of ``exc``: the message of the cause, one plain line.

    An error raised in a Ray actor arrives as a ``RayTaskError`` whose text is the
    remote traceback (ANSI colours, the worker's pid, actor id and address, file
    paths); its ``cause`` holds the error as raised. This takes the cause's own
    message, keeps its first line, drops ANSI escapes, replaces absolute paths and
    caps the length. The full error goes to the server's log, never to a client.
    """
    seen: set[int] = set()
    while id(exc) not in seen:  # a cause can be wrapped more than once
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    text = str(exc.args[0]) if len(exc.args) == 1 else str(exc)
    text = _ANSI.sub("", text)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    first = _ABSOLUTE_PATH.sub("<path>", first)
    if len(first) > _MESSAGE_LIMIT:
        first = first[: _MESSAGE_LIMIT - 3] + "..."
    return first or type(exc).__name__
