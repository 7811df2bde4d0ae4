"""Tests of memkv.storage.buddy: invariants under random alloc/free, misuse, profiles."""

from __future__ import annotations

import random
from typing import Any, NoReturn

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memkv.errors import AllocatorMisuseError, ConfigError, InvalidInputError
from memkv.storage.buddy import (
    _HEAP_REBUILD_MIN,
    _HEAP_STALE_FACTOR,
    BuddyAllocator,
    BuddyStats,
)
from memkv.storage.config import MIB, UNIT_PROFILES, AllocatorConfig


def _top_blocks(capacity: int, unit: int) -> list[tuple[int, int]]:
    """The top-level blocks a fully free allocator must coalesce back to, largest first."""
    units, offset, blocks = capacity // unit, 0, []
    for order in range(units.bit_length() - 1, -1, -1):
        if units >> order & 1:
            blocks.append((offset, unit << order))
            offset += unit << order
    return blocks


def _extent(nbytes: int, unit: int) -> int:
    units = -(-nbytes // unit)
    return unit << (units - 1).bit_length()


class _NoScanDict(dict[int, Any]):
    """A dict that fails any walk over its entries: alloc/free must never scan live extents."""

    def _scan(self, *args: object) -> NoReturn:
        raise AssertionError("the allocator scanned all live allocations")

    __iter__ = keys = values = items = _scan


class BuddyMachine(RuleBasedStateMachine):
    """Random allocs and frees against a model of what must hold."""

    @initialize(
        unit_shift=st.integers(min_value=0, max_value=12),
        units=st.integers(min_value=1, max_value=40),
    )
    def setup(self, unit_shift: int, units: int) -> None:
        self.unit = 1 << unit_shift
        self.capacity = units * self.unit
        self.buddy = BuddyAllocator(self.capacity, self.unit)
        self.buddy._live = _NoScanDict()  # structural O(log n) check, see _NoScanDict
        self.requests: dict[int, int] = {}
        self.full_seen = False

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        # Mostly small requests, so the arena fills up in interesting ways.
        top = self.buddy.max_alloc_bytes
        limit = min(top, data.draw(st.sampled_from([self.unit, 4 * self.unit, top])))
        nbytes = data.draw(st.integers(min_value=1, max_value=limit))
        offset = self.buddy.alloc(nbytes)
        extent = _extent(nbytes, self.unit)
        if offset is None:
            # "Full" must be true: no free block can hold the request.
            assert all(size < extent for _, size in self.buddy.free_blocks())
            self.full_seen = True
            return
        assert offset not in self.requests
        assert self.buddy.size_of(offset) == extent
        assert self.buddy.requested_of(offset) == nbytes
        assert offset % extent == 0 and 0 <= offset and offset + extent <= self.capacity
        self.requests[offset] = nbytes

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.requests)))
        self.buddy.free(offset)
        del self.requests[offset]
        with pytest.raises(AllocatorMisuseError):
            self.buddy.free(offset)
        with pytest.raises(AllocatorMisuseError):
            self.buddy.size_of(offset)

    @invariant()
    def extents_tile_the_arena(self) -> None:
        # Live extents and free blocks never overlap and together cover every byte.
        pieces = sorted(
            [(o, _extent(n, self.unit)) for o, n in self.requests.items()]
            + self.buddy.free_blocks()
        )
        cursor = 0
        for offset, size in pieces:
            assert offset == cursor, f"gap or overlap at {cursor}: {pieces}"
            assert offset % size == 0
            cursor += size
        assert cursor == self.capacity

    @invariant()
    def stats_agree(self) -> None:
        s = self.buddy.stats()
        allocated = sum(_extent(n, self.unit) for n in self.requests.values())
        requested = sum(self.requests.values())
        free_sizes = [size for _, size in self.buddy.free_blocks()]
        assert s.capacity_bytes == self.capacity
        assert s.allocated_bytes == allocated
        assert s.requested_bytes == requested
        assert s.free_bytes == self.capacity - allocated == sum(free_sizes)
        assert s.largest_free_bytes == max(free_sizes, default=0)
        assert s.live_allocations == len(self.requests)
        assert s.occupancy == pytest.approx(allocated / self.capacity)
        if s.free_bytes:
            expected = 1 - s.largest_free_bytes / s.free_bytes
            assert s.external_fragmentation == pytest.approx(expected)
        else:
            assert s.external_fragmentation == 0.0
        if allocated:
            assert s.internal_fragmentation == pytest.approx(1 - requested / allocated)
        else:
            assert s.internal_fragmentation == 0.0

    def teardown(self) -> None:
        if not hasattr(self, "buddy"):
            return
        for offset in list(self.requests):
            self.buddy.free(offset)
        # Fully freed: everything coalesced back into the top-level blocks.
        assert self.buddy.free_blocks() == sorted(_top_blocks(self.capacity, self.unit))
        s = self.buddy.stats()
        assert s.largest_free_bytes == _top_blocks(self.capacity, self.unit)[0][1]
        assert s.free_bytes == self.capacity and s.live_allocations == 0


BuddyMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBuddyMachine = BuddyMachine.TestCase


@pytest.mark.parametrize("units", [1, 2, 8, 13, 31, 64])
def test_power_of_two_capacity_coalesces_to_whole(units: int) -> None:
    unit = 4096
    buddy = BuddyAllocator(units * unit, unit)
    offsets = []
    while (o := buddy.alloc(unit)) is not None:
        offsets.append(o)
    assert len(offsets) == units  # every unit usable
    assert buddy.stats().free_bytes == 0 and buddy.stats().external_fragmentation == 0.0
    random.Random(units).shuffle(offsets)
    for o in offsets:
        buddy.free(o)
    assert buddy.free_blocks() == sorted(_top_blocks(units * unit, unit))
    if units & (units - 1) == 0:
        assert buddy.stats().largest_free_bytes == units * unit


def test_non_power_of_two_capacity_top_blocks() -> None:
    unit = 1 << 20
    buddy = BuddyAllocator(13 * unit, unit)  # 8 + 4 + 1 units
    assert buddy.free_blocks() == [(0, 8 * unit), (8 * unit, 4 * unit), (12 * unit, unit)]
    assert buddy.max_alloc_bytes == 8 * unit
    with pytest.raises(AllocatorMisuseError, match="largest extent"):
        buddy.alloc(9 * unit)  # fits the capacity, but no block can ever hold it
    a = buddy.alloc(8 * unit)
    b = buddy.alloc(4 * unit)
    c = buddy.alloc(unit)
    assert (a, b, c) == (0, 8 * unit, 12 * unit)
    assert buddy.alloc(1) is None
    for o in (b, a, c):
        assert o is not None
        buddy.free(o)
    assert buddy.stats().largest_free_bytes == 8 * unit


def test_lowest_address_first_and_split() -> None:
    unit = 4096
    buddy = BuddyAllocator(16 * unit, unit)
    assert buddy.alloc(1) == 0
    # The split left free blocks of 1, 2, 4 and 8 units behind the first unit.
    assert buddy.free_blocks() == [
        (unit, unit),
        (2 * unit, 2 * unit),
        (4 * unit, 4 * unit),
        (8 * unit, 8 * unit),
    ]
    assert buddy.alloc(3 * unit) == 4 * unit  # rounded to 4 units
    assert buddy.size_of(4 * unit) == 4 * unit
    assert buddy.alloc(unit) == unit


def test_full_returns_none_not_error() -> None:
    buddy = BuddyAllocator(4 * 4096, 4096)
    assert buddy.alloc(4 * 4096) == 0
    assert buddy.alloc(1) is None
    buddy.free(0)
    assert buddy.alloc(1) == 0


def test_fragmented_returns_none_although_bytes_are_free() -> None:
    unit = 4096
    buddy = BuddyAllocator(4 * unit, unit)
    offsets = [o for _ in range(4) if (o := buddy.alloc(unit)) is not None]
    assert len(offsets) == 4
    buddy.free(offsets[1])
    buddy.free(offsets[3])
    s = buddy.stats()
    assert s.free_bytes == 2 * unit and s.largest_free_bytes == unit
    assert s.external_fragmentation == pytest.approx(0.5)
    assert buddy.alloc(2 * unit) is None  # not buddies: 1 and 3 never merge


@pytest.mark.parametrize("nbytes", [0, -1, -4096, 1.5, "4096", None, True, 4 * 4096 + 1])
def test_bad_sizes_are_misuse(nbytes: Any) -> None:
    buddy = BuddyAllocator(4 * 4096, 4096)
    with pytest.raises(AllocatorMisuseError):
        buddy.alloc(nbytes)
    assert buddy.stats().live_allocations == 0


