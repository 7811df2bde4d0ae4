"""What the connector's scheduler side hands its workers each step
(:class:`MemkvConnectorMetadata`: loads and saves), and the small rules both
sides share: request sizes, vLLM's paged layouts, content-named sessions."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from memkv.errors import InvalidInputError
from memkv.gpu_kernels import ops as kernels
from memkv.integrations.vllm.direct_load import DirectLoad
from memkv.integrations.vllm.pending_saves import DEFAULT_SAVE_WAIT_S
from memkv.protocol.layout import KVLayout
from memkv.staging import StagingSlot

__all__ = [
    "Direct",
    "Fetched",
    "Leased",
    "Load",
    "MemkvConnectorMetadata",
    "Save",
    "content_session_id",
    "paged_layout",
    "request_bytes",
]

#: Blocks travel in requests of at most this many bytes: a 4096-token prompt of a
#: Llama-3-8B-shaped model is 512 MiB, over a gateway's body limit in one piece.
REQUEST_BYTES = 64 << 20


def request_bytes(extra: dict[str, Any]) -> int:
    value = extra.get("max_request_bytes", REQUEST_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"max_request_bytes must be a positive int, got {value!r}")
    return value


def save_wait_s(extra: dict[str, Any]) -> float:
    value = extra.get("save_wait_s", DEFAULT_SAVE_WAIT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidInputError(f"save_wait_s must be a number >= 0, got {value!r}")
    return float(value)


@dataclass
class Load:
    req_id: str
    keys: list[bytes]  # memkv block keys, in chain order
    block_ids: list[int]  # vLLM blocks to fill, one per key


@dataclass
class Save:
    req_id: str
    token_ids: list[int]  # the prompt's full blocks' tokens
    block_ids: list[int]  # one vLLM block per memkv block
    start_block: int  # blocks before it are in memkv already
    session_id: str | None
    priority: str


#: How long a failed save's staging stays unused: the append may still be in flight
#: at the gateway (the client gave up waiting), and a device may still copy from it.
STAGING_QUARANTINE_S = 120.0


@dataclass
class Staged:
    """A save's blocks ``[blocks, layers, 2, kv_heads, tokens, head_dim]``, copied out of
    the paged cache; ``slot``: where they lie in this host's staging shared memory
    (None: in this process's memory)."""

    blocks: torch.Tensor
    slot: StagingSlot | None = None

    def release(self, after_s: float = 0.0) -> None:
        """Give the staging space back, now or ``after_s`` from now."""
        if self.slot is None:
            return
        if after_s <= 0:
            self.slot.release()
        else:
            timer = threading.Timer(after_s, self.slot.release)
            timer.daemon = True
            timer.start()


@dataclass
class Fetched:
    """A load's blocks, fetched and waiting to be written layer by layer."""

    load: Load
    blocks: list[torch.Tensor]
    pending: set[int]  # layers not written yet


@dataclass
class Direct:
    """A load's blocks copied straight from shared memory, layer by layer."""

    load: Load
    copy: DirectLoad
    pending: set[int]  # layers not written yet


@dataclass
class Leased:
    entry: Direct
    pending_ids: set[int]  # the vLLM blocks it fills


@dataclass
class MemkvConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


def paged_layout(kv_layer: torch.Tensor) -> int:
    """Which of vLLM's paged layouts a layer's cache has (see memkv.gpu_kernels).

    The CPU backend's ``[blocks, H, N, 2 * D]`` (per head, the block's K rows then
    its V rows), and the flash-attention one ``[2, blocks, N, H, D]``.
    """
    if kv_layer.dim() == 4:
        return kernels.PAGED_CPU
    if kv_layer.dim() == 5 and kv_layer.shape[0] == 2:
        return kernels.PAGED_FLASH
    raise ValueError(f"memkv does not know vLLM's KV cache layout {tuple(kv_layer.shape)}")


def content_session_id(layout: KVLayout, token_ids: list[int]) -> str:
    """The session a request without one stores its prompt under: named by its content."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(layout.fingerprint)
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return f"vllm-{digest.hexdigest()}"
