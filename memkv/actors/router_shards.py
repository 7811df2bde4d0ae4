"""The router shards of one deployment, seen from a client (a gateway, the in-cluster API).

A session operation goes straight to the shard that owns the session
(:func:`memkv.protocol.shards.shard_of`): no central hop. The few questions
about the whole table — stats, a prefix match across sessions, where blocks
are by key, bulk creates — are asked of every shard at once and merged here.
With one shard every call goes to it unchanged.

Calls return Ray object references (or lists of them), so the same code
serves an async gateway (``await asyncio.gather(*refs)``) and a sync client
(``ray.get(refs)``); the ``merge_*`` functions then combine the answers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import msgspec

from memkv.actors.handles import DeviceReaderHandle, Pending, SessionServiceHandle
from memkv.protocol.layout import KVLayout
from memkv.protocol.messages import PrefixMatch
from memkv.protocol.services import CreateSession, CreateSessions, SessionView, SessionViews
from memkv.protocol.shards import shard_name, shard_of
from memkv.protocol.stats import ClusterStats, TenantUse
from memkv.router.state import OTHER_TENANTS, STATS_TENANTS

#: A device's reader in a located group: a handle, or a fake in tests.
_Reader = TypeVar("_Reader")

__all__ = ["RouterShards", "merge_created", "merge_located", "merge_prefix", "merge_stats"]


class RouterShards:
    """Handles of the N router shards, in shard order, and which one owns a session."""

    def __init__(self, handles: Sequence[Any]) -> None:
        if not handles:
            raise ValueError("a deployment has at least one router shard")
        self.handles = tuple(handles)
        self._services = tuple(SessionServiceHandle(h) for h in self.handles)

    @classmethod
    def find(cls, router_name: str, namespace: str) -> RouterShards:
        """Look every shard up by name: shard 0 says how many there are.

        Raises:
            ValueError: a shard is not running (as ``ray.get_actor``).
        """
        import ray

        first: Any = ray.get_actor(router_name, namespace=namespace)
        count = int(ray.get(first.shard_info.remote())["shards"])
        return cls([first] + [
            ray.get_actor(shard_name(router_name, i), namespace=namespace)
            for i in range(1, count)
        ])

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.handles)

    @property
    def first(self) -> Any:
        """Shard 0: asked for what every shard knows alike (devices, liveness)."""
        return self.handles[0]

    def of(self, session_id: str) -> Any:
        """The shard that owns ``session_id``."""
        return self.handles[shard_of(session_id, len(self.handles))]

    def service(self, session_id: str) -> SessionServiceHandle:
        """The session service of the shard that owns ``session_id`` (typed)."""
        return self._services[shard_of(session_id, len(self.handles))]

    @property
    def first_service(self) -> SessionServiceHandle:
        """Shard 0's service: asked what every shard knows alike (devices, liveness)."""
        return self._services[0]

    @property
    def services(self) -> tuple[SessionServiceHandle, ...]:
        return self._services

    def split(self, session_ids: Sequence[str]) -> dict[int, list[int]]:
        """Shard -> the indices of ``session_ids`` it owns (in order)."""
        groups: dict[int, list[int]] = {}
        for i, sid in enumerate(session_ids):
            groups.setdefault(shard_of(sid, len(self.handles)), []).append(i)
        return groups

    # -- questions about the whole table: one call per shard ---------------------------

    def stats(self) -> list[Any]:
        """Refs of every shard's stats (devices' and archives' from shard 0 only)."""
        if len(self.handles) == 1:
            return [self.first.stats.remote()]
        return [h.stats.remote(i == 0) for i, h in enumerate(self.handles)]

    def match_prefix(self, layout: KVLayout, namespace: str, tokens: list[int]) -> list[Any]:
        return [h.match_prefix.remote(layout, namespace, tokens) for h in self.handles]

    def locate_blocks(self, keys: list[bytes], namespace: str | list[str] | None
                      ) -> list[Pending[list[tuple[str, DeviceReaderHandle, list[bytes]]]]]:
        """Each shard's answer: where its blocks of ``keys`` are, as readers."""
        return [s.locate_blocks(keys, namespace) for s in self._services]

    def touch_sessions(self, session_ids: Sequence[str]) -> list[Any]:
        return [
            self.handles[shard].touch_sessions.remote([session_ids[i] for i in at])
            for shard, at in self.split(session_ids).items()
        ]

    def create_sessions(
        self, requests: Sequence[CreateSession]
    ) -> tuple[list[list[int]], list[Pending[SessionViews]]]:
        """Each shard's share of a bulk create, in one call per shard.

        Returns the indices each call covers and its answer: put back in order
        by :func:`merge_created`, one view per request. An error names the
        request's index in ``requests``; those of other shards may have been
        created meanwhile (their retry answers ConflictError).
        """
        if len(self.handles) == 1:
            bulk = CreateSessions(requests=tuple(requests))
            return [list(range(len(requests)))], [self._services[0].create_sessions(bulk)]
        groups = self.split([r.session_id for r in requests])
        order = sorted(groups)
        calls = [
            self._services[shard].create_sessions(CreateSessions(
                requests=tuple(requests[i] for i in groups[shard]),
                indices=tuple(groups[shard]),
            ))
            for shard in order
        ]
        return [groups[shard] for shard in order], calls