def test_misuse_is_a_value_error() -> None:
    buddy = BuddyAllocator(4096, 4096)
    with pytest.raises(ValueError):
        buddy.alloc(0)
    with pytest.raises(InvalidInputError):
        buddy.free(0)


@pytest.mark.parametrize("offset", [4096, 1, -4096, 8 * 4096, 2.0, "0", None, False])
def test_foreign_or_unaligned_offsets_are_misuse(offset: Any) -> None:
    buddy = BuddyAllocator(8 * 4096, 4096)
    assert buddy.alloc(2 * 4096) == 0  # 4096 lies inside this extent but is not its start
    with pytest.raises(AllocatorMisuseError):
        buddy.free(offset)
    with pytest.raises(AllocatorMisuseError):
        buddy.size_of(offset)
    assert buddy.stats().live_allocations == 1


def test_double_free_is_misuse() -> None:
    buddy = BuddyAllocator(8 * 4096, 4096)
    a = buddy.alloc(4096)
    assert a is not None
    buddy.free(a)
    with pytest.raises(AllocatorMisuseError, match="double free"):
        buddy.free(a)
    assert buddy.stats().free_bytes == 8 * 4096


@pytest.mark.parametrize(
    ("capacity", "unit"),
    [
        (0, 4096),
        (-4096, 4096),
        (4096 + 1, 4096),
        (3 * 4096, 3000),
        (4096, 0),
        (4096.0, 4096),
        (4096, True),
    ],
)
def test_bad_construction_is_config_error(capacity: Any, unit: Any) -> None:
    with pytest.raises(ConfigError):
        BuddyAllocator(capacity, unit)


@pytest.mark.parametrize("profile", sorted(UNIT_PROFILES))
def test_profiles_build_allocators(profile: str) -> None:
    unit = AllocatorConfig(min_unit_bytes=UNIT_PROFILES[profile]).min_unit_bytes
    buddy = BuddyAllocator(6 * unit, unit)
    assert buddy.min_unit_bytes == unit and buddy.capacity_bytes == 6 * unit
    a = buddy.alloc(1)
    b = buddy.alloc(unit + 1)  # two units
    assert a is not None and b is not None
    assert buddy.size_of(a) == unit and buddy.size_of(b) == 2 * unit
    assert b % (2 * unit) == 0


def test_profile_units_differ() -> None:
    assert UNIT_PROFILES["h100"] == 8 * MIB
    assert UNIT_PROFILES["edge"] == 1 * MIB
    assert AllocatorConfig().min_unit_bytes == 4 * MIB


def test_huge_capacity_is_logarithmic_in_structure() -> None:
    # 1 PiB of 4 MiB units: 2**28 units. Set-up, alloc and free touch one free
    # list per order, so this stays tiny; a per-unit structure would not.
    unit = 4 * MIB
    capacity = 1 << 50
    buddy = BuddyAllocator(capacity, unit)
    assert buddy.free_blocks() == [(0, capacity)]
    a = buddy.alloc(1)
    assert a == 0
    assert len(buddy.free_blocks()) == 28  # one buddy left behind per split
    buddy.free(a)
    assert buddy.free_blocks() == [(0, capacity)]


def test_stale_heap_entries_stay_bounded() -> None:
    # Merging leaves stale heap entries; the free lists must not grow without bound.
    unit = 4096
    buddy = BuddyAllocator(256 * unit, unit)
    buddy._live = _NoScanDict()
    rng = random.Random(7)
    live: list[int] = []
    for _ in range(4000):
        if live and rng.random() < 0.5:
            buddy.free(live.pop(rng.randrange(len(live))))
        else:
            o = buddy.alloc(rng.choice([1, unit, 3 * unit, 8 * unit]))
            if o is not None:
                live.append(o)
    for free_list in buddy._free:
        bound = max(_HEAP_REBUILD_MIN, _HEAP_STALE_FACTOR * (len(free_list.members) + 1))
        assert len(free_list.heap) <= bound + 1


def test_stats_is_a_frozen_snapshot() -> None:
    buddy = BuddyAllocator(4 * 4096, 4096)
    s = buddy.stats()
    assert isinstance(s, BuddyStats)
    buddy.alloc(100)
    assert s.allocated_bytes == 0 and buddy.stats().allocated_bytes == 4096
    assert buddy.stats().internal_fragmentation == pytest.approx(1 - 100 / 4096)
    with pytest.raises(AttributeError):
        s.free_bytes = 0  # type: ignore[misc]
