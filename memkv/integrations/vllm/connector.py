"""MemkvConnector: vLLM's v1 KV connector over the memkv gateway.

Before a request's prefill, the scheduler side asks memkv how much of the
prompt is cached (``/v1/match``: whole blocks, the last prompt token always
recomputed) and tells vLLM; the worker side then reads those blocks by key and
writes them into the blocks vLLM allocated. After the prefill, the prompt's
full blocks are copied out of the paged cache layer by layer and stored in
memkv, by a background thread, so decoding does not wait for the upload.

Agent sessions: ``kv_transfer_params={"session_id": ..., "priority": ...}``
(vLLM's ``SamplingParams.extra_args``, or the OpenAI API's ``extra_body``) makes
each turn an append to that memkv session. Requests without one still share
prefixes by content: their blocks go to a session named after the prompt's last
full block.

memkv blocks are vLLM blocks: ``block_tokens`` is the engine's block size, and
each block is stored in memkv's layout ``[layers, 2 (K, V), kv_heads, tokens,
head_dim]``, so a session saved by vLLM restores in transformers too.

Anything that goes wrong on the way (memkv down, a block gone, a checksum)
ends in recompute: a failed lookup reports no hit, a failed load reports its
blocks to vLLM as not loaded (``get_block_ids_with_load_errors``), a failed
save is logged and counted. Never an error to the request.

Configuration (``kv_connector_extra_config``)::

    {"transport": "gateway",            # or "cluster" (see memkv.integrations.vllm.transport)
     "url": "http://127.0.0.1:8080",   # gateway: where it listens
     "token": "...",                    # gateway: a tenant token, or $MEMKV_TOKEN
     "ray_address": "auto",             # cluster: the Ray cluster memkv runs in
     "same_node": true,                 # copy blocks held in this host's shared memory
                                        #   straight into the paged cache (needs
                                        #   device.same_node_reads; gateway: on by default,
                                        #   cluster: off by default)
     "fetch_buffer_bytes": 1073741824,  # fetched blocks are read into reused, prefaulted
                                        #   buffers; this much is kept between steps
     "block_port": true,                # gateway: blocks not leased, and saves, over the
                                        #   gateway's block port where it has one (else HTTP)
     "connect_timeout_s": 10,           # cluster: the most engine start waits to join
                                        #   Ray; later requests compute while it goes on
     "model_id": "my-llama",            # part of every block hash (default: the model path)
     "namespace": null,                 # gateway: a public namespace to use (default: the
                                        #   token's tenant); cluster: the namespace (default)
     "layerwise": true,                 # write loaded KV into the paged cache layer by layer
     "max_request_bytes": 67108864,     # blocks per save/read request (keep it under the
                                        #   gateway's max_body_bytes)
     "save_staging_bytes": 1073741824,  # same node: saves are copied from the paged cache
                                        #   into this much shared memory (populated at
                                        #   start) and named there, not sent; a save that
                                        #   does not fit goes over the socket (0: never)
     "save_reserve_min_bytes": 8388608, # same node: a save this big is copied straight
                                        #   into slots the session's device reserves in
                                        #   its shared memory, and kept there (null: never)
     "save_wait_s": 2.0,                # a session's next turn waits up to this long for
                                        #   its last turn's save to land (0: never waits)
     "load_copy_threads": 2,            # same node, CPU cache: a load of 16 MiB or more
                                        #   is written by two threads (1: by the engine's)
     "stats_path": null}                # also write the running totals here, as JSON
                                        #   (with saves_queued / saves_done: a save
                                        #   is stored once they are equal)

Loading, layer by layer: ``start_load_kv`` fetches the step's hit blocks (a
memkv block holds every layer, so the fetch is whole), and each layer's slices
are written into the paged cache in ``wait_for_layer_load``, just before that
layer's attention reads them, so the copies interleave with the forward pass
instead of preceding it (on a GPU, with the copy of layer i+1 behind layer i's
compute). ``"layerwise": false`` writes every layer before the forward pass.

Metrics: hit tokens, blocks, bytes and seconds of loads and saves, and
failures, as vLLM connector stats (logged with vLLM's figures) and Prometheus
counters ``vllm:memkv_*`` on the engine's ``/metrics`` (see ``metrics.py``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import httpx
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from memkv.errors import MemkvError
from memkv.gpu_kernels import ops as kernels
from memkv.integrations.vllm.block_buffers import BlockBuffers
from memkv.integrations.vllm.direct_load import DirectLoad, PinnedStaging, cache_words
from memkv.integrations.vllm.lookups import Lookups
from memkv.integrations.vllm.metrics import MemkvConnectorStats, MemkvPromMetrics, StatsRecorder
from memkv.integrations.vllm.pending_saves import PendingSaves
from memkv.integrations.vllm.plan import (
    STAGING_QUARANTINE_S,
    Direct,
    Fetched,
    Leased,
    Load,
    MemkvConnectorMetadata,
    Save,
    Staged,
    content_session_id,
    load_copy_threads,
    paged_layout,
    request_bytes,
    reserve_min_bytes,
    save_wait_s,
)
from memkv.integrations.vllm.stats_file import write_part
from memkv.integrations.vllm.transport import KVTransport, transport_from_config
from memkv.protocol.dtypes import StorageDType
from memkv.protocol.layout import KVLayout
from memkv.same_node import SegmentMaps

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["MemkvConnector"]

logger = logging.getLogger(__name__)

_DTYPES: dict[Any, StorageDType] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
}
#: What memkv being down, slow or wrong looks like from here: each ends in recompute.
_FAILURES: tuple[type[BaseException], ...] = (
    MemkvError, OSError, httpx.HTTPError, ValueError, RuntimeError, KeyError,
)
try:  # the cluster transport's failures (Ray is there only where that transport is used)
    import ray.exceptions

    _FAILURES = (*_FAILURES, ray.exceptions.RayError)
except ImportError:  # pragma: no cover - the gateway transport needs no Ray
    pass


#: Fetched-block buffers kept between steps for reuse (the rest of a big load is freed).
FETCH_BUFFER_KEEP_BYTES = 1 << 30


class MemkvConnector(KVConnectorBase_V1):
    """Loads the longest cached prefix from memkv before prefill; saves new blocks after."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(
            vllm_config=vllm_config, role=role, kv_cache_config=cast(Any, kv_cache_config)
        )
        self._extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        model = vllm_config.model_config
        self._block_size = vllm_config.cache_config.block_size
        self.layout = KVLayout(
            str(self._extra.get("model_id") or model.model),
            num_layers=model.get_num_layers(vllm_config.parallel_config),
            num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
            head_dim=model.get_head_size(),
            dtype=_DTYPES[model.dtype],
            block_tokens=self._block_size,
        )
        self._layerwise = bool(self._extra.get("layerwise", True))
        self._request_bytes = request_bytes(self._extra)
        self._reserve_min_bytes = reserve_min_bytes(self._extra)
        self._stats_path = self._extra.get("stats_path")
        self._stats_lock = threading.Lock()  # the engine's thread and the saver's
        self._role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._transport: KVTransport | None = None
        self._transport_lock = threading.Lock()
        # Scheduler side: what get_num_new_matched_tokens found, per request.
        self._matched: dict[str, list[bytes]] = {}
        self._pending_loads: dict[str, Load] = {}
        self._hits: dict[str, int] = {}  # memkv blocks of each request's prompt
        self._params: dict[str, dict[str, Any]] = {}
        self._pending_saves = PendingSaves(save_wait_s(self._extra))
        # Prefix matches off the scheduler's thread (the transport is made on first use).
        self._lookups = Lookups(lambda tokens: self.transport().match(tokens))
        self._copy_threads = load_copy_threads(self._extra)
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._layer_names: list[str] = []
        self._fetched: list[Fetched] = []
        self._buffers = BlockBuffers(
            self.layout.block_nbytes(),
            int(self._extra.get("fetch_buffer_bytes", FETCH_BUFFER_KEEP_BYTES)),
        )
        self._direct: list[Direct] = []
        self._maps = SegmentMaps()  # this host's memkv segments, mapped once
        self._words: dict[int, np.ndarray] = {}  # CPU layer caches as numpy words
        self._pinned = PinnedStaging()  # for CUDA caches: reused host staging
        self._failed_requests: set[str] = set()  # this step's loads that went wrong
        self._staged: dict[str, Staged] = {}  # req id -> its blocks' copy, to send
        self._load_errors: set[int] = set()
        self._outbox: queue.Queue[tuple[Save, Staged] | None] = queue.Queue()
        self._sender: threading.Thread | None = None
        self.stats = StatsRecorder()
        # Saves handed to the saver thread, and those it finished (stored or failed).
        self._saves_queued = 0
        self._saves_done = 0
        if role == KVConnectorRole.SCHEDULER:
            self._warm_up()

    # -- shared ------------------------------------------------------------------------

    def transport(self) -> KVTransport:
        """memkv, reached the configured way (made on first use, by whichever thread)."""
        with self._transport_lock:
            if self._transport is None:
                self._transport = transport_from_config(self.layout, self._extra)
            return self._transport

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that memkv holds (whole blocks).

        The last prompt token is always left to compute (vLLM needs its logits).
        Any failure answers 0: the engine computes everything itself.
        """
        tokens = list(request.prompt_token_ids or [])
        params = dict(getattr(request, "kv_transfer_params", None) or {})
        self._params[request.request_id] = params
        usable = (len(tokens) - 1) // self._block_size * self._block_size
        if usable <= num_computed_tokens:
            self._pending_saves.forget(request.request_id)
            return 0, False
        if self._pending_saves.too_soon(request.request_id):
            time.sleep(0.001)  # vLLM asks again next step: not a busy loop meanwhile
            return None, False
        try:
            found = self._lookups.poll(request.request_id, tokens[:usable])
        except _FAILURES as e:
            logger.warning("memkv lookup failed, computing instead: %s", e)
            self._pending_saves.forget(request.request_id)
            return 0, False
        if found is None:
            return None, False  # the lookup still runs: vLLM schedules the others
        matched, keys = found
        hit = matched // self._block_size * self._block_size
        if self._pending_saves.should_wait(request.request_id, params.get("session_id"), hit,
                                           usable, local=num_computed_tokens):
            return None, False  # its session's last save has not landed yet
        if hit <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = keys[: hit // self._block_size]
        self._hits[request.request_id] = hit // self._block_size
        return hit - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        keys = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or not keys:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = (request.num_computed_tokens or 0) // self._block_size
        wanted = keys[first:]
        self._pending_loads[request.request_id] = Load(
            request.request_id, wanted, block_ids[first : first + len(wanted)]
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (requests with a memkv hit) and saves (prompts prefilled now)."""
        meta = MemkvConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending_loads.pop(new.req_id, None)
            if load is not None:
                meta.loads.append(load)
            tokens = list(new.prompt_token_ids or [])
            full = len(tokens) // self._block_size
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if full == 0 or new.num_computed_tokens + scheduled < len(tokens):
                continue  # a chunked prefill: its blocks are not all written in this step
            params = self._params.get(new.req_id, {})
            # Blocks memkv already has (the hit) are not sent again.
            start = min(self._hits.pop(new.req_id, 0), full)
            if start == full:
                continue
            meta.saves.append(
                Save(
                    new.req_id,
                    tokens[: full * self._block_size],
                    list(new.block_ids[0][start:full]),
                    start,
                    params.get("session_id"),
                    str(params.get("priority", "normal")),
                )
            )
            self._pending_saves.issued(params.get("session_id"), full * self._block_size)
        self._pending_loads.clear()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        for table in (self._params, self._matched, self._hits):
            table.pop(request.request_id, None)
        self._pending_saves.forget(request.request_id)
        self._lookups.forget(request.request_id)
        return False, None

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._layer_names = list(kv_caches)  # once, not per layer of every load
        self._words = {
            i: cache_words(t) for i, t in enumerate(kv_caches.values()) if not t.is_cuda
        }
        self._write_stats_file()  # the worker's file exists from the start
        self._warm_up()
        try:  # the save staging made (and its pages populated) now, not in the first save
            self.transport().save_slot(0)
            # This host's device segments, mapped with their page tables populated: a
            # fresh engine's first load or save pays no page faults (~35 ms per 512 MiB).
            self.transport().prepare_shared_memory(self._maps,
                                                   self._reserve_min_bytes is not None)
        except _FAILURES as e:
            logger.debug("memkv shared memory not ready: %s", e)

    def _warm_up(self) -> None:
        """Reach memkv at engine start: a first request should not pay for joining Ray
        (about a second) or opening a connection. memkv down now is no error: each
        request tries again, and computes what it cannot load."""
        try:
            self.transport().warm_up()
        except _FAILURES as e:
            logger.warning("memkv is not reachable yet (requests will retry): %s", e)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Fetch each request's cached blocks; write them now, or layer by layer.

        A load that cannot be fetched, or fails its checksum, is reported as a
        load error (vLLM recomputes its blocks); nothing of it is written.
        """
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, MemkvConnectorMetadata)
        self._finish_loads()  # a previous step's layers that no attention layer asked for
        for load in metadata.loads:
            self._start_load(load)
        if metadata.loads:
            self._write_stats_file()

    def _start_load(self, load: Load) -> None:
        """Lease what this host's shared memory holds, fetch the rest; write now or per layer."""
        start = time.perf_counter()
        direct = self._lease(load)
        wanted = [(k, b) for k, b in zip(load.keys, load.block_ids, strict=True)
                  if direct is None or b not in direct.pending_ids]
        fetched: Fetched | None = None
        if wanted:
            rest = Load(load.req_id, [k for k, _ in wanted], [b for _, b in wanted])
            try:
                blocks = self._read(rest.keys)
            except _FAILURES as e:
                logger.warning("memkv load of %s failed, recomputing: %s", load.req_id, e)
                self.stats.add(load_failures=1)
                self._load_errors.update(load.block_ids)
                self._failed_requests.add(load.req_id)
                if direct is not None:
                    direct.entry.copy.finish()  # its leases go back; nothing of it is written
                return
            fetched = Fetched(rest, blocks, set(self._layer_index.values()))
            self._fetched.append(fetched)
        if direct is not None:
            self._direct.append(direct.entry)
        fetch_s = time.perf_counter() - start
        write_s = 0.0
        if not self._layerwise:
            written = time.perf_counter()
            for layer in sorted(self._layer_index.values()):
                self._write_all(layer)
            write_s = time.perf_counter() - written
        direct_blocks = len(direct.pending_ids) if direct is not None else 0
        fetched_blocks = len(fetched.blocks) if fetched is not None else 0
        self.stats.add(
            hit_tokens=len(load.keys) * self._block_size,
            load_blocks=direct_blocks + fetched_blocks,
            load_blocks_shared_memory=direct_blocks,
            load_blocks_fetched=fetched_blocks,
            load_bytes=(direct.entry.copy.nbytes if direct is not None else 0)
            + (sum(b.numel() * b.element_size() for b in fetched.blocks) if fetched else 0),
            load_seconds=fetch_s + write_s,
            load_fetch_seconds=fetch_s,
            load_write_seconds=write_s,
        )

    def _lease(self, load: Load) -> Leased | None:
        """The load's blocks in this host's shared memory, mapped and pinned (None: none)."""
        try:
            leased = self.transport().lease(load.keys)
        except _FAILURES as e:
            logger.debug("memkv lease for %s failed, fetching instead: %s", load.req_id, e)
            return None
        if leased is None:
            return None
        lease, release = leased
        blocks = [(plan, entry, block_id)
                  for found, block_id in zip(lease.blocks, load.block_ids, strict=True)
                  if found is not None for plan, entry in [found]]
        if not blocks:
            release()
            return None
        try:
            copy = DirectLoad(self._maps, blocks, release, staging=self._pinned,
                              copy_threads=self._copy_threads)
        except _FAILURES as e:  # a segment gone (its device restarted), a bad plan
            logger.warning("memkv shared memory unusable for %s, fetching: %s", load.req_id, e)
            release()
            return None
        entry = Direct(load, copy, set(self._layer_index.values()))
        return Leased(entry, set(copy.block_ids))

    def _write_all(self, layer: int) -> None:
        """Layer ``layer`` of every load of this step not written yet."""
        for fetched in self._fetched:
            if layer in fetched.pending:
                self._write_layer(fetched, layer)
        for direct in self._direct:
            if layer in direct.pending:
                kv_layer = self._kv_caches[self._layer_names[layer]]
                direct.copy.write_layer(layer, kv_layer, paged_layout(kv_layer),
                                        self._words.get(layer))
                direct.pending.discard(layer)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Write this layer's slices of the step's loaded blocks into the paged cache."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not (self._fetched or self._direct):
            return
        start = time.perf_counter()
        self._write_all(layer)
        spent = time.perf_counter() - start
        self.stats.add(load_seconds=spent, load_write_seconds=spent)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy this layer's KV of the blocks to save (the upload happens off this thread)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, MemkvConnectorMetadata)
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        start = time.perf_counter()
        for save in metadata.saves:
            staged = self._staged.get(save.req_id)
            if staged is None:
                staged = self._staged[save.req_id] = self._save_buffer(save)
            kernels.paged_read(kv_layer, save.block_ids, layer, staged.blocks,
                               paged_layout(kv_layer))
        if metadata.saves:
            self.stats.add(save_copy_seconds=time.perf_counter() - start)

    def wait_for_save(self) -> None:
        self._finish_loads()
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, MemkvConnectorMetadata)
        failed, self._failed_requests = self._failed_requests, set()
        for save in metadata.saves:
            staged = self._staged.pop(save.req_id, None)
            if save.req_id in failed:
                # Its KV of this step was computed over blocks that did not load:
                # never stored under its tokens (vLLM recomputes the request).
                if staged is not None:
                    staged.release()
                continue
            if staged is not None:
                self._ensure_sender()
                self._saves_queued += 1
                self._outbox.put((save, staged))
        if metadata.saves:
            self._write_stats_file()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return MemkvConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> MemkvPromMetrics:
        return MemkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout=30)
        self._write_stats_file()
        self._lookups.close()
        if self._transport is not None:
            self._transport.close()

    # -- internals ---------------------------------------------------------------------

    def _write_layer(self, fetched: Fetched, layer: int) -> None:
        """Layer ``layer`` of each fetched block into its vLLM block."""
        kv_layer = self._kv_caches[self._layer_names[layer]]  # names in layer order
        blocks: Any = fetched.blocks
        kernels.paged_write(blocks, fetched.load.block_ids, layer, kv_layer,
                            paged_layout(kv_layer))
        fetched.pending.discard(layer)

    def _finish_loads(self) -> None:
        """Write what no ``wait_for_layer_load`` asked for, check what came from shared
        memory, and forget the step's loads."""
        for layer in sorted(self._layer_index.values()):
            self._write_all(layer)
        for direct in self._direct:
            bad = direct.copy.finish()
            if bad:
                logger.warning("memkv load of %s: %d blocks failed their checksum or lease "
                               "after the copy, recomputing", direct.load.req_id, len(bad))
                self.stats.add(load_failures=1, load_checksum_failures=len(bad))
                self._load_errors.update(bad)
                self._failed_requests.add(direct.load.req_id)
        self._fetched = []
        self._direct = []
        self._buffers.give_back()  # every fetched block is in the paged cache now

    def _chunk_blocks(self) -> int:
        return max(1, self._request_bytes // self.layout.block_nbytes())

    def _read(self, keys: list[bytes]) -> list[torch.Tensor]:
        per = self._chunk_blocks()
        blocks: list[torch.Tensor] = []
        for i in range(0, len(keys), per):
            chunk = keys[i : i + per]
            # Into the step's reused buffers: no page faults inside the load.
            blocks.extend(self.transport().read(chunk, out=self._buffers.take(len(chunk))))
        return blocks

    def _save_buffer(self, save: Save) -> Staged:
        """Where a save's blocks are copied out of the paged cache: slots the session's
        device reserved in its shared memory (the device keeps the bytes there: one
        copy in all), else this host's staging shared memory where the gateway is
        local (the device copies them once more), else memory of this process's."""
        count = len(save.block_ids)
        if self._reserve_min_bytes is not None \
                and count * self.layout.block_nbytes() >= self._reserve_min_bytes:
            reserved = self._reserved_buffer(save)
            if reserved is not None:
                return reserved
        shape = (count, *self.layout.block_shape())
        nbytes = count * self.layout.block_nbytes()
        try:
            slot = self.transport().save_slot(nbytes)
        except _FAILURES as e:
            logger.debug("memkv save staging unusable, saving over the socket: %s", e)
            slot = None
        view = slot.take(nbytes) if slot is not None else None
        if slot is None or view is None:
            return Staged(torch.empty(shape, dtype=self.layout.torch_dtype))
        words = torch.frombuffer(view, dtype=torch.uint8)
        return Staged(words.view(self.layout.torch_dtype).view(shape), slot)

    def _reserved_buffer(self, save: Save) -> Staged | None:
        count = len(save.block_ids)
        tokens = save.token_ids[: (save.start_block + count) * self._block_size]
        try:
            reservation = self.transport().reserve(self._session_of(save), save.priority,
                                                   tokens, count)
        except _FAILURES as e:
            logger.debug("memkv write reservation failed, staging instead: %s", e)
            return None
        if reservation is None or not reservation.writable:
            return None
        dtype, block_shape = self.layout.torch_dtype, self.layout.block_shape()
        run = reservation.run()
        if run is not None:  # back to back: a run of vLLM blocks is one copy
            words = torch.from_numpy(run).view(dtype)
            return Staged(words.view(count, *block_shape), reservation=reservation)
        return Staged([torch.from_numpy(reservation.slot(i)).view(dtype).view(block_shape)
                       for i in range(count)], reservation=reservation)

    def _session_of(self, save: Save) -> str:
        return save.session_id or content_session_id(self.layout, save.token_ids)

    def _save(self, session_id: str, save: Save, blocks: list[torch.Tensor],
              staged: Staged) -> None:
        """Append in requests of at most ``max_request_bytes``, each the tokens up to its end
        (one request for blocks in staging: their bytes are not in the body)."""
        per = len(blocks) if staged.in_shared_memory else self._chunk_blocks()
        for i in range(0, len(blocks), per):
            chunk = blocks[i : i + per]
            first = save.start_block + i
            tokens = save.token_ids[: (first + len(chunk)) * self._block_size]
            self.transport().save(session_id, save.priority, tokens, chunk, first,
                                  reserved=staged.reservation)

    def _write_stats_file(self) -> None:
        if not self._stats_path:
            return
        doc = {
            **self.stats.snapshot(),
            "saves_queued": self._saves_queued,
            "saves_done": self._saves_done,
            "lookups_deferred": self._pending_saves.deferred,
        }
        # The scheduler's connector and the workers' share the file: each writes its
        # own part, the top level sums them (memkv.integrations.vllm.stats_file).
        with self._stats_lock:
            write_part(self._stats_path, f"{self._role_name}-{os.getpid()}", doc)

    def _ensure_sender(self) -> None:
        if self._sender is None or not self._sender.is_alive():
            self._sender = threading.Thread(
                target=self._send_loop, name="memkv-saver", daemon=True
            )
            self._sender.start()

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            save, staged = item
            start = time.perf_counter()
            session_id = self._session_of(save)
            blocks = staged.block_list()
            try:
                self._save(session_id, save, blocks, staged)
            except _FAILURES as e:
                logger.warning("memkv save of %s failed (a later miss): %s", save.req_id, e)
                self.stats.add(save_failures=1)
                staged.release(after_s=STAGING_QUARANTINE_S)  # a device may still read it
            else:
                staged.release()
                self.stats.add(
                    save_blocks=len(blocks),
                    save_blocks_staged=len(blocks) if staged.slot is not None else 0,
                    save_blocks_reserved=len(blocks) if staged.reservation is not None else 0,
                    save_bytes=staged.nbytes,
                    save_seconds=time.perf_counter() - start,
                )
            self._saves_done += 1
            self._write_stats_file()
