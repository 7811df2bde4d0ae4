"""Same-host block leases: where blocks sit in this host's shared memory, pinned
until the client gives the lease back (through any gateway worker) or it runs out."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path, Response

from memkv.actors.router_shards import merge_located
from memkv.api.answers import LeasedBlockOut, LeaseOut, LeasesOut, SegmentOut, SegmentsOut
from memkv.api.client_leases import parse_lease_id
from memkv.api.context import Caller, GatewayState
from memkv.api.models import BlockLeaseIn
from memkv.errors import InvalidInputError, UnknownBlockError

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/segments", tags=["kv"])
async def host_segments(gw: GatewayState, who: Caller) -> SegmentsOut:
    """The shared-memory segments of the devices on this node (none without a device
    here): what a client on this host reads leased blocks from and writes reserved
    slots into. It maps them when it starts, its page tables populated then."""
    who.require("read")
    segments: list[SegmentOut] = []
    if gw.this_node:
        await gw.refresh_devices()
        for device_id, device in sorted(gw.devices_by_id.items()):
            if await gw.node_of_device(device_id) != gw.this_node:
                continue
            incarnation, found = await device.shared_segments()
            segments.extend(SegmentOut(device_id=device_id, incarnation=incarnation,
                                       segment=name, segment_bytes=size, reservable=reservable)
                            for name, size, reservable in found)
    return SegmentsOut(host=gw.host_shm, segments=segments)


@router.post("/v1/blocks/lease", tags=["kv"])
async def lease_blocks(body: BlockLeaseIn, gw: GatewayState, who: Caller) -> LeasesOut:
    """Where blocks sit in this host's shared memory, pinned under leases (same host only).

    For a client on the gateway's host (its ``host`` equals the client's
    :func:`memkv.shm.same_node.shm_identity`): it maps each block's segment,
    copies ``nbytes`` from ``offset``, checks ``crc32``, and gives each
    lease back with ``DELETE /v1/blocks/lease/{id}`` (or lets it run out at
    ``expires_at``, on the host's monotonic clock). A block answered
    ``null`` is not in shared memory here (another node, same-node reads
    off, the lease bound reached): read it with ``/v1/blocks/read``.
    Keys the token may not read answer 404, like missing ones.
    """
    who.require("read")
    namespaces = who.read_namespaces(body.namespace)
    try:
        keys = list(dict.fromkeys(bytes.fromhex(k) for k in body.keys))
    except ValueError as e:
        raise InvalidInputError(f"keys must be hex strings: {e}") from e
    if not namespaces:
        raise UnknownBlockError("no block of a trusted publisher has these keys")
    groups = merge_located(
        list(await asyncio.gather(*gw.routers.locate_blocks(keys, namespaces)))
    )
    planned: dict[bytes, LeasedBlockOut] = {}
    leases: list[LeaseOut] = []
    for device_id, device, group in groups if gw.same_node_reads and gw.this_node else []:
        plan = await device.read_plan(list(group), None, body.ttl_s, (), who.tenant)
        nbytes = sum(e.nbytes for e in plan.entries if e is not None)
        if not plan.same_node or plan.node_id != gw.this_node or not plan.lease_id:
            if plan.lease_id:
                device.release_lease(plan.lease_id, who.tenant)
            continue
        if nbytes > gw.client_leases.room():
            gw.client_leases.refused_over_budget += 1
            device.release_lease(plan.lease_id, who.tenant)
            continue
        public_id = gw.client_leases.add(who.tenant, device, plan, body.ttl_s)
        for entry in plan.entries:
            if entry is not None:
                planned[entry.key] = LeasedBlockOut.of(entry, len(leases))
        leases.append(LeaseOut(id=public_id, device_id=device_id,
                               incarnation=plan.incarnation, expires_at=plan.expires_at))
    return LeasesOut(host=gw.host_shm, leases=leases, blocks=[planned.get(k) for k in keys])


@router.delete("/v1/blocks/lease/{lease_id}", status_code=204, tags=["kv"])
async def release_block_lease(
    lease_id: Annotated[str, Path(max_length=256)], gw: GatewayState, who: Caller
) -> Response:
    """Give a lease back (through any gateway worker): its blocks may move again.
    Unknown, run out, or another tenant's: 404."""
    parsed = parse_lease_id(lease_id)
    device = gw.client_leases.take(who.tenant, lease_id)
    if device is None and parsed is not None:
        # Granted by another worker (or replica): the id names the device.
        device = await gw.device_named(parsed[1])
    if parsed is None or device is None or not await device.release_lease(parsed[0], who.tenant):
        raise UnknownBlockError(f"no live lease {lease_id!r} of this caller")
    return Response(status_code=204)
