"""Tests of memkv.storage.prefetch: the per-stream Markov prefetcher."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.errors import InvalidInputError
from memkv.storage.config import PrefetchConfig
from memkv.storage.prefetch import MarkovPrefetcher


def _feed(p: MarkovPrefetcher[str], keys: str, stream: str = "s") -> None:
    for key in keys:
        p.observe(key, stream)


def test_deterministic_cycle_is_predicted_with_probability_one() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    _feed(p, "ABC" * 5)
    assert p.predict("A") == [("B", 1.0), ("C", 1.0)]  # A itself is not a prediction
    assert p.predict("C", window=1) == [("A", 1.0)]


def test_even_branch_stays_below_the_default_threshold() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    for i in range(10):  # ten sessions read A then B, ten read A then C
        _feed(p, "AB", stream=f"b{i}")
        _feed(p, "AC", stream=f"c{i}")
    assert p.successors("A") == {"B": 0.5, "C": 0.5}
    assert p.predict("A") == []  # 0.5 < 0.6
    got = dict(p.predict("A", threshold=0.5))
    assert got == pytest.approx({"B": 0.5, "C": 0.5})


def test_visit_probability_counts_any_step_within_the_window() -> None:
    # A -> B (1/2) or A -> C (1/2), C -> B: B is visited within 2 steps surely,
    # though it is at step 2 only half of the time.
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    _feed(p, "AB", "s1")
    _feed(p, "ACB", "s2")
    assert dict(p.predict("A", window=1, threshold=0.1)) == pytest.approx({"B": 0.5, "C": 0.5})
    assert dict(p.predict("A", window=2, threshold=0.1)) == pytest.approx({"B": 1.0, "C": 0.5})


def test_window_and_limit_are_respected() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig(max_prefetch_blocks=3))
    _feed(p, "ABCDEFGH")
    assert [k for k, _ in p.predict("A", window=2)] == ["B", "C"]
    assert [k for k, _ in p.predict("A", window=10)] == ["B", "C", "D"]  # config limit
    assert [k for k, _ in p.predict("A", window=10, limit=5)] == ["B", "C", "D", "E", "F"]
    assert [k for k, _ in p.predict("A")] == ["B", "C", "D"]  # lookahead_window=5, limit 3
    assert p.predict("A", limit=0) == []


def test_ranking_best_first_then_nearest() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    for i in range(4):
        _feed(p, "AB" if i else "AC", f"s{i}")
    _feed(p, "BD", "d")
    got = p.predict("A", threshold=0.1)
    assert [k for k, _ in got] == ["B", "D", "C"]
    assert [pr for _, pr in got] == pytest.approx([0.75, 0.75, 0.25])


def test_streams_are_learnt_separately() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    for _ in range(3):
        for a, b in zip("ABC", "XYZ", strict=True):  # two sessions interleaved
            p.observe(a, "s1")
            p.observe(b, "s2")
    assert [k for k, _ in p.predict("A", window=2)] == ["B", "C"]
    assert [k for k, _ in p.predict("X", window=2)] == ["Y", "Z"]


def test_unknown_key_predicts_nothing_and_repeats_are_not_transitions() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    assert p.predict("nope") == []
    _feed(p, "AAAB")
    assert p.successors("A") == {"B": 1.0}


def test_memory_bounds() -> None:
    cfg = PrefetchConfig(max_tracked_keys=10, max_successors=3)
    p: MarkovPrefetcher[int] = MarkovPrefetcher(cfg, max_streams=4)
    for i in range(100):
        p.observe(i, f"stream-{i % 7}")
    assert p.stats().states <= 10
    hub: MarkovPrefetcher[int] = MarkovPrefetcher(cfg)
    for i in range(1, 20):  # 0 is followed by 19 different keys
        hub.observe(0, "s")
        hub.observe(i, "s")
    assert len(hub.successors(0)) <= 3
    assert hub.stats().transitions <= 3 * hub.stats().states


def test_weakest_successor_is_dropped() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig(max_successors=2))
    for nxt, times in (("B", 5), ("C", 1), ("D", 1)):
        for _ in range(times):
            _feed(p, "A" + nxt, stream=f"{nxt}-{_}")
    succ = p.successors("A")
    assert set(succ) == {"B", "D"}  # C was the weakest when D arrived
    # Dropped mass stays in the denominator: probabilities stay honest.
    assert succ["B"] == pytest.approx(5 / 7)


def test_forget_removes_state_and_incoming_edges() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    _feed(p, "ABCD")
    p.forget("C")
    assert [k for k, _ in p.predict("A")] == ["B"]
    assert p.successors("C") == {}
    p.forget("C")  # idempotent
    p.observe("E", "s")  # stream "s" ended at D: D -> E
    assert p.successors("D") == {"E": 1.0}


def test_stats_count_predictions_and_hits() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    _feed(p, "ABCABC")
    p.predict("A")
    _feed(p, "AB", stream="t")
    st_ = p.stats()
    assert st_.observations == 8 and st_.predictions == 1
    assert st_.predicted_keys == 2 and st_.hits == 1
    assert st_.precision == pytest.approx(0.5)


def test_argument_errors() -> None:
    p: MarkovPrefetcher[str] = MarkovPrefetcher(PrefetchConfig())
    for kwargs in ({"window": 0}, {"threshold": 0.0}, {"threshold": 1.5}, {"limit": -1}):
        with pytest.raises(InvalidInputError):
            p.predict("A", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        MarkovPrefetcher(PrefetchConfig(), min_path_mass=1.0)
    with pytest.raises(InvalidInputError):
        MarkovPrefetcher(PrefetchConfig(), max_streams=0)


# ------------------------------------------------- exactness against brute force


def _exact_visit_probability(
    p: MarkovPrefetcher[int], start: int, target: int, window: int
) -> float:
    """First-passage probability by absorbing ``target`` (independent of the walk code)."""
    dist = {start: 1.0}
    hit = 0.0
    for _ in range(window):
        nxt: dict[int, float] = {}
        for node, mass in dist.items():
            for succ, prob in p.successors(node).items():
                if succ == target:
                    hit += mass * prob
                else:
                    nxt[succ] = nxt.get(succ, 0.0) + mass * prob
        dist = nxt
    return hit


@settings(max_examples=60, deadline=None)
@given(
    walks=st.lists(st.lists(st.integers(0, 6), min_size=2, max_size=12), min_size=1, max_size=8),
    window=st.integers(1, 5),
)
def test_visit_probabilities_match_first_passage_dp(walks: list[list[int]], window: int) -> None:
    cfg = PrefetchConfig(max_prefetch_blocks=1024)
    exact: MarkovPrefetcher[int] = MarkovPrefetcher(cfg, min_path_mass=0.0)
    pruned: MarkovPrefetcher[int] = MarkovPrefetcher(cfg, min_path_mass=0.05)
    for i, walk in enumerate(walks):
        for key in walk:
            exact.observe(key, i)
            pruned.observe(key, i)
    for start in range(7):
        got = dict(exact.predict(start, window=window, threshold=1e-9))
        approx = dict(pruned.predict(start, window=window, threshold=1e-9))
        for target in range(7):
            if target == start:
                assert target not in got
                continue
            want = _exact_visit_probability(exact, start, target, window)
            assert math.isclose(got.get(target, 0.0), want, rel_tol=1e-9, abs_tol=1e-12)
            # Pruning only ever loses mass, and never more than it reports cutting.
            lower = approx.get(target, 0.0)
            assert lower <= want + 1e-12
            assert want - lower <= pruned.stats().pruned_mass + 1e-12
