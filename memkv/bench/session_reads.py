"""Session reads of the data-plane suite: one stored session restored through the
same-node path, in-cluster (Ray) and the gateway (HTTP and block port), beside
memcpy of the same bytes, and what one H100 needs to prefill it instead."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from memkv.bench.clients import run_clients
from memkv.bench.context import BenchContext
from memkv.bench.levels import LevelResult, from_latencies, memcpy_level
from memkv.protocol.layout import KVLayout

__all__ = ["H100_BF16_FLOPS", "NAMESPACE", "PREFILL_MFU", "h100_prefill_s", "session_rows"]

NAMESPACE = "bench-dataplane"
#: One H100 SXM: 989 TFLOPS dense BF16 (NVIDIA H100 Tensor Core GPU datasheet; 1,979
#: is the sparse figure). Prefill FLOPs of Llama-3-8B (8.03e9 parameters) for T
#: tokens: 2*N*T for the weights plus 2*L*T^2*d for causal attention (QK^T and AV).
H100_BF16_FLOPS = 989e12
LLAMA3_8B_PARAMS = 8.03e9
LLAMA3_8B_HIDDEN = 4096
#: Model FLOPs utilisation of a good prefill kernel stack (vLLM, TensorRT-LLM) on H100.
PREFILL_MFU = 0.5


def _store_session(ctx: BenchContext, layout: KVLayout, tokens: int, tag: str) -> tuple[str, Any]:
    """A session of ``tokens`` random tokens' KV stored in-cluster; its id and route."""
    import ray
    import torch

    cluster = ctx.get_cluster()
    sid = f"dp-session-{tag}-{uuid.uuid4().hex[:8]}"
    cluster.create_session(sid, layout, namespace=NAMESPACE)
    token_ids = np.random.default_rng(3).integers(0, 32000, tokens).tolist()
    n_blocks = -(-tokens // layout.block_tokens)
    g = torch.Generator().manual_seed(4)
    # One block of random values repeated: the bytes moved are what is measured.
    block = torch.randn(layout.block_shape(), generator=g).to(layout.torch_dtype)
    for i in range(n_blocks):  # one turn per block keeps each put's object small
        cluster.put_blocks(
            sid, token_ids[: min(tokens, (i + 1) * layout.block_tokens)], [block], start_block=i
        )
    route = ray.get(cluster.routers.of(sid).read_route.remote(sid, 0, None))
    return sid, route


def _same_node_reads(route: Any, reps: int) -> list[float]:
    import ray

    from memkv.shm.same_node import SameNodeReader

    layout: KVLayout = route.layout
    out = [np.empty(layout.block_nbytes(n), dtype=np.uint8) for n in route.tokens]
    node = ray.get_runtime_context().get_node_id()
    lat = []
    with SameNodeReader(route.device, node_id=node) as reader:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            got = reader.read(list(route.keys), out=out)
            lat.append(time.perf_counter() - t0)
            if len(got) != len(out) or not all(g.exact for g in got):
                raise RuntimeError("the same-node read did not return every block exactly")
    return lat[1:]


def _in_cluster_reads(ctx: BenchContext, sid: str, route: Any, reps: int) -> list[float]:
    """Until every block is readable in this process: zero-copy views of object-store objects.

    Unlike the same-node path, whose blocks must be copied out before their
    lease ends, these views stay valid while the reader holds them, so the
    read ends when the last one is mapped (an engine then copies them into its
    own cache, as it would any restored block).
    """
    cluster = ctx.get_cluster()
    _touch_object_store()
    lat = []
    for _ in range(reps + 1):  # the first pass untimed
        t0 = time.perf_counter()
        held = [block for _, block in cluster.read_session(sid)]
        lat.append(time.perf_counter() - t0)
        if len(held) != len(route.keys):
            raise RuntimeError(f"expected {len(route.keys)} blocks in-cluster, got {len(held)}")
        del held
    return lat[1:]


def _touch_object_store(fill: float = 0.9, chunk_bytes: int = 8 << 20) -> None:
    """Fault in this process's mapping of the object store, as a long-running reader has.

    A fresh process's first pass over the store's pages pays page faults (64 MiB:
    43 ms against 25 ms once touched, measured here; Ray's preallocation of the
    store did not remove it). Objects put and held until most of the store is
    written touch every page once; reading sessions until as many bytes had
    passed did the same but took minutes for a small session (12,800 reads of
    a 16 KiB session in the quick run).
    """
    import ray

    held = []
    for _ in range(int(_object_store_bytes() * fill) // chunk_bytes):
        held.append(ray.put(np.ones(chunk_bytes, dtype=np.uint8)))
    del held


def _object_store_bytes() -> int:
    """The object store of this process's node (a cluster's total counts every node's)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == here and n["Alive"]), None)
    return int((node or {}).get("Resources", {}).get("object_store_memory", 0))


def _gateway_session_reads(
    url: str, sid: str, route: Any, reps: int, block_port: bool
) -> list[float]:
    layout: KVLayout = route.layout
    params = {
        "url": url,
        "block_port": block_port,
        "session_id": sid,
        "ops": reps + 1,
        "block_bytes": [layout.block_nbytes(n) for n in route.tokens],
    }
    (run,) = run_clients("gateway_session", params, 1)
    return run.latencies[1:]


def session_rows(
    ctx: BenchContext, layout: KVLayout, tokens: int, reps: int, tag: str
) -> list[LevelResult]:
    sid, route = _store_session(ctx, layout, tokens, tag)
    nbytes = sum(layout.block_nbytes(n) for n in route.tokens)
    label = f"{tokens}-token session ({nbytes / (1 << 20):.0f} MiB, {layout.model_id})"
    try:
        rows = [memcpy_level(nbytes // len(route.keys), max(reps * 4, 8), len(route.keys))]
        rows[0] = LevelResult(
            f"memcpy ({label})",
            "copy",
            1,
            rows[0].ops,
            nbytes,
            rows[0].gb_s,
            rows[0].p50_ms,
            rows[0].p99_ms,
        )
        rows.append(
            from_latencies(f"same-node ({label})", "read", _same_node_reads(route, reps), nbytes)
        )
        rows.append(
            from_latencies(
                f"in-cluster ({label})", "read", _in_cluster_reads(ctx, sid, route, reps), nbytes
            )
        )
        for path, port in (("HTTP", False), ("block port", True)):
            rows.append(
                from_latencies(
                    f"gateway {path} ({label})",
                    "read",
                    _gateway_session_reads(ctx.get_gateway_url(), sid, route, reps, port),
                    nbytes,
                )
            )
        return rows
    finally:
        ctx.get_cluster().delete_session(sid)


def h100_prefill_s(tokens: int) -> tuple[float, float]:
    """Seconds one H100 needs to prefill ``tokens`` of Llama-3-8B: at peak, and at PREFILL_MFU."""
    flops = 2 * LLAMA3_8B_PARAMS * tokens + 2 * 32 * tokens**2 * LLAMA3_8B_HIDDEN
    peak = flops / H100_BF16_FLOPS
    return peak, peak / PREFILL_MFU
