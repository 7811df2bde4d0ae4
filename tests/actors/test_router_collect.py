"""The router's archive deletes never take a block an append in flight has deduplicated.

Real SessionRouter and DeviceCache behind fake handles (no Ray); the device's
put is held at a gate so a delete of the block's other holder runs in between.
"""

import asyncio

import torch

from memkv.actors.device import DeviceCache
from memkv.actors.router import SessionRouterShell
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.services import AppendTurn, CreateSession, LayoutSpec
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.payloads import to_payload

from ..api.fakes import FakeHandle, Resolved

LAYOUT = KVLayout("collect-model", 2, 2, 8, block_tokens=4)
UNIT = 4096


class _GatedDevice(FakeHandle):
    """A device whose next put waits for ``gate`` (after telling ``entered``)."""

    def __init__(self, device):
        super().__init__(device)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.held = False

    def __getattr__(self, name):
        method = super().__getattr__(name)
        if name != "put" or not self.held:
            return method
        outer = self

        class _Held:
            async def remote(self, *args, **kwargs):
                outer.entered.set()
                await outer.gate.wait()
                return await method.remote(*args, **kwargs)

        return _Held()


class _Archive:
    """Records the router's deletes."""

    def __init__(self):
        self.deleted = []

    def ping(self):
        return "ok"

    def delete(self, keys):
        self.deleted.extend(bytes(k) for k in keys)
        return len(keys)


def _blocks(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    keys = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    values = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    return split_kv(LAYOUT, keys, values)


def _append(session_id, tokens):
    return AppendTurn(session_id=session_id, token_ids=AppendTurn.pack_tokens(tokens))


def test_a_delete_during_a_deduplicating_append_keeps_the_shared_block(tmp_path):
    cfg = StoreConfig(hot_capacity_bytes=8 * UNIT, warm_capacity_bytes=8 * UNIT,
                      allocator=AllocatorConfig(min_unit_bytes=UNIT),
                      archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"),
                      debug_refcounts=True)
    device = DeviceCache("collect-dev", cfg, put_object=Resolved)
    gated, archive = _GatedDevice(device), _Archive()
    router = SessionRouterShell(background_prefetch_interval_s=3600)
    tokens = list(range(8))
    chain = [bytes(k) for k in chain_hashes(tokens, LAYOUT, "n")]
    blocks = _blocks(8)
    payloads = [to_payload(k, b) for k, b in zip(chain, blocks, strict=True)]

    async def scenario():
        await router.register_device("dev-0", gated)
        await router.register_archive("archive-0", FakeHandle(archive))
        for sid in ("a", "b"):
            await router.create_session(
                CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="n"))
        await router.put_blocks(_append("a", tokens), payloads)
        gated.held = True
        b_put = asyncio.ensure_future(router.put_blocks(_append("b", tokens), payloads))
        await gated.entered.wait()  # b's put is at the device: it will deduplicate a's blocks
        await router.delete_session("a")  # a was their only recorded holder
        gated.gate.set()
        await b_put
        router.background.cancel()  # the background prefetcher register_device started

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert archive.deleted == []  # b holds them: nothing goes to the archive's delete
    assert router.state.refcount(chain[0]) == 1
    read = device.get_blocks(chain)
    assert [p.data.tobytes() for p in read] == [b.numpy().tobytes() for b in blocks]
    device.close()
