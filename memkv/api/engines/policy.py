"""Which engine serves a session's turn: the routing policy, with no I/O.

In order:

1. **Sticky**: the engine that served the session's last turn, while it is
   healthy and under the spill threshold (its prefix cache may still hold the
   session, and memkv's blocks are where it read them).
2. **KV node**: an engine on the node whose device holds the session's blocks
   (its connector reads them over the same-node path), the least loaded of
   them.
3. **Least loaded** engine of the model.

An engine over the spill threshold (queued + running requests, or KV use) is
passed over while another is under it; the session's KV follows it from memkv.
Every choice says why, for the routing counters.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Choice", "EngineLoad", "Reason", "SpillThreshold", "choose_engine"]


class Reason(enum.StrEnum):
    STICKY = "sticky"
    KV_NODE = "kv-node"
    LEAST_LOADED = "least-loaded"
    SPILL = "spill"  # the sticky or KV-node engine was over the threshold


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the policy knows of an engine (from the registry's checks)."""

    engine_id: str
    model: str
    node: str  # the Ray node it runs on ("" when not on a memkv node)
    healthy: bool
    requests: int  # running + waiting: its /metrics, or what this gateway has sent it
    kv_use: float  # 0..1 of its KV cache in use
    max_requests: int | None = None  # its own spill bound (None: the threshold's)


@dataclass(frozen=True, slots=True)
class SpillThreshold:
    """An engine at or over either bound is passed over while another is under both (an
    engine's own ``max_requests``, where it has one, is its request bound)."""

    max_requests: int = 32
    max_kv_use: float = 0.95

    def over(self, engine: EngineLoad) -> bool:
        bound = engine.max_requests if engine.max_requests is not None else self.max_requests
        return engine.requests >= bound or engine.kv_use >= self.max_kv_use


@dataclass(frozen=True, slots=True)
class Choice:
    engine_id: str
    reason: Reason


def _load(engine: EngineLoad) -> tuple[int, float, str]:
    return engine.requests, engine.kv_use, engine.engine_id


def choose_engine(
    model: str,
    engines: Sequence[EngineLoad],
    *,
    sticky: str | None = None,
    kv_node: str | None = None,
    spill: SpillThreshold | None = None,
    avoid: frozenset[str] = frozenset(),
) -> Choice | None:
    """The engine for a turn of a session, or None when no healthy engine serves ``model``.

    Args:
        sticky: the engine of the session's last turn.
        kv_node: the Ray node whose device holds the session's blocks.
        avoid: engines already tried for this request (a failover).
    """
    spill = spill or SpillThreshold()
    serving = [e for e in engines if e.healthy and e.model == model and e.engine_id not in avoid]
    if not serving:
        return None
    under = [e for e in serving if not spill.over(e)]
    spilled = False
    if sticky is not None:
        engine = next((e for e in serving if e.engine_id == sticky), None)
        if engine is not None:
            if not spill.over(engine) or not under:
                return Choice(engine.engine_id, Reason.STICKY)
            spilled = True
    if kv_node:
        near = [e for e in serving if e.node and e.node == kv_node]
        near_under = [e for e in near if not spill.over(e)]
        if near_under:
            return Choice(min(near_under, key=_load).engine_id,
                          Reason.SPILL if spilled else Reason.KV_NODE)
        spilled = spilled or bool(near)
    pool = under or serving
    return Choice(min(pool, key=_load).engine_id,
                  Reason.SPILL if spilled else Reason.LEAST_LOADED)
