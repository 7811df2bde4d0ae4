"""The archive actor: an :class:`~memkv.archive.service.ArchiveService`
(the cold tier of a node, no Ray inside) run by Ray.

On a restart (Ray restarts the actor) the segment store rebuilds its index
from the files on disk, so everything that was archived is served again.
"""

from __future__ import annotations

from typing import Any

import ray

from memkv.actors.node_env import export_node_id
from memkv.archive.service import ArchiveService

__all__ = ["ArchiveActor", "ArchiveService", "NodeArchive"]


class NodeArchive(ArchiveService):
    """An ArchiveService whose directory may name ``$MEMKV_NODE_ID`` (its node)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        export_node_id()
        super().__init__(*args, **kwargs)


#: The actor: methods run one at a time in order except reads, which may
#: overlap a write (the segment store has its own lock and pread is thread-safe).
# (Ray's stubs leave max_concurrency out of remote()'s overloads.)
ArchiveActor = ray.remote(  # type: ignore[call-overload]
    max_restarts=-1, max_task_retries=0, max_concurrency=4
)(NodeArchive)
