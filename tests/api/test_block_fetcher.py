"""The gateway's block fetcher: a read served from plans the gateway holds needs
no pin of its own (memkv.api.blocks.BlockFetcher), and keeps those plans while
it streams."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from memkv.api.blocks import BlockFetcher, PlanCache
from memkv.protocol.messages import PlanEntry, ReadPlan

SEGMENT_BYTES = 1 << 16
BLOCK = 4096
KEYS = [bytes([i]) * 16 for i in range(4)]


async def _answer(value: Any) -> Any:
    return value


class _Device:
    """A reader (memkv.protocol.members.BlockReader) that plans every block in one
    segment and counts its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.leases = 0

    def hold_for_read(self, keys: list[bytes], ttl_s: float = 120.0) -> Any:
        self.calls.append("hold_for_read")
        return _answer("hold")

    def read_plan(self, keys: list[bytes], stream: Any, ttl: float, wanted: Any = (),
                  owner: str | None = None) -> Any:
        self.calls.append("read_plan")
        self.leases += 1
        entries = tuple(PlanEntry(k, "hot", "seg", SEGMENT_BYTES, KEYS.index(k) * BLOCK, BLOCK,
                                  (1,), "float16", 0, True) for k in [*keys, *wanted])
        return _answer(ReadPlan(f"lease-{self.leases}", "dev", "node", "inc", ttl, entries))

    def release_lease(self, lease_id: str, owner: str | None = None) -> Any:
        self.calls.append("release_lease")
        return _answer(True)


class _Maps:
    def view(self, segment: str, nbytes: int, incarnation: str) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)


async def _read(fetcher: BlockFetcher, device: _Device, during: Any = None) -> list[bytes]:
    got = []
    async for item in fetcher.fetch("dev", device, KEYS, None):
        got.append(item.key)
        if during is not None:
            during()
    return got


def test_a_read_from_held_plans_asks_the_device_nothing():
    async def main() -> None:
        plans = PlanCache(ttl_s=30, margin_s=5, max_bytes=1 << 30)
        fetcher, device = BlockFetcher(_Maps(), "node", plans), _Device()  # type: ignore[arg-type]
        assert await _read(fetcher, device) == KEYS
        assert "hold_for_read" in device.calls and "read_plan" in device.calls
        device.calls.clear()
        # Again: every block is in a held plan, whose lease pins it.
        in_use = []
        assert await _read(fetcher, device, lambda: in_use.append(
            min(h.in_use for h in plans._held.values()))) == KEYS
        await asyncio.sleep(0)
        assert "hold_for_read" not in device.calls and "read_plan" not in device.calls
        # The plans stay in use while the read streams (a sweep cannot take them) ...
        assert min(in_use) >= 1
        # ... and are free once it has ended.
        assert all(h.in_use == 0 for h in plans._held.values())

    asyncio.run(main())


def test_a_read_with_a_block_not_held_pins_its_blocks_first():
    async def main() -> None:
        plans = PlanCache(ttl_s=30, margin_s=5, max_bytes=1 << 30)
        fetcher, device = BlockFetcher(_Maps(), "node", plans), _Device()  # type: ignore[arg-type]
        await _read(fetcher, device)
        for held in plans._held.values():
            held.use_until = 0.0  # past its use time: not served from any more
        device.calls.clear()
        assert await _read(fetcher, device) == KEYS
        assert device.calls[0] == "hold_for_read"

    asyncio.run(main())


def test_every_block_from_shared_memory_says_until_when_a_pin_keeps_it():
    """What the response checks before a block goes to a socket (memkv.api.guarded_send):
    the plan's lease, or the read's hold where that lasts longer."""
    async def main() -> None:
        import time

        plans = PlanCache(ttl_s=30, margin_s=5, max_bytes=1 << 30)
        fetcher, device = BlockFetcher(_Maps(), "node", plans, hold_s=120.0), _Device()  # type: ignore[arg-type]
        before = time.monotonic()
        first = [item async for item in fetcher.fetch("dev", device, KEYS, None)]
        # A fresh read holds every block it announced for 120 s.
        assert all(before + 119 < b.valid_until <= time.monotonic() + 120 for b in first)
        # From the plans the gateway holds (no hold of its own): their 30 s lease.
        again = [item async for item in fetcher.fetch("dev", device, KEYS, None)]
        assert all(before + 29 < b.valid_until <= time.monotonic() + 30 for b in again)

    asyncio.run(main())
