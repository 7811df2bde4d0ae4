"""The lifecycle policy: blocks kept for the soonest session that will read them again,
by what sessions said of themselves (memkv/storage/eviction/lifecycle.py)."""

from __future__ import annotations

import pytest

from memkv.bench import trace_replay as rt
from memkv.bench.agent_trace import agent_fleet_turns
from memkv.bench.eviction_agents import QUICK_FLEET, replay_hinted
from memkv.errors import InvalidInputError
from memkv.storage.config import EvictionConfig
from memkv.storage.eviction import make_policy
from memkv.storage.eviction.lifecycle import LifecyclePolicy


def _turn(policy: LifecyclePolicy[str], session: str, keys: list[str], now: float,
          **end: object) -> None:
    policy.start_turn(session, now)
    for key in keys:
        if key in policy:
            policy.access(key, now)
        else:
            policy.insert(key, now)
    policy.end_turn(session, now, **end)  # type: ignore[arg-type]


def _victims(policy: LifecyclePolicy[str], now: float) -> list[str]:
    out = []
    while (victim := policy.pop_victim(now)) is not None:
        out.append(victim)
    return out


def test_finished_then_longest_paused_then_active_by_when_each_is_back():
    policy: LifecyclePolicy[str] = LifecyclePolicy(active_horizon_ms=10_000)
    _turn(policy, "done", ["d1", "d2"], 0, final=True)
    _turn(policy, "long-tool", ["l1"], 1, pause_ms=600_000)
    _turn(policy, "short-tool", ["s1"], 2, pause_ms=60_000)
    _turn(policy, "thinking-old", ["a1"], 3)
    _turn(policy, "thinking-new", ["b1"], 4)
    policy.insert("no-session", 5)  # read outside any turn: nobody said it comes back
    victims = _victims(policy, 6)
    assert set(victims[:2]) == {"d1", "d2"}  # (read at the same time: either first)
    # Active sessions are back within the horizon of their last read: the one that read
    # last is expected back last (Belady's rule on predicted times).
    assert victims[2:] == ["no-session", "l1", "s1", "b1", "a1"]


def test_a_shared_block_stays_while_any_session_that_holds_it_lives():
    policy: LifecyclePolicy[str] = LifecyclePolicy()
    _turn(policy, "a", ["system", "a1"], 0)
    _turn(policy, "b", ["system", "b1"], 1, pause_ms=120_000)
    _turn(policy, "a", ["system", "a1", "a2"], 2, final=True)
    # a is done: its own blocks go first; the system prompt is b's too, back in 2 min.
    assert set(_victims(policy, 3)[:2]) == {"a1", "a2"}
    _turn(policy, "c", ["system"], 4)
    policy.end_turn("b", 5, final=True)
    policy.end_turn("c", 6, final=True)
    assert "system" in policy and policy.pop_victim(7) in {"system", "b1"}


def test_a_pause_is_believed_for_at_most_the_cap_and_pins_hold():
    policy: LifecyclePolicy[str] = LifecyclePolicy(max_pause_ms=1_000)
    _turn(policy, "says-a-day", ["x"], 0, pause_ms=86_400_000)  # back at 1 s, as far as we care
    _turn(policy, "says-a-minute", ["y"], 0, pause_ms=60_000)
    policy.pin("y")
    assert policy.pop_victim(1) == "x"  # y is pinned; x said more than the cap anyway
    assert policy.pop_victim(1) is None
    policy.unpin("y")
    assert policy.pop_victim(1) == "y"
    with pytest.raises(InvalidInputError, match="pause_ms"):
        policy.end_turn("says-a-minute", 2, pause_ms=-1)


def test_on_an_agent_fleet_the_hints_beat_lru():
    turns = agent_fleet_turns(QUICK_FLEET, seed=3)
    requests = [request for request, _ in turns]
    capacity = max(16, rt.distinct_blocks(requests) // 20)  # 5%
    lru = rt.replay(requests, capacity,
                    make_policy(EvictionConfig.model_validate({"policy": "lru"})))
    assert replay_hinted(turns, capacity).hit_ratio > lru.hit_ratio + 0.02
