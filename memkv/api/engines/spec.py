"""An engine as it is registered: what every gateway process needs to route to it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineSpec"]


@dataclass(frozen=True)
class EngineSpec:
    """An engine of the configuration (``gateway.engines``, ``memkv up --engine``) or of
    ``POST /v1/engines``."""

    url: str
    model: str | None = None  # None: ask its /v1/models
    node: str = ""  # the Ray node it runs on ("": none of memkv's)
    priority_scheduling: bool = False  # it runs vLLM's priority scheduler
    max_requests: int | None = None  # its spill bound (None: the gateway's)
    tenants: frozenset[str] | None = None  # whose requests it takes (None: everyone's)
