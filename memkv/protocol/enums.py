"""The enums every layer shares: tiers, priorities, session states, acknowledgement modes."""

from __future__ import annotations

import enum

__all__ = ["EVICTION_ORDER", "PRIORITY_RANK", "Priority", "SessionState", "Tier"]


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


#: Background blocks leave memory first, high-priority ones last.
EVICTION_ORDER = (Priority.BACKGROUND, Priority.NORMAL, Priority.HIGH)
PRIORITY_RANK = {Priority.BACKGROUND: 0, Priority.NORMAL: 1, Priority.HIGH: 2}
