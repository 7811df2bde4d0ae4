"""The replicated cold tier: each block on ``replicas`` archives, reads falling over,
and the router's repair putting lost copies back.

Real archive services (segment files under tmp_path) in this process; an
archive "on a dead node" answers every call with ``ActorUnschedulableError``,
as Ray does for an actor pinned to a node that is gone. No Ray.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from ray.exceptions import ActorUnschedulableError

from memkv.actors.cold_replicas import ArchiveReplicas, replica_order
from memkv.archive.service import ArchiveService
from memkv.errors import MemberLostError, UnknownBlockError
from memkv.router.collector import Collector
from memkv.router.peers import ShardPeers
from memkv.router.repair import ReplicaRepair
from memkv.router.state import RouterState
from memkv.storage.config import ArchiveConfig, CodecConfig

FINGERPRINT = bytes(16)


class _Node:
    """An archive as an actor handle: ``handle.method.remote(*args)`` is a deferred
    call (the tier resolves it); a dead node's calls raise ActorUnschedulableError."""

    def __init__(self, service: ArchiveService) -> None:
        self.service = service
        self.dead = False
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.service, name)

        def call() -> Any:
            self.calls.append(name)
            if self.dead:
                raise ActorUnschedulableError("the actor's node is gone")
            return method

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                return lambda: call()(*args)

        return _Remote


class _Archive:
    """The same archive as the router sees it (an awaitable member)."""

    def __init__(self, node: _Node) -> None:
        self.node = node

    def __getattr__(self, name: str) -> Any:
        async def run(*args: Any) -> Any:
            if self.node.dead:
                raise MemberLostError("the actor's node is gone")
            return getattr(self.node.service, name)(*args)

        return run


@pytest.fixture
def nodes(tmp_path: Path):
    made = [_Node(ArchiveService(ArchiveConfig(directory=tmp_path / f"a{i}", fsync="never")))
            for i in range(3)]
    yield made
    for n in made:
        n.service.close()


def _tier(nodes: list[_Node], replicas: int = 2) -> ArchiveReplicas:
    return ArchiveReplicas([(f"a{i}", n) for i, n in enumerate(nodes)], CodecConfig(),
                           replicas=replicas, resolve=lambda thunk: thunk(), share=lambda x: x)


def _blocks(n: int) -> list[tuple[bytes, torch.Tensor, bytes, str]]:
    g = torch.Generator().manual_seed(n)
    return [(bytes([i + 1]) * 16, torch.randn(2, 4, generator=g).half(), FINGERPRINT, "lz4")
            for i in range(n)]


def _holders(nodes: list[_Node], key: bytes) -> list[int]:
    return [i for i, n in enumerate(nodes) if not n.dead and n.service.contains([key])[0]]


def test_replica_order_puts_the_own_archive_first_and_spreads_the_rest() -> None:
    names = ["a", "b", "c", "d"]
    assert replica_order("b", names, spread=0) == ["b", "a", "c", "d"]
    assert replica_order("b", names, spread=1) == ["b", "c", "d", "a"]
    assert replica_order(None, names, spread=2) == ["c", "d", "a", "b"]
    # Second copies of consecutive devices land on different archives.
    assert len({replica_order("a", names, spread=i)[1] for i in range(3)}) == 3


def test_a_write_lands_on_replicas_archives_and_reads_back_exact(nodes) -> None:
    tier = _tier(nodes)
    blocks = _blocks(3)
    tier.put_many(blocks, durable=True)
    for key, *_ in blocks:
        assert _holders(nodes, key) == [0, 1]  # the first two of the order, not the third
    loaded = tier.load_many([k for k, *_ in blocks])
    for (_, block, _, _), got in zip(blocks, loaded, strict=True):
        assert torch.equal(got, block)


def test_a_lost_archive_is_skipped_for_writes_and_reads_fall_over(nodes) -> None:
    tier = _tier(nodes)
    first = _blocks(2)
    tier.put_many(first, durable=True)
    nodes[0].dead = True
    # Reads of what it held come from the other copy.
    assert torch.equal(tier.load(first[0][0]), first[0][1])
    assert tier.lost == {"a0"} and tier.fallback_reads >= 1
    # New writes still get two copies: on the live archives.
    more = [(bytes([9]) * 16, torch.ones(2, 4).half(), FINGERPRINT, "lz4")]
    tier.put_many(more, durable=True)
    assert _holders(nodes, more[0][0]) == [1, 2]
    assert tier.under_replicated_writes == 0
    assert tier.missing([first[1][0], bytes(16)]) == [bytes(16)]


