"""The same-node read path: copy blocks straight out of a device's shared memory.

A reader on the device actor's node asks for a read plan (segment, offset,
length and checksum of each block, under a lease that pins them), copies the
bytes out of the mapped segments into its own buffers, verifies each copy's
checksum, and releases the lease. One copy, no serialisation, no socket.

It is opt-in per deployment (``same_node_reads``): every process that can map
the segments can read every block in them, whatever its tenant.

Guarantees:
- A lease that ran out before release (or a device that restarted under the
  plan) raises :class:`~memkv.errors.LeaseExpiredError`; the copies are
  dropped, never returned.
- A plan used on another node raises :class:`~memkv.errors.WrongNodeError`.
- A copy whose checksum differs raises :class:`~memkv.errors.CorruptDataError`.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from memkv.errors import CorruptDataError, LeaseExpiredError, WrongNodeError
from memkv.protocol.checksum import crc32
from memkv.protocol.dtypes import numpy_view_dtype
from memkv.protocol.messages import PlanEntry, ReadPlan

__all__ = ["CopiedBlock", "SameNodeReader", "SegmentMaps", "copy_entries", "shm_identity"]

_SHM_DIR = "/dev/shm"
#: Copy threads of a reader (memory bandwidth of one core is not all of a node's).
COPY_THREADS = 2
#: A plan is taken as valid only if this much of its lease is left after the copy.
LEASE_MARGIN_S = 0.5


def shm_identity() -> str:
    """Names this host's shared memory: equal in two processes that see the same segments.

    The kernel's boot id (one per host and boot) and the device number of the
    ``/dev/shm`` mount (containers with a private ``/dev/shm`` differ in it).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: no same-host shared memory worth naming
        return ""
    try:
        dev = os.stat(_SHM_DIR).st_dev
    except OSError:
        return ""
    return f"{boot}/{dev}"


@dataclass(frozen=True, slots=True)
class CopiedBlock:
    """A block copied out of shared memory: its bytes as a numpy array (bf16 as uint16)."""

    key: bytes
    array: np.ndarray
    dtype: str
    found: str
    exact: bool
    lossy: str = ""


class SegmentMaps:
    """Read-only mappings of shared-memory segments, by (segment, device incarnation).

    A device that restarts creates a new segment under the same name; the old
    mapping would show the dead process's memory, so a mapping is only reused
    for the incarnation that made it.
    """

    def __init__(self) -> None:
        self._maps: dict[str, tuple[str, mmap.mmap, np.ndarray]] = {}
        self._lock = threading.Lock()

    def view(self, segment: str, nbytes: int, incarnation: str,
             populate: bool = False) -> np.ndarray:
        """The whole segment as a read-only uint8 array (``populate``: its page tables
        filled now, so that the first copy out of it takes no page faults)."""
        with self._lock:
            cached = self._maps.get(segment)
            if cached is not None and cached[0] == incarnation and cached[2].size >= nbytes:
                return cached[2]
            if cached is not None:
                del self._maps[segment]
            if "/" in segment or segment in (".", ".."):
                raise CorruptDataError(f"a read plan names an invalid segment {segment!r}")
            try:
                fd = os.open(os.path.join(_SHM_DIR, segment), os.O_RDONLY)
            except FileNotFoundError:
                raise LeaseExpiredError(
                    f"segment {segment!r} is gone (its device restarted); ask for a new plan"
                ) from None
            try:
                flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
                mapped = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            array = np.frombuffer(mapped, dtype=np.uint8)
            self._maps[segment] = (incarnation, mapped, array)
            return array

    def prune(self, keep: Callable[[str, str], bool]) -> int:
        """Let go of the mappings ``keep(segment, incarnation)`` says are stale (the
        segment was unlinked, or made again). A mapping keeps its pages alive after the
        file is unlinked (a client's 1 GiB of staging outliving the engine that made
        it), so an owner that maps other processes' segments calls this now and then.
        Returns how many it let go."""
        with self._lock:
            stale = [name for name, (incarnation, _, _) in self._maps.items()
                     if not keep(name, incarnation)]
            for name in stale:
                del self._maps[name]  # closed once no array views it
            return len(stale)

    def prune_unlinked(self) -> int:
        """:meth:`prune` of the segments no longer in ``/dev/shm``."""
        return self.prune(lambda name, _: os.path.exists(os.path.join(_SHM_DIR, name)))

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        with self._lock:
            # Mappings close once no array views them (numpy holds a reference).
            self._maps.clear()


