"""How many append-body bytes the gateway receives at once: per tenant, then in all.

An append reserves its declared length before its body is read. What a tenant
could do to the others with that, and the rule against each:

- hold the whole budget with bodies that never finish: each tenant may hold at
  most ``tenant_bytes``, and a ``reserve_bytes`` share of the budget is kept for
  tenants that have no body in flight, so no group of tenants can take it all;
- send nothing: a body that stalls for the body timeout is answered 408;
- trickle (a byte every now and then, so never "stalled"): a body is judged by
  its rate, as servers judge slowloris clients (Apache's ``MinRate``). Once it is
  ``grace_s`` old, a body slower than ``min_rate`` bytes/s (since it began) is
  dropped when another append needs its room, and after ``slow_grace_s`` it is
  dropped anyway; no body may take longer than ``max_body_s``.

A new append waits at most ``stall_s`` for room (``grace_s`` where the bodies in
its way are too young to judge), then answers 503 with Retry-After; dropped
bodies answer 408 with the reason.
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
#: How long a waiting append allows the bodies it had dropped to let go of their room.
_DROP_SETTLE_S = 0.25
#: The slowest a body may arrive (bytes/s, averaged since it began): 1 MiB/s.
MIN_RATE = 1 << 20
#: How old a body is before its rate is judged when another append needs room.
GRACE_S = 0.5
#: How old before a body slower than MIN_RATE is dropped whether or not room is needed.
SLOW_GRACE_S = 10.0
#: The longest one body may take (seconds).
MAX_BODY_S = 300.0


class BodyHold:
    """One append body's reservation, kept up to date by its reader.

    The reader stores the ``asyncio.timeout`` it waits for each chunk under
    (``timeout``) and notes each chunk (``progress``): dropping a hold
    reschedules that timeout to now, so its reader ends at once (``why`` says why).
    """

    __slots__ = ("_budget", "_clock", "dropped", "last", "received", "size", "started",
                 "tenant", "timeout", "why")

    def __init__(self, tenant: str, size: int, budget: BodyBudget,
                 clock: Callable[[], float]) -> None:
        self.tenant, self.size = tenant, size
        self._budget = budget
        self._clock = clock
        self.started = self.last = clock()
        self.received = 0
        self.timeout: asyncio.Timeout | None = None
        self.dropped = False
        self.why = ""

    def progress(self, nbytes: int = 0) -> None:
        """``nbytes`` more of the body came; a body too slow or too long is dropped."""
        self.last = self._clock()
        self.received += nbytes
        age = self.last - self.started
        if age >= self._budget.max_body_s:
            self.drop(f"it took longer than {self._budget.max_body_s:g} s")
        elif age >= self._budget.slow_grace_s and self.rate() < self._budget.min_rate:
            self.drop(f"it arrived at {self.rate():.0f} bytes/s, under the "
                      f"{self._budget.min_rate} bytes/s a body must keep")

    def rate(self) -> float:
        """Bytes/s since the body began."""
        return self.received / max(self._clock() - self.started, 1e-9)

    def slow(self, now: float) -> bool:
        """Past its grace and under the minimum rate, or silent for the stall time."""
        age = now - self.started
        return (age >= self._budget.grace_s and self.rate() < self._budget.min_rate) \
            or now - self.last >= self._budget.stall_s

    def drop(self, why: str) -> None:
        if self.dropped:
            return
        self.dropped, self.why = True, why
        self._budget.dropped += 1
        if self.timeout is not None and not self.timeout.expired():
            self.timeout.reschedule(asyncio.get_running_loop().time())


class BodyBudget:
    """Append bodies in flight, by declared length: a cap per tenant and one in all.

    Args:
        max_bytes: all tenants together.
        tenant_bytes: one tenant's appends together (default: half of ``max_bytes``).
        reserve_bytes: kept for tenants with no body in flight (default: a quarter).
        stall_s: the longest a new append waits for room; a body silent this long
            is dropped when room is needed.
        min_rate, grace_s, slow_grace_s, max_body_s: see the module docstring.
    """

    def __init__(
        self,
        max_bytes: int,
        *,
        tenant_bytes: int | None = None,
        reserve_bytes: int | None = None,
        stall_s: float = 0.5,
        min_rate: int = MIN_RATE,
        grace_s: float = GRACE_S,
        slow_grace_s: float = SLOW_GRACE_S,
        max_body_s: float = MAX_BODY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max_bytes
        self._tenant_max = tenant_bytes if tenant_bytes is not None else max_bytes // 2
        self._reserve = reserve_bytes if reserve_bytes is not None else max_bytes // 4
        self.stall_s = stall_s
        self.min_rate = min_rate
        self.grace_s = grace_s
        self.slow_grace_s = slow_grace_s
        self.max_body_s = max_body_s
        self._clock = clock
        self.used = 0
        self._by_tenant: Counter[str] = Counter()
        self._holds: set[BodyHold] = set()
        self._room = asyncio.Condition()
        self.dropped = 0  # bodies dropped (stalled, too slow, too long)

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, size: int) -> AsyncIterator[BodyHold]:
        """Reserve ``size`` bytes for ``tenant``'s body while it is read.

        Raises:
            ClosedError: (503) the tenant's own appends hold its share, or the
                gateway stayed full for ``stall_s`` after dropping slow bodies.
        """
        if self._by_tenant[tenant] + size > self._tenant_max and self._by_tenant[tenant]:
            raise ClosedError(
                f"this tenant's other appends hold {self._by_tenant[tenant]} bytes of the "
                f"{self._tenant_max} it may send at once; retry shortly"
            )
        if not self._fits(tenant, size):
            await self._make_room(tenant, size)
        entry = BodyHold(tenant, size, self, self._clock)
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

    def _fits(self, tenant: str, size: int) -> bool:
        """Whether ``size`` more fits: the reserve only for a tenant with nothing in flight."""
        limit = self._max if not self._by_tenant[tenant] else self._max - self._reserve
        return self.used + size <= limit

    async def _make_room(self, tenant: str, size: int) -> None:
        """Drop slow bodies until ``size`` fits; wait at most ``stall_s`` (or, for bodies
        younger than their grace, until they are judged) and a moment for the drops."""
        deadline = self._clock() + max(self.stall_s, self.grace_s) + _DROP_SETTLE_S
        while not self._fits(tenant, size):
            self._drop_slow()
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise ClosedError(
                    f"the gateway is receiving {self.used} bytes of other appends; retry shortly"
                )
            # Wake on a release, or look again soon: a body may turn slow meanwhile.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, _RECHECK_S)), self._room:
                    await self._room.wait_for(lambda: self._fits(tenant, size))

    def _drop_slow(self) -> None:
        now = self._clock()
        for entry in list(self._holds):
            if not entry.dropped and entry.slow(now):
                entry.drop(f"it arrived at {entry.rate():.0f} bytes/s while the gateway was "
                           "full (another append needed its room)")
