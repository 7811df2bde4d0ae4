"""How many append-body bytes the gateway receives at once: per tenant, then in all.

An append reserves its declared length before its body is read. One budget for
the whole gateway let one tenant block every other: two stalled ~1 GiB appends
(a few KB sent each) made every other tenant's appends answer 503 for the body
timeout. So each tenant may hold only a share of the budget (its own appends
get the 503 beyond it), and when the whole budget is full, bodies that sent
nothing for ``stall_s`` are dropped at once (408) instead of after the body
timeout, and the new append waits up to ``stall_s`` for their room.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

from memkv.errors import ClosedError

__all__ = ["BodyBudget", "BodyHold"]

#: How often a full budget looks again for bodies that stalled meanwhile.
_RECHECK_S = 0.05


class BodyHold:
    """One append body's reservation, kept up to date by its reader.

    The reader stores the ``asyncio.timeout`` it waits for each chunk under
    (``timeout``) and notes each chunk (``progress``): dropping a stalled hold
    reschedules that timeout to now, so its reader ends at once.
    """

    __slots__ = ("dropped", "last", "size", "tenant", "timeout", "_clock")

    def __init__(self, tenant: str, size: int, clock: Callable[[], float]) -> None:
        self.tenant, self.size = tenant, size
        self._clock = clock
        self.last = clock()
        self.timeout: asyncio.Timeout | None = None
        self.dropped = False

    def progress(self) -> None:
        self.last = self._clock()

    def drop(self) -> None:
        self.dropped = True
        if self.timeout is not None and not self.timeout.expired():
            self.timeout.reschedule(asyncio.get_running_loop().time())


class BodyBudget:
    """Append bodies in flight, by declared length: a cap per tenant and one in all.

    Args:
        max_bytes: all tenants together.
        tenant_bytes: one tenant's appends together (default: half of ``max_bytes``).
        stall_s: a body that sent nothing for this long is dropped when the
            budget is full and another append needs its room.
    """

    def __init__(
        self,
        max_bytes: int,
        *,
        tenant_bytes: int | None = None,
        stall_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max_bytes
        self._tenant_max = tenant_bytes if tenant_bytes is not None else max_bytes // 2
        self._stall_s = stall_s
        self._clock = clock
        self.used = 0
        self._by_tenant: Counter[str] = Counter()
        self._holds: set[BodyHold] = set()
        self._room = asyncio.Condition()
        self.dropped = 0  # stalled bodies dropped under pressure

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, size: int) -> AsyncIterator[BodyHold]:
        """Reserve ``size`` bytes for ``tenant``'s body while it is read.

        Raises:
            ClosedError: (503) the tenant's own appends hold its share, or the
                gateway stayed full for ``stall_s`` after dropping stalled bodies.
        """
        if self._by_tenant[tenant] + size > self._tenant_max and self._by_tenant[tenant]:
            raise ClosedError(
                f"this tenant's other appends hold {self._by_tenant[tenant]} bytes of the "
                f"{self._tenant_max} it may send at once; retry shortly"
            )
        if self.used + size > self._max:
            await self._make_room(size)
        entry = BodyHold(tenant, size, self._clock)
        self.used += size
        self._by_tenant[tenant] += size
        self._holds.add(entry)
        try:
            yield entry
        finally:
            self._holds.discard(entry)
            self.used -= size
            self._by_tenant[tenant] -= size
            if not self._by_tenant[tenant]:
                del self._by_tenant[tenant]
            async with self._room:
                self._room.notify_all()

    async def _make_room(self, size: int) -> None:
        """Drop stalled bodies until ``size`` fits; wait at most ``stall_s`` in all."""
        deadline = self._clock() + self._stall_s
        while self.used + size > self._max:
            self._drop_stalled()
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise ClosedError(
                    f"the gateway is receiving {self.used} bytes of other appends; retry shortly"
                )
            # Wake on a release, or look again soon: a body may stall meanwhile.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, _RECHECK_S)), self._room:
                    await self._room.wait_for(lambda: self.used + size <= self._max)

    def _drop_stalled(self) -> None:
        now = self._clock()
        for entry in list(self._holds):
            if not entry.dropped and now - entry.last >= self._stall_s:
                entry.drop()
                self.dropped += 1
