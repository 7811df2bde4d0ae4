"""In-process stand-ins for actor handles, so the gateway runs against plain classes (no Ray).

``FakeHandle(obj).method.remote(*args)`` returns an awaitable of
``obj.method(*args)`` (awaited too when the method is async), the way an
actor handle's call does. The router is the real :class:`SessionRouter`
over real :class:`DeviceCache` objects; only the process boundaries are gone.
A device built with ``put_object=Resolved`` runs its real ``fetch_blocks``
(the in-cluster read path) and answers a reference that holds the blocks.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any


class Resolved:
    """An object reference that already holds its value: ``ray.put`` without Ray
    (awaiting it gives the value, as awaiting an ObjectRef does)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        return self.value
        yield  # a generator: awaitable without suspending


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            result = self._fn(*args, **kwargs)
            if inspect.isawaitable(result) and not isinstance(result, Resolved):
                result = await result
            return result

        # An actor call starts when it is made, awaited or not (fire and forget, as
        # the router's prefetch after a resume is): a task on the running loop.
        try:
            return asyncio.get_running_loop().create_task(run())
        except RuntimeError:
            return run()  # no loop here: awaited later, where one runs


class FakeHandle:
    """A plain object behind an actor-handle-like face."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        return _Method(getattr(self._obj, name))


class FakeDevice(FakeHandle):
    """A DeviceCache behind a handle face (its ``ray.put``-returning method mapped)."""


def device_and_router(directory: Any, name: str, *, unit: int = 4096, blocks: int = 8) -> Any:
    """A real DeviceCache (tiers of ``blocks`` units) registered with a real SessionRouter.

    Returns ``(device, router, loop)``: the router behind a FakeHandle goes to
    ``create_app``; close the device and the loop when done.
    """
    import asyncio

    from memkv.actors.device import DeviceCache
    from memkv.actors.router import SessionRouterShell
    from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig

    cfg = StoreConfig(
        hot_capacity_bytes=blocks * unit,
        warm_capacity_bytes=blocks * unit,
        allocator=AllocatorConfig(min_unit_bytes=unit),
        archive=ArchiveConfig(directory=directory, fsync="never"),
        debug_refcounts=True,
    )
    device = DeviceCache(name, cfg, put_object=Resolved)
    router = SessionRouterShell(background_prefetch_interval_s=3600)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(router.register_device("dev-0", FakeHandle(device)))
    return device, router, loop
