"""A node's gateway as N worker processes on one pair of ports (``gateway.workers``).

One event loop in one process does all of a gateway's work; a node with
many clients wants its cores. Each worker is a whole gateway (its own
uvicorn, block port, staging segment, plan cache) bound with
``SO_REUSEPORT`` to the same HTTP and block port, and the kernel spreads
new connections over them. Nothing a client does needs the same worker
twice: sessions are the router's, blocks the devices', and a client lease
names its device (memkv.api.client_leases).

Worker 0 runs in the calling process (``memkv up``'s), as a single gateway
always did; the others are Ray actors pinned to this node (no CPUs reserved:
they serve, they do not compute). A worker that dies is not restarted (Ray
cannot promise a restarted actor its constructor's handles): the others keep
the ports open and take its connections; ``memkv up`` again brings it back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from memkv.api.server import GatewayServer

__all__ = ["Gateway", "GatewayProcess", "GatewayWorker", "WorkerInfo"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Which process a gateway worker is and where it serves."""

    pid: int
    url: str
    block_port: int | None


class GatewayProcess:
    """One more gateway process on this node, on the first worker's ports (an actor).

    ``options``: :meth:`GatewayServer.start`'s keywords, as worker 0 got them
    (with its ports), forwarded whole.
    """

    def __init__(self, routers: Any, worker: int, options: Mapping[str, Any]) -> None:
        self._server = GatewayServer.start(routers, reuse_port=True, worker=worker, **options)

    def info(self) -> WorkerInfo:
        return WorkerInfo(os.getpid(), self._server.url, self._server.block_port)

    def stop(self) -> None:
        self._server.stop()


GatewayWorker = ray.remote(num_cpus=0, max_restarts=0)(GatewayProcess)


class Gateway:
    """The gateway of this node: worker 0 here and ``workers - 1`` worker actors.

    Example:
        >>> with Gateway.start(cluster, workers=2, port=0) as gw:   # doctest: +SKIP
        ...     print(gw.url, gw.block_port)

    Args (of :meth:`start`):
        cluster: a :class:`memkv.cluster.MemkvCluster`.
        workers: gateway processes on this node (1: just this one).
        options: the rest of :meth:`GatewayServer.start`'s keywords; every
            worker gets the same, with the ports worker 0 bound.
    """

    def __init__(self, first: GatewayServer, actors: list[Any]) -> None:  # actor handles
        self.first = first
        self.actors = actors
        self.url, self.host, self.port = first.url, first.host, first.port
        self.block_port = first.block_port

    @property
    def workers(self) -> int:
        return 1 + len(self.actors)

    @classmethod
    def start(cls, cluster: Any, *, workers: int = 1, **options: Any) -> Gateway:
        if workers < 1:
            raise ValueError(f"gateway.workers must be at least 1, got {workers}")
        first = GatewayServer.start(cluster, reuse_port=workers > 1, **options)
        if workers == 1:
            return cls(first, [])
        shared = {**options, "port": first.port, "block_port": first.block_port}
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actors: list[Any] = [
            GatewayWorker.options(scheduling_strategy=here).remote(cluster.routers, i, shared)
            for i in range(1, workers)
        ]
        gateway = cls(first, actors)
        try:
            infos = ray.get([a.info.remote() for a in actors])
        except Exception:
            gateway.stop()
            raise
        logger.info("gateway workers on %s: pids %s", first.url,
                    [os.getpid()] + [i.pid for i in infos])
        return gateway

    def stop(self) -> None:
        """Stop the worker actors (each gives back its read plans), then worker 0."""
        stops = [a.stop.remote() for a in self.actors]
        for actor, done in zip(self.actors, stops, strict=True):
            try:
                ray.get(done, timeout=30)
            except Exception:  # noqa: BLE001 - a dead worker has nothing to give back
                logger.debug("gateway worker did not stop cleanly", exc_info=True)
            ray.kill(actor, no_restart=True)
        self.actors = []
        self.first.stop()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
