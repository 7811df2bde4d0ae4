"""Prefix lookups off vLLM's scheduling loop (memkv.integrations.vllm.lookups)."""

from __future__ import annotations

import threading

import pytest

from memkv.errors import MemkvError
from memkv.integrations.vllm.lookups import Lookups


def test_a_quick_lookup_is_answered_in_the_same_step():
    lookups = Lookups(lambda tokens, partition: (len(tokens), [partition]), inline_s=5.0)
    assert lookups.poll("r1", [1, 2, 3]) == (3, [None])
    # Looked up in the request's partition (its cache_salt's), where it has one.
    assert lookups.poll("r2", [1, 2], "p1") == (2, ["p1"])
    assert len(lookups) == 0
    lookups.close()


def test_a_slow_lookup_says_ask_again_and_does_not_run_twice():
    go, calls = threading.Event(), []

    def match(tokens, partition):
        calls.append(tokens)
        go.wait(10)
        return 8, [b"a", b"b"]

    lookups = Lookups(match, inline_s=0.001)
    assert lookups.poll("r1", [1] * 8) is None  # started; vLLM schedules the others
    assert lookups.poll("r1", [1] * 8) is None  # still running: not started again
    go.set()
    for _ in range(1000):
        if (found := lookups.poll("r1", [1] * 8)) is not None:
            break
    assert found == (8, [b"a", b"b"]) and len(calls) == 1
    # The answer is used once: a later ask starts a new lookup (memkv may hold more).
    assert lookups.poll("r1", [1] * 8) == (8, [b"a", b"b"]) and len(calls) == 2
    lookups.close()


def test_a_failed_lookup_raises_once_and_a_finished_request_is_forgotten():
    def match(tokens, partition):
        raise MemkvError("memkv is down")

    lookups = Lookups(match, inline_s=5.0)
    with pytest.raises(MemkvError):
        lookups.poll("r1", [1])
    assert len(lookups) == 0
    block = threading.Event()
    slow = Lookups(lambda tokens, partition: block.wait(10) and (0, []), inline_s=0.001)
    assert slow.poll("r2", [1]) is None
    slow.forget("r2")  # the request finished while its lookup ran
    assert len(slow) == 0
    block.set()
    slow.close()
    lookups.close()
