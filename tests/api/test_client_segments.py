"""The gateway's mappings of clients' staging segments let go of a client that went:
a mapping would keep its pages (a vLLM engine's 1 GiB) alive after the file is gone."""

from __future__ import annotations

from memkv.api.client_segments import PRUNE_INTERVAL_S, ClientSegments
from memkv.shm.staging import client_staging


def test_a_gone_clients_segment_is_let_go_of():
    now = [0.0]
    segments = ClientSegments(clock=lambda: now[0])
    gone, staying = client_staging(1 << 20), client_staging(1 << 20)
    assert gone is not None and staying is not None
    try:
        for staging in (gone, staying):
            slot = staging.lease(4096)
            assert slot is not None
            slot.take(4096)[:] = b"\x07" * 4096
            view = segments.resolve(staging.segment, 0, 4096)
            assert bytes(view[:2]) == b"\x07\x07"
            del view
        assert len(segments) == 2
        gone.close()  # the engine went (or the sweeper unlinked its segment)
        segments.resolve(staying.segment, 0, 16)
        assert len(segments) == 2  # not yet: pruned now and then, not on every block
        now[0] += PRUNE_INTERVAL_S
        segments.resolve(staying.segment, 0, 16)
        assert len(segments) == 1  # the live client's mapping stays
        assert segments.prune() == 0
    finally:
        staying.close()
        segments.close()


def test_an_idle_gateway_lets_go_too(monkeypatch):
    """No block staged after the client went: the gateway's own rounds let go of it."""
    import asyncio

    from memkv.api import client_segments as module

    async def scenario() -> int:
        segments = ClientSegments()
        staging = client_staging(1 << 20)
        assert staging is not None
        segments.resolve(staging.segment, 0, 16)  # starts the rounds (a loop runs here)
        staging.close()
        for _ in range(100):
            if len(segments) == 0:
                break
            await asyncio.sleep(0.02)
        left = len(segments)
        segments.close()
        return left

    monkeypatch.setattr(module, "PRUNE_INTERVAL_S", 0.01)
    assert asyncio.run(scenario()) == 0