def merge_created(indices: list[list[int]], answers: list[SessionViews]) -> list[SessionView]:
    """The sessions of a split bulk create, in the order of the requests."""
    placed = {i: view for at, answer in zip(indices, answers, strict=True)
              for i, view in zip(at, answer.sessions, strict=True)}
    return [placed[i] for i in range(len(placed))]


def merge_prefix(answers: list[PrefixMatch]) -> PrefixMatch:
    """The longest cached prefix any shard's sessions hold."""
    if len(answers) == 1:
        return answers[0]
    return max(answers, key=lambda a: a.tokens)


def merge_located(
    answers: list[list[tuple[str, _Reader, list[bytes]]]],
) -> list[tuple[str, _Reader, list[bytes]]]:
    """One ``(device, handle, keys)`` group per device; a key several shards found
    (content-addressed, so the same bytes) is read from the first."""
    if len(answers) == 1:
        return answers[0]
    groups: dict[str, tuple[str, _Reader, list[bytes]]] = {}
    seen: set[bytes] = set()
    for answer in answers:
        for device_id, handle, keys in answer:
            fresh = [k for k in keys if k not in seen]
            seen.update(fresh)
            if fresh:
                groups.setdefault(device_id, (device_id, handle, []))[2].extend(fresh)
    return list(groups.values())


def merge_stats(answers: list[ClusterStats]) -> ClusterStats:
    """One figure set for the whole table (sums; devices and archives from shard 0)."""
    if len(answers) == 1:
        return answers[0]
    states: Counter[str] = Counter()
    priorities: Counter[str] = Counter()
    sessions: Counter[str] = Counter()
    kv_bytes: Counter[str] = Counter()
    for a in answers:
        states.update(a.session_states)
        priorities.update(a.session_priorities)
        for name, use in a.tenants.items():
            sessions[name] += use.sessions
            kv_bytes[name] += use.bytes
    named = sorted((t for t in sessions if t != OTHER_TENANTS), key=lambda t: (-kv_bytes[t], t))
    tenants = {t: TenantUse(sessions=sessions[t], bytes=kv_bytes[t])
               for t in named[:STATS_TENANTS]}
    rest = named[STATS_TENANTS:] + ([OTHER_TENANTS] if OTHER_TENANTS in sessions else [])
    if rest:
        tenants[OTHER_TENANTS] = TenantUse(sessions=sum(sessions[t] for t in rest),
                                           bytes=sum(kv_bytes[t] for t in rest))
    return msgspec.structs.replace(
        answers[0],
        shard=None,
        sessions=sum(a.sessions for a in answers),
        shard_sessions=[a.sessions for a in answers],
        logical_bytes=sum(a.logical_bytes for a in answers),
        session_states=dict(states),
        session_priorities=dict(priorities),
        tenants=tenants,
        background_prefetched=sum(a.background_prefetched for a in answers),
    )
