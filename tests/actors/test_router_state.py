import pytest

from memkv.errors import (
    BlockLostError,
    InvalidInputError,
    MemkvError,
    UnknownBlockError,
    UnknownSessionError,
)
from memkv.protocol.enums import SessionState
from memkv.protocol.events import BlockEvents
from memkv.protocol.layout import KVLayout
from memkv.router.state import RouterState

LAYOUT = KVLayout("m", 2, 2, 8, block_tokens=4).to_dict()


def append(s, sid, chain, tokens):
    """Place and record an append the way the router does around its device call; the
    device's answer says it now holds the chain (its block events)."""
    device = s.place(sid, chain)
    epoch, end = s.blocks.cursor(device)  # ("", 0) at first contact: a snapshot answers
    s.blocks.apply(device, BlockEvents(epoch=f"epoch-{device}", start=end,
                                       end=end + len(chain), stored=tuple(chain),
                                       snapshot=not epoch))
    return s.record_put(sid, s.sessions.plan_append(sid, tokens, chain))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def state(**kw):
    s = RouterState(clock=kw.pop("clock", Clock()), **kw)
    s.add_device("d0", "inc0")
    s.add_device("d1", "inc1")
    return s


def test_least_loaded_placement_spreads_sessions():
    s = state()
    for i in range(4):
        s.create(f"s{i}", LAYOUT, "t", "normal")
        append(s, f"s{i}", [f"chain-{i}".encode()], 4)
    assert {r.device_id for r in s.sessions} == {"d0", "d1"}
    assert s.devices["d0"].sessions == s.devices["d1"].sessions == 2


def test_a_session_asked_near_a_node_goes_to_a_device_there_else_by_load():
    s = state()
    s.add_device("d2", "inc2")
    s.node_of.update({"d0": "aaaa1111", "d1": "bbbb2222", "d2": "bbbb2222"})
    for i in range(3):
        s.create(f"near{i}", LAYOUT, "t", "normal")
        assert s.place_near(f"near{i}", "bbbb") in ("d1", "d2")  # a prefix will do
    assert s.devices["d1"].sessions + s.devices["d2"].sessions == 3
    assert abs(s.devices["d1"].sessions - s.devices["d2"].sessions) == 1  # by load there
    s.create("far", LAYOUT, "t", "normal")
    assert s.place_near("far", "cccc") is None  # no device on that node: by load later
    append(s, "far", [b"far-chain"], 4)
    assert s.get("far").device_id == "d0"
    s.set_draining("d0")
    s.create("drained", LAYOUT, "t", "normal")
    assert s.place_near("drained", "aaaa") is None  # a draining device takes none


def test_prefix_affinity_places_sharers_together():
    s = state()
    s.create("a", LAYOUT, "t", "normal")
    s.create("filler", LAYOUT, "t", "normal")
    append(s, "a", [b"p1", b"p2", b"a3"], 12)
    first = s.get("a").device_id
    append(s, "filler", [b"x"], 4)  # the other device is now less loaded...
    s.create("b", LAYOUT, "t", "normal")
    s.create("c", LAYOUT, "t", "normal")
    # ...but b shares a's prefix, so it goes where that prefix is.
    assert s.place("b", [b"p1", b"p2", b"b3"]) == first
    no_affinity = state(prefix_affinity=False)
    no_affinity.create("a", LAYOUT, "t", "normal")
    no_affinity.create("b", LAYOUT, "t", "normal")
    append(no_affinity, "a", [b"p1"], 4)
    d = no_affinity.get("a").device_id
    assert no_affinity.place("b", [b"p1"]) != d


def test_placement_follows_what_a_device_holds_whoever_stored_it():
    """A prefix stored through another shard (this shard has no session on that device)
    still draws a session that shares it: the device's own block events say it is there."""
    s = state()
    for sid in ("a0", "a1"):  # one session of this shard on each device
        s.create(sid, LAYOUT, "t", "normal")
        append(s, sid, [sid.encode()], 4)
    # d1 is busier, so the least-loaded choice is d0; but d1's pool holds the prefix
    # (stored there by another shard's session).
    s.update_load("d1", 0.9)
    s.blocks.apply("d1", BlockEvents(epoch="epoch-d1", start=1, end=3,
                                     stored=(b"sys1", b"sys2")))
    assert s.blocks.depth("d1", [b"sys1", b"sys2"]) == 2
    s.create("b", LAYOUT, "t", "normal")
    s.create("c", LAYOUT, "t", "normal")
    assert s.place("b", [b"sys1", b"sys2", b"b3"]) == "d1"
    assert s.place("c", [b"unshared"]) == "d0"  # the least loaded, with nothing to share


