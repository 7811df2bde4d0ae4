"""Background prefetch (trigger 3) on a real router over a real device, both of its branches.

The cluster test of it could only check whichever branch the shared cluster's
hot tier happened to be in; here each branch is set up on purpose.
"""

from __future__ import annotations

import torch

from memkv.protocol.hashing import chain_hashes
from memkv.protocol.services import AppendTurn, CreateSession, LayoutSpec
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.payloads import to_payload

from ..api.fakes import device_and_router

UNIT = 4096
# One 16-token block of this layout is 16 KiB in fp16: four units, half of an
# 8-unit hot tier (the router calls a device under-used below 30%).
LAYOUT = KVLayout("background-model", num_layers=2, num_kv_heads=2, head_dim=64,
                  block_tokens=16, dtype="float16")


async def _session(router, sid: str, first_token: int) -> list[bytes]:
    await router.create_session(CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT)))
    tokens = list(range(first_token, first_token + LAYOUT.block_tokens))
    g = torch.Generator().manual_seed(first_token)
    shape = (LAYOUT.num_kv_heads, len(tokens), LAYOUT.head_dim)
    keys = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    values = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    chain = [bytes(k) for k in chain_hashes(tokens, LAYOUT, "default")]
    blocks = [to_payload(k, b) for k, b in zip(chain, split_kv(LAYOUT, keys, values), strict=True)]
    request = AppendTurn(session_id=sid, token_ids=AppendTurn.pack_tokens(tokens))
    await router.put_blocks(request, blocks)
    return chain


def _run(tmp_path, scenario):
    device, router, loop = device_and_router(tmp_path / "cold", "background-dev", unit=UNIT,
                                             blocks=8)
    try:
        return loop.run_until_complete(scenario(device, router))
    finally:
        router.background.cancel()
        device.close()
        loop.close()


def test_an_under_used_hot_tier_brings_the_hottest_idle_session_back(tmp_path):
    async def scenario(device, router):
        chain = await _session(router, "idle", 0)
        await router.suspend("idle")
        assert device.locations(chain) == ["cold"]
        assert device.stats().hot_usage < 0.3
        moved = await router.background_round()
        return moved, device.locations(chain)

    moved, tiers = _run(tmp_path, scenario)
    assert (moved, tiers) == (1, ["hot"])


def test_a_busy_hot_tier_is_left_to_foreground_work(tmp_path):
    async def scenario(device, router):
        idle = await _session(router, "idle", 0)
        await router.suspend("idle")
        await _session(router, "busy", 1000)  # active: its block stays hot
        assert device.stats().hot_usage >= 0.3
        moved = await router.background_round()
        return moved, device.locations(idle)

    moved, tiers = _run(tmp_path, scenario)
    assert (moved, tiers) == (0, ["cold"])
