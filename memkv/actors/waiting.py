"""Waiting for an actor call's answer from a thread, in any actor.

``ray.get`` in a process of an asyncio actor (the router) warns "Using blocking
ray.get inside async actor" whatever thread calls it, and on the event loop's
thread it would block every other request. The router's start-up reads (its
journal's replicas) and its snapshots' writes (on a worker thread) wait through
the reference's future instead: the same answer and errors, no event loop
involved.
"""

from __future__ import annotations

from typing import Any

__all__ = ["wait_for"]


def wait_for(ref: Any, timeout: float | None = None) -> Any:
    """The answer of the call ``ref`` (an ObjectRef), blocking this thread only."""
    return ref.future().result(timeout)
