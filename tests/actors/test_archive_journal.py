"""A router's journal on archives: it outlives the router's node, fences old routers,
and a stale or lagging copy never wins.

Real archive services (journal replicas under tmp_path) in this process; an
archive "on a dead node" answers with ``ActorUnschedulableError`` as Ray does.
No Ray.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorUnschedulableError

from memkv.actors.archive_journal import ArchiveJournal, journal_name, journal_shard_counts
from memkv.archive.journal_replica import SupersededError
from memkv.archive.service import ArchiveService
from memkv.errors import InvalidInputError, MemberLostError
from memkv.router.state import RouterState
from memkv.storage.config import ArchiveConfig
from memkv.storage.journal import Journal

NAME = journal_name("memkv-router", 0, 1)


class _Node:
    """An archive as an actor handle whose node can die (see test_cold_replicas)."""

    def __init__(self, service: ArchiveService, node: str) -> None:
        self.service = service
        self.service.node_id = node
        self.dead = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.service, name)
        node = self

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                def run() -> Any:
                    if node.dead:
                        raise ActorUnschedulableError("the actor's node is gone")
                    return method(*args)
                return _Ref(run)

        return _Remote


class _Ref:
    """A call's answer as Ray's object reference is one: awaited (the call runs on a
    thread, as an actor's runs elsewhere), or resolved by ``resolve`` (``ray.get``)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def __call__(self) -> Any:
        return self.run()

    def __await__(self) -> Any:
        return asyncio.to_thread(self.run).__await__()


@pytest.fixture
def nodes(tmp_path: Path):
    made = [_Node(ArchiveService(ArchiveConfig(directory=tmp_path / f"a{i}", fsync="never")),
                  f"node-{i}") for i in range(3)]
    yield made
    for n in made:
        n.service.close()


def _journal(nodes: list[_Node], own_node: str = "node-0", **kw: Any) -> ArchiveJournal:
    return ArchiveJournal(NAME, [(f"a{i}", n) for i, n in enumerate(nodes)], replicas=2,
                          own_node=own_node, resolve=lambda thunk: thunk(), **kw)


def _positions(nodes: list[_Node]) -> list[tuple[int, int]]:
    return [n.service.journal_position(NAME) for n in nodes]


def test_the_table_is_on_two_archives_off_the_routers_node_and_replays_elsewhere(nodes) -> None:
    state = RouterState(journal=_journal(nodes, own_node="node-0"))
    # The first snapshot fenced every archive at epoch 1.
    assert _positions(nodes) == [(1, 0)] * 3
    state.add_archive("arch-x")
    state.add_device("dev-y")
    state.journal.sync()
    # Appends went to the archives of the other nodes, not the router's own.
    assert _positions(nodes) == [(1, 0), (1, 2), (1, 2)]
    # The router's node dies with its archive: a new router elsewhere replays the table.
    nodes[0].dead = True
    again = RouterState(journal=_journal(nodes, own_node="node-1"))
    assert again.known_archives == ["arch-x"] and again.known_devices == ["dev-y"]
    assert again.journal.epoch == 2


def test_a_superseded_router_acknowledges_nothing_more(nodes) -> None:
    old = RouterState(journal=_journal(nodes))
    old.add_archive("before")
    old.journal.sync()
    new = RouterState(journal=_journal(nodes))  # the old one still runs (a split)
    assert new.known_archives == ["before"]
    old.add_archive("after-the-split")
    with pytest.raises(SupersededError, match="superseded by epoch 2"):
        old.journal.sync()
    third = RouterState(journal=_journal(nodes))
    assert third.known_archives == ["before"]


def test_a_lost_replica_is_replaced_by_a_snapshot_before_the_answer(nodes) -> None:
    state = RouterState(journal=_journal(nodes))
    state.add_archive("one")
    state.journal.sync()
    nodes[1].dead = True  # a replica's node
    state.add_archive("two")
    state.journal.sync()
    assert state.journal.wants_snapshot  # the stand-in needs the whole table
    state.compact_journal(every=1_000)  # what the router does before it answers
    assert not state.journal.wants_snapshot
    assert nodes[0].service.journal_position(NAME)[1] == 2  # the stand-in has it all
    # Both of the nodes that had it are lost: the stand-in alone serves the table.
    nodes[2].dead = True
    again = RouterState(journal=_journal(nodes, own_node="node-9"))
    assert again.known_archives == ["one", "two"]


def test_a_stale_copy_never_wins(nodes) -> None:
    state = RouterState(journal=_journal(nodes, own_node="node-0"))
    state.add_archive("kept")
    state.journal.sync()
    nodes[2].dead = True  # away while the table moves on
    state.add_archive("later")
    state.journal.sync()
    state.compact_journal(every=1_000)
    nodes[2].dead = False  # back, with its old copy
    assert nodes[2].service.journal_position(NAME) < nodes[1].service.journal_position(NAME)
    again = RouterState(journal=_journal(nodes))
    assert again.known_archives == ["kept", "later"]


def test_a_replica_that_missed_records_refuses_a_gap(nodes, tmp_path) -> None:
    nodes[0].service.journal_snapshot(NAME, 3, 10, [])
    with pytest.raises(InvalidInputError, match="needs a snapshot"):
        nodes[0].service.journal_append(NAME, 3, 12, [b"x"])
    with pytest.raises(SupersededError):
        nodes[0].service.journal_append(NAME, 2, 11, [b"x"])
    with pytest.raises(InvalidInputError, match="1-128"):
        nodes[0].service.journal_position("../escape")


def test_a_local_journal_moves_to_the_archives(nodes, tmp_path) -> None:
    local = Journal(tmp_path / "local", fsync=False)
    before = RouterState(journal=local)
    before.add_archive("from-disk")
    local.sync()
    local.close()
    state = RouterState(journal=_journal(nodes, local=Journal(tmp_path / "local", fsync=False)))
    assert state.known_archives == ["from-disk"]
    nodes[0].dead = True
    again = RouterState(journal=_journal(nodes))
    assert again.known_archives == ["from-disk"]


def test_no_archive_left(nodes) -> None:
    for n in nodes:
        n.dead = True
    with pytest.raises(MemberLostError, match="no archive answered"):
        _journal(nodes)


def test_journal_names_carry_the_shard_count(nodes) -> None:
    nodes[0].service.journal_snapshot(journal_name("r", 1, 4), 1, 1, [])
    nodes[0].service.journal_snapshot(journal_name("other", 0, 2), 1, 1, [])
    assert journal_shard_counts(nodes[0].service.journal_names(), "r") == {4}


def test_asking_after_a_journal_leaves_no_trace(nodes) -> None:
    """A router that looks for the journals of another shard count (or a typo) must not
    make them appear: the next start would read a shard count from them."""
    assert nodes[0].service.journal_position(journal_name("r", 0, 8)) == (0, 0)
    assert nodes[0].service.journal_read(journal_name("r", 0, 8)) == (0, 0, [])
    assert nodes[0].service.journal_names() == []
    with pytest.raises(InvalidInputError, match="1-128"):
        nodes[0].service.journal_read("..")


def test_a_change_flushed_before_its_answer_survives_the_routers_crash(nodes) -> None:
    """A memory-mode change is not fsynced, but it leaves the router's process before
    the router answers: a crash right after the answer keeps it."""
    state = RouterState(journal=_journal(nodes))
    state.add_archive("flushed")
    assert state.journal.buffered
    state.journal.flush()
    assert not state.journal.buffered
    assert _positions(nodes)[1:] == [(1, 1), (1, 1)]
    # The router dies here (its object is dropped unsynced); a new one replays it.
    again = RouterState(journal=_journal(nodes))
    assert again.known_archives == ["flushed"]
    # A later sync with nothing pending still fsyncs what was flushed (an empty batch).
    again.add_device("d")
    again.journal.flush()
    again.journal.sync()
    assert not again.journal._unsynced


def test_a_snapshot_leaves_the_routers_event_loop_serving_and_commits_after_it(nodes) -> None:
    """The router compacts its journal on its event loop: a slow archive (restarting, or
    a large table) must not stop it, and no record may reach a replica before the
    snapshot it follows."""
    state = RouterState(journal=_journal(nodes, own_node="node-0"))
    state.add_archive("one")
    state.journal.sync()
    calls: list[str] = []
    writing, finish, appended = threading.Event(), threading.Event(), threading.Event()
    service = nodes[1].service
    snapshot, append = service.journal_snapshot, service.journal_append

    def slow_snapshot(*args: Any) -> Any:
        calls.append("snapshot")
        writing.set()
        assert finish.wait(30)
        return snapshot(*args)

    def noted_append(*args: Any) -> Any:
        calls.append("append")
        appended.set()
        return append(*args)

    service.journal_snapshot, service.journal_append = slow_snapshot, noted_append

    async def router_loop() -> None:
        state.journal.wants_snapshot = True  # e.g. a replica was replaced
        compaction = asyncio.create_task(state.compact_journal_async(every=1_000))
        assert await asyncio.to_thread(writing.wait, 30)
        # The loop serves while the snapshot is written: a change is logged, and a
        # second compaction does not start another snapshot.
        state.add_archive("two")
        await state.compact_journal_async(every=1_000)
        commit = asyncio.create_task(state.journal.commit(fsync=True))
        assert not await asyncio.to_thread(appended.wait, 0.5)  # it waits for the snapshot
        finish.set()
        await compaction
        await commit

    asyncio.run(router_loop())
    assert calls == ["snapshot", "append"]
    assert state.journal.records_since_snapshot == 1  # "two", after the snapshot
    assert not state.journal.wants_snapshot
    again = RouterState(journal=_journal(nodes, own_node="node-9"))
    assert again.known_archives == ["one", "two"]