def test_cluster_refcounts_report_garbage_only_when_nobody_holds_a_block():
    s = state()
    for sid in ("a", "b"):
        s.create(sid, LAYOUT, "t", "normal")
    assert append(s, "a", [b"p", b"a1"], 8) == []
    assert append(s, "b", [b"p", b"b1"], 8) == []
    assert s.refcount(b"p") == 2
    # a's partial tail replaced: the old tail is garbage, the prefix is not
    assert append(s, "a", [b"p", b"a2"], 8) == [b"a1"]
    assert s.delete("a") == [b"a2"]
    assert s.delete("b") == [b"p", b"b1"]
    with pytest.raises(UnknownSessionError):
        s.delete("b")


def test_hotness_decays_with_half_life():
    clock = Clock()
    s = state(clock=clock, hotness_half_life_s=10)
    s.create("a", LAYOUT, "t", "normal")
    s.touch("a")
    s.touch("a")
    assert s.hotness("a") == pytest.approx(2.0)
    clock.t = 10
    assert s.hotness("a") == pytest.approx(1.0)
    clock.t = 20
    s.touch("a")
    assert s.hotness("a") == pytest.approx(1.5)


def test_background_candidates_are_the_hottest_inactive_sessions():
    clock = Clock()
    s = state(clock=clock)
    for sid, touches in (("cold", 1), ("warm", 3), ("active", 9)):
        s.create(sid, LAYOUT, "t", "normal")
        append(s, sid, [sid.encode()], 4)
        for _ in range(touches):
            s.touch(sid)
    d = s.get("cold").device_id
    for sid in ("cold", "warm", "active"):
        s.get(sid).device_id = d
    s.record_state("cold", SessionState.ARCHIVED)
    s.record_state("warm", SessionState.SUSPENDED)
    assert s.background_candidates(d, limit=4) == ["warm", "cold"]


def test_lost_sessions_raise_block_lost():
    s = state()
    s.create("a", LAYOUT, "t", "normal")
    s.mark_lost("a", "device d0 restarted before ...")
    with pytest.raises(BlockLostError, match="restarted"):
        s.get("a")


def test_bad_input():
    s = state()
    with pytest.raises(InvalidInputError, match="priority"):
        s.create("a", LAYOUT, "t", "urgent")
    with pytest.raises(InvalidInputError):
        s.create("", LAYOUT, "t", "normal")
    with pytest.raises(InvalidInputError, match="layout"):
        s.create("a", {"model_id": "m"}, "t", "normal")
    s.create("a", LAYOUT, "t", "normal")
    with pytest.raises(InvalidInputError, match="already exists"):
        s.create("a", LAYOUT, "t", "normal")
    with pytest.raises(UnknownSessionError):
        s.get("nope")
    empty = RouterState()
    empty.create("x", LAYOUT, "t", "normal")
    with pytest.raises(MemkvError, match="no device"):
        empty.place("x")
    with pytest.raises(InvalidInputError):
        RouterState(hotness_half_life_s=0)


def test_the_journal_rebuilds_the_table_refcounts_and_namespaces(tmp_path):
    from memkv.storage.journal import Journal

    def fresh():
        return RouterState(clock=Clock(), journal=Journal(tmp_path / "router"))

    s = fresh()
    s.add_device("d0", "inc0")
    s.create("a", LAYOUT, "t", "normal")
    s.create("b", LAYOUT, "t", "high", durable=True)
    s.create("gone", LAYOUT, "t", "normal")
    append(s, "a", [b"p", b"a1"], 8)
    append(s, "b", [b"p", b"b1"], 8)
    append(s, "a", [b"p", b"a2"], 8)  # a's tail replaced
    s.record_state("b", SessionState.SUSPENDED)
    s.set_priority("a", "background")
    s.delete("gone")
    s.mark_lost("a", "disk on fire")
    s.journal.close()

    t = fresh()  # a restarted router
    assert t.known_devices == ["d0"]
    assert t.sessions.ids() == ["a", "b"]
    b = t.get("b")
    assert (b.chain, b.tokens, b.turn, b.state, b.durable) == (
        [b"p", b"b1"],
        8,
        1,
        SessionState.SUSPENDED,
        True,
    )
    a = t.sessions.lookup("a")
    assert a.lost_reason == "disk on fire" and a.priority.value == "background"
    assert a.chain == [b"p", b"a2"] and a.turn == 2 and a.device_id == "d0"
    assert t.refcount(b"p") == 2 and not t.referenced(b"a1") and t.referenced(b"a2")
    # Where a block sits is the devices' word, not the journal's: a restarted router
    # places it once it has read the device's log.
    assert t.locate([b"b1"], "t") == ({}, [b"b1"])
    t.add_device("d0", "inc0")
    t.blocks.apply("d0", BlockEvents(epoch="e", start=0, end=2, stored=(b"p", b"b1"),
                                     snapshot=True))
    assert t.locate([b"b1"], "t") == ({"d0": [b"b1"]}, [])
    with pytest.raises(UnknownBlockError):
        t.locate([b"b1"], "another-tenant")
    with pytest.raises(UnknownBlockError):
        t.locate([b"a1"], "t")  # no session holds it any more
    # The restart compacted the history into a snapshot; a third start reads the same.
    assert t.journal.records_since_snapshot == 0
    t.forget_device("d0")
    t.add_device("d1", "inc1")
    t.move("b", "d1")
    t.journal.close()
    u = fresh()
    assert u.get("b").device_id == "d1" and u.known_devices == ["d1"]
    u.add_device("d1", "inc1")
    u.blocks.apply("d1", BlockEvents(epoch="e1", start=0, end=1, stored=(b"b1",),
                                     snapshot=True))
    assert u.locate([b"b1"]) == ({"d1": [b"b1"]}, [])


