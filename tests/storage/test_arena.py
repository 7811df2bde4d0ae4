"""Tests of memkv.storage.arena: slab + buddy invariants, views, shared memory across processes."""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memkv.errors import (
    AllocatorMisuseError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    LayoutMismatchError,
)
from memkv.shm.same_node import SegmentMaps
from memkv.storage.arena import ALIGNMENT_BYTES, Allocation, Arena, ArenaStats
from memkv.storage.config import UNIT_PROFILES, AllocatorConfig
from memkv.storage.device_arena import DeviceArena
from memkv.storage.shm_arena import SharedHostArena

UNIT = 4096  # the smallest unit AllocatorConfig accepts: keeps the arenas tiny
SHM_DIR = Path("/dev/shm")
needs_dev_shm = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs Linux /dev/shm")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _segment_exists(name: str) -> bool:
    return (SHM_DIR / name).exists()


def _mapped_in_this_process(name: str) -> bool:
    return f"/{name}" in Path("/proc/self/maps").read_text()


@pytest.fixture
def shared_arena() -> Iterator[Callable[..., SharedHostArena]]:
    """Makes SharedHostArenas; closes them and checks that no segment is left behind."""
    made: list[SharedHostArena] = []

    def make(*args: Any, **kwargs: Any) -> SharedHostArena:
        arena = SharedHostArena(*args, **kwargs)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        arena.close()
        if SHM_DIR.is_dir():
            assert not _segment_exists(arena.name), f"segment {arena.name} leaked"


