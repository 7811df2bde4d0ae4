"""The gateway's settings: its ports and limits, who may call it (auth), and the
inference engines its OpenAI front door routes to."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from memkv.config.base import GIB, MAX_PORT, Frozen
from memkv.storage.config import MIB

__all__ = ["AuthSettings", "GatewaySettings", "InferenceEngineSettings", "RoutingSettings"]


class AuthSettings(Frozen):
    """Who may call the gateway (see :mod:`memkv.api.auth`)."""

    enabled: bool = Field(
        default=True,
        description="Every route but /healthz and /readyz needs a bearer token. Off: one "
        "trusted user, session ids unscoped, any namespace (loopback experiments only).",
    )
    tokens_file: Path | None = Field(
        default=None,
        description="Token document (tenant, roles, public namespaces per SHA-256 of a token), "
        "e.g. a mounted Kubernetes Secret; None: $MEMKV_TOKENS, else `memkv up` makes a "
        "token for tenant 'default' and writes it to <data dir>/gateway-token (0600).",
    )
    open_metrics: bool = Field(
        default=True, description="Serve /metrics without a token (for Prometheus scrapes)."
    )
    open_docs: bool = Field(
        default=True, description="Serve /docs, /redoc and /openapi.json without a token."
    )
    max_sessions_per_tenant: int | None = Field(
        default=None,
        ge=0,
        description="Sessions a tenant may hold (507 beyond); the token document's "
        "'tenants' section sets it per tenant. None: no limit.",
    )
    max_bytes_per_tenant: int | None = Field(
        default=None,
        ge=0,
        description="KV bytes (model dtype) a tenant's sessions may hold together (507 "
        "beyond, nothing stored). None: no limit.",
    )


class InferenceEngineSettings(Frozen):
    """An inference engine the gateway's OpenAI front door routes to (``vllm serve``)."""

    url: str = Field(pattern=r"^https?://", description="Its base URL.")
    model: str | None = Field(default=None, description="Its model; null: its /v1/models.")
    node: str = Field(default="", description="The Ray node it runs on (KV affinity).")
    priority_scheduling: bool = Field(
        default=False, description="It runs vLLM's priority scheduler (--scheduling-policy "
        "priority): a session's priority goes with its requests.")
    max_requests: int | None = Field(
        default=None, ge=1, description="Its spill bound: running + waiting requests at which "
        "sessions move to another engine; null: gateway.routing.spill_requests.")
    tenants: list[str] | None = Field(
        default=None, description="The tenants whose requests it takes (its connector holds "
        "a token of theirs and stores what it computes as theirs); null: every tenant's.")


class RoutingSettings(Frozen):
    """How the OpenAI front door chooses an engine for a session's turn and checks engines."""

    spill_requests: int = Field(
        default=32, ge=1, description="An engine with this many running + waiting requests "
        "is passed over while another is under its bounds: the session's turn goes there and "
        "its KV follows from memkv (an engine's max_requests overrides it).")
    spill_kv_use: float = Field(
        default=0.95, gt=0, le=1, description="Likewise for the share of the engine's KV "
        "cache in use (its /metrics).")
    check_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between an engine's checks (/health, /metrics).")
    failures_to_down: int = Field(
        default=2, ge=1, description="Failed checks in a row that take an engine out of "
        "routing (one failed request does at once); one good check brings it back.")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="A forwarded request's time limit (the engine's "
        "connection is closed after it, which aborts the request there).")


class GatewaySettings(Frozen):
    """The FastAPI gateway."""

    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address to bind; 127.0.0.1 keeps it local, 0.0.0.0 serves the network.",
    )
    port: int = Field(
        default=8080, ge=0, le=MAX_PORT, description="TCP port to bind (0: any free port)."
    )
    block_port: int | None = Field(
        default=8081,
        ge=0,
        le=MAX_PORT,
        description="TCP port of the block port on the same host: memkv's frames over bare "
        "TCP beside HTTP, which clients use for KV bodies when /healthz advertises it "
        "(docs/wire-format.md); 0: any free port; null: off (HTTP only).",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Gateway processes on this node, all on the same HTTP and block port "
        "(SO_REUSEPORT; the kernel spreads connections): one event loop each, so more "
        "cores for KV bodies. Each has its own staging segment (put_staging_bytes each).",
    )
    max_body_bytes: int = Field(
        default=GIB, gt=0, description="Largest request body accepted (a turn's KV blocks)."
    )
    read_stall_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="A block reader that takes no bytes for this long has its connection "
        "aborted: bytes in the devices' shared memory never reach a socket after the pin "
        "that keeps them (docs/security.md).",
    )
    read_hold_s: float = Field(
        default=120.0,
        gt=0,
        le=600,
        description="How long a block read pins every block it announced (released when "
        "it ends; a delete racing the read waits for it).",
    )
    put_staging_bytes: int = Field(
        default=256 * MIB,
        ge=0,
        description="Shared memory the gateway reads append bodies into, for devices on its "
        "node to copy from (no object store on the way); 0 = off. Used only where a device "
        "runs on the gateway's node.",
    )
    auth: AuthSettings = Field(default_factory=AuthSettings, description="Authentication.")
    engines: list[InferenceEngineSettings] = Field(
        default_factory=list,
        description="Engines the OpenAI front door (/v1/chat/completions, /v1/completions) "
        "routes to; more register at /v1/engines or with memkv up --engine URL.",
    )
    routing: RoutingSettings = Field(
        default_factory=RoutingSettings, description="The front door's engine choice and checks."
    )
