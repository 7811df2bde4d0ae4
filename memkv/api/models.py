"""The JSON bodies the gateway takes, as pydantic models (the OpenAPI schema is theirs)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt

from memkv.api.client_leases import (
    DEFAULT_TTL_S,
    MAX_TTL_S,
)
from memkv.protocol.dtypes import DTYPES
from memkv.protocol.ids import (
    MAX_SESSION_ID_LEN,
    NAMESPACE_PATTERN,
    SESSION_ID_PATTERN,
)
from memkv.protocol.layout import LAYOUT_LIMITS, MAX_MODEL_ID_CHARS

__all__ = [
    "BINARY",
    "MAX_KEYS_PER_READ",
    "BlockLeaseIn",
    "BlocksByKeyIn",
    "ForkIn",
    "LayoutIn",
    "MatchIn",
    "ReserveIn",
    "RewindIn",
    "SessionCreate",
    "SessionIdPath",
    "SuspendIn",
]

BINARY = {"type": "string", "format": "binary"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _json_int(value: Any) -> Any:
    """JSON's integers (``4``, and ``4.0``, which JSON Schema calls an integer), not ``"4"``."""
    if isinstance(value, bool) or isinstance(value, str):
        raise ValueError(f"expected an integer, got {value!r:.40}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_json_int)]
#: The largest token id (the wire carries them as int64).
MAX_TOKEN_ID = (1 << 63) - 1
#: A token id: an integer written as one, never ``true`` or ``1.0`` (a caller's bug, not a
#: token), >= 0.
TokenId = Annotated[StrictInt, Field(
    ge=0, le=MAX_TOKEN_ID, description="A token id: an integer written as one (not 1.0, "
    "not true), 0 <= id < 2**63.")]


class LayoutIn(_Model):
    # "4" is not 4. Bounds are KVLayout's own (LAYOUT_LIMITS).
    model_config = ConfigDict(extra="forbid", strict=False)

    model_id: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    num_layers: JsonInt = Field(ge=1, le=LAYOUT_LIMITS["num_layers"])
    num_kv_heads: JsonInt = Field(ge=1, le=LAYOUT_LIMITS["num_kv_heads"])
    head_dim: JsonInt = Field(ge=1, le=LAYOUT_LIMITS["head_dim"])
    dtype: str = Field(default="float16", pattern="^(" + "|".join(DTYPES) + ")$")
    block_tokens: JsonInt = Field(default=256, ge=1, le=LAYOUT_LIMITS["block_tokens"])


class SessionCreate(_Model):
    session_id: str = Field(
        pattern=SESSION_ID_PATTERN,
        description="1..256 characters of A-Z a-z 0-9 . _ : @ -, starting with a letter or digit",
    )
    layout: LayoutIn
    namespace: str | None = Field(
        default=None,
        pattern=NAMESPACE_PATTERN,
        description="Where the session's blocks are hashed: the caller's tenant by default, "
        "a public namespace its token may publish into (shared prompts), or #<partition>: "
        "a partition of the caller's own, hashed apart from its other blocks (an engine "
        "shared by tenants keeps each one's KV in its own).",
    )
    priority: str = "normal"
    ack: Literal["memory", "archive"] | None = Field(
        default=None,
        description="When an append is answered: memory = its blocks are in device memory; "
        "archive = they are fsynced in the cold tier and survive a crash of every process. "
        "Default: the deployment's router.default_ack.",
    )
    exact_only: StrictBool = Field(
        default=False,
        description="Its blocks never take a lossy step (fp16 of fp32, int8, lossy cold codec). "
        "Blocks shared with sessions that allowed one before may still read as inexact: "
        "every block read says whether it is exact.",
    )
    finite_only: StrictBool = Field(
        default=False,
        description="Appends whose KV holds a NaN or an infinity are refused (422, naming "
        "the block). Default: stored as sent, bit for bit (such blocks never take a lossy "
        "step).",
    )
    near: str | None = Field(
        default=None,
        pattern=r"^(gateway|[0-9a-f]{6,64})$",
        description="Place the session on a device of this Ray node when it has one: "
        "'gateway' (the node of the gateway that answers: its reads take the same-node "
        "path) or a node id (a unique hex prefix of 6 or more). Default: by load.",
    )


class SuspendIn(_Model):
    offline: bool = False


#: A count of tokens as the wire carries it (int64); whether it is in the session's range
#: is the session's to say (400, naming it), not the schema's.
TokenCount = Annotated[int, Field(ge=-(1 << 63), le=MAX_TOKEN_ID), BeforeValidator(_json_int)]
_TAIL_TOKENS = Field(
    default=None, max_length=LAYOUT_LIMITS["block_tokens"],
    description="Only when the end falls inside a block: that block's token ids (all of "
    "them, as the session holds them). They must hash to the block's key; its first "
    "tokens are then stored under their own hash.",
)


class ForkIn(_Model):
    new_id: str = Field(
        pattern=SESSION_ID_PATTERN,
        description="The new session's id (the caller's tenant, as the parent's).",
    )
    # (no bounds here: a count outside 1..the parent's tokens is a 400 naming them)
    at_tokens: TokenCount | None = Field(
        default=None,
        description="Tokens of the parent it keeps (1 to its count; default: all); one that "
        "ends inside a "
        "block has that block's first tokens copied once, every other block is shared.",
    )
    tail_tokens: list[TokenId] | None = _TAIL_TOKENS


class RewindIn(_Model):
    # (no bounds here: a count outside 1..the session's tokens is a 400 naming them)
    tokens: TokenCount = Field(
        description="Tokens the session keeps (1 to its count); the blocks after them are "
        "let go.")
    tail_tokens: list[TokenId] | None = _TAIL_TOKENS


class MatchIn(_Model):
    layout: LayoutIn
    namespace: str | None = Field(
        default=None, pattern=NAMESPACE_PATTERN,
        description="Default: the caller's tenant; #<partition>: a partition of it."
    )
    token_ids: list[TokenId]


#: Keys one by-key read may name (duplicates are collapsed first).
MAX_KEYS_PER_READ = 4096


class BlocksByKeyIn(_Model):
    namespace: str | None = Field(
        default=None,
        pattern=NAMESPACE_PATTERN,
        description="Whose blocks: the caller's tenant by default, or a public namespace "
        "its token may read. Keys of any other namespace answer 404, like missing ones.",
    )
    keys: list[Annotated[str, Field(pattern=r"^[0-9a-fA-F]{32}$")]] = Field(
        description="Block keys: 16 bytes as 32 hex digits.", max_length=MAX_KEYS_PER_READ
    )


class BlockLeaseIn(BlocksByKeyIn):
    ttl_s: float = Field(
        default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S,
        description="How long the blocks stay pinned unless the lease is given back first.",
    )


class ReserveIn(_Model):
    """A write reservation for a session's next append (same host only)."""

    blocks: int = Field(gt=0, le=4096, description="Block-sized slots wanted.")
    tokens: list[TokenId] | None = Field(
        default=None, max_length=1 << 20,
        description="The session's tokens after the append: a new session is placed by "
                    "their prefix, as its first append would place it.")
    ttl_s: float = Field(default=30.0, gt=0, le=300,
                         description="How long the slots wait for the append that names them.")


#: A session id in a path: the one id rule, in the schema too.
SessionIdPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN, max_length=MAX_SESSION_ID_LEN)]
