import json
import math
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.errors import InvalidInputError
from memkv.storage.diagnostics import COLD_BUCKET, AccessStats, WindowRatios, reuse_bucket


def brute_force_histogram(stream: list[int], max_tracked: int) -> dict[str, int]:
    """Reuse distances by definition: distinct keys strictly between two accesses."""
    hist: dict[str, int] = {}
    for i, key in enumerate(stream):
        prev = max((j for j in range(i) if stream[j] == key), default=None)
        distance = None if prev is None else len(set(stream[prev + 1 : i]))
        if distance is not None and distance >= max_tracked:
            distance = None  # forgotten: at least max_tracked newer keys since
        bucket = reuse_bucket(distance)
        hist[bucket] = hist.get(bucket, 0) + 1
    return hist


def test_reuse_bucket_edges() -> None:
    assert [reuse_bucket(d) for d in (0, 1, 2, 3, 4, 7, 8, 1023, 1024)] == [
        "0",
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "512-1023",
        "1024-2047",
    ]
    assert reuse_bucket(None) == COLD_BUCKET
    with pytest.raises(InvalidInputError):
        reuse_bucket(-1)


def test_small_stream_by_hand() -> None:
    stats = AccessStats()
    for t, key in enumerate("aabcbda"):
        stats.record(key, "hot", now=float(t))
    # a:inf a:0 b:inf c:inf b:1 d:inf a:3 (b, c, d between)
    assert stats.reuse_distance_histogram() == {"0": 1, "1": 1, "2-3": 1, COLD_BUCKET: 4}


# Streams longer than the initial Fenwick tree (64) exercise the renumbering.
@settings(max_examples=60, deadline=None)
@given(
    stream=st.integers(1, 60).flatmap(
        lambda n: st.lists(st.integers(0, n), min_size=1, max_size=400)
    ),
    max_tracked=st.one_of(st.integers(1, 12), st.just(1_000_000)),
)
def test_reuse_distance_matches_brute_force(stream: list[int], max_tracked: int) -> None:
    stats = AccessStats(max_tracked_keys=max_tracked)
    for t, key in enumerate(stream):
        stats.record(key, None, now=float(t))
    expected = brute_force_histogram(stream, max_tracked)
    assert stats.reuse_distance_histogram() == expected
    assert sum(expected.values()) == len(stream)
    assert list(stats.reuse_distance_histogram()) == sorted(
        expected, key=lambda b: math.inf if b == COLD_BUCKET else int(b.split("-")[0])
    )
    assert stats.snapshot()["tracked_keys"] == min(len(set(stream)), max_tracked)


@pytest.mark.parametrize("max_tracked", [7, 100, 1_000_000])
def test_long_skewed_stream_matches_brute_force(max_tracked: int) -> None:
    rng = random.Random(max_tracked)
    # Mostly a hot set, sometimes a long tail: distances from 0 to hundreds.
    stream = [rng.randrange(8) if rng.random() < 0.6 else rng.randrange(400) for _ in range(3000)]
    stats = AccessStats(max_tracked_keys=max_tracked)
    for t, key in enumerate(stream):
        stats.record(key, "cold", now=float(t))
    assert stats.reuse_distance_histogram() == brute_force_histogram(stream, max_tracked)


def test_hit_ratios_per_window() -> None:
    stats = AccessStats(window_seconds=10.0)
    for t, tier in [(0, "hot"), (1, "hot"), (2, "warm"), (9.9, None), (10, "cold"), (35, None)]:
        stats.record(("blk", t), tier, now=t)
    windows = stats.hit_ratios()
    assert windows == [
        WindowRatios(start=0.0, end=10.0, accesses=4, hot=0.5, warm=0.25, cold=0.0, miss=0.25),
        WindowRatios(start=10.0, end=20.0, accesses=1, hot=0.0, warm=0.0, cold=1.0, miss=0.0),
        WindowRatios(start=30.0, end=40.0, accesses=1, hot=0.0, warm=0.0, cold=0.0, miss=1.0),
    ]


def test_only_the_latest_windows_are_kept() -> None:
    stats = AccessStats(window_seconds=1.0, max_windows=3)
    for t in range(6):
        stats.record("k", "hot", now=t + 0.5)
    assert [w.start for w in stats.hit_ratios()] == [3.0, 4.0, 5.0]
    stats.record("k", "warm", now=0.5)  # older than every kept window: not windowed
    assert [w.start for w in stats.hit_ratios()] == [3.0, 4.0, 5.0]
    stats.record("k", "warm", now=4.2)  # out of order but still kept
    assert stats.hit_ratios()[1].accesses == 2
    snap = stats.snapshot()
    assert snap["accesses"] == 8 and snap["counts"]["warm"] == 2  # totals count everything


def test_snapshot_is_json_friendly() -> None:
    stats = AccessStats(window_seconds=5)
    for t in range(20):
        stats.record(b"key%d" % (t % 4), ("hot", "warm", "cold", None)[t % 4], now=t)
    snap = json.loads(json.dumps(stats.snapshot()))
    assert snap["accesses"] == 20
    assert snap["ratios"] == {"hot": 0.25, "warm": 0.25, "cold": 0.25, "miss": 0.25}
    assert snap["reuse_distance"] == {"2-3": 16, COLD_BUCKET: 4}
    assert len(snap["windows"]) == 4 and snap["windows"][0]["accesses"] == 5
    assert AccessStats().snapshot()["ratios"]["miss"] == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_seconds": 0},
        {"window_seconds": -1.0},
        {"window_seconds": math.inf},
        {"window_seconds": "60"},
        {"max_windows": 0},
        {"max_windows": 2.5},
        {"max_tracked_keys": 0},
        {"max_tracked_keys": True},
    ],
)
def test_bad_parameters(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidInputError):
        AccessStats(**kwargs)  # type: ignore[arg-type]


def test_bad_records_change_nothing() -> None:
    stats = AccessStats()
    with pytest.raises(InvalidInputError, match="tier"):
        stats.record("k", "lukewarm", now=0.0)
    with pytest.raises(InvalidInputError, match="now"):
        stats.record("k", "hot", now=math.nan)
    with pytest.raises(InvalidInputError, match="now"):
        stats.record("k", "hot", now="0")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="hashable"):
        stats.record(["k"], "hot", now=0.0)
    assert stats.snapshot()["accesses"] == 0 and stats.reuse_distance_histogram() == {}


def test_threads_lose_no_records() -> None:
    stats = AccessStats(max_tracked_keys=50)

    def work(t: int) -> None:
        for i in range(500):
            stats.record((t, i % 60), "hot", now=float(i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(stats.reuse_distance_histogram().values()) == 2000
    assert stats.snapshot()["tracked_keys"] == 50
