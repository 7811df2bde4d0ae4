"""The router's plain logic: sessions, placement, hotness and cluster-wide refcounts.

:class:`RouterState` holds the session table
(:class:`~memkv.storage.sessions.SessionTable`, the one owner of sessions),
places sessions on devices (prefix affinity, then least loaded), keeps each
session's hotness (an exponentially decayed access rate) and counts, per
block, the sessions anywhere that hold it, so the archive deletes a block only
when no session holds it. Tested without Ray; the actor in
:mod:`memkv.actors.router` is its async shell.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memkv.errors import InvalidInputError, MemkvError, UnknownBlockError
from memkv.protocol.enums import Priority, SessionState
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.layout import KVLayout, block_token_count
from memkv.protocol.messages import ChainUpdate
from memkv.storage.sessions import SessionRecord, SessionTable

__all__ = ["DeviceLoad", "RouterState", "SessionRecord"]


@dataclass(slots=True)
class DeviceLoad:
    sessions: int = 0
    hot_usage: float = 0.0
    incarnation: str | None = None


class RouterState:
    """Session table, placement, hotness and cluster-wide block refcounts.

    Args:
        hotness_half_life_s: the access rate's half-life.
        prefix_affinity: place a new session on the device that already holds
            the longest prefix of its chain.
        clock: seconds (injectable for tests).
    """

    def __init__(
        self,
        *,
        hotness_half_life_s: float = 300.0,
        prefix_affinity: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if hotness_half_life_s <= 0:
            raise InvalidInputError(f"hotness_half_life_s must be > 0, got {hotness_half_life_s}")
        self._decay = math.log(2) / hotness_half_life_s
        self._prefix_affinity = prefix_affinity
        self._clock = clock
        self.sessions = SessionTable(clock)
        self.devices: dict[str, DeviceLoad] = {}
        self._refcounts: Counter[bytes] = Counter()
        # block -> devices whose sessions hold it (how many sessions on each)
        self._block_devices: dict[bytes, Counter[str]] = {}
        # block -> the namespace its hash was salted with (by-key reads are
        # served only within the namespaces the caller may read)
        self._block_namespace: dict[bytes, str] = {}

    # -- devices -------------------------------------------------------------------

    def add_device(self, device_id: str, incarnation: str | None = None) -> None:
        self.devices.setdefault(device_id, DeviceLoad()).incarnation = incarnation

    def update_load(self, device_id: str, hot_usage: float) -> None:
        self.devices[device_id].hot_usage = hot_usage

    def sessions_on(self, device_id: str) -> list[SessionRecord]:
        return [r for r in self.sessions if r.device_id == device_id]

    # -- sessions ------------------------------------------------------------------

    def create(
        self,
        session_id: str,
        layout: KVLayout | dict[str, Any],
        namespace: str,
        priority: Priority | str,
    ) -> SessionRecord:
        """A new session (the id rule, layout and priority are checked here, once)."""
        if not isinstance(layout, KVLayout):
            layout = KVLayout.from_dict(layout)
        return self.sessions.create(session_id, layout, namespace=namespace, priority=priority)

    def get(self, session_id: str) -> SessionRecord:
        return self.sessions.get(session_id)

    def place(self, session_id: str, chain_hint: Sequence[bytes] = ()) -> str:
        """The device of a session, choosing one on first use.

        Prefix affinity first (the device whose sessions hold the longest
        prefix of ``chain_hint``, so a shared prefix stays stored once), then
        the device with the fewest sessions and the emptiest hot tier.
        """
        record = self.get(session_id)
        if record.device_id is not None:
            return record.device_id
        if not self.devices:
            raise MemkvError("no device is registered with the router")
        choice: str | None = None
        if self._prefix_affinity:
            best = 0
            for device_id in self.devices:
                depth = 0
                for key in chain_hint:
                    if self._block_devices.get(key, Counter())[device_id] == 0:
                        break
                    depth += 1
                if depth > best:
                    best, choice = depth, device_id
        if choice is None:
            choice = min(
                self.devices,
                key=lambda d: (self.devices[d].sessions, self.devices[d].hot_usage, d),
            )
        record.device_id = choice
        self.devices[choice].sessions += 1
        return choice

    def touch(self, session_id: str) -> None:
        """Count an access in the session's hotness (decayed access rate)."""
        record = self.get(session_id)
        now = self._clock()
        record.hotness = record.hotness * math.exp(-self._decay * (now - record.last_access)) + 1
        record.last_access = now

    def hotness(self, session_id: str) -> float:
        record = self.get(session_id)
        return record.hotness * math.exp(-self._decay * (self._clock() - record.last_access))

    def record_put(self, session_id: str, update: ChainUpdate) -> list[bytes]:
        """The session's device applied ``update``. Returns blocks no session holds any more."""
        record = self.get(session_id)
        for key in update.hold:
            self._ref(key, record.device_id)
            self._block_namespace.setdefault(bytes(key), record.namespace)
        garbage = [key for key in update.drop if self._unref(key, record.device_id)]
        self.sessions.commit_append(session_id, update)
        self.touch(session_id)
        return garbage

    def record_state(self, session_id: str, state: SessionState) -> None:
        self.get(session_id).state = state

    def delete(self, session_id: str) -> list[bytes]:
        """Forget a session (lost ones too). Returns blocks no session holds any more."""
        record = self.sessions.pop(session_id)
        if record.device_id is not None and record.device_id in self.devices:
            self.devices[record.device_id].sessions -= 1
        return [k for k in dict.fromkeys(record.chain) if self._unref(k, record.device_id)]

    def mark_lost(self, session_id: str, reason: str) -> None:
        self.sessions.mark_lost(session_id, reason)

    def background_candidates(self, device_id: str, limit: int) -> list[str]:
        """The hottest sessions of a device that are not active (worth prefetching)."""
        now = self._clock()
        candidates = [r for r in self.sessions_on(device_id) if not r.active and not r.lost]
        candidates.sort(
            key=lambda r: r.hotness * math.exp(-self._decay * (now - r.last_access)), reverse=True
        )
        return [r.session_id for r in candidates[:limit]]

    def refcount(self, key: bytes) -> int:
        return self._refcounts[key]

    def match_prefix(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int]
    ) -> tuple[int, list[bytes]]:
        """Leading tokens of ``token_ids`` whose blocks some session of ``namespace`` holds."""
        counts = block_token_count(layout, len(token_ids))
        matched: list[bytes] = []
        tokens = 0
        for key, n in zip(chain_hashes(token_ids, layout, namespace), counts, strict=True):
            if self._refcounts[bytes(key)] <= 0:
                break
            matched.append(bytes(key))
            tokens += n
        return tokens, matched

    def locate(
        self, keys: Sequence[bytes], namespace: str | None = None
    ) -> dict[str, list[bytes]]:
        """Group ``keys`` by a device whose sessions hold them.

        Args:
            namespace: only blocks hashed in this namespace are found (None: any).

        Raises:
            UnknownBlockError: a key no session holds (or one of another namespace:
                the same answer, so keys of other tenants cannot be probed).
        """
        by_device: dict[str, list[bytes]] = {}
        for key in keys:
            holders = self._block_devices.get(bytes(key))
            if not holders or (
                namespace is not None and self._block_namespace.get(bytes(key)) != namespace
            ):
                raise UnknownBlockError(f"no session holds block {bytes(key).hex()}")
            device_id = max(holders, key=lambda d: holders[d])
            by_device.setdefault(device_id, []).append(bytes(key))
        return by_device

    # -- internals -----------------------------------------------------------------------

    def _ref(self, key: bytes, device_id: str | None) -> None:
        key = bytes(key)
        self._refcounts[key] += 1
        if device_id is not None:
            self._block_devices.setdefault(key, Counter())[device_id] += 1

    def _unref(self, key: bytes, device_id: str | None) -> bool:
        key = bytes(key)
        self._refcounts[key] -= 1
        if device_id is not None and key in self._block_devices:
            counts = self._block_devices[key]
            counts[device_id] -= 1
            if counts[device_id] <= 0:
                del counts[device_id]
            if not counts:
                del self._block_devices[key]
        if self._refcounts[key] <= 0:
            del self._refcounts[key]
            self._block_namespace.pop(key, None)
            return True
        return False
