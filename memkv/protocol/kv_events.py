"""memkv's tier changes as vLLM's KV events, for KV-aware routers (llm-d, Dynamo).

vLLM publishes its prefix cache's changes over ZMQ (``--kv-events-config``):
each message is ``(topic, sequence number as 8 big-endian bytes, payload)``,
the payload a msgpack ``KVEventBatch`` (an array ``[ts, events,
data_parallel_rank]``), each event a map tagged by its class name:
``BlockStored`` (blocks now held on a medium), ``BlockRemoved`` (gone from it),
``AllBlocksCleared``. These structs encode exactly as vLLM's
(``vllm/distributed/kv_events.py``; a test decodes memkv's payload with vLLM's
own decoder), so a subscriber written for vLLM's engines reads memkv's devices.

What memkv says in them:

- ``medium``: where the copy is, in vLLM's words for memkv's tiers: the hot
  tier is ``GPU`` (device memory; RAM on a CPU-only device), the warm tier
  ``CPU`` (host shared memory), the cold tier ``STORAGE`` (the archive on
  NVMe). A block demoted from hot to warm is a ``BlockRemoved`` on ``GPU`` and
  a ``BlockStored`` on ``CPU``.
- ``block_hashes`` and ``parent_block_hash``: memkv's block keys (16 bytes, a
  chained hash of the block's tokens, the layout and the namespace:
  ``docs/wire-format.md``), which a router matches against ``POST /v1/match``
  or by hashing as memkv does. ``token_ids`` is empty: a device holds KV, not
  the tokens it was computed from.
- The host and device: in the topic, ``memkv@<host>/<device id>``.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "MEDIUM_OF_TIER",
    "TOPIC_PREFIX",
    "decode_batch",
    "encode_batch",
    "topic_of",
]

#: memkv's tiers in vLLM's medium names.
MEDIUM_OF_TIER = {"hot": "GPU", "warm": "CPU", "cold": "STORAGE"}
TOPIC_PREFIX = "memkv@"


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # (required, as vLLM's decoder wants it)


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _DECODER.decode(payload)


def topic_of(host: str, device_id: str) -> str:
    return f"{TOPIC_PREFIX}{host}/{device_id}"
