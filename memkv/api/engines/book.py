"""Where engine registrations are kept, so that every gateway process routes to the
same engines.

A deployment runs several gateway processes (``gateway.workers`` per node, and
a gateway per node or pod); ``POST /v1/engines`` reaches one of them. Each
process's registry writes what it registers into the book and, at every round
of checks, takes from the book what others registered or removed.

- :class:`LocalBook`: one process's own (a gateway alone, tests).
- :class:`RayKvBook`: Ray's internal key-value store in the GCS, shared by
  every process of the Ray cluster (and as durable as the GCS: with GCS fault
  tolerance, KubeRay's Redis, it survives a head restart).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Protocol

from memkv.api.engines.spec import EngineSpec

__all__ = ["EngineBook", "LocalBook", "RayKvBook"]


class EngineBook(Protocol):
    async def put(self, engine_id: str, spec: EngineSpec) -> None: ...

    async def remove(self, engine_id: str) -> None: ...

    async def entries(self) -> dict[str, EngineSpec]: ...


class LocalBook:
    """The registrations of this process only."""

    def __init__(self) -> None:
        self._entries: dict[str, EngineSpec] = {}

    async def put(self, engine_id: str, spec: EngineSpec) -> None:
        self._entries[engine_id] = spec

    async def remove(self, engine_id: str) -> None:
        self._entries.pop(engine_id, None)

    async def entries(self) -> dict[str, EngineSpec]:
        return dict(self._entries)


class RayKvBook:
    """Registrations in Ray's internal KV, one key per engine under ``namespace``
    (the memkv cluster's Ray namespace: two deployments on one Ray cluster keep apart).

    Its calls block on the GCS: they run on a thread, off the gateway's event loop.
    """

    PREFIX = "memkv/engines/"

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    async def put(self, engine_id: str, spec: EngineSpec) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        doc = dataclasses.asdict(spec)
        doc["tenants"] = None if spec.tenants is None else sorted(spec.tenants)
        await asyncio.to_thread(_internal_kv_put, self.PREFIX + engine_id,
                                json.dumps(doc).encode(), True, namespace=self.namespace)

    async def remove(self, engine_id: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        await asyncio.to_thread(_internal_kv_del, self.PREFIX + engine_id,
                                namespace=self.namespace)

    async def entries(self) -> dict[str, EngineSpec]:
        return await asyncio.to_thread(self._entries)

    def _entries(self) -> dict[str, EngineSpec]:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

        out: dict[str, EngineSpec] = {}
        for key in _internal_kv_list(self.PREFIX, namespace=self.namespace):
            value = _internal_kv_get(key, namespace=self.namespace)
            if value is None:
                continue  # removed between the listing and the read
            doc = json.loads(value)
            tenants = doc.pop("tenants")
            out[key.decode()[len(self.PREFIX):]] = EngineSpec(
                **doc, tenants=None if tenants is None else frozenset(tenants))
        return out