def test_a_layout_is_parsed_once_and_a_look_alike_value_still_refused():
    s = state()
    s.create("a", dict(LAYOUT), "t", "normal")
    s.create("b", dict(LAYOUT), "t", "normal")
    assert s.get("a").layout is s.get("b").layout  # one parse for equal dicts
    # True == 1 and hashes alike: the cache must not hand back the layout of 1.
    one_layer = {**LAYOUT, "num_layers": 1}
    s.create("c", one_layer, "t", "normal")
    with pytest.raises(InvalidInputError, match="num_layers"):
        s.create("d", {**LAYOUT, "num_layers": True}, "t", "normal")
    with pytest.raises(InvalidInputError, match="model_id must be a str"):
        s.create("e", {**LAYOUT, "model_id": ["not", "hashable"]}, "t", "normal")
    with pytest.raises(InvalidInputError, match="expected a layout dict"):
        s.create("f", ["num_layers", 2], "t", "normal")
    assert s.sessions.ids() == ["a", "b", "c"]


def test_the_journal_is_rewritten_once_it_is_as_long_as_the_table(tmp_path):
    from memkv.storage.journal import Journal

    s = RouterState(clock=Clock(), journal=Journal(tmp_path / "router"))
    for i in range(30):
        s.create(f"s{i}", LAYOUT, "t", "normal")
    s.compact_journal(every=10)  # 30 records, 30 sessions: due
    assert s.journal.records_since_snapshot == 0
    for i in range(30, 50):
        s.create(f"s{i}", LAYOUT, "t", "normal")
    # 20 records past the snapshot, 50 sessions: a table that only grows has
    # nothing to fold (snapshot + journal are the table, once each).
    s.compact_journal(every=10)
    assert s.journal.records_since_snapshot == 20
    for i in range(29):
        s.set_priority(f"s{i}", "high")
    s.compact_journal(every=10)  # 49 records: not yet
    assert s.journal.records_since_snapshot == 49
    s.set_priority("s29", "high")
    s.compact_journal(every=10)  # 50 records, as long as the table: rewritten
    assert s.journal.records_since_snapshot == 0
    s.journal.close()
    restarted = RouterState(clock=Clock(), journal=Journal(tmp_path / "router"))
    assert len(restarted.sessions.ids()) == 50
    assert {restarted.get(f"s{i}").priority.value for i in range(30)} == {"high"}


def test_placement_names_only_live_devices_after_restarts(tmp_path):
    """Item 1 of [1/5]: a journal naming a previous run's device never places on it.

    Run 1 appends on ``old``; run 2 forgets ``old`` (gone with the machine),
    registers ``new`` and moves the session there; the router is killed and
    replays all of that (the lost session keeps ``old``, as lost ones do). The
    next new session must land on ``new``, and a session placed on a device
    that died before its first block is placed again.
    """
    from memkv.storage.journal import Journal

    def fresh():
        return RouterState(clock=Clock(), journal=Journal(tmp_path / "router"))

    run1 = fresh()
    run1.add_device("old", "inc-old")
    for sid in ("kept", "lost"):
        run1.create(sid, LAYOUT, "t", "normal")
        append(run1, sid, [sid.encode()], 4)
    run1.create("placed-only", LAYOUT, "t", "normal")
    run1.place("placed-only")
    run1.journal.close()

    run2 = fresh()
    run2.forget_device("old")
    run2.add_device("new", "inc-new")
    run2.move("kept", "new")
    run2.mark_lost("lost", "its device is gone")
    for i in range(3):  # the second run's own sessions: "new" is now the busier device
        run2.create(f"run2-{i}", LAYOUT, "t", "normal")
        append(run2, f"run2-{i}", [f"run2-{i}".encode()], 4)
    run2.journal.close()

    for replayed in (fresh(), fresh()):  # kill -9 of the router, twice
        replayed.add_device("new", "inc-new2")
        replayed.create("next", LAYOUT, "t", "normal")
        assert replayed.place("next", [b"x"]) == "new"
        assert replayed.place("placed-only") == "new"
        replayed.delete("next")
        replayed.journal.close()


