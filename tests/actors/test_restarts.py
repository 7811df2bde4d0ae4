"""Asking again while an actor restarts: until it answers, or the time is up."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError

from memkv.actors.restarts import through_restarts


def test_a_call_is_made_again_while_its_actor_restarts_then_gives_up():
    calls = []

    def restarting() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RayActorError()
        return "answer"

    assert through_restarts(restarting, timeout_s=5, wait_s=0.001) == "answer"
    assert len(calls) == 3

    def gone() -> str:
        raise RayActorError()

    with pytest.raises(RayActorError):
        through_restarts(gone, timeout_s=0.05, wait_s=0.01)

    def wrong() -> str:
        raise ValueError("not a restart")

    with pytest.raises(ValueError):  # only a restart is waited out
        through_restarts(wrong, timeout_s=5)
