"""A device's cold tier in a cluster: the archive actors, each block on ``replicas`` of them.

The archives are the cold tier of the whole cluster, one per node with an NVMe
path. A device writes every cold block to the first ``replicas`` live archives
of its list (its own node's first, then the others in an order that differs by
device, so replicas spread); one archive per node, so the copies are on
distinct nodes. A durable write (an ``archive``-mode append, a suspend) is
acknowledged only once every copy is fsynced.

An archive whose node is gone (Ray cannot place it again:
``ActorUnschedulableError``) is skipped from then on: writes go to the next
live one, reads fall over to the others. A block missing from one archive, or
damaged there (its frame fails the checksum), is read from another: corrupt
data is never served, and the router's repair puts the copy back
(:mod:`memkv.router.repair`).

An archive whose disk (or ``archive.capacity_bytes``) is full refuses writes
with :class:`~memkv.errors.StorageFullError`: it leaves the write set for
``FULL_RETRY_S`` (reads still go to it) and the next archive takes the copy,
so one full disk never stops the cluster's appends. Only when no archive can
take a single copy does the write fail (HTTP 507, nothing acknowledged).

Copies have a deadline (``replica_timeout_s``): an archive that has not answered
by then (a slow or cut-off host, still alive to Ray) is passed over and the
next one takes the copy; with none left, the write is answered with the copies
it has, and the router's repair adds the missing ones. So a slow host costs
its own writes latency, not every session's. Only when no copy at all arrives
in time does the write keep waiting, for the first archive that answers.

Blocks are encoded here (the device's CPU does the codec work) and sent as
frames. ``remove`` does nothing: another device's session may hold the same
content-addressed block, so only the router, which sees every session, deletes
archived blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import ray
import torch
from ray.exceptions import ActorUnschedulableError, RayActorError

from memkv.actors.restarts import through_restarts
from memkv.actors.waiting import wait_for
from memkv.errors import MemberLostError, StorageFullError, UnknownBlockError, plain_message
from memkv.protocol.enums import Tier
from memkv.protocol.stats import ArchiveStats
from memkv.storage.codecs import decode_frame, encode_stored
from memkv.storage.config import CodecConfig
from memkv.storage.tiers import ColdStats, StoredBlock

__all__ = ["ArchiveReplicas", "replica_order"]

#: An under-replicated write is logged at most this often (the count says how many).
UNDER_REPLICATED_LOG_S = 60.0
#: How long a full archive is left out of writes before it is tried again (compaction,
#: the collector or an operator may have made room).
FULL_RETRY_S = 10.0
#: How often copies that missed their deadline are polled while no copy has landed.
_LATE_POLL_S = 0.05

logger = logging.getLogger(__name__)

# Pause between retries while an archive actor restarts.
_ARCHIVE_RETRY_S = 0.2


class _Sent(NamedTuple):
    """A copy's put, sent: its reference, and its arguments (to send it again to an
    archive Ray restarted meanwhile)."""

    ref: Any
    args: tuple[Any, ...]


def replica_order(own: str | None, archives: Sequence[str], spread: int) -> list[str]:
    """The archives a device writes to and reads from, in order.

    Its own node's archive first (a local write, and a local read), then the
    others rotated by ``spread`` (the device's index), so the second copies of
    different devices land on different archives.
    """
    others = sorted(a for a in archives if a != own)
    if others:
        k = spread % len(others)
        others = others[k:] + others[:k]
    return ([own] if own is not None else []) + others


class ArchiveReplicas:
    """The store's cold tier, kept by the cluster's archive actors.

    Args:
        archives: ``(name, handle)`` in preference order (:func:`replica_order`).
        codecs: how blocks are encoded into frames.
        replicas: copies of each block, on that many archives (capped by the
            live archives there are; fewer is logged and counted).
        restart_timeout_s: how long to wait for an archive Ray is restarting.
        resolve: waits for a call's answer (memkv.actors.waiting): ``(ref,
            timeout_s)``, raising TimeoutError when it has none in time.
        share: puts a payload sent to several archives in the object store once
            (``ray.put``).
        replica_timeout_s: how long a write waits for a copy before it passes
            that archive over (None: for every copy, however long).
    """

    tier = Tier.COLD
    owns_sessions = False
    capacity_bytes: int | None = None

    def __init__(
        self,
        archives: Sequence[tuple[str, Any]],
        codecs: CodecConfig,
        *,
        replicas: int = 1,
        restart_timeout_s: float = 60.0,
        resolve: Callable[[Any, float | None], Any] = wait_for,
        share: Callable[[Any], Any] = ray.put,
        clock: Callable[[], float] = time.monotonic,
        replica_timeout_s: float | None = None,
    ) -> None:
        # (No archive at all, every one gone: each call raises MemberLostError.)
        self._archives = list(archives)
        self._codecs = codecs
        self.replicas = max(1, replicas)
        self._restart_timeout_s = restart_timeout_s
        self._resolve, self._share = resolve, share
        self.lost: set[str] = set()
        self.under_replicated_writes = 0  # batches written to fewer copies than asked
        self._next_short_log = 0.0  # when an under-replicated write may be logged again
        self.fallback_reads = 0  # blocks read from an archive other than the first
        self._clock = clock
        self._full_until: dict[str, float] = {}  # full archives: left out of writes until
        self.full_refusals = 0  # writes an archive refused for want of room
        self.replica_timeout_s = replica_timeout_s
        self.late_copies = 0  # copies passed over for missing their deadline

    # -- which archives -------------------------------------------------------------

    def _live(self) -> list[tuple[str, Any]]:
        live = [(n, a) for n, a in self._archives if n not in self.lost]
        if not live:
            raise MemberLostError(
                f"every archive of this device is lost ({', '.join(sorted(self.lost))}): the "
                f"cold tier is unreachable until an archive node joins"
            )
        return live

    def _writable(self) -> list[str]:
        """Live archives not known to be full, in order."""
        now = self._clock()
        return [n for n, _ in self._live() if self._full_until.get(n, 0.0) <= now]

    def _full(self, name: str, error: StorageFullError) -> None:
        self.full_refusals += 1
        if self._full_until.get(name, 0.0) <= self._clock():
            logger.warning("archive %s is full (%s); its copies go to the others for %.0f s",
                           name, plain_message(error), FULL_RETRY_S)
        self._full_until[name] = self._clock() + FULL_RETRY_S

    def _lose(self, name: str, error: BaseException) -> None:
        if name not in self.lost:
            logger.warning("archive %s is lost (%s); using the others", name, error)
            self.lost.add(name)

    def _get(self, name: str, method: str, *args: Any, sent: Any = None,
             timeout_s: float | None = None) -> Any:
        """``archive.method(*args)``'s answer, waiting out a restart (it rebuilds its
        index); ``sent``: the call's reference, if it was already sent, and
        ``timeout_s`` how long to wait for it (TimeoutError after).

        Every archive call is idempotent (puts of content-addressed frames,
        reads, membership), so retrying one that may have run is safe.
        """
        archive = dict(self._archives)[name]
        if sent is not None:
            try:
                return self._resolve(sent, timeout_s)
            except ActorUnschedulableError:
                raise
            except RayActorError:
                pass  # restarting: ask again below
        return through_restarts(
            lambda: self._resolve(getattr(archive, method).remote(*args), None),
            timeout_s=self._restart_timeout_s, wait_s=_ARCHIVE_RETRY_S)

    def _first(self, method: str, *args: Any) -> Any:
        """The first live archive's answer (the next one's when it is lost)."""
        while True:
            name, _ = self._live()[0]
            try:
                return self._get(name, method, *args)
            except ActorUnschedulableError as e:
                self._lose(name, e)

    # -- writes ---------------------------------------------------------------------

    def _write(self, frames: list[tuple[bytes, bytes, bytes]], durable: bool) -> None:
        """``frames`` on ``replicas`` live archives (sent together, awaited together,
        each within ``replica_timeout_s``).

        Raises:
            StorageFullError: no archive could take a copy (every one is full).
        """
        done: set[str] = set()
        refused: dict[str, StorageFullError] = {}  # by this write
        late: dict[str, _Sent] = {}  # calls past their deadline, still running
        while True:
            live = [n for n, _ in self._live()]
            targets = [n for n in self._writable()
                       if n not in done and n not in refused and n not in late]
            targets = targets[: self.replicas - len(done)]
            if not targets:
                if not done and late:
                    self._first_late(late, done, refused)  # no copy yet: any, however late
                break
            # One copy in the object store, whatever the number of replicas.
            args = (self._share(frames) if len(targets) > 1 else frames, durable)
            refs = {n: dict(self._archives)[n].put_frames.remote(*args) for n in targets}
            deadline = (None if self.replica_timeout_s is None
                        else self._clock() + self.replica_timeout_s)
            for name, ref in refs.items():
                wait = None if deadline is None else max(0.0, deadline - self._clock())
                self._settle(name, _Sent(ref, args), wait, done, refused, late)
            if len(done) >= self.replicas:
                break
        if not done and not refused:
            raise MemberLostError("no archive took the cold copy: every one asked was lost")
        if not done:
            full = sorted(n for n in self._full_until if self._full_until[n] > self._clock())
            raise StorageFullError(
                f"no archive can take the cold copy: {len(full)} of {len(live)} live "
                f"archive(s) are full ({', '.join(full) or 'none'})"
                + (f"; {plain_message(next(iter(refused.values())))}" if refused else "")
            )
        passed_over = [n for n in late if n not in done]
        if passed_over:
            self.late_copies += len(passed_over)
            logger.warning("archive(s) %s did not take a cold copy within %g s: passed over "
                           "(%d such copies so far; the router's repair adds them)",
                           ", ".join(passed_over), self.replica_timeout_s, self.late_copies)
        if len(done) < self.replicas:
            self.under_replicated_writes += 1
            # Every write is short while the archives are (one machine with one archive:
            # each write): the first says so, then one line a minute with the count.
            now = time.monotonic()
            if now >= self._next_short_log:
                self._next_short_log = now + UNDER_REPLICATED_LOG_S
                logger.warning(
                    "cold blocks written to %d of %d replicas (%d such writes so far; "
                    "archives live: %d, lost: %s); the router's repair adds the copies "
                    "when an archive joins",
                    len(done), self.replicas, self.under_replicated_writes, len(live),
                    ", ".join(sorted(self.lost)) or "none",
                )

    def _settle(self, name: str, call: _Sent, wait: float | None,
                done: set[str], refused: dict[str, StorageFullError],
                late: dict[str, _Sent]) -> None:
        """One copy's outcome (``call``: its reference and arguments), waiting at most
        ``wait`` for it; recorded in the sets given."""
        ref, args = call
        try:
            self._get(name, "put_frames", *args, sent=ref, timeout_s=wait)
            done.add(name)
            late.pop(name, None)
        except TimeoutError:
            late[name] = call
        except ActorUnschedulableError as e:
            late.pop(name, None)
            self._lose(name, e)
        except StorageFullError as e:
            late.pop(name, None)
            refused[name] = e
            self._full(name, e)

    def _first_late(self, late: dict[str, _Sent], done: set[str],
                    refused: dict[str, StorageFullError]) -> None:
        """Every copy missed its deadline and no archive is left: the first to land."""
        while late and not done:
            for name, call in list(late.items()):
                self._settle(name, call, _LATE_POLL_S, done, refused, late)
                if done:
                    return

    def put(self, key: bytes, block: StoredBlock, *, fingerprint: bytes, codec: str) -> int:
        frame = encode_stored(self._codecs, codec, block)
        self._write([(bytes(key), frame, fingerprint)], False)
        return len(frame)

    def put_many(
        self, items: Sequence[tuple[bytes, StoredBlock, bytes, str]], *, durable: bool = False
    ) -> list[int]:
        """Encode every block here, then one call per replica for them all.

        ``durable``: each archive fsyncs (group-committed) before it answers.
        """
        frames = [(bytes(k), encode_stored(self._codecs, c, b), fp) for k, b, fp, c in items]
        self._write(frames, durable)
        return [len(frame) for _, frame, _ in frames]

    def sync(self) -> None:
        for name, _ in self._live():
            try:
                self._get(name, "flush")
            except ActorUnschedulableError as e:
                self._lose(name, e)

    # -- reads ----------------------------------------------------------------------

    def _per_key(self, method: str, keys: list[bytes], *, reads: bool = False) -> list[Any]:
        """Each key's answer from the first live archive that has one (its ``method``
        answers None for a key it lacks); None where no live archive does. ``reads``:
        count the blocks answered by an archive other than the first."""
        found: list[Any] = [None] * len(keys)
        wanted = list(range(len(keys)))
        for rank, (name, _) in enumerate(self._live()):
            if not wanted:
                break
            try:
                answers = self._get(name, method, [keys[i] for i in wanted], True)
            except ActorUnschedulableError as e:
                self._lose(name, e)
                continue
            for i, answer in zip(wanted, answers, strict=True):
                if answer is not None:
                    found[i] = answer
                    self.fallback_reads += reads and rank > 0
            wanted = [i for i in wanted if found[i] is None]
        return found

    def load_many(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """One call to the first archive for every frame (others only for what it lacks),
        decoded here.

        Raises:
            UnknownBlockError: no live archive holds a block whole.
        """
        wanted = [bytes(k) for k in keys]
        frames: list[bytes | None] = self._per_key("get_frames", wanted, reads=True)
        absent = [k for k, f in zip(wanted, frames, strict=True) if f is None]
        if absent:
            raise UnknownBlockError(
                f"{len(absent)} block(s) are in no live archive whole, e.g. {absent[0].hex()[:16]}"
            )
        return [decode_frame(f) for f in frames if f is not None]

    def load(self, key: bytes) -> torch.Tensor:
        return self.load_many([key])[0]

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        """Keys no live archive holds."""
        wanted = [bytes(k) for k in keys]
        for name, _ in self._live():
            if not wanted:
                break
            asked = wanted
            try:
                present = self._get(name, "contains", asked)
            except ActorUnschedulableError as e:
                self._lose(name, e)
                continue
            wanted = [k for k, ok in zip(asked, present, strict=True) if not ok]
        return wanted

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and not self.missing([key])

    def codecs(self, keys: Sequence[bytes]) -> list[str]:
        """Each block's codec, from the first live archive that holds it."""
        wanted = [bytes(k) for k in keys]
        found: list[str | None] = self._per_key("codecs", wanted)
        absent = [k for k, c in zip(wanted, found, strict=True) if c is None]
        if absent:
            raise UnknownBlockError(f"block {absent[0].hex()[:16]} is in no live archive")
        return [c for c in found if c is not None]

    def remove(self, key: bytes) -> None:
        return None

    def block_keys(self) -> Iterator[bytes]:
        return iter(())

    def stats(self) -> ColdStats:
        """The first live archive's (this node's, while it lives)."""
        s: ArchiveStats = self._first("stats")
        return ColdStats(s.blocks, s.live_bytes, s.dead_bytes)

    def live_bytes(self) -> int:
        return self.stats().live_bytes

    def close(self) -> None:
        return None