def _extent(nbytes: int) -> int:
    units = -(-nbytes // UNIT)
    return UNIT << (units - 1).bit_length()


class ArenaMachine(RuleBasedStateMachine):
    """Mixed slab and buddy allocations, each filled with its own bytes."""

    @initialize(
        units=st.integers(min_value=2, max_value=24),
        classes=st.sampled_from([None, 1, 4]),
    )
    def setup(self, units: int, classes: int | None) -> None:
        self.arena = DeviceArena(units * UNIT, UNIT, slab_classes_per_doubling=classes)
        self.expected: dict[Allocation, torch.Tensor] = {}
        self.seed = 0

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        small = st.integers(min_value=1, max_value=UNIT // 2)
        large = st.integers(min_value=UNIT // 2 + 1, max_value=self.arena.max_alloc_bytes)
        nbytes = data.draw(st.one_of(small, small, large))
        a = self.arena.allocate(nbytes)
        if a is None:
            # "Full" must be true: a large request has no free extent, and a
            # small one has neither a partial slab nor a free unit.
            assert self.arena.stats().largest_free_bytes < (
                UNIT if nbytes <= UNIT // 2 else _extent(nbytes)
            )
            return
        assert a.nbytes == nbytes
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        view = self.arena.write(a, payload)
        assert view.data_ptr() == self.arena.buffer.data_ptr() + a.offset  # a view, no copy
        self.expected[a] = payload

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(sorted(self.expected, key=lambda x: x.offset)))
        self.arena.free(a)
        del self.expected[a]
        with pytest.raises(AllocatorMisuseError):
            self.arena.free(a)

    @invariant()
    def no_overlap_aligned_inside(self) -> None:
        cursor = 0
        for a in sorted(self.expected, key=lambda x: x.offset):
            assert a.offset % ALIGNMENT_BYTES == 0
            assert a.offset >= cursor, "two live allocations overlap"
            cursor = a.offset + a.nbytes
        assert cursor <= self.arena.capacity_bytes

    @invariant()
    def nothing_clobbered(self) -> None:
        for a, payload in self.expected.items():
            assert torch.equal(self.arena.view(a, (a.nbytes,), torch.uint8), payload)

    @invariant()
    def stats_agree(self) -> None:
        s = self.arena.stats()
        large = [a for a in self.expected if a.nbytes > UNIT // 2]
        used = sum(a.nbytes for a in self.expected)
        reserved = s.slabs * UNIT + sum(_extent(a.nbytes) for a in large)
        assert s.used_bytes == used
        assert s.live_allocations == len(self.expected)
        assert s.reserved_bytes == reserved
        assert s.free_bytes == s.capacity_bytes - reserved
        assert s.occupancy == pytest.approx(reserved / s.capacity_bytes)
        assert 0.0 <= s.internal_fragmentation < 1.0
        assert 0.0 <= s.external_fragmentation < 1.0
        # Every slab holds at least one live allocation: empty ones went back.
        slab_units = {a.offset // UNIT for a in self.expected if a.nbytes <= UNIT // 2}
        assert s.slabs == len(slab_units)

    def teardown(self) -> None:
        if not hasattr(self, "arena"):
            return
        for a in list(self.expected):
            self.arena.free(a)
        s = self.arena.stats()
        assert (s.used_bytes, s.reserved_bytes, s.slabs, s.live_allocations) == (0, 0, 0, 0)
        assert s.largest_free_bytes == self.arena.max_alloc_bytes  # fully coalesced
        self.arena.close()


ArenaMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestArenaMachine = ArenaMachine.TestCase


# -- slab layer -------------------------------------------------------------------------


def test_small_allocations_share_a_slab_and_it_returns_when_empty() -> None:
    with DeviceArena(4 * UNIT, UNIT) as arena:
        a = arena.allocate(100)
        b = arena.allocate(200)  # same 256-byte class
        c = arena.allocate(300)  # another class: another slab
        assert a is not None and b is not None and c is not None
        assert a.offset // UNIT == b.offset // UNIT != c.offset // UNIT
        assert b.offset - a.offset == ALIGNMENT_BYTES
        s = arena.stats()
        assert (s.slabs, s.reserved_bytes, s.used_bytes) == (2, 2 * UNIT, 600)
        arena.free(a)
        assert arena.stats().slabs == 2
        arena.free(b)
        assert arena.stats().slabs == 1 and arena.stats().reserved_bytes == UNIT
        arena.free(c)
        assert arena.stats().reserved_bytes == 0
        assert arena.stats().largest_free_bytes == 4 * UNIT


def test_slab_fills_then_spills_to_a_new_slab() -> None:
    with DeviceArena(2 * UNIT, UNIT) as arena:
        slot = UNIT // 2  # the largest slab class: two slots per slab
        allocations = [arena.allocate(slot) for _ in range(4)]
        live = [a for a in allocations if a is not None]
        assert len(live) == 4 and arena.stats().slabs == 2
        assert arena.allocate(slot) is None  # both slabs full, no unit left
        assert arena.allocate(1) is None  # another class needs a unit of its own
        arena.free(live[1])
        again = arena.allocate(slot)
        assert again is not None and again.offset == live[1].offset


def test_request_above_half_a_unit_gets_its_own_extent() -> None:
    with DeviceArena(8 * UNIT, UNIT) as arena:
        a = arena.allocate(UNIT // 2 + 1)
        assert a is not None and a.offset % UNIT == 0
        s = arena.stats()
        assert (s.slabs, s.reserved_bytes) == (0, UNIT)
        b = arena.allocate(3 * UNIT)
        assert b is not None and arena.stats().reserved_bytes == UNIT + 4 * UNIT


def test_size_classes_per_doubling_share_slabs() -> None:
    unit = 4 * UNIT
    sizes = [2304, 2816, 3328, 3840]  # four distinct 256-byte classes
    with (
        DeviceArena(16 * unit, unit) as exact,
        DeviceArena(16 * unit, unit, slab_classes_per_doubling=1) as coarse,
    ):
        for n in sizes:
            assert exact.allocate(n) is not None
            assert coarse.allocate(n) is not None
        assert exact.stats().slabs == len(sizes)
        assert coarse.stats().slabs == 1  # all round up to 4096: one class, four slots
        assert coarse.stats().used_bytes == exact.stats().used_bytes


# -- misuse -----------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, -1, 2.0, "1", None, True, 8 * UNIT + 1])
def test_bad_sizes_are_misuse(nbytes: Any) -> None:
    with DeviceArena(8 * UNIT, UNIT) as arena:
        with pytest.raises(AllocatorMisuseError):
            arena.allocate(nbytes)
        assert arena.stats().live_allocations == 0


def test_full_returns_none() -> None:
    with DeviceArena(2 * UNIT, UNIT) as arena:
        big = arena.allocate(2 * UNIT)
        assert big is not None
        assert arena.allocate(UNIT) is None  # buddy path
        assert arena.allocate(10) is None  # slab path: no unit for a slab
        arena.free(big)
        assert arena.allocate(10) is not None


def test_double_free_and_stale_handles_are_misuse() -> None:
    with DeviceArena(4 * UNIT, UNIT) as arena:
        for nbytes in (100, 2 * UNIT):
            a = arena.allocate(nbytes)
            assert a is not None
            arena.free(a)
            with pytest.raises(AllocatorMisuseError, match="not a live allocation"):
                arena.free(a)
            b = arena.allocate(nbytes)  # reuses the same offset
            assert b is not None and b.offset == a.offset
            with pytest.raises(AllocatorMisuseError):
                arena.free(a)  # the stale handle must not free b
            with pytest.raises(AllocatorMisuseError):
                arena.view(a, (nbytes,), torch.uint8)
            assert arena.stats().live_allocations == 1
            arena.free(b)


def test_foreign_allocations_are_misuse() -> None:
    with DeviceArena(4 * UNIT, UNIT) as one, DeviceArena(4 * UNIT, UNIT) as other:
        a = one.allocate(100)
        b = other.allocate(100)
        assert a is not None and b is not None and a.offset == b.offset
        with pytest.raises(AllocatorMisuseError):
            one.free(b)
        with pytest.raises(AllocatorMisuseError):
            one.free(Allocation(a.offset, a.nbytes))  # forged
        with pytest.raises(AllocatorMisuseError):
            one.free(a.offset)  # type: ignore[arg-type]
        one.free(a)
        other.free(b)


def test_bad_construction() -> None:
    with pytest.raises(ConfigError):
        DeviceArena(UNIT + 1, UNIT)
    with pytest.raises(ConfigError):
        DeviceArena(4 * ALIGNMENT_BYTES, ALIGNMENT_BYTES)  # a unit must hold two slots
    with pytest.raises(ConfigError):
        DeviceArena(4 * UNIT, UNIT, slab_classes_per_doubling=3)
    with pytest.raises(InvalidInputError):
        DeviceArena(4 * UNIT, UNIT, device="no-such-device")
    with pytest.raises(TypeError):
        Arena(torch.empty(UNIT, dtype=torch.uint8), UNIT)  # type: ignore[abstract]


# -- views ------------------------------------------------------------------------------


def test_view_checks_shape_dtype_and_aliases() -> None:
    with DeviceArena(4 * UNIT, UNIT) as arena:
        a = arena.allocate(2 * 3 * 4 * 2)
        assert a is not None
        x = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4)
        w = arena.write(a, x)
        v = arena.view(a, (2, 3, 4), torch.float16)
        assert torch.equal(v, x) and v.data_ptr() == w.data_ptr()
        v[0, 0, 0] = 100.0
        assert arena.view(a, [48], torch.uint8).data_ptr() == w.data_ptr()
        assert float(w[0, 0, 0]) == 100.0  # one memory
        assert arena.view(a, torch.Size([12]), torch.int32).shape == (12,)
        with pytest.raises(LayoutMismatchError):
            arena.view(a, (2, 3, 4), torch.float32)  # 96 bytes, allocation holds 48
        with pytest.raises(LayoutMismatchError):
            arena.view(a, (47,), torch.uint8)
        with pytest.raises(InvalidInputError):
            arena.view(a, (2, -3, -8), torch.float16)
        with pytest.raises(InvalidInputError):
            arena.view(a, "48", torch.uint8)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            arena.view(a, (48,), "uint8")  # type: ignore[arg-type]


def test_write_checks_size_and_handles_strides_and_autograd() -> None:
    with DeviceArena(4 * UNIT, UNIT) as arena:
        a = arena.allocate(64 * 4)
        assert a is not None
        with pytest.raises(LayoutMismatchError):
            arena.write(a, torch.zeros(65))
        with pytest.raises(InvalidInputError):
            arena.write(a, [0.0] * 64)  # type: ignore[arg-type]
        src = torch.arange(128, dtype=torch.float32).reshape(8, 16)[:, ::2]  # strided
        src.requires_grad_(True)
        v = arena.write(a, src)
        assert v.shape == (8, 8) and not v.requires_grad
        assert torch.equal(v, src.detach())


def test_every_dtype_is_aligned() -> None:
    with DeviceArena(8 * UNIT, UNIT) as arena:
        for dtype in (torch.float64, torch.complex128, torch.int16, torch.bfloat16):
            n = 7
            a = arena.allocate(n * dtype.itemsize)
            assert a is not None
            t = arena.view(a, (n,), dtype)
            assert t.data_ptr() % dtype.itemsize == 0


# -- lifecycle --------------------------------------------------------------------------


def test_closed_arena_refuses_use() -> None:
    arena = DeviceArena(4 * UNIT, UNIT)
    a = arena.allocate(10)
    assert a is not None and not arena.closed
    arena.close()
    arena.close()  # idempotent
    assert arena.closed
    for call in (
        lambda: arena.allocate(10),
        lambda: arena.free(a),
        lambda: arena.view(a, (10,), torch.uint8),
        lambda: arena.write(a, torch.zeros(10, dtype=torch.uint8)),
        arena.stats,
        lambda: arena.buffer,
    ):
        with pytest.raises(ClosedError):
            call()


def test_stats_type() -> None:
    with DeviceArena(4 * UNIT, UNIT) as arena:
        s = arena.stats()
        assert isinstance(s, ArenaStats)
        assert (s.capacity_bytes, s.free_bytes, s.occupancy) == (4 * UNIT, 4 * UNIT, 0.0)


@pytest.mark.parametrize("profile", ["edge", "default", "h100"])
def test_profiles_build_arenas(profile: str) -> None:
    # The arena lives on the meta device: the allocator is real, the memory is not needed.
    unit = AllocatorConfig(min_unit_bytes=UNIT_PROFILES[profile]).min_unit_bytes
    with DeviceArena(4 * unit, unit, device="meta") as arena:
        assert arena.min_unit_bytes == unit
        small = arena.allocate(unit // 2)
        large = arena.allocate(unit // 2 + 1)
        assert small is not None and large is not None
        assert arena.stats().slabs == 1
        assert arena.stats().reserved_bytes == 2 * unit


# -- shared host memory -----------------------------------------------------------------


def _child_reads_and_writes(
    name: str, capacity: int, offset: int, nbytes: int, reply_offset: int
) -> None:
    """Runs in a spawned process: check the parent's bytes, answer with our own.

    Maps ``/dev/shm/<name>`` itself (Python's SharedMemory would hand the segment to
    its resource tracker, which unlinks it when this process exits)."""
    import mmap

    import numpy as np

    with open(f"/dev/shm/{name}", "r+b") as f, mmap.mmap(f.fileno(), capacity) as mapped:
        seen = np.frombuffer(mapped, dtype=np.int32, count=nbytes // 4, offset=offset)
        if not np.array_equal(seen, np.arange(nbytes // 4, dtype=np.int32) * 3):
            raise SystemExit(3)
        reply = np.frombuffer(mapped, dtype=np.float32, count=16, offset=reply_offset)
        reply[:] = np.arange(16, dtype=np.float32) * 0.5
        del seen, reply


@needs_dev_shm
def test_cross_process_sharing(shared_arena: Callable[..., SharedHostArena]) -> None:
    arena = shared_arena(8 * UNIT, UNIT)
    a = arena.allocate(4000)
    r = arena.allocate(64)
    assert a is not None and r is not None
    arena.write(a, torch.arange(1000, dtype=torch.int32) * 3)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(
        target=_child_reads_and_writes,
        args=(arena.name, arena.capacity_bytes, a.offset, a.nbytes, r.offset),
    )
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert torch.equal(arena.view(r, (16,), torch.float32), torch.arange(16.0) * 0.5)
    assert _segment_exists(arena.name)  # the child's mapping never unlinks


@needs_dev_shm
def test_close_unlinks_and_views_never_dangle(
    shared_arena: Callable[..., SharedHostArena],
) -> None:
    arena = shared_arena(4 * UNIT, UNIT)
    name = arena.name
    a = arena.allocate(UNIT)
    assert a is not None
    late = arena.write(a, torch.full((UNIT,), 7, dtype=torch.uint8))
    arena.close()
    assert not _segment_exists(name)
    # The view outlived the arena (a misuse, documented): it must still be
    # mapped, not a dangling pointer, and be unmapped once it is gone.
    assert _mapped_in_this_process(name)
    assert int(late.sum()) == 7 * UNIT
    del late
    gc.collect()
    assert not _mapped_in_this_process(name)


@needs_dev_shm
def test_garbage_collected_arena_unlinks() -> None:
    arena = SharedHostArena(2 * UNIT, UNIT)
    name = arena.name
    assert _segment_exists(name)
    del arena
    gc.collect()
    assert not _segment_exists(name)


@needs_dev_shm
def test_a_readers_mapping_sees_the_arena_and_never_unlinks(
    shared_arena: Callable[..., SharedHostArena],
) -> None:
    arena = shared_arena(2 * UNIT, UNIT)
    arena.buffer[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    maps = SegmentMaps()  # how a reader on the node maps a device's segments
    view = maps.view(arena.name, arena.capacity_bytes, "incarnation")
    assert view[:4].tolist() == [1, 2, 3, 4] and not view.flags.writeable
    del view
    maps.close()
    assert _segment_exists(arena.name)


def test_shared_arena_errors(shared_arena: Callable[..., SharedHostArena]) -> None:
    arena = shared_arena(2 * UNIT, UNIT, name=f"memkv-test-{os.getpid()}")
    with pytest.raises(InvalidInputError, match="exists"):
        SharedHostArena(2 * UNIT, UNIT, name=arena.name)


def test_pin_without_cuda_is_ignored(shared_arena: Callable[..., SharedHostArena]) -> None:
    arena = shared_arena(2 * UNIT, UNIT, pin=True)
    assert arena.pinned == torch.cuda.is_available()
    a = arena.allocate(16)
    assert a is not None
    assert arena.write(a, torch.ones(4)).sum() == 4


# -- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_device_arena_on_cuda() -> None:
    with DeviceArena(8 * UNIT, UNIT, device="cuda:0") as arena:
        assert arena.buffer.is_cuda
        a = arena.allocate(1024 * 2)
        assert a is not None
        v = arena.write(a, torch.arange(1024, dtype=torch.float16))  # host -> device
        assert v.is_cuda and v.data_ptr() % ALIGNMENT_BYTES == 0
        assert torch.equal(v.cpu(), torch.arange(1024, dtype=torch.float16))


@pytest.mark.gpu
@needs_cuda
def test_pinned_shared_arena_copies_to_device(
    shared_arena: Callable[..., SharedHostArena],
) -> None:
    arena = shared_arena(8 * UNIT, UNIT, pin=True)
    assert arena.pinned
    a = arena.allocate(4096)
    assert a is not None
    src = torch.arange(1024, dtype=torch.float32, device="cuda:0")
    v = arena.write(a, src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(v, src.cpu())
    del v
    arena.close()
    assert not arena.pinned


def test_prefault_populates_without_changing_bytes():
    from memkv.storage.shm_arena import SharedHostArena

    with SharedHostArena(1 << 20, 4096) as arena:
        a = arena.allocate(4096)
        values = torch.arange(1024, dtype=torch.int32)
        arena.write(a, values)
        assert arena.prefault(chunk_bytes=64 << 10) in (0, 1 << 20)  # 0: kernel < 5.14
        assert torch.equal(arena.view(a, (1024,), torch.int32), values)
    assert arena.prefault() == 0  # closed: nothing to do
