"""Read plans the gateway hands to clients on its own host (``POST /v1/blocks/lease``).

An engine beside the gateway (a ``vllm serve`` with memkv's connector, one URL
and one token) should not receive its KV through a socket: the bytes are in
shared memory already. The gateway asks the block's device for a read plan,
as it does for its own reads, and answers the plan: segment, offset, length
and checksum of each block under a lease. The client maps the segments and
copies the blocks straight into where they go (vLLM's paged cache), checks
each checksum, and gives the lease back (``DELETE /v1/blocks/lease/{id}``).

Why this is no wider a door than same-node reads are already: a plan is only
served where the device serves plans (``device.same_node_reads``, which says
every process on the node is trusted with every block in the segments), and
only for blocks the token may read. What a client pins is bounded:
``max_bytes`` in all, and every lease runs out after ``ttl_s`` whether or not
it is given back; beyond the bound blocks are answered unplanned (read them
over HTTP), never an error.

Whether the client is on the gateway's host is the client's to tell: the
answer names the host's shared memory (:func:`memkv.shm.same_node.shm_identity`),
and a client elsewhere sees another name and reads over HTTP instead.

A lease's id names its device (``<lease>.<device id>``), and the device keeps
the lease's owner (the caller's tenant): so any gateway worker or replica can
take a lease back, not only the one that granted it (``gateway.workers`` share
one port; a client's next connection may land on another). The byte bound is
each worker's own; a lease given back elsewhere counts against its granting
worker until it would have run out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from memkv.protocol.members import BlockReader
from memkv.protocol.messages import ReadPlan

__all__ = ["ClientLeases", "parse_lease_id"]

#: Longest lease a client may ask for: a load copies in well under a second.
MAX_TTL_S = 60.0
DEFAULT_TTL_S = 30.0


@dataclass(slots=True)
class _Issued:
    tenant: str | None
    device: BlockReader  # the device's reader: where the release goes
    lease_id: str
    nbytes: int
    expires: float  # local monotonic time after which the device has let go anyway


class ClientLeases:
    """The leases handed to clients, by id, with the bytes they pin.

    Args:
        max_bytes: block bytes all clients' live leases may pin together.
        clock: the gateway's monotonic clock (a fake in tests).
    """

    def __init__(self, *, max_bytes: int, clock: Any = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        self._issued: OrderedDict[str, _Issued] = OrderedDict()  # oldest first
        self._bytes = 0
        self.granted = 0
        self.refused_over_budget = 0

    @property
    def pinned_bytes(self) -> int:
        self._expire()
        return self._bytes

    def room(self) -> int:
        """Bytes a new lease may still pin."""
        self._expire()
        return max(0, self.max_bytes - self._bytes)

    def add(self, tenant: str | None, device: BlockReader, plan: ReadPlan, ttl_s: float) -> str:
        """Count ``plan`` (granted to ``tenant``) against the bound; its client-facing id."""
        nbytes = sum(e.nbytes for e in plan.entries if e is not None)
        public_id = f"{plan.lease_id}.{plan.device_id}"
        self._issued[public_id] = _Issued(
            tenant, device, plan.lease_id, nbytes, self._clock() + ttl_s
        )
        self._bytes += nbytes
        self.granted += 1
        return public_id

    def take(self, tenant: str | None, public_id: str) -> BlockReader | None:
        """The device of ``tenant``'s lease ``public_id`` if this worker granted it
        (forgotten now), else None: release it at the device its id names."""
        self._expire()
        issued = self._issued.get(public_id)
        if issued is None or issued.tenant != tenant:
            return None
        del self._issued[public_id]
        self._bytes -= issued.nbytes
        return issued.device

    def _expire(self) -> None:
        """Forget leases past their end (the device released them itself)."""
        now = self._clock()
        # Not strictly in expiry order (ttls differ), so look at all past ones cheaply:
        # leases are few (one per load in flight) and short.
        for lease_id in [i for i, x in self._issued.items() if x.expires <= now]:
            self._bytes -= self._issued.pop(lease_id).nbytes

    def stats(self) -> dict[str, int]:
        return {
            "live": len(self._issued),
            "pinned_bytes": self.pinned_bytes,
            "granted": self.granted,
            "refused_over_budget": self.refused_over_budget,
        }


def parse_lease_id(public_id: str) -> tuple[str, str] | None:
    """``(device lease id, device id)`` of a client-facing lease id, or None if malformed."""
    lease_id, dot, device_id = public_id.partition(".")
    if not dot or not lease_id or not device_id:
        return None
    return lease_id, device_id
