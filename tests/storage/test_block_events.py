"""The block pool's change log: what a reader following a device learns of its table."""

from memkv.router.block_index import BlockIndex
from memkv.storage.block_events import BlockEventLog


def test_changes_since_a_cursor_are_net_per_key():
    log = BlockEventLog("epoch-1")
    log.stored(b"a")
    log.stored(b"b")
    first = log.since(0, "epoch-1", lambda: [b"a", b"b"])
    assert (first.stored, first.removed, first.end, first.snapshot) == ((b"a", b"b"), (), 2, False)
    log.removed(b"a")
    log.stored(b"c")
    log.removed(b"c")  # stored and removed between two reads: only the removal counts
    log.stored(b"a")  # removed and stored again: present
    later = log.since(first.end, "epoch-1", lambda: [b"a", b"b"])
    assert set(later.stored) == {b"a"} and set(later.removed) == {b"c"} and later.end == 6


def test_a_reader_too_far_behind_or_of_another_epoch_gets_the_whole_table():
    log = BlockEventLog("epoch-2", keep=2)
    for key in (b"a", b"b", b"c"):
        log.stored(key)
    behind = log.since(0, "epoch-2", lambda: [b"a", b"b", b"c"])
    assert behind.snapshot and set(behind.stored) == {b"a", b"b", b"c"}
    restarted = log.since(3, "epoch-1", lambda: [b"c"])  # a cursor of the old process
    assert restarted.snapshot and restarted.stored == (b"c",) and restarted.epoch == "epoch-2"


def test_an_index_following_the_log_holds_what_the_table_holds():
    log, index = BlockEventLog("e"), BlockIndex()
    table: set[bytes] = set()

    def change(key: bytes, present: bool) -> None:
        (table.add if present else table.discard)(key)
        (log.stored if present else log.removed)(key)

    for step, (key, present) in enumerate([(b"p1", True), (b"p2", True), (b"x", True),
                                           (b"x", False), (b"p2", False), (b"p3", True)]):
        change(key, present)
        if step % 2:
            epoch, cursor = index.cursor("d0")
            index.apply("d0", log.since(cursor, epoch, lambda: sorted(table)))
    assert {k for k in (b"p1", b"p2", b"p3", b"x") if index.holds("d0", k)} == table
    assert index.depth("d0", [b"p1", b"p3", b"p2"]) == 2
    index.forget("d0")
    assert index.depth("d0", [b"p1"]) == 0 and index.cursor("d0") == ("", 0)


def test_answers_arriving_out_of_order_never_take_the_index_back():
    log, index = BlockEventLog("e"), BlockIndex()
    log.stored(b"a")
    older = log.since(0, "e", lambda: [b"a"])  # two puts asked from the same cursor...
    log.removed(b"a")
    log.stored(b"b")
    newer = log.since(0, "e", lambda: [b"b"])
    index.apply("d0", log.since(0, "", lambda: [b"b"]))  # (a snapshot: the first contact)
    index.apply("d0", newer)
    index.apply("d0", older)  # ...and the older answer came last: skipped
    assert not index.holds("d0", b"a") and index.holds("d0", b"b")
    assert index.cursor("d0") == ("e", 3)