def test_fewer_live_archives_than_replicas_writes_degraded_and_says_so(nodes, caplog) -> None:
    tier = _tier(nodes, replicas=3)
    nodes[2].dead = True
    with caplog.at_level(logging.WARNING, logger="memkv.actors.cold_replicas"):
        tier.put_many(_blocks(1), durable=True)
        tier.put_many(_blocks(1), durable=True)
    assert tier.under_replicated_writes == 2
    # Said once, not once per write (one archive short means every write is).
    (said,) = [r.getMessage() for r in caplog.records if "replicas" in r.getMessage()]
    assert "written to 2 of 3 replicas (1 such writes so far" in said
    nodes[0].dead = nodes[1].dead = True
    with pytest.raises(MemberLostError, match="every archive"):
        tier.put_many(_blocks(1))


def test_a_damaged_copy_is_never_served_the_replica_is(nodes) -> None:
    tier = _tier(nodes)
    (key, block, _, _), = blocks = _blocks(1)
    tier.put_many(blocks, durable=True)
    # Damage the first archive's copy on disk (its payload's last byte).
    nodes[0].service.flush()
    segment = next(nodes[0].service._segments._dir.glob("seg-*.log"))
    data = bytearray(segment.read_bytes())
    data[-1] ^= 0xFF
    segment.write_bytes(bytes(data))
    assert torch.equal(tier.load(key), block)
    assert nodes[0].service.corrupt_reads == 1
    nodes[1].dead = True
    with pytest.raises(UnknownBlockError, match="no live archive"):
        tier.load(key)


def _repair(nodes: list[_Node], referenced: set[bytes],
            replicas: int = 2) -> tuple[ReplicaRepair, Collector]:
    state = RouterState()
    state.referenced = lambda key: key in referenced  # type: ignore[method-assign]
    collector = Collector(state, ShardPeers(0, 1, "r", None))
    for i, n in enumerate(nodes):
        collector.archives[f"a{i}"] = _Archive(n)  # type: ignore[assignment]
    return ReplicaRepair(collector, replicas=replicas, interval_s=3600), collector


def test_repair_copies_the_blocks_of_a_lost_archive_to_the_others(nodes) -> None:
    tier = _tier(nodes)
    blocks = _blocks(5)
    tier.put_many(blocks, durable=True)  # on a0 and a1
    garbage = blocks[4][0]  # held by no session: left alone
    repair, collector = _repair(nodes, {k for k, *_ in blocks[:4]})
    nodes[0].dead = True
    stats = asyncio.run(repair.run())
    assert stats.lost_archives == ["a0"] and stats.live_archives == 2
    assert stats.repaired_blocks == 4 and stats.under_replicated == 0
    for key, *_ in blocks[:4]:
        assert _holders(nodes, key) == [1, 2]
    assert _holders(nodes, garbage) == [1]
    # The copies are whole: the lost archive's blocks read back from the new one alone.
    nodes[1].dead = True
    reread = _tier(nodes)
    for key, block, _, _ in blocks[:4]:
        assert torch.equal(reread.load(key), block)
    assert nodes[2].service.codecs([blocks[0][0]]) == ["lz4"]
    # A second pass has nothing to do.
    nodes[1].dead = False
    collector.archives["a1"] = _Archive(nodes[1])  # type: ignore[assignment]
    again = asyncio.run(repair.run())
    assert again.repaired_blocks == 4 and again.under_replicated == 0 and again.passes == 2


def test_repair_with_one_archive_left_has_nothing_to_copy_to(nodes) -> None:
    tier = _tier(nodes)
    blocks = _blocks(2)
    tier.put_many(blocks, durable=True)
    repair, _ = _repair(nodes, {k for k, *_ in blocks})
    nodes[0].dead = nodes[2].dead = True
    stats = asyncio.run(repair.run())
    assert stats.live_archives == 1 and stats.repaired_blocks == 0
    assert stats.under_replicated == 0  # one archive: one copy is all there can be
