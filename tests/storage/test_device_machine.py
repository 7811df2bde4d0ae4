"""The device's block store against a model, under random appends, reads, leases,
suspends, deletes and restarts (a hypothesis state machine).

The model is what the owners of sessions know (two router shards, each with its
own references on the device): each session's tokens, whether it is active,
and the leases readers hold. From it alone follow which blocks
the store must keep (every live session's chain, and every block a lease still
pins: a pin outlives a delete) and what their bytes are (a block's content is a
function of its key, so a deduplicated block reads the same for every holder).
The store runs with ``debug_refcounts``, so its own reference invariants are
checked after every call too. Tiers are tiny, so appends demote and evict.
"""

import hashlib
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from memkv.device import DeviceService
from memkv.errors import BlockLostError, CapacityError
from memkv.protocol.enums import Priority, SessionState
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.layout import block_token_count
from memkv.protocol.members import Holder
from memkv.router.block_index import BlockIndex
from memkv.router.sessions import SessionRecord, SessionTable
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import KVLayout
from memkv.storage.payloads import from_payload, to_payload

LAYOUT = KVLayout("machine", 1, 1, 4, dtype="float32", block_tokens=4)
UNIT = 4096
#: Two shared prompts: sessions that start with one share its blocks.
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9])
#: Two router shards, each with its own references on the device.
OWNERS = ("shard-0", "shard-1")


