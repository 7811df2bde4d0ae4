"""The enums every layer shares: tiers, priorities, session states, acknowledgement modes."""

from __future__ import annotations

import enum

from memkv.errors import InvalidInputError

__all__ = [
    "EVICTION_ORDER",
    "PRIORITY_RANK",
    "AckMode",
    "Priority",
    "SessionState",
    "Tier",
    "parse_ack",
    "parse_priority",
]


class Tier(enum.StrEnum):
    """Where a block copy lives, fastest first."""

    HOT = "hot"
    WARM = "warm"
    COLD = "cold"


class Priority(enum.StrEnum):
    """A session's priority class; eviction drains classes in :data:`EVICTION_ORDER`."""

    HIGH = "high"
    NORMAL = "normal"
    BACKGROUND = "background"


class SessionState(enum.StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"  # blocks written to the cold tier; some may still be in memory
    ARCHIVED = "archived"  # suspended, and none of its blocks is in memory any more
    # Its blocks are gone for good (a device restart before they were archived):
    # reported, never stored as a record's state (the record keeps the reason).
    LOST = "lost"


class AckMode(enum.StrEnum):
    """When an append answers (docs/durability.md)."""

    MEMORY = "memory"  # its blocks are in device memory
    ARCHIVE = "archive"  # its blocks are fsynced in the cold tier


#: Background blocks leave memory first, high-priority ones last.
EVICTION_ORDER = (Priority.BACKGROUND, Priority.NORMAL, Priority.HIGH)
PRIORITY_RANK = {Priority.BACKGROUND: 0, Priority.NORMAL: 1, Priority.HIGH: 2}


def parse_priority(p: Priority | str) -> Priority:
    """A Priority from its value.

    Raises:
        InvalidInputError: not one of ``high``, ``normal``, ``background``.
    """
    try:
        return Priority(p)
    except ValueError:
        raise InvalidInputError(
            f"priority must be one of {[x.value for x in Priority]}, got {p!r}"
        ) from None


def parse_ack(ack: AckMode | str | None) -> AckMode | None:
    """An AckMode from its value (None: the deployment's default).

    Raises:
        InvalidInputError: not ``memory`` or ``archive``.
    """
    if ack is None:
        return None
    try:
        return AckMode(ack)
    except ValueError:
        raise InvalidInputError(
            f"ack must be one of {[x.value for x in AckMode]}, got {ack!r}"
        ) from None
