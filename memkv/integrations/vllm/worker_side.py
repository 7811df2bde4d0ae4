"""The connector's worker side: loads into the paged cache, and copies out of it to save.

vLLM makes this side in each worker process. Each step it gets the scheduler
side's plan (:class:`~memkv.integrations.vllm.plan.MemkvConnectorMetadata`):

- loads: the blocks of this host's shared memory are leased and copied
  straight into the paged cache (:mod:`~memkv.integrations.vllm.direct_load`),
  the rest fetched; written layer by layer just before each layer's attention
  reads them (``wait_for_layer_load``), or all before the forward pass;
- saves: each layer's KV of the blocks the step completes is copied out of the
  paged cache as the forward pass writes it (``save_kv_layer``), and stored off
  this thread (:mod:`~memkv.integrations.vllm.saver`); the blocks of a request
  that finished are copied in ``wait_for_save`` (they are complete and vLLM
  keeps them until :meth:`WorkerSide.get_finished` names the request).

A load that cannot be fetched, or fails its checksum, is reported as a load
error (vLLM recomputes its blocks) and the step's save of that request is
dropped (its KV was computed over blocks that did not arrive).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memkv.gpu_kernels import ops as kernels
from memkv.integrations.vllm.block_buffers import BlockBuffers
from memkv.integrations.vllm.direct_load import DirectLoad, PinnedStaging, cache_words
from memkv.integrations.vllm.metrics import StatsRecorder
from memkv.integrations.vllm.plan import (
    FAILURES,
    Direct,
    Fetched,
    Leased,
    Load,
    MemkvConnectorMetadata,
    Save,
    Staged,
    load_copy_threads,
    paged_layout,
    request_bytes,
    reserve_min_bytes,
)
from memkv.integrations.vllm.saver import Saver
from memkv.integrations.vllm.stats_file import write_part
from memkv.integrations.vllm.transport import KVTransport
from memkv.protocol.layout import KVLayout
from memkv.shm.same_node import SegmentMaps

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

#: Fetched-block buffers kept between steps for reuse (the rest of a big load is freed).
FETCH_BUFFER_KEEP_BYTES = 1 << 30


class WorkerSide:
    """Loads and saves of one vLLM worker.

    Args:
        layout: the engine's KV layout in memkv's terms.
        extra: ``kv_connector_extra_config``.
        transport: memkv (made on first use, by whichever thread).
    """

    def __init__(self, layout: KVLayout, extra: dict[str, Any],
                 transport: Callable[[], KVTransport]) -> None:
        self.layout = layout
        self._block_size = layout.block_tokens
        self._transport = transport
        self._layerwise = bool(extra.get("layerwise", True))
        self._request_bytes = request_bytes(extra)
        self._reserve_min_bytes = reserve_min_bytes(extra)
        self._copy_threads = load_copy_threads(extra)
        self._stats_path = extra.get("stats_path")
        self._stats_lock = threading.Lock()  # the engine's thread and the saver's
        self.stats = StatsRecorder()
        self.saver = Saver(layout, transport, self.stats, request_bytes=self._request_bytes,
                           reserve_min_bytes=self._reserve_min_bytes,
                           on_done=self.write_stats_file)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._layer_names: list[str] = []
        self._fetched: list[Fetched] = []
        self._buffers = BlockBuffers(
            layout.block_nbytes(), int(extra.get("fetch_buffer_bytes", FETCH_BUFFER_KEEP_BYTES)))
        self._direct: list[Direct] = []
        self._maps = SegmentMaps()  # this host's memkv segments, mapped once
        self._words: dict[int, np.ndarray] = {}  # CPU layer caches as numpy words
        self._pinned = PinnedStaging()  # for CUDA caches: reused host staging
        self._failed_requests: set[str] = set()  # this step's loads that went wrong
        self._staged: dict[str, Staged] = {}  # req id -> its blocks' copy, to send
        self._load_errors: set[int] = set()
        self._finished_saving: set[str] = set()  # finished requests whose blocks are copied

    # -- set-up ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._layer_names = list(kv_caches)  # once, not per layer of every load
        self._words = {
            i: cache_words(t) for i, t in enumerate(kv_caches.values()) if not t.is_cuda
        }
        self.write_stats_file()  # the worker's file exists from the start
        try:
            self._transport().warm_up()
        except FAILURES as e:
            logger.warning("memkv is not reachable yet (requests will retry): %s", e)
        try:  # the save staging made (and its pages populated) now, not in the first save
            self._transport().save_slot(0)
            # This host's device segments, mapped with their page tables populated: a
            # fresh engine's first load or save pays no page faults (~35 ms per 512 MiB).
            self._transport().prepare_shared_memory(self._maps,
                                                    self._reserve_min_bytes is not None)
        except FAILURES as e:
            logger.debug("memkv shared memory not ready: %s", e)

    # -- loads ----------------------------------------------------------------------

    def start_load_kv(self, metadata: MemkvConnectorMetadata) -> None:
        """Fetch each request's cached blocks; write them now, or layer by layer."""
        self._finish_loads()  # a previous step's layers that no attention layer asked for
        for load in metadata.loads:
            self._start_load(load)
        if metadata.loads:
            self.write_stats_file()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Write this layer's slices of the step's loaded blocks into the paged cache."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not (self._fetched or self._direct):
            return
        start = time.perf_counter()
        self._write_all(layer)
        spent = time.perf_counter() - start
        self.stats.add(load_seconds=spent, load_write_seconds=spent)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------

    def save_kv_layer(self, metadata: MemkvConnectorMetadata, layer_name: str,
                      kv_layer: torch.Tensor) -> None:
        """Copy this layer's KV of the blocks the step completes (stored off this thread)."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        start = time.perf_counter()
        copied = False
        for save in metadata.saves:
            if not save.final and save.block_ids:  # (none: a turn appended by reference)
                self._copy_layer(save, layer, kv_layer)
                copied = True
        if copied:
            self.stats.add(save_copy_seconds=time.perf_counter() - start)

    def wait_for_save(self, metadata: MemkvConnectorMetadata) -> None:
        """Hand the step's saves to the saver; copy finished requests' blocks first."""
        self._finish_loads()
        finals = [save for save in metadata.saves if save.final]
        if finals:
            # Their blocks are complete and vLLM keeps them until get_finished says so.
            start = time.perf_counter()
            for name, kv_layer in self._kv_caches.items():
                for save in finals:
                    if save.block_ids:  # (none: a turn appended by reference)
                        self._copy_layer(save, self._layer_index[name], kv_layer)
            self.stats.add(save_copy_seconds=time.perf_counter() - start)
        failed, self._failed_requests = self._failed_requests, set()
        for save in metadata.saves:
            staged = self._staged.pop(save.req_id + ("/final" if save.final else ""), None)
            if staged is None and not save.block_ids:
                staged = Staged(torch.empty(0))  # a turn appended by reference: no bytes
            if save.final:
                self._finished_saving.add(save.req_id)
            if save.req_id in failed and not save.final:
                # Its KV of this step was computed over blocks that did not load:
                # never stored under its tokens (vLLM recomputes the request).
                self.stats.add(save_skipped_blocks=len(save.block_ids),
                               save_skipped_blocks_load_failed=len(save.block_ids))
                if staged is not None:
                    staged.release()
                continue
            if staged is not None:
                self.saver.submit(save, staged)
        if metadata.saves:
            self.write_stats_file()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Finished requests whose last blocks are copied out: vLLM may free them."""
        done, self._finished_saving = self._finished_saving, set()
        return done or None, None

    # -- stats and shutdown ---------------------------------------------------------------

    def write_stats_file(self) -> None:
        if not self._stats_path:
            return
        doc = {**self.stats.snapshot(), "saves_queued": self.saver.queued,
               "saves_done": self.saver.done}
        # The scheduler's connector and the workers' share the file: each writes its
        # own part, the top level sums them (memkv.integrations.vllm.stats_file).
        with self._stats_lock:
            write_part(self._stats_path, f"worker-{os.getpid()}", doc)

    def close(self) -> None:
        self.saver.close()
        self.write_stats_file()

    # -- internals ----------------------------------------------------------------------

    def _copy_layer(self, save: Save, layer: int, kv_layer: torch.Tensor) -> None:
        key = save.req_id + ("/final" if save.final else "")
        staged = self._staged.get(key)
        if staged is None:
            staged = self._staged[key] = self.saver.buffer(save)
        kernels.paged_read(kv_layer, save.block_ids, layer, staged.blocks,
                           paged_layout(kv_layer))

    def _start_load(self, load: Load) -> None:
        """Lease what this host's shared memory holds, fetch the rest; write now or per layer."""
        start = time.perf_counter()
        direct = self._lease(load)
        wanted = [(k, b) for k, b in zip(load.keys, load.block_ids, strict=True)
                  if direct is None or b not in direct.pending_ids]
        fetched: Fetched | None = None
        if wanted:
            rest = Load(load.req_id, [k for k, _ in wanted], [b for _, b in wanted],
                        load.partition)
            try:
                blocks = self._read(rest.keys, load.partition)
            except FAILURES as e:
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
            leased = self._transport().scoped(load.partition).lease(load.keys)
        except FAILURES as e:
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
        except FAILURES as e:  # a segment gone (its device restarted), a bad plan
            logger.warning("memkv shared memory unusable for %s, fetching: %s", load.req_id, e)
            release()
            return None
        entry = Direct(load, copy, set(self._layer_index.values()))
        return Leased(entry, set(copy.block_ids))

    def _write_all(self, layer: int) -> None:
        """Layer ``layer`` of every load of this step not written yet."""
        for fetched in self._fetched:
            if layer in fetched.pending:
                kv_layer = self._kv_caches[self._layer_names[layer]]  # names in layer order
                blocks: Any = fetched.blocks
                kernels.paged_write(blocks, fetched.load.block_ids, layer, kv_layer,
                                    paged_layout(kv_layer))
                fetched.pending.discard(layer)
        for direct in self._direct:
            if layer in direct.pending:
                kv_layer = self._kv_caches[self._layer_names[layer]]
                direct.copy.write_layer(layer, kv_layer, paged_layout(kv_layer),
                                        self._words.get(layer))
                direct.pending.discard(layer)

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

    def _read(self, keys: list[bytes], partition: str | None) -> list[torch.Tensor]:
        per = max(1, self._request_bytes // self.layout.block_nbytes())
        blocks: list[torch.Tensor] = []
        transport = self._transport().scoped(partition)
        for i in range(0, len(keys), per):
            chunk = keys[i : i + per]
            # Into the step's reused buffers: no page faults inside the load.
            blocks.extend(transport.read(chunk, out=self._buffers.take(len(chunk))))
        return blocks
