"""What every suite gets: its sizes (quick or full), its inputs, and a memkv cluster.

A suite that needs the cluster or the gateway asks the context; the context
starts an embedded cluster (sized for benchmarks) and a gateway on first use,
or hands out the ones it was given (the test suite's session fixtures: Ray can
be initialised only once per process).
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memkv.errors import ConfigError

if TYPE_CHECKING:
    from memkv.cluster import MemkvCluster

__all__ = [
    "BENCH_CLUSTER_OVERRIDES",
    "DEFAULT_OUT",
    "BenchContext",
]

DEFAULT_OUT = Path("benchmarks") / "results"

MIB = 1 << 20
GIB = 1 << 30

#: The embedded cluster the CLI starts: one CPU device with room for the largest
#: suite (64 clients x a few 4 MiB blocks, 8k-token sessions) without demotions
#: muddying the figures, and an object store that holds a suite's blocks in flight.
BENCH_CLUSTER_OVERRIDES: dict[str, Any] = {
    "cluster": {
        "namespace": "memkv-bench",
        "embedded_devices": 1,
        "embedded_object_store_bytes": 1 * GIB,
    },
    "device": {
        "hot_capacity_bytes": 2 * GIB,
        "warm_capacity_bytes": 1 * GIB,
        "allocator": {"min_unit_bytes": 1 * MIB},
        # The suites measure the same-node path too (one trusted machine).
        "same_node_reads": True,
    },
    # Benchmarks are not about durability: leave flushing to the OS.
    "archive": {"fsync": "never"},
}

#: How long a benchmark waits for a new device to populate its arenas.
PREFAULT_WAIT_S = 120.0

#: Request bodies the bench gateway accepts: a turn of an 8k-token session is 32 MiB.
BENCH_MAX_BODY_BYTES = 256 * MIB

@dataclass(slots=True)
class BenchContext:
    """Sizes, inputs and shared resources of one ``memkv bench`` run.

    Attributes:
        quick: seconds-long sizes (tests, smoke runs) instead of the full ones.
        trace: a Mooncake-format JSONL trace for the eviction suite.
        model: a local HF causal LM directory for the resume suite.
        out: where results are written.
        cluster: a running memkv cluster to use (else one is started on demand).
        gateway_url: a running gateway to use (else one is started on demand).
    """

    quick: bool = False
    trace: Path | None = None
    model: Path | None = None
    out: Path = DEFAULT_OUT
    cluster: MemkvCluster | None = None
    gateway_url: str | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def get_cluster(self) -> MemkvCluster:
        """The cluster to measure: the one given, or an embedded one started now.

        Raises:
            ConfigError: Ray is already initialised in this process by someone
                else (pass that cluster in instead).
        """
        if self.cluster is not None:
            return self.cluster
        import ray

        from memkv.cluster import connect
        from memkv.config import load_config

        if ray.is_initialized():
            raise ConfigError(
                "Ray is already initialised in this process; pass its memkv cluster to "
                "BenchContext(cluster=...) instead of letting the benchmark start one"
            )
        archive_dir = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="memkv-bench-"))
        overrides = {**BENCH_CLUSTER_OVERRIDES}
        overrides["archive"] = {**overrides["archive"], "directory": archive_dir}
        config = load_config(overrides=overrides)
        self.cluster = self._stack.enter_context(connect(config=config))
        # Measure a device in its steady state: its arenas populate their pages
        # in the background at start, which would compete with the first figures.
        devices = ray.get(self.cluster.router.devices.remote()).values()
        ray.get([d.wait_prefaulted.remote(PREFAULT_WAIT_S) for d in devices])
        return self.cluster

    def get_gateway_url(self) -> str:
        """The gateway's base URL: the one given, or one started now on 127.0.0.1."""
        if self.gateway_url is not None:
            return self.gateway_url
        from memkv.api.server import GatewayServer

        server = GatewayServer.start(
            self.get_cluster(), host="127.0.0.1", port=0, max_body_bytes=BENCH_MAX_BODY_BYTES
        )
        self._stack.enter_context(server)
        self.gateway_url = server.url
        return server.url

    def close(self) -> None:
        """Stop what this context started (gateway, then cluster), never what it was given."""
        self._stack.close()

    def __enter__(self) -> BenchContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
