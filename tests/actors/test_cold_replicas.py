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
from memkv.errors import MemberLostError, StorageFullError, UnknownBlockError
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


class _SlowNode(_Node):
    """An archive on a slow host: a put answers only after ``polls`` waits have run
    out (each raising TimeoutError, as ``wait_for`` does), and
    lands then; ``polls=None``: never (a host cut off, not yet declared dead)."""

    def __init__(self, service: ArchiveService, polls: int | None) -> None:
        super().__init__(service)
        self.polls = polls

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.service, name)
        node = self

        class _Call:
            def __init__(self, args: tuple[Any, ...]) -> None:
                self.args = args

            def result(self, timeout: float | None) -> Any:
                # A wait without a deadline gets the answer, however slow.
                if name == "put_frames" and timeout is not None and (
                        node.polls is None or node.polls > 0):
                    if node.polls is not None:
                        node.polls -= 1
                    raise TimeoutError
                return method(*self.args)

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                return _Call(args)

        return _Remote


def _resolve(call: Any, timeout: float | None = None) -> Any:
    return call.result(timeout) if hasattr(call, "result") else call()


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
                           replicas=replicas, resolve=_resolve, share=lambda x: x)


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


def test_a_full_archive_leaves_the_write_set_and_the_next_takes_the_copy(
    tmp_path: Path, caplog
) -> None:
    # a0's budget is smaller than one block: every write it is asked for is refused.
    full = _Node(ArchiveService(ArchiveConfig(directory=tmp_path / "full", fsync="never"),
                                capacity_bytes=64))
    made = [full] + [_Node(ArchiveService(ArchiveConfig(directory=tmp_path / f"a{i}",
                                                        fsync="never"))) for i in (1, 2)]
    now = [0.0]
    tier = ArchiveReplicas([(f"a{i}", n) for i, n in enumerate(made)], CodecConfig(),
                           replicas=2, resolve=_resolve, share=lambda x: x,
                           clock=lambda: now[0])
    try:
        blocks = _blocks(2)
        with caplog.at_level(logging.WARNING, logger="memkv.actors.cold_replicas"):
            tier.put_many(blocks[:1], durable=True)
            tier.put_many(blocks[1:], durable=True)
        for key, *_ in blocks:
            assert _holders(made, key) == [1, 2]  # two copies all the same
        assert tier.under_replicated_writes == 0
        assert tier.full_refusals == 1  # left out of the second write: not asked again
        assert sum("is full" in r.getMessage() for r in caplog.records) == 1
        assert torch.equal(tier.load(blocks[0][0]), blocks[0][1])
        # After FULL_RETRY_S it is asked again (room may have been made).
        now[0] += 11.0
        tier.put_many(_blocks(3)[2:], durable=True)
        assert tier.full_refusals == 2
    finally:
        for n in made:
            n.service.close()


def test_when_no_archive_can_take_a_copy_the_write_fails_as_full(tmp_path: Path) -> None:
    made = [_Node(ArchiveService(ArchiveConfig(directory=tmp_path / f"a{i}", fsync="never"),
                                 capacity_bytes=64)) for i in range(2)]
    tier = ArchiveReplicas([(f"a{i}", n) for i, n in enumerate(made)], CodecConfig(),
                           replicas=2, resolve=_resolve, share=lambda x: x)
    try:
        with pytest.raises(StorageFullError, match=r"no archive can take the cold copy: 2 of 2"):
            tier.put_many(_blocks(1), durable=True)
    finally:
        for n in made:
            n.service.close()


def _timed_tier(made: list[_Node], replicas: int = 2) -> ArchiveReplicas:
    return ArchiveReplicas([(f"a{i}", n) for i, n in enumerate(made)], CodecConfig(),
                           replicas=replicas, resolve=_resolve, share=lambda x: x,
                           replica_timeout_s=0.01)


def _service(tmp_path: Path, name: str) -> ArchiveService:
    return ArchiveService(ArchiveConfig(directory=tmp_path / name, fsync="never"))


def test_a_copy_past_its_deadline_goes_to_the_next_archive(tmp_path: Path, caplog) -> None:
    # The device's own archive is on a host cut off (never answers): the copies
    # land on the two others, on time.
    made = [_SlowNode(_service(tmp_path, "a0"), polls=None),
            _Node(_service(tmp_path, "a1")), _Node(_service(tmp_path, "a2"))]
    tier = _timed_tier(made)
    try:
        blocks = _blocks(2)
        with caplog.at_level(logging.WARNING, logger="memkv.actors.cold_replicas"):
            tier.put_many(blocks, durable=True)
        for key, *_ in blocks:
            assert _holders(made, key) == [1, 2]
        assert tier.late_copies == 1 and tier.under_replicated_writes == 0
        assert any("did not take a cold copy" in r.getMessage() for r in caplog.records)
        assert torch.equal(tier.load_many([blocks[1][0]])[0], blocks[1][1])
    finally:
        for n in made:
            n.service.close()


def test_with_no_archive_left_the_write_answers_with_the_copies_it_has(tmp_path: Path) -> None:
    made = [_Node(_service(tmp_path, "a0")), _SlowNode(_service(tmp_path, "a1"), polls=None)]
    tier = _timed_tier(made)
    try:
        blocks = _blocks(1)
        tier.put_many(blocks, durable=True)  # does not wait for a1
        assert _holders(made, blocks[0][0]) == [0]
        assert tier.under_replicated_writes == 1 and tier.late_copies == 1
    finally:
        for n in made:
            n.service.close()


def test_when_every_copy_is_late_the_first_to_land_answers(tmp_path: Path) -> None:
    # No copy in time anywhere: slow beats failing; the first that lands acknowledges.
    made = [_SlowNode(_service(tmp_path, "a0"), polls=None),
            _SlowNode(_service(tmp_path, "a1"), polls=5)]
    tier = _timed_tier(made)
    try:
        blocks = _blocks(1)
        tier.put_many(blocks, durable=True)
        assert _holders(made, blocks[0][0]) == [1]
        assert tier.under_replicated_writes == 1
    finally:
        for n in made:
            n.service.close()


def test_without_a_deadline_every_copy_is_waited_for(tmp_path: Path) -> None:
    made = [_SlowNode(_service(tmp_path, "a0"), polls=3), _Node(_service(tmp_path, "a1"))]
    tier = ArchiveReplicas([(f"a{i}", n) for i, n in enumerate(made)], CodecConfig(),
                           replicas=2, resolve=_resolve, share=lambda x: x)
    try:
        blocks = _blocks(1)
        tier.put_many(blocks, durable=True)
        assert _holders(made, blocks[0][0]) == [0, 1] and tier.late_copies == 0
    finally:
        for n in made:
            n.service.close()
