"""A ``memkv up`` deployment for the engine tests: what a ``vllm serve`` user points at.

Its tiers hold the engines' blocks in shared memory (the suite's cluster keeps
tiers of a few KiB, for pressure), same-node reads are on, and the gateway
asks for a token, as a deployment's does: an engine is given one URL and one
token and finds the fastest path by itself. Two tenants have tokens: ``default``
(with the admin role, which registers engines) and ``other``.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import pytest
import yaml

from ..memkv_up import start_memkv_up, stop_memkv_up


@dataclass(frozen=True)
class Deployment:
    url: str
    token: str  # tenant "default": write, read, admin
    other_token: str  # tenant "other": write, read


def _tokens_file(path, tokens: dict[str, tuple[str, list[str]]]) -> None:
    path.write_text(yaml.safe_dump({"tokens": [
        {"sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": tenant, "roles": roles}
        for token, (tenant, roles) in tokens.items()]}))


@pytest.fixture(scope="session")
def memkv_deployment(tmp_path_factory):
    data = tmp_path_factory.mktemp("memkv-up")
    token, other = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    _tokens_file(data / "tokens.yaml", {token: ("default", ["write", "read", "admin"]),
                                        other: ("other", ["write", "read"])})
    proc, summary = start_memkv_up(data, data / "up.log", {
        "MEMKV_GATEWAY__AUTH__TOKENS_FILE": str(data / "tokens.yaml"),
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
        yield Deployment(summary["gateway"], token, other)
    finally:
        stop_memkv_up(proc)
