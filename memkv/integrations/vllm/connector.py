"""MemkvConnector: vLLM's v1 KV connector over the memkv gateway.

Before a request's prefill, the scheduler side asks memkv how much of the
prompt it holds beyond vLLM's own prefix cache (``/v1/match``: whole blocks,
the last prompt token always recomputed) and tells vLLM; the worker side then
writes exactly those blocks into the blocks vLLM allocated for them. Every
block whose KV a step completes is saved: a prompt's chunks as they are
prefilled (a prompt longer than the scheduler's step budget, or one sharing a
step with others, is prefilled over several steps), and the blocks generated
tokens fill; each is copied out of the paged cache layer by layer and stored
in memkv by a background thread, so decoding does not wait for the upload.
The two roles live in :mod:`~memkv.integrations.vllm.scheduler_side` and
:mod:`~memkv.integrations.vllm.worker_side`; this class hands vLLM's calls to
the one its process has.

Agent sessions: ``kv_transfer_params={"session_id": ..., "priority": ...}``
(vLLM's ``SamplingParams.extra_args``, or the OpenAI API's ``extra_body``) makes
each turn an append to that memkv session. Requests without one still share
prefixes by content: their blocks go to a session named after their prompt.

memkv blocks are vLLM blocks: ``block_tokens`` is the engine's block size, and
each block is stored in memkv's layout ``[layers, 2 (K, V), kv_heads, tokens,
head_dim]``, so a session saved by vLLM restores in transformers too.

Anything that goes wrong on the way (memkv down, a block gone, a checksum)
ends in recompute: a failed lookup reports no hit, a failed load reports its
blocks to vLLM as not loaded (``get_block_ids_with_load_errors``), a failed
save is logged and counted (``save_skipped_blocks`` by reason). Never an error
to the request: the connector sets vLLM's ``kv_load_failure_policy`` to
``recompute`` (vLLM 0.32's default, ``fail``, would end the request) unless
``"load_failure_policy": "fail"`` is asked for here.

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
     "save_generated": "all",           # blocks filled by generated tokens are saved too
                                        #   ("sessions": only requests with a session_id;
                                        #   "none": prompts only)
     "load_failure_policy": "recompute", # or "fail": vLLM ends a request whose load fails
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
import threading
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from memkv.errors import InvalidInputError
from memkv.integrations.vllm.metrics import MemkvConnectorStats, MemkvPromMetrics
from memkv.integrations.vllm.plan import FAILURES, MemkvConnectorMetadata
from memkv.integrations.vllm.scheduler_side import SchedulerSide
from memkv.integrations.vllm.transport import KVTransport, transport_from_config
from memkv.integrations.vllm.worker_side import WorkerSide
from memkv.protocol.dtypes import StorageDType
from memkv.protocol.layout import KVLayout

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
LOAD_FAILURE_POLICIES = ("recompute", "fail")


class MemkvConnector(KVConnectorBase_V1):
    """Loads what vLLM lacks of a prompt from memkv; saves every block it computes."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(
            vllm_config=vllm_config, role=role, kv_cache_config=cast(Any, kv_cache_config)
        )
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        model = vllm_config.model_config
        self.layout = KVLayout(
            str(extra.get("model_id") or model.model),
            num_layers=model.get_num_layers(vllm_config.parallel_config),
            num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
            head_dim=model.get_head_size(),
            dtype=_DTYPES[model.dtype],
            block_tokens=vllm_config.cache_config.block_size,
        )
        self._extra = extra
        self._transport: KVTransport | None = None
        self._transport_lock = threading.Lock()
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            _recompute_failed_loads(self._kv_transfer_config, extra)
            self.scheduler = SchedulerSide(self.layout, extra, self.transport)
            try:  # reach memkv now: a first request should not pay for it
                self.transport().warm_up()
            except FAILURES as e:  # memkv down at start is no error
                logger.warning("memkv is not reachable yet (requests will retry): %s", e)
        else:
            self.worker = WorkerSide(self.layout, extra, self.transport)

    def transport(self) -> KVTransport:
        """memkv, reached the configured way (made on first use, by whichever thread)."""
        with self._transport_lock:
            if self._transport is None:
                self._transport = transport_from_config(self.layout, self._extra)
            return self._transport

    # -- scheduler side ------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("a scheduler call on memkv's worker-side connector")
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("a worker call on memkv's scheduler-side connector")
        return self.worker

    def _metadata(self) -> MemkvConnectorMetadata:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, MemkvConnectorMetadata):
            raise TypeError(f"memkv's connector was bound {type(metadata).__name__}")
        return metadata

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker().save_kv_layer(self._metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._metadata())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.stats.take() if self.worker is not None else None

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
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
        if self._transport is not None:
            self._transport.close()


def _recompute_failed_loads(transfer_config: Any, extra: dict[str, Any]) -> None:
    """memkv's promise: a load that fails is recomputed, never an error to the request.

    vLLM 0.32 reads ``kv_load_failure_policy`` (default ``fail``) just after it makes
    the scheduler's connector, so the connector sets it here.
    """
    policy = extra.get("load_failure_policy", "recompute")
    if policy not in LOAD_FAILURE_POLICIES:
        raise InvalidInputError(
            f"load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, got {policy!r}")
    if getattr(transfer_config, "kv_load_failure_policy", policy) != policy:
        logger.info("memkv: vLLM's kv_load_failure_policy set to %r (a failed load %s)",
                    policy, "is recomputed" if policy == "recompute" else "fails its request")
        transfer_config.kv_load_failure_policy = policy
