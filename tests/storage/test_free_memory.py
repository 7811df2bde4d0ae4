"""A device gives the pages of free tier memory back ([2/6] item 7): before, it kept
1.7 GB of RSS with every session deleted."""

from __future__ import annotations

import os

import torch

from memkv.storage.free_memory import release_idle_extents
from memkv.storage.shm_arena import SharedHostArena

UNIT = 1 << 20


def _resident(arena: SharedHostArena) -> int:
    """Resident pages of the arena's segment (tmpfs: the blocks allocated to it)."""
    return os.stat(f"/dev/shm/{arena.name}").st_blocks * 512


def test_free_extents_go_back_and_live_ones_keep_their_bytes():
    arena = SharedHostArena(64 * UNIT, UNIT, name=f"memkv-free-test-{os.getpid()}")
    try:
        arena.buffer.fill_(7)  # populated, as a device's tiers are at start
        assert _resident(arena) >= 64 * UNIT
        kept = arena.allocate(4 * UNIT)
        arena.write(kept, torch.full((4 * UNIT,), 9, dtype=torch.uint8))
        released = release_idle_extents([arena], min_bytes=16 * UNIT)
        assert released >= 32 * UNIT  # the free buddies of at least 16 MiB
        assert _resident(arena) <= 64 * UNIT - released + UNIT
        view = arena.view(kept, (4 * UNIT,), torch.uint8)
        assert bool((view == 9).all())  # the live allocation is untouched
        again = arena.allocate(32 * UNIT)  # a released extent is usable again
        assert again is not None
        arena.write(again, torch.ones(32 * UNIT, dtype=torch.uint8))
    finally:
        arena.close()
