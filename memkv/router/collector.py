"""The session table's garbage collector: archived blocks no session holds any more.

A block leaves the archive only when no session of any router shard holds it
and no append in flight is about to (an append's blocks reach the archive
before the router records them). Whatever is in doubt stays: an archived
block kept too long costs disk, one deleted too early costs a session.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

from memkv.errors import MemberGoneError, MemberLostError
from memkv.protocol.members import Archive, Directory
from memkv.router.peers import ShardPeers
from memkv.router.state import RouterState

__all__ = ["Collector"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Collector:
    """The router's archives, and what it deletes from them.

    Args:
        state: the session table (who holds what).
        peers: the other shards, asked before a delete.
    """

    def __init__(self, state: RouterState, peers: ShardPeers) -> None:
        self.state = state
        self.peers = peers
        self.archives: dict[str, Archive] = {}
        self.lost_archives: set[str] = set()  # their node is gone
        # Blocks of appends between their device put and their record: a delete
        # meanwhile must not send them to the archive's delete (the device may
        # have deduplicated the append against the very copy being collected).
        self._in_flight: Counter[bytes] = Counter()

    @contextmanager
    def protect(self, keys: Sequence[bytes]) -> Iterator[None]:
        """Keep ``keys`` out of every delete while an append that holds them is in flight."""
        protected = list(dict.fromkeys(bytes(k) for k in keys))
        self._in_flight.update(protected)
        try:
            yield
        finally:
            self._in_flight.subtract(protected)
            for key in protected:
                if self._in_flight[key] <= 0:
                    del self._in_flight[key]

    def referenced(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether a session of this shard, or an append in flight, holds each block."""
        return [self.state.referenced(k) or k in self._in_flight for k in keys]

    def lose_archive(self, name: str, error: BaseException) -> None:
        """An archive whose node is gone: forgotten (its blocks' other copies serve)."""
        if self.archives.pop(name, None) is not None:
            logger.warning("archive %s is lost (%s); its replicas serve its blocks", name, error)
            self.lost_archives.add(name)
            self.state.forget_archive(name)

    async def each_archive(self, ask: Callable[[Archive], Awaitable[_T]]) -> dict[str, _T]:
        """``ask`` of every archive, concurrently; one found lost is forgotten and left out."""
        names = list(self.archives)
        answers = await asyncio.gather(
            *(ask(self.archives[n]) for n in names), return_exceptions=True
        )
        out: dict[str, _T] = {}
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, MemberLostError):
                self.lose_archive(name, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                out[name] = answer
        return out

    async def referenced_anywhere(self, keys: list[bytes]) -> set[bytes]:
        """Those of ``keys`` a session of any shard (or an append in flight here) holds."""
        mine = {k for k, held in zip(keys, self.referenced(keys), strict=True) if held}
        others = [k for k in keys if k not in mine]
        if others and self.peers.names:
            nobody = set(await self.peers.unreferenced(others))
            mine |= {k for k in others if k not in nobody}
        return mine

    async def collect(self, garbage: list[bytes]) -> None:
        """Delete blocks this shard's table no longer references, unless someone else does.

        A block an append in flight holds stays (if that append fails, it stays
        archived unreferenced until a start-up sweep: disk, never a session).
        """
        garbage = [k for k in garbage if k not in self._in_flight]
        if garbage and self.archives:
            garbage = await self.peers.unreferenced(garbage)
        if garbage and self.archives:
            await self.each_archive(lambda a: a.delete(garbage))

    async def collect_unreferenced(self, archives: Sequence[Archive]) -> None:
        """Delete archived blocks no session holds (left by appends a crash never recorded).

        Only right while no append is in flight (its blocks reach the archive
        before the router records them): at start, before the first append.
        A sharded table skips it: the other shards may have appends in flight
        whatever this one's state (leftovers cost disk until deleted, never a
        session).
        """
        if self.peers.names:
            return
        for archive in archives:
            keys = await archive.keys()
            garbage = [k for k in keys if not self.state.referenced(k)]
            if garbage:
                await archive.delete(garbage)
                logger.warning("collected %d unreferenced archive blocks", len(garbage))

    async def reattach(self, directory: Directory) -> None:
        """A restarted router: find the journal's archives again by name; a gone one
        is forgotten (a new one registers itself: ``memkv up``)."""
        for name in list(self.state.known_archives):
            archive = directory.archive(name)
            try:
                if archive is None:
                    raise MemberGoneError(f"no archive {name!r}")
                await archive.ping()
            except MemberGoneError:
                self.state.forget_archive(name)
                continue
            self.archives[name] = archive
