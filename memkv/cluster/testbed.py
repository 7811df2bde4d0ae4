"""Several Ray nodes on this machine: the multi-node test bed of the tests, the
cluster benchmark and ``make soak``.

:class:`LocalNodes` wraps ``ray.cluster_utils.Cluster`` (Ray's own multi-node
test harness): a head and worker nodes, each its own raylet and object store
with the custom resources memkv places its actors by, all on 127.0.0.1. Node
deaths are noticed in about a second (Ray's default is tens), and the machine's
previous "current Ray" address is put back afterwards (the harness overwrites
it). A process joins one Ray cluster: run it in a process of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import TracebackType
from typing import Any

from memkv.cluster.loopback import LOOPBACK_ADDRESS, keep_ray_on_loopback

__all__ = ["FAST_HEALTH_CHECKS", "LocalNodes"]

#: Ray's health checks, fast: a node that died is declared dead within ~1 s.
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 200,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 500,
}


class LocalNodes:
    """A head node and workers on this machine; this process is a driver on the head.

    Args:
        head_resources: custom resources of the head (e.g. an archive's).
        namespace: the driver's Ray namespace.
        object_store_bytes: each node's object store.
    """

    def __init__(self, head_resources: dict[str, float], *, namespace: str,
                 object_store_bytes: int = 256 << 20) -> None:
        keep_ray_on_loopback()
        from ray._private import utils as ray_utils
        from ray.cluster_utils import Cluster

        self._ray_utils = ray_utils
        self._object_store_bytes = object_store_bytes
        self._previous_address = ray_utils.read_ray_address()
        self.harness = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": head_resources, "node_ip_address": LOOPBACK_ADDRESS,
            "include_dashboard": False, "object_store_memory": object_store_bytes,
            "_system_config": FAST_HEALTH_CHECKS})
        # The driver joins before the workers exist, so its node is the head's.
        self.harness.connect(namespace=namespace)
        self.workers: list[Any] = []

    @property
    def address(self) -> str:
        return str(self.harness.address)

    def add(self, resources: dict[str, float]) -> Any:
        """A worker node with these custom resources (and one CPU)."""
        node = self.harness.add_node(num_cpus=1, resources=resources,
                                     node_ip_address=LOOPBACK_ADDRESS,
                                     object_store_memory=self._object_store_bytes)
        self.workers.append(node)
        return node

    def kill(self, node: Any) -> None:
        """The node's raylet and processes killed at once (a machine lost)."""
        self.harness.remove_node(node, allow_graceful=False)

    def remove(self, node: Any) -> None:
        """The node stopped in order (a scale-down after its drain)."""
        self.harness.remove_node(node, allow_graceful=True)

    def close(self) -> None:
        import ray

        try:
            ray.shutdown()
            self.harness.shutdown()
        finally:
            if self._previous_address:
                self._ray_utils.write_ray_address(self._previous_address)
            else:
                Path(self._ray_utils.get_ray_address_file(None)).unlink(missing_ok=True)
            logging.getLogger(__name__).info("local Ray nodes stopped")

    def __enter__(self) -> LocalNodes:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
