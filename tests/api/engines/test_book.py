"""Engine registrations shared by gateway processes: a registry takes what another
registered or removed at its next round of checks; the Ray book keeps them in the GCS."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from memkv.api.engines.book import LocalBook, RayKvBook
from memkv.api.engines.registry import EngineRegistry
from memkv.api.engines.spec import EngineSpec

from .test_front_door import MODEL, FakeEngine


def test_an_engine_registered_in_one_gateway_process_is_routed_to_by_the_others():
    engine = FakeEngine("shared")

    async def main() -> None:
        book = LocalBook()  # (what RayKvBook is across processes)
        async with httpx.AsyncClient() as client:
            here = EngineRegistry(client, book=book)
            there = EngineRegistry(client, book=book)
            await here.register(engine.url, engine_id="x", max_requests=3,
                                tenants=frozenset({"acme"}))
            assert there.get("x") is None
            await there.check_all()
            seen = there.get("x")
            assert seen is not None and seen.healthy and seen.model == MODEL
            assert (seen.max_requests, seen.tenants) == (3, frozenset({"acme"}))
            seen.inflight = 2  # there's own requests in flight survive a re-registration
            await here.register(engine.url, engine_id="x", max_requests=5)
            await there.check_all()
            assert there.get("x").max_requests == 5 and there.get("x").inflight == 2
            await here.unregister("x")
            await there.check_all()
            assert there.get("x") is None and there.engines() == []

    try:
        asyncio.run(main())
    finally:
        engine.server.stop()


def test_the_ray_book_keeps_registrations_per_memkv_namespace(cluster):
    spec = EngineSpec("http://127.0.0.1:9", "m", "node-1", True, 4, frozenset({"a", "b"}))
    mine, theirs = RayKvBook(f"book-{uuid.uuid4().hex[:6]}"), RayKvBook(f"book-{uuid.uuid4().hex}")

    async def main() -> None:
        await mine.put("e1", spec)
        assert await mine.entries() == {"e1": spec}
        assert await theirs.entries() == {}
        await mine.remove("e1")
        assert await mine.entries() == {}

    asyncio.run(main())
