"""The repeated-work loop: rounds go on after one fails, logged on one line each."""

from __future__ import annotations

import asyncio
import logging

from memkv.errors import ClosedError
from memkv.periodic import Periodic


class _RemoteError(Exception):
    """What Ray raises for an actor's error: the remote traceback in its text, the error
    itself as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("ray::Archive.keys()\n  File ...\n    raise ClosedError\nClosedError")
        self.cause = cause


def test_a_failed_round_is_one_log_line_and_the_next_round_runs(caplog):
    rounds: list[int] = []

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise _RemoteError(ClosedError("segment store at /x is closed"))
        if len(rounds) == 3:
            done.set()

    async def main() -> None:
        loop = Periodic(work, 0.001, "replica repair")
        loop.ensure_running()
        await asyncio.wait_for(done.wait(), 10)
        loop.cancel()

    done = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="memkv.periodic"):
        asyncio.run(main())
    assert len(rounds) == 3
    (record,) = caplog.records
    assert record.getMessage() == (
        "replica repair round failed: ClosedError: segment store at /x is closed")
