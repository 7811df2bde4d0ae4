"""Typed messages between memkv's processes (frozen dataclasses of plain values).

Ray pickles these between actors; the HTTP gateway turns them into JSON. They
carry no tensors: blocks travel as numpy arrays (in-cluster), shared-memory
read plans (same node) or wire frames (HTTP).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from memkv.protocol.enums import Priority
from memkv.protocol.layout import KVLayout

if TYPE_CHECKING:
    from memkv.protocol.members import BlockReader

__all__ = ["ChainUpdate", "PlanEntry", "PrefixMatch", "ReadPlan", "ReadRoute"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The leading tokens some session of a namespace cached, and their block keys."""

    tokens: int
    blocks: tuple[bytes, ...]
    #: The namespace it was found in (a gateway asks several: a tenant's, public ones).
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """Where one pinned block's bytes are, for a reader that maps the segment itself.

    Attributes:
        key: the block hash.
        found: the tier the block was in when asked for (``hot``, ``warm``, ``cold``).
        segment: the shared-memory segment (``/dev/shm/<segment>``) holding it.
        segment_bytes: the segment's size.
        offset: byte offset of the block in the segment.
        nbytes: bytes of the block.
        shape: ``[layers, 2, kv_heads, tokens, head_dim]``.
        dtype: ``float32``, ``float16`` or ``bfloat16``.
        crc32: CRC32 of the bytes (the writer's while the block is exact).
        exact: False when the bytes went through a lossy step (int8, fp16 of fp32, …).
        lossy: which step ("" when exact; see :mod:`memkv.protocol.exactness`).
    """

    key: bytes
    found: str
    segment: str
    segment_bytes: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    crc32: int
    exact: bool
    lossy: str = ""


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """A lease on pinned blocks and where to copy them from.

    Attributes:
        lease_id: hand back with ``release_lease`` once the copies are done.
        device_id: the device that holds the blocks.
        node_id: the Ray node of that device: only a reader on it can map the segments.
        incarnation: the device process's incarnation (segments of an older one are stale).
        ttl_s: the lease runs out this many seconds after it was granted; after
            that the blocks may move and ``release_lease`` says so.
        expires_at: when it runs out, in the device's ``time.monotonic()``: the
            same clock as every process's on that node (Linux CLOCK_MONOTONIC),
            so a reader there can tell without asking whether it is still valid.
        same_node: False when the deployment does not serve read plans
            (``device.same_node_reads`` off): every entry is None.
        entries: one per key asked for, in order; None where a block could not
            be planned (not in a shared arena): read those in-cluster instead.
    """

    lease_id: str
    device_id: str
    node_id: str
    incarnation: str
    ttl_s: float
    entries: tuple[PlanEntry | None, ...]
    expires_at: float = 0.0
    same_node: bool = True


@dataclass(frozen=True, slots=True)
class ReadRoute:
    """The router's answer to "where do I read this session's blocks".

    Attributes:
        device_id: the session's device ("" while the session holds no block).
        device: its reader (reads go there directly, never through the router).
            The router puts its actor handle here; the session-service handle
            (``memkv.actors.handles``) hands the route on with the handle
            wrapped as a :class:`~memkv.protocol.members.BlockReader`.
        first_index: chain index of ``keys[0]``.
        keys: the block keys, in chain order.
        tokens: tokens held by each of those blocks (the last may be partial).
        layout: the session's layout.
        turn: the session's turn this route was read at.
    """

    device_id: str
    device: BlockReader | None
    first_index: int
    keys: tuple[bytes, ...]
    tokens: tuple[int, ...]
    layout: KVLayout
    turn: int = 0

    def sliced(self, start: int, end: int | None) -> ReadRoute:
        """The part of a whole-session route (first_index 0) from ``start`` to ``end``."""
        keys, tokens = self.keys[start:end], self.tokens[start:end]
        return ReadRoute(self.device_id, self.device, start, keys, tokens, self.layout, self.turn)

    def with_reader(self, reader: BlockReader | None) -> ReadRoute:
        """The same route read through ``reader`` (a handle over ``device``)."""
        return replace(self, device=reader)


@dataclass(frozen=True, slots=True)
class ChainUpdate:
    """What one append changes in a device's block store.

    The session's owner (the router, or a single-process store's session
    table) computes it from the session's old and new chains; the device
    applies it to its blocks without knowing about sessions, the way vLLM's
    scheduler drives its block pool.

    Attributes:
        layout: the session's layout (the blocks' shape and dtype).
        chain: the session's whole chain after the append.
        tokens: tokens of each block of ``chain`` (the last may be partial).
        start_block: index in ``chain`` of the first block sent with the update;
            blocks before it must be stored already.
        priority: the session's class (a shared block takes its holders' highest).
        was_active: the session was active before the append (an append
            activates a suspended session: its blocks count as in use again).
        hold: keys of ``chain`` the session did not hold before (one reference more each).
        drop: keys it held before and no longer does (one reference less each).
        kept: keys it held before and still holds (one more round of use: precision).
        tail_rewrites: how often the session's partial last block has been
            replaced (the codec policy stores often rewritten tails uncompressed).
        exact_only: the session's blocks never take a lossy step (no fp16 of an
            fp32 block, no int8, no lossy cold codec) while it holds them.
        turn: the index of the turn this append creates (0 = the session's
            first): blocks it creates keep it (the precision policy keeps
            first-round blocks in the model's dtype).
    """

    layout: KVLayout
    chain: tuple[bytes, ...]
    tokens: tuple[int, ...]
    start_block: int
    priority: Priority
    was_active: bool
    hold: tuple[bytes, ...]
    drop: tuple[bytes, ...]
    kept: tuple[bytes, ...]
    tail_rewrites: int = 0
    exact_only: bool = False
    turn: int = 0
