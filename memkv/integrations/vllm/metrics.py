"""What the memkv connector did, in vLLM's own stats and Prometheus metrics.

The worker side counts (hit tokens, bytes and seconds of loads and saves,
failures); vLLM collects :class:`MemkvConnectorStats` from each worker after
every step, sums them across workers and intervals, logs them with its other
figures ("KV Transfer metrics: ...") and hands them to
:class:`MemkvPromMetrics`, which exports them on the engine's ``/metrics``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTERS", "MemkvConnectorStats", "MemkvPromMetrics", "StatsRecorder"]

#: Counter name -> what it counts. All are sums (across steps and workers).
COUNTERS: dict[str, str] = {
    "hit_tokens": "Prompt tokens whose KV was loaded from memkv instead of computed.",
    "load_blocks": "Blocks loaded from memkv into the paged KV cache.",
    "load_bytes": "Bytes of KV loaded from memkv.",
    "load_seconds": "Seconds spent loading KV from memkv (fetch and copy into the cache).",
    "load_fetch_seconds": "Of load_seconds: fetching the blocks from memkv.",
    "load_write_seconds": "Of load_seconds: writing them into the paged KV cache.",
    "load_failures": "Loads that failed and were recomputed by the engine.",
    "load_blocks_shared_memory": "Of load_blocks: copied straight from the shared memory of "
    "this host into the paged cache (the same-node path).",
    "load_blocks_fetched": "Of load_blocks: fetched through the gateway or the cluster, then "
    "written into the paged cache.",
    "load_checksum_failures": "Loaded blocks whose checksum (or lease) failed after the copy; "
    "vLLM recomputed them.",
    "save_blocks": "Blocks saved to memkv.",
    "save_bytes": "Bytes of KV saved to memkv.",
    "save_seconds": "Seconds the background saver spent storing KV in memkv.",
    "save_copy_seconds": "Seconds the forward pass spent copying blocks to save out of the "
    "paged cache (into this host's staging shared memory where the gateway is local).",
    "save_blocks_staged": "Of save_blocks: named in this host's staging shared memory, not "
    "sent (the device copies them into its own).",
    "save_blocks_reserved": "Of save_blocks: copied straight into slots the session's device "
    "reserved in its shared memory, and kept there (one copy in all).",
    "save_reference_appends": "Turns appended to their named session by reference only: "
    "vLLM's prefix cache held all their full blocks (memkv has them), so no bytes went.",
    "save_failures": "Saves that failed (those blocks miss later).",
    "save_skipped_blocks": "Blocks whose KV the engine computed and memkv did not store "
    "(the sum of the reasons below; 0 in a healthy run).",
    "save_skipped_blocks_load_failed": "Of save_skipped_blocks: computed in a step whose load "
    "of the same request failed (vLLM recomputes them, and they are saved then).",
    "save_skipped_blocks_memkv_error": "Of save_skipped_blocks: memkv refused the save or "
    "could not be reached.",
}


@dataclass
class MemkvConnectorStats(KVConnectorStats):
    """The counters of one interval (or of several, aggregated)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: round(value, 4) if isinstance(value, float) else value
            for name, value in self.data.items()
        }
        for kind in ("load", "save"):
            seconds = self.data[f"{kind}_seconds"]
            if seconds > 0:
                out[f"{kind}_gb_per_s"] = round(self.data[f"{kind}_bytes"] / seconds / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)


class StatsRecorder:
    """Thread-safe counters: the forward pass and the saver thread both add to them.

    ``take()`` hands vLLM the interval's counters and starts a new interval;
    ``totals`` keeps the sums since start (for benchmarks and logs).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.totals: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: float) -> None:
        unknown = set(counts) - set(COUNTERS)
        if unknown:
            raise KeyError(f"unknown connector counters {sorted(unknown)}")
        with self._lock:
            for name, value in counts.items():
                self._interval[name] += value
                self.totals[name] += value

    def take(self) -> MemkvConnectorStats | None:
        with self._lock:
            if not any(self._interval.values()):
                return None
            data, self._interval = self._interval, dict.fromkeys(COUNTERS, 0)
        return MemkvConnectorStats(data=dict(data))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.totals)


class MemkvPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:memkv_{name}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                per_engine[engine_idx].inc(value)
