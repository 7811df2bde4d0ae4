"""A ``memkv up`` deployment for the engine tests: what a ``vllm serve`` user points at.

Its tiers hold the engines' blocks in shared memory (the suite's cluster keeps
tiers of a few KiB, for pressure), same-node reads are on, and the gateway
asks for a token, as a deployment's does: an engine is given one URL and one
token and finds the fastest path by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ..memkv_up import start_memkv_up, stop_memkv_up


@dataclass(frozen=True)
class Deployment:
    url: str
    token: str


@pytest.fixture(scope="session")
def memkv_deployment(tmp_path_factory):
    data = tmp_path_factory.mktemp("memkv-up")
    proc, summary = start_memkv_up(data, data / "up.log", {
        "MEMKV_CLUSTER__NAMESPACE": "memkv-engine-tests",
        "MEMKV_CLUSTER__EMBEDDED_DEVICES": "1",
        "MEMKV_CLUSTER__EMBEDDED_OBJECT_STORE_BYTES": str(100 << 20),
        "MEMKV_DEVICE__HOT_CAPACITY_BYTES": str(64 << 20),
        "MEMKV_DEVICE__WARM_CAPACITY_BYTES": str(64 << 20),
        "MEMKV_DEVICE__ALLOCATOR__MIN_UNIT_BYTES": str(1 << 20),
        "MEMKV_DEVICE__SAME_NODE_READS": "true",
        "MEMKV_DEVICE__PREFAULT": "false",
        "MEMKV_ARCHIVE__DIRECTORY": str(data / "archive"),
        "MEMKV_ARCHIVE__FSYNC": "never",
    })
    try:
        yield Deployment(summary["gateway"], (data / "gateway-token").read_text().strip())
    finally:
        stop_memkv_up(proc)
