"""``$MEMKV_NODE_ID`` in memkv's actor processes: the Ray node they run on.

A data path written once in a config must differ per node where nodes share a
disk (nodes of ``ray.cluster_utils.Cluster`` on one machine, or a network
filesystem): ``/mnt/shared/$MEMKV_NODE_ID/archive``. The path is resolved in
the process that uses it (:func:`memkv.storage.owned_dir.resolve_on_node`), so
each actor exports its node's id before it opens a directory.
"""

from __future__ import annotations

import os

import ray

__all__ = ["NODE_ID_ENV", "export_node_id"]

NODE_ID_ENV = "MEMKV_NODE_ID"
#: Characters of Ray's node id kept (its hex prefix is unique in any real cluster).
NODE_ID_CHARS = 12


def export_node_id() -> str:
    """Set ``$MEMKV_NODE_ID`` to this process's Ray node (its first 12 hex digits)."""
    node = (
        ray.get_runtime_context().get_node_id()[:NODE_ID_CHARS] if ray.is_initialized() else "local"
    )
    os.environ[NODE_ID_ENV] = node
    return node