def copy_entries(
    maps: SegmentMaps,
    plan: ReadPlan,
    entries: Sequence[PlanEntry],
    out: Sequence[np.ndarray | None] | None = None,
) -> list[np.ndarray]:
    """Copy planned blocks into ``out`` (uint8 buffers of each block's size) or new arrays."""
    copies: list[np.ndarray] = []
    for i, entry in enumerate(entries):
        segment = maps.view(entry.segment, entry.segment_bytes, plan.incarnation)
        if entry.offset < 0 or entry.offset + entry.nbytes > segment.size:
            raise CorruptDataError(
                f"block {entry.key.hex()}: bytes {entry.offset}+{entry.nbytes} lie outside "
                f"segment {entry.segment!r} of {segment.size} bytes"
            )
        dst = out[i] if out is not None else None
        if dst is None:
            dst = np.empty(entry.nbytes, dtype=np.uint8)
        elif dst.nbytes != entry.nbytes:
            raise ValueError(
                f"out[{i}] holds {dst.nbytes} bytes, block {entry.key.hex()} needs {entry.nbytes}"
            )
        src = segment[entry.offset : entry.offset + entry.nbytes]
        np.copyto(dst.reshape(-1).view(np.uint8), src)
        copies.append(dst)
    return copies


class SameNodeReader:
    """Reads blocks from a device actor on this node through shared memory.

    Args:
        device: the device: its reader (a :class:`~memkv.protocol.members.BlockReader`,
            as routes and located groups hand it out), a bare Ray actor handle,
            or a plain :class:`~memkv.actors.device.DeviceCache` (same process, tests).
        node_id: this process's Ray node id (``ray.get_runtime_context()``);
            plans of another node are refused.
        ttl_s: lease length asked for.
        threads: copy threads (blocks are copied and checked in parallel).
        clock: this node's monotonic clock (the device's; a fake in tests).

    Example:
        >>> reader = SameNodeReader(device, node_id=ray.get_runtime_context().get_node_id())
        >>> blocks = reader.read(keys)            # doctest: +SKIP
    """

    def __init__(
        self,
        device: Any,
        *,
        node_id: str,
        ttl_s: float = 30.0,
        threads: int = COPY_THREADS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._device = device
        self._node_id = node_id
        self._ttl_s = ttl_s
        self._maps = SegmentMaps()
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._clock = clock

    def _call(self, method: str, *args: Any) -> Any:
        fn = getattr(self._device, method)
        if hasattr(fn, "remote"):  # a bare actor handle
            import ray

            return ray.get(fn.remote(*args))
        answer = fn(*args)
        # A reader handle's answer is on its way (Answer); a local device's is here.
        return answer.result() if hasattr(answer, "result") else answer

    def plan(self, keys: Sequence[bytes], stream: str | None = None) -> ReadPlan:
        """A plan for ``keys`` (pinned until :meth:`release` or the lease runs out)."""
        plan: ReadPlan = self._call("read_plan", [bytes(k) for k in keys], stream, self._ttl_s)
        if plan.node_id != self._node_id:
            self.release(plan)
            raise WrongNodeError(
                f"device {plan.device_id!r} runs on node {plan.node_id}, this reader on "
                f"{self._node_id}: same-node reads need the same node (read in-cluster instead)"
            )
        return plan

    def release(self, plan: ReadPlan) -> bool:
        return bool(self._call("release_lease", plan.lease_id))

    def read(
        self,
        keys: Sequence[bytes],
        *,
        out: Sequence[np.ndarray | None] | None = None,
        stream: str | None = None,
        verify: bool = True,
    ) -> list[CopiedBlock]:
        """Copy ``keys``' blocks; blocks not in shared memory come in-cluster.

        The copies and their checksums run on up to :data:`COPY_THREADS`
        threads (numpy and ISA-L release the interpreter lock). Whether the
        lease held is decided on this node's monotonic clock against the
        plan's deadline, so the release needs no answer and is not waited for.

        Args:
            out: optional destination buffers (uint8, one block's size each).
            verify: check each copy's CRC32 (on by default; the check is the
                only defence against a writer that broke the pins).

        Raises:
            LeaseExpiredError, WrongNodeError, CorruptDataError: see the module.
        """
        plan = self.plan(keys, stream)
        planned = [(i, e) for i, e in enumerate(plan.entries[: len(keys)]) if e is not None]
        try:
            dsts = [out[i] for i, _ in planned] if out is not None else [None] * len(planned)
            copies = self._copy_all(plan, [e for _, e in planned], dsts, verify)
            # Nothing copied from shared memory (nothing planned): nothing to void.
            valid = not planned or self._clock() < plan.expires_at - LEASE_MARGIN_S
        finally:
            self.release_async(plan)
        if not valid:
            raise LeaseExpiredError(
                f"lease {plan.lease_id} on device {plan.device_id!r} ran out before the copy "
                "finished; its blocks may have moved (the copies were discarded)"
            )
        result: list[CopiedBlock | None] = [None] * len(keys)
        for (i, entry), copy in zip(planned, copies, strict=True):
            array = copy.view(numpy_view_dtype(entry.dtype)).reshape(entry.shape)
            result[i] = CopiedBlock(
                entry.key, array, entry.dtype, entry.found, entry.exact, entry.lossy
            )
        missing = [i for i, r in enumerate(result) if r is None]
        if missing:
            for i, payload in zip(
                missing,
                self._call("get_blocks", [bytes(keys[i]) for i in missing], stream),
                strict=True,
            ):
                result[i] = CopiedBlock(
                    payload.key,
                    np.array(payload.data),
                    payload.dtype,
                    payload.tier or "",
                    payload.exact,
                    payload.lossy,
                )
        return [r for r in result if r is not None]

    def _copy_all(
        self,
        plan: ReadPlan,
        entries: Sequence[PlanEntry],
        dsts: Sequence[np.ndarray | None],
        verify: bool,
    ) -> list[np.ndarray]:
        def one(i: int) -> np.ndarray:
            (copy,) = copy_entries(self._maps, plan, [entries[i]], [dsts[i]])
            if verify and crc32(copy) != entries[i].crc32:
                raise CorruptDataError(
                    f"block {entries[i].key.hex()}: its copy from shared memory fails its checksum"
                )
            return copy

        if len(entries) < 2 or self._threads <= 1:
            return [one(i) for i in range(len(entries))]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="memkv-copy")
        return list(self._pool.map(one, range(len(entries))))

    def release_async(self, plan: ReadPlan) -> None:
        """Give a plan back without waiting for the answer (see :meth:`read`)."""
        if not plan.lease_id:  # a plan of nothing (same-node reads are off)
            return
        fn = self._device.release_lease
        if hasattr(fn, "remote"):
            fn.remote(plan.lease_id)  # its answer is not needed: see read()
        else:
            fn(plan.lease_id)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._maps.close()

    def __enter__(self) -> SameNodeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class HostLease:
    """A gateway's answer to ``POST /v1/blocks/lease``: blocks pinned in its host's memory.

    Attributes:
        host: the gateway host's :func:`shm_identity`; the plans are only of use
            where it equals this process's (:attr:`local`).
        plans: one read plan per device lease (release each by ``lease_id``).
        blocks: per key asked for, its plan and entry, or None (read it over HTTP).
    """

    host: str
    plans: tuple[ReadPlan, ...]
    blocks: tuple[tuple[ReadPlan, PlanEntry] | None, ...]

    @property
    def local(self) -> bool:
        return bool(self.host) and self.host == shm_identity()

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> HostLease:
        """Parse the route's answer (raises ValueError/KeyError/TypeError on a malformed one)."""
        entries_of: list[list[PlanEntry]] = [[] for _ in doc["leases"]]
        pairs: list[tuple[int, PlanEntry] | None] = []
        for block in doc["blocks"]:
            if block is None:
                pairs.append(None)
                continue
            entry = PlanEntry(
                key=bytes.fromhex(block["key"]),
                found=str(block["found"]),
                segment=str(block["segment"]),
                segment_bytes=int(block["segment_bytes"]),
                offset=int(block["offset"]),
                nbytes=int(block["nbytes"]),
                shape=tuple(int(x) for x in block["shape"]),
                dtype=str(block["dtype"]),
                crc32=int(block["crc32"]),
                exact=bool(block["exact"]),
                lossy=str(block.get("lossy", "")),
            )
            entries_of[int(block["lease"])].append(entry)
            pairs.append((int(block["lease"]), entry))
        plans = tuple(
            ReadPlan(
                lease_id=str(lease["id"]),
                device_id=str(lease["device_id"]),
                node_id="",
                incarnation=str(lease["incarnation"]),
                ttl_s=0.0,
                entries=tuple(entries),
                expires_at=float(lease["expires_at"]),
            )
            for lease, entries in zip(doc["leases"], entries_of, strict=True)
        )
        return cls(
            str(doc["host"]),
            plans,
            tuple(None if p is None else (plans[p[0]], p[1]) for p in pairs),
        )