def test_placement_with_no_live_device_says_so():
    s = RouterState(clock=Clock())
    s.create("a", LAYOUT, "t", "normal")
    with pytest.raises(MemkvError, match="no device"):
        s.place("a")


def test_a_truncated_session_keeps_its_prefix_and_the_journal_remembers(tmp_path):
    from memkv.storage.journal import Journal

    def fresh():
        return RouterState(clock=Clock(), journal=Journal(tmp_path / "router"))

    s = fresh()
    s.add_device("d0", "inc0")
    s.create("a", LAYOUT, "t", "normal")
    s.create("b", LAYOUT, "t", "normal")
    append(s, "a", [b"p", b"a1", b"a2"], 10)  # blocks of 4, 4, 2 tokens
    append(s, "b", [b"p", b"b1"], 8)
    with pytest.raises(InvalidInputError, match="keep_blocks"):
        s.truncate("a", 0, "nothing survives: that is mark_lost")
    garbage = s.truncate("a", 1, "device d0 restarted")
    assert sorted(garbage) == [b"a1", b"a2"]  # b still holds the shared block
    a = s.get("a")  # served, not lost
    assert (a.chain, a.tokens, a.lost_tokens, a.partial_reason) == (
        [b"p"], 4, 6, "device d0 restarted"
    )
    assert s.refcount(b"p") == 2 and not s.referenced(b"a1")
    assert s.match_prefix(KVLayout.from_dict(LAYOUT), "t", list(range(10)))[0] <= 4
    assert a.view().lost_tokens == 6
    s.journal.close()

    t = fresh()  # replayed (and compacted into a snapshot)
    a = t.get("a")
    assert (a.chain, a.tokens, a.lost_tokens, a.partial_reason) == (
        [b"p"], 4, 6, "device d0 restarted"
    )
    t.journal.close()
    u = fresh()  # read back from the snapshot
    assert (u.get("a").tokens, u.get("a").lost_tokens) == (4, 6)
    assert not u.referenced(b"a1")


def test_records_of_an_earlier_version_replay_and_a_corrupt_one_is_named(tmp_path):
    """The journal's records are typed now (memkv.router.records): the maps an earlier
    version wrote (no finite_only, no tail, a put naming no device) replay as before,
    and a record that does not decode is refused with the field it got wrong."""
    from memkv.errors import CorruptDataError
    from memkv.router.records import SessionCreated, decode_record, encode_record
    from memkv.storage.journal import Journal

    journal = Journal(tmp_path / "router")
    for entry in (
        {"op": "device", "name": "d0"},
        {"op": "create", "id": "old", "ns": "t", "layout": LAYOUT, "prio": "normal",
         "durable": True, "exact_only": False},
        {"op": "put", "id": "old", "chain": [b"p", b"q"], "tokens": 6, "turn": 1},
        {"op": "state", "id": "old", "state": "suspended"},
        {"op": "prio", "id": "old", "prio": "high"},
    ):
        journal.append(entry)
    journal.close()
    s = RouterState(clock=Clock(), journal=Journal(tmp_path / "router"))
    old = s.get("old")
    assert (old.chain, old.tokens, old.turn, old.state, old.priority.value, old.durable,
            old.finite_only, old.device_id) == ([b"p", b"q"], 6, 1, SessionState.SUSPENDED,
                                                 "high", True, False, None)
    # What is written now is the same map (defaults left out: older readers default them).
    assert encode_record(SessionCreated(id="x", ns="t", layout=LAYOUT, prio="normal")) == {
        "op": "create", "id": "x", "ns": "t", "layout": LAYOUT, "prio": "normal"}
    with pytest.raises(CorruptDataError, match="unknown|op"):
        decode_record({"op": "teleport", "id": "x"})
    with pytest.raises(CorruptDataError, match=r"\$\.tokens"):
        decode_record({"op": "put", "id": "x", "chain": [], "tokens": "six", "turn": 1})
