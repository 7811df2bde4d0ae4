"""Prefix lookups off the scheduler's thread.

vLLM asks a connector how much of a waiting request's prompt it holds
(``get_num_new_matched_tokens``) on the engine core's scheduling loop; a
blocking round trip to memkv there holds up every other request of the step
(several requests arriving together paid for each other's lookups). A lookup
runs on a small pool instead: if its answer comes within ``inline_s`` it is
used at once, else vLLM is told to ask again next step (the answer None) and
schedules the others meanwhile.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["INLINE_S", "Lookups"]

#: How long a step waits for a lookup before asking vLLM to ask again (seconds).
INLINE_S = 0.002

Match = tuple[int, list[Any]]
#: A lookup: tokens, and the partition of the connector's namespace they are looked for in.
MatchFn = Callable[[list[int], str | None], Match]


class Lookups:
    """Prefix matches of waiting requests, each run once on a pool of ``workers``.

    Args:
        match: the lookup (tokens, partition -> matched tokens and block keys); may raise.
    """

    def __init__(self, match: MatchFn, *, workers: int = 4,
                 inline_s: float = INLINE_S) -> None:
        self._match = match
        self._inline_s = inline_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="memkv-lookup")
        self._running: dict[str, concurrent.futures.Future[Match]] = {}

    def poll(self, request_id: str, tokens: Sequence[int],
             partition: str | None = None) -> Match | None:
        """The match of ``tokens`` (in ``partition``) for ``request_id``, or None while it
        runs (it is started on the first call). The match's own error is raised once,
        when done."""
        future = self._running.get(request_id)
        if future is None:
            future = self._pool.submit(self._match, list(tokens), partition)
            self._running[request_id] = future
        try:
            answer = future.result(timeout=self._inline_s)
        except concurrent.futures.TimeoutError:
            return None  # vLLM asks again next step; the others are scheduled meanwhile
        except BaseException:
            del self._running[request_id]
            raise
        del self._running[request_id]
        return answer

    def forget(self, request_id: str) -> None:
        """The request is gone: its lookup's answer, if any comes, is dropped."""
        future = self._running.pop(request_id, None)
        if future is not None:
            future.cancel()

    def __len__(self) -> int:
        return len(self._running)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
