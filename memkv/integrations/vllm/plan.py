"""What the connector's scheduler side hands its workers each step
(:class:`MemkvConnectorMetadata`: loads and saves), and the small rules both
sides share: request sizes, vLLM's paged layouts, content-named sessions."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from memkv.client.reserved import SlotReservation
from memkv.errors import InvalidInputError, MemkvError
from memkv.gpu_kernels import ops as kernels
from memkv.integrations.vllm.direct_load import DirectLoad
from memkv.integrations.vllm.pending_saves import DEFAULT_SAVE_WAIT_S
from memkv.protocol.layout import KVLayout
from memkv.shm.staging import StagingSlot

__all__ = [
    "FAILURES",
    "Direct",
    "Fetched",
    "Leased",
    "Load",
    "MemkvConnectorMetadata",
    "Save",
    "content_session_id",
    "paged_layout",
    "partition_of",
    "request_bytes",
    "reserve_min_bytes",
    "save_generated",
]

#: What memkv being down, slow or wrong looks like from here: each ends in recompute.
FAILURES: tuple[type[BaseException], ...] = (
    MemkvError, OSError, httpx.HTTPError, ValueError, RuntimeError, KeyError,
)
try:  # the cluster transport's failures (Ray is there only where that transport is used)
    import ray.exceptions

    FAILURES = (*FAILURES, ray.exceptions.RayError)
except ImportError:  # pragma: no cover - the gateway transport needs no Ray
    pass

#: Blocks travel in requests of at most this many bytes: a 4096-token prompt of a
#: Llama-3-8B-shaped model is 512 MiB, over a gateway's body limit in one piece.
REQUEST_BYTES = 64 << 20


def request_bytes(extra: dict[str, Any]) -> int:
    value = extra.get("max_request_bytes", REQUEST_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"max_request_bytes must be a positive int, got {value!r}")
    return value


#: A save of at least this many bytes asks the session's device for a write
#: reservation (one round trip on the forward pass, ~1-3 ms here) and is copied
#: straight into its memory; smaller ones are staged (the device copies them in
#: the background, which costs less than the round trip for a few blocks).
RESERVE_MIN_BYTES = 8 << 20


def reserve_min_bytes(extra: dict[str, Any]) -> int | None:
    """``save_reserve_min_bytes`` (None: saves never ask for a reservation)."""
    value = extra.get("save_reserve_min_bytes", RESERVE_MIN_BYTES)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"save_reserve_min_bytes must be an int >= 0 or null, "
                                f"got {value!r}")
    return value


#: Two: the second core of a CPU engine's worker moves the memory-bound copy faster.
DEFAULT_LOAD_COPY_THREADS = 2


def load_copy_threads(extra: dict[str, Any]) -> int:
    """``load_copy_threads``: threads that write a large same-node load into a CPU cache."""
    value = extra.get("load_copy_threads", DEFAULT_LOAD_COPY_THREADS)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2:
        raise InvalidInputError(f"load_copy_threads must be 1 or 2, got {value!r}")
    return value


#: Which requests' generated tokens are saved as their blocks fill: "all" (the
#: next turn of a chat, sent whole again, hits through the previous answer),
#: "sessions" (only requests with a memkv session), "none" (prompts only).
SAVE_GENERATED = ("all", "sessions", "none")


def save_generated(extra: dict[str, Any]) -> str:
    value = extra.get("save_generated", "all")
    if value not in SAVE_GENERATED:
        raise InvalidInputError(f"save_generated must be one of {SAVE_GENERATED}, got {value!r}")
    return str(value)


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
    partition: str | None = None  # of the connector's namespace (vLLM's cache_salt)


@dataclass
class Save:
    req_id: str
    token_ids: list[int]  # the request's tokens up to the end of its last block here
    block_ids: list[int]  # one vLLM block per memkv block
    start_block: int  # blocks before it are in memkv already (or on their way)
    session_id: str
    priority: str
    #: The request finished: vLLM keeps these blocks until the workers say they
    #: copied them (``get_finished``), which they do in this step's wait_for_save.
    final: bool = False
    partition: str | None = None  # of the connector's namespace (vLLM's cache_salt)


#: How long a failed save's staging stays unused: the append may still be in flight
#: at the gateway (the client gave up waiting), and a device may still copy from it.
STAGING_QUARANTINE_S = 120.0


@dataclass
class Staged:
    """A save's blocks ``[blocks, layers, 2, kv_heads, tokens, head_dim]``, copied out of
    the paged cache; ``slot``: where they lie in this host's staging shared memory;
    ``reservation``: in slots the session's device reserved (a list of blocks where
    the slots are not back to back); neither: in this process's memory."""

    blocks: torch.Tensor | list[torch.Tensor]
    slot: StagingSlot | None = None
    reservation: SlotReservation | None = None

    def block_list(self) -> list[torch.Tensor]:
        return list(self.blocks) if isinstance(self.blocks, list) \
            else [self.blocks[i] for i in range(self.blocks.shape[0])]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.block_list())

    @property
    def in_shared_memory(self) -> bool:
        """Named in the append rather than sent (staged or reserved)."""
        return self.slot is not None or self.reservation is not None

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


def partition_of(cache_salt: object) -> str | None:
    """The partition of memkv's namespace a request's KV lives in: one per vLLM
    ``cache_salt`` (tenants of a shared engine each have their own, memkv's front door
    sets it), so that one's prompts never hit another's blocks in memkv either (a
    timing channel: vLLM PR #39082). None: no salt, the connector's own namespace."""
    if not isinstance(cache_salt, str) or not cache_salt:
        return None
    return hashlib.blake2b(cache_salt.encode(), digest_size=12).hexdigest()


def content_session_id(layout: KVLayout, token_ids: list[int]) -> str:
    """The session a request without one stores its prompt under: named by its content."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(layout.fingerprint)
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return f"vllm-{digest.hexdigest()}"
