"""The session router's Ray actor: one named actor per cluster (or per shard).

:class:`~memkv.router.service.SessionRouter` is the plain service
(the session table, placement, recovery, garbage); this shell gives it what
only a Ray process has: devices, archives and peers as typed handles over
Ray actor handles (:mod:`memkv.actors.handles`), found again by name after a
restart, and each message of the session service as one msgpack document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle

from memkv.actors.archive_journal import ArchiveJournal, journal_name
from memkv.actors.handles import ArchiveHandle, DeviceHandle, RayDirectory, named_actors
from memkv.actors.node_env import export_node_id
from memkv.protocol.responses import StoredResponse
from memkv.protocol.services import (
    AppendTurn,
    CreateSession,
    CreateSessions,
    ForkSession,
    ReserveSlots,
    RewindSession,
    decode,
    encode,
)
from memkv.router import RouterState, SessionRouter
from memkv.storage.journal import Journal
from memkv.storage.owned_dir import resolve_on_node

__all__ = ["RouterState", "SessionRouter", "SessionRouterActor", "SessionRouterShell"]


class SessionRouterShell(SessionRouter):
    """What Ray callers reach (:class:`memkv.actors.handles.SessionServiceHandle`
    is the other end of the ``*_wire`` methods)."""

    def __init__(
        self,
        namespace: str | None = None,
        *,
        journal_archives: Sequence[str] = (),
        journal_replicas: int = 0,
        **options: Any,
    ) -> None:
        """Args (beyond :class:`SessionRouter`'s):
            namespace: the deployment's Ray namespace (passed: the actor's runtime
                context names the namespace of the job that created it, which may
                be another).
            journal_archives, journal_replicas: keep the journal on that many of
                these archives (:class:`ArchiveJournal`) rather than in
                ``journal_dir`` (then only read, once, by a shard moving there).
        """
        node = export_node_id()  # its journal's path may name $MEMKV_NODE_ID
        if journal_archives and journal_replicas > 0 and options.get("journal_dir"):
            local_dir = options.pop("journal_dir")
            name = journal_name(options.get("router_name", "memkv-router"),
                                options.get("shard", 0), options.get("shards", 1))
            options["journal"] = ArchiveJournal(
                name,
                named_actors(journal_archives, namespace),
                replicas=journal_replicas,
                own_node=node,
                local=_existing_journal(local_dir, options.get("journal_fsync", True)),
            )
        super().__init__(directory=RayDirectory(namespace), **options)

    async def register_device(self, device_id: str, device: Any) -> None:
        await super().register_device(device_id, DeviceHandle(device))

    async def register_archive(self, archive_id: str, archive: Any) -> None:
        await super().register_archive(archive_id, ArchiveHandle(archive))

    async def archives(self) -> dict[str, ActorHandle]:
        """Each live archive's actor handle (a client that attached finds them here)."""
        await self._ready()
        return {name: handle.actor for name, handle in self.collector.archives.items()
                if isinstance(handle, ArchiveHandle)}

    async def create_session_wire(self, request: bytes) -> bytes:
        return encode(await self.create_session(decode(CreateSession, request)))

    async def create_sessions_wire(self, request: bytes) -> bytes:
        return encode(await self.create_sessions(decode(CreateSessions, request)))

    async def session_wire(self, session_id: str) -> bytes:
        return encode(await self.session(session_id))

    async def put_blocks_wire(self, request: bytes, blocks: list[Any]) -> bytes:
        return encode(await self.put_blocks(decode(AppendTurn, request), blocks))

    async def reserve_slots_wire(self, request: bytes) -> bytes:
        return encode(await self.reserve_slots(decode(ReserveSlots, request)))

    async def resume_wire(self, session_id: str) -> bytes:
        return encode(await self.resume(session_id))

    async def suspend_wire(self, session_id: str, offline: bool) -> bytes:
        return encode(await self.suspend(session_id, offline))

    async def set_priority_wire(self, session_id: str, priority: str) -> bytes:
        return encode(await self.set_priority(session_id, priority))

    async def fork_session_wire(self, request: bytes) -> bytes:
        return encode(await self.fork_session(decode(ForkSession, request)))

    async def rewind_session_wire(self, request: bytes) -> bytes:
        return encode(await self.rewind_session(decode(RewindSession, request)))

    # -- stored responses (memkv.protocol.responses.ResponseService) ----------------------

    async def put_response_wire(self, session_id: str, response: bytes) -> None:
        await self.responses.put(session_id, decode(StoredResponse, response))

    async def get_response_wire(self, session_id: str, response_id: str) -> bytes:
        return encode(await self.responses.get(session_id, response_id))

    async def delete_response(self, session_id: str, response_id: str) -> None:
        await self.responses.delete(session_id, response_id)


def _existing_journal(directory: str, fsync: bool) -> Journal | None:
    """The journal a shard kept on local disk, if it kept one (not created otherwise)."""
    path = resolve_on_node(directory)
    if not any((path / f).is_file() for f in ("journal.log", "snapshot.bin")):
        return None
    return Journal(path, fsync=fsync)


#: The actor: async, so slow device calls of one session do not block others.
#: Ray restarts it if its process dies; it rebuilds its table from the journal.
SessionRouterActor = ray.remote(max_restarts=-1, max_task_retries=0)(SessionRouterShell)
