"""A resumed turn waits for its session's last save, then computes what is missing."""

import pytest

from memkv.integrations.vllm.pending_saves import PendingSaves


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lookup_short_of_the_last_save_waits_until_the_save_lands() -> None:
    clock = Clock()
    saves = PendingSaves(wait_s=2.0, recheck_s=0.02, clock=clock)
    saves.issued("s1", 256)
    assert saves.should_wait("r1", "s1", hit=0, usable=288)  # not landed yet
    assert saves.too_soon("r1")
    clock.now += 0.03
    assert not saves.too_soon("r1")
    assert saves.should_wait("r1", "s1", hit=128, usable=288)  # half of it so far
    clock.now += 0.03
    assert not saves.should_wait("r1", "s1", hit=256, usable=288)  # landed
    assert not saves.too_soon("r1")
    assert not saves.should_wait("r2", "s1", hit=0, usable=288)  # forgotten once seen
    assert saves.deferred == 2


def test_the_wait_is_bounded_and_only_for_what_the_prompt_can_use() -> None:
    clock = Clock()
    saves = PendingSaves(wait_s=1.0, clock=clock)
    saves.issued("s1", 256)
    assert not saves.should_wait("r1", "s1", hit=64, usable=64)  # needs no more than it has
    saves.issued("s1", 256)
    clock.now += 1.0
    assert not saves.should_wait("r1", "s1", hit=0, usable=288)  # given up: compute
    assert not saves.should_wait("r1", "s1", hit=0, usable=288)


def test_requests_without_a_session_or_with_waiting_off_never_wait() -> None:
    saves = PendingSaves(wait_s=2.0)
    saves.issued(None, 256)
    assert not saves.should_wait("r1", None, hit=0, usable=288)
    off = PendingSaves(wait_s=0)
    off.issued("s1", 256)
    assert not off.should_wait("r1", "s1", hit=0, usable=288)
    with pytest.raises(ValueError, match="wait_s"):
        PendingSaves(wait_s=-1)


def test_saves_of_sessions_that_never_return_are_dropped_once_too_old() -> None:
    clock = Clock()
    saves = PendingSaves(wait_s=1.0, clock=clock)
    for i in range(100):
        saves.issued(f"s{i}", 64)
        clock.now += 0.1
    assert len(saves._issued) <= 11  # only those issued within the last second
    assert saves.should_wait("r", "s99", hit=0, usable=64)


def test_no_wait_for_a_save_the_engines_own_prefix_cache_already_holds() -> None:
    clock = Clock()
    saves = PendingSaves(wait_s=2.0, clock=clock)
    saves.issued("s1", 256)
    # The engine still holds the session's blocks (its KV space fits the fleet): the
    # save would bring nothing, so the turn goes on at once.
    assert not saves.should_wait("r1", "s1", hit=0, usable=288, local=256)
    saves.issued("s1", 256)
    # It holds only part of them: what memkv is about to have is worth the wait.
    assert saves.should_wait("r2", "s1", hit=0, usable=288, local=128)