def block_for(key: bytes, tokens: int) -> torch.Tensor:
    """A block's content, derived from its key (the same key: the same bytes)."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return torch.randn(shape, generator=g)


class DeviceMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.owners = {name: SessionTable() for name in OWNERS}
        self.owner_of: dict[str, str] = {}
        self.tokens: dict[str, list[int]] = {}
        self.pinned: dict[str, list[bytes]] = {}  # open lease -> the keys it pins
        self.next_id = 0
        self.device: DeviceService | None = None
        self._recorded_everything = True
        self.index = BlockIndex()

    @initialize()
    def start(self) -> None:
        self.directory = _tmp_factory.mktemp("device-machine")
        self.device = self._open()

    def _open(self) -> DeviceService:
        cfg = StoreConfig(
            hot_capacity_bytes=2 * UNIT,
            warm_capacity_bytes=2 * UNIT,
            allocator=AllocatorConfig(min_unit_bytes=UNIT),
            archive=ArchiveConfig(directory=self.directory, fsync="never"),
            debug_refcounts=True,
        )
        # Named per process: its warm segment's name is the device's (one per node).
        return DeviceService(f"dev-machine-{os.getpid()}", cfg)

    def teardown(self) -> None:
        if self.device is not None:
            self.device.close()

    # -- what the model says the store holds -----------------------------------------

    def chain(self, sid: str) -> list[bytes]:
        return [bytes(k) for k in chain_hashes(self.tokens[sid], LAYOUT, "t")]

    def expected_keys(self) -> set[bytes]:
        held = {k for sid in self.tokens for k in self.chain(sid)}
        return held | {k for keys in self.pinned.values() for k in keys}

    # -- rules -------------------------------------------------------------------------

    def record(self, sid: str) -> SessionRecord:
        return self.owners[self.owner_of[sid]].get(sid)

    def _append(self, sid: str, tokens: list[int], *, recorded: bool = True) -> None:
        """One append; ``recorded`` False: the owner died before it recorded the append
        the device applied (its table, the truth, still has the turn before)."""
        assert self.device is not None
        name = self.owner_of[sid]
        owner = self.owners[name]
        old = self.chain(sid) if sid in self.tokens else []
        chain = [bytes(k) for k in chain_hashes(tokens, LAYOUT, "t")]
        start = 0
        while start < min(len(old), len(chain)) and old[start] == chain[start]:
            start += 1
        counts = block_token_count(LAYOUT, len(tokens))
        update = owner.plan_append(sid, len(tokens), chain, start)
        payloads = [to_payload(k, block_for(k, n))
                    for k, n in zip(chain[start:], counts[start:], strict=True)]
        try:
            self.device.put(update, payloads, owner=name, durable=owner.get(sid).durable)
        except CapacityError:
            # Every tier is full of pinned blocks: refused, and nothing changed
            # (the invariants check that the store still holds what it held).
            return
        if recorded:
            owner.commit_append(sid, update)
            self.tokens[sid] = tokens

    @rule(prompt=st.sampled_from(PROMPTS), own=st.integers(0, 9), owner=st.sampled_from(OWNERS),
          mode=st.sampled_from(["plain", "exact_only", "durable"]),
          priority=st.sampled_from(list(Priority)))
    def create(self, prompt: list[int], own: int, owner: str, mode: str,
               priority: Priority) -> None:
        """A new session; ``exact_only`` ones start with a prompt of their own (their blocks
        are shared with no session that may take a lossy step), ``durable`` ones are
        acknowledged only once every block is in the archive."""
        sid = f"s{self.next_id}"
        self.next_id += 1
        if mode == "exact_only":
            prompt = [1000 + self.next_id]
        self.owners[owner].create(sid, LAYOUT, namespace="t", priority=priority,
                                  exact_only=mode == "exact_only", durable=mode == "durable")
        self.owner_of[sid] = owner
        self._append(sid, prompt + [100 + self.next_id * 10 + i for i in range(own)])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 6))
    def extend(self, data: st.DataObject, more: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[sid]
        self._append(sid, tokens + [200 + len(tokens) + i for i in range(more)])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 6))
    def append_then_owner_restarts(self, data: st.DataObject, more: int) -> None:
        """The device applies an append its owner never recorded; the owner restarts and
        sets its references from its table (``resync``): the unrecorded ones go."""
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[sid]
        self._append(sid, tokens + [300 + len(tokens) + i for i in range(more)], recorded=False)
        self._recorded_everything = False
        self._resync(self.owner_of[sid])
        self._recorded_everything = True

    @rule(owner=st.sampled_from(OWNERS))
    def owner_restarts(self, owner: str) -> None:
        self._resync(owner)

    def _resync(self, name: str) -> None:
        assert self.device is not None
        mine = [s for s in sorted(self.tokens) if self.owner_of[s] == name]
        holders = [
            Holder(LAYOUT, self.chain(s), block_token_count(LAYOUT, len(self.tokens[s])),
                   self.record(s).active, self.record(s).priority)
            for s in mine
        ]
        lost = self.device.resync(holders, name)
        # Lost: a session whose recorded chain names a block the unrecorded append
        # replaced (its old partial tail) and that no tier kept; it holds nothing now.
        if self._recorded_everything:
            assert lost == []
        for i in lost:
            sid = mine[i]
            self.owners[name].pop(sid)
            del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        chain = self.chain(sid)
        counts = block_token_count(LAYOUT, len(self.tokens[sid]))
        got = self.device.get_blocks(chain, sid)
        for key, n, payload in zip(chain, counts, got, strict=True):
            assert payload.key == key
            block = from_payload(payload)
            if payload.exact:
                assert torch.equal(block, block_for(key, n)), key.hex()
            else:  # an offline suspend's lossy codec, or a lower precision: said so
                assert not self.record(sid).exact_only, f"{sid} is exact_only: {payload.lossy}"
                assert payload.lossy and block.shape == block_for(key, n).shape

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), priority=st.sampled_from(list(Priority)))
    def set_priority(self, data: st.DataObject, priority: Priority) -> None:
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.device.set_priority(self.chain(sid), priority.value, sid)
        self.record(sid).priority = priority

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        """Prefetch brings blocks into free hot space only: it never changes what is held."""
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        assert 0 <= self.device.prefetch(self.chain(sid)) <= len(set(self.chain(sid)))

    @precondition(lambda self: self.tokens)
    @rule(target=leases, data=st.data(), planned=st.booleans())
    def lease(self, data: st.DataObject, planned: bool) -> str:
        """A reader pins a session's blocks: a same-node read plan, or a streaming read's hold."""
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        chain = self.chain(sid)
        if planned:
            plan = self.device.read_plan(chain, ttl_s=600)
            keys = [e.key for e in plan.entries if e is not None]
            lease_id = plan.lease_id
        else:
            lease_id, keys = self.device.hold_for_read(chain, ttl_s=600), chain
        self.pinned[lease_id] = keys
        return lease_id

    @rule(lease_id=consumes(leases))
    def release_lease(self, lease_id: str) -> None:
        assert self.device is not None
        released = self.device.release_lease(lease_id)
        # A restart ended every lease of the old process: those are no longer known.
        assert released == (lease_id in self.pinned)
        self.pinned.pop(lease_id, None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), offline=st.booleans())
    def suspend(self, data: st.DataObject, offline: bool) -> None:
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        record = self.record(sid)
        self.device.deactivate(self.chain(sid), offline=offline, was_active=record.active,
                               owner=self.owner_of[sid])
        record.state = SessionState.SUSPENDED

    @precondition(lambda self: any(not self.record(s).active for s in self.tokens))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(s for s in self.tokens
                                               if not self.record(s).active)))
        tiers = self.device.activate(self.chain(sid), self.owner_of[sid])
        assert [k for k, _, _ in tiers] == self.chain(sid)
        self.record(sid).state = SessionState.ACTIVE

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        assert self.device is not None
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        record = self.owners[self.owner_of[sid]].pop(sid)
        self.device.release(self.chain(sid), record.active, self.owner_of[sid])
        del self.tokens[sid]

    @rule()
    def restart(self) -> None:
        """The device process dies and comes back: memory and leases are gone; the owner
        holds each session again from the archive, keeping the leading blocks that are
        there (an active session's blocks that never went cold are lost)."""
        assert self.device is not None
        self.device.close()
        self.device = self._open()
        self.pinned.clear()
        for sid in sorted(self.tokens):
            record = self.record(sid)
            chain = self.chain(sid)
            counts = block_token_count(LAYOUT, len(self.tokens[sid]))
            try:
                kept = self.device.adopt(LAYOUT, chain, counts, record.priority.value,
                                         exact_only=record.exact_only,
                                         owner=self.owner_of[sid], keep_prefix=True)
            except BlockLostError:
                assert not record.durable, f"{sid} was acknowledged in archive mode"
                self.owners[self.owner_of[sid]].pop(sid)
                del self.tokens[sid]
                continue
            if kept < len(chain):
                assert not record.durable, f"{sid} lost blocks {kept}.. of an archive-mode session"
                self.tokens[sid] = self.tokens[sid][: sum(counts[:kept])]
                record.chain = [k for k in record.chain[:kept]]
                record.tokens = len(self.tokens[sid])
            record.state = SessionState.SUSPENDED  # adopted chains are held inactive

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def keeps_exactly_what_is_held_or_pinned(self) -> None:
        if self.device is None:
            return
        expected = self.expected_keys()
        assert self.device.stats().blocks == len(expected)
        assert set(self.device.still_held(sorted(expected))) == expected
        # A reader following the device's block events (a router shard's index) sees
        # the same table, across restarts (a new epoch answers a snapshot).
        self.index.apply("dev", self.device.block_events(self.index.cursor("dev")))
        assert self.index.held("dev") == expected


_tmp_factory: pytest.TempPathFactory


@pytest.fixture(autouse=True)
def _tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    global _tmp_factory
    _tmp_factory = tmp_path_factory


DeviceMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
test_device_store_matches_its_model = DeviceMachine.TestCase
