"""Kernels suite: each conversion and copy kernel's throughput against a plain copy.

On a GPU (``memkv.gpu_kernels.backend() == "cuda"``) the CUDA kernels run on
device tensors and the anchor is a device-to-device copy of the same bytes; here,
without one, the CPU reference runs and the anchor is a numpy memcpy. GB/s counts
the bytes each kernel reads (its input), median of five runs after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memkv.bench.context import BenchContext
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, track
from memkv.gpu_kernels import backend
from memkv.gpu_kernels import ops as kernels

__all__ = ["run"]

REPS = 5
FULL_MIB, QUICK_MIB = 64, 4
#: A Llama-3-8B-shaped block of 32 tokens: [32 layers, 2, 8 heads, 32 tokens, 128].
BLOCK = (32, 2, 8, 32, 128)


def _time(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(ctx: BenchContext) -> SuiteResult:
    where = backend()
    device = "cuda" if where == "cuda" else "cpu"
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    mib = QUICK_MIB if ctx.quick else FULL_MIB
    n = mib << 20
    g = torch.Generator().manual_seed(0)
    block_bytes = int(np.prod(BLOCK)) * 2
    blocks = max(1, n // block_bytes)
    x = torch.randn((blocks, *BLOCK), generator=g).to(torch.bfloat16).to(device)
    x32 = x.float()
    flat = x32.reshape(-1)
    codes4 = torch.randint(0, 16, (flat.numel(),), dtype=torch.uint8, generator=g).numpy()
    lo, hi = kernels.group_minmax(flat.cpu(), 128)
    scale = (hi - lo) / kernels.NIBBLE_LEVELS
    raw = x.view(torch.uint8).reshape(-1)
    offsets = [i * block_bytes for i in reversed(range(blocks))]
    num_blocks = blocks + 3
    cache = torch.empty((num_blocks, 8, 32, 2 * 128), dtype=torch.bfloat16, device=device)
    ids = list(range(3, 3 + blocks))
    q = [kernels.int8_quantize(x32[i]) for i in range(blocks)]
    deq_out = torch.empty(BLOCK, dtype=torch.bfloat16, device=device)

    def paged_write_every_layer() -> None:
        for layer in range(BLOCK[0]):
            kernels.paged_write(x, ids, layer, cache, kernels.PAGED_CPU)

    def copy() -> None:
        if device == "cuda":
            raw.clone()
        else:
            np.copyto(np.empty(raw.numel(), dtype=np.uint8), raw.numpy())

    cases: list[tuple[str, int, Callable[[], Any]]] = [
        ("copy (anchor)", raw.numel(), copy),
        ("cast bf16 -> fp32", x.numel() * 2, lambda: kernels.cast(x, torch.float32)),
        ("cast fp32 -> fp16", x32.numel() * 4, lambda: kernels.cast(x32, torch.float16)),
        ("int8 quantise (per block)", x32.numel() * 4,
         lambda: [kernels.int8_quantize(x32[i]) for i in range(blocks)]),
        ("int8 dequantise (per block)", sum(c.numel() for c, _, _ in q),
         lambda: [kernels.int8_dequantize(c, k, v, deq_out) for c, k, v in q]),
        ("4-bit group min/max", flat.numel() * 4,
         lambda: kernels.group_minmax(flat.cpu(), 128)),
        ("4-bit codes", flat.numel() * 4,
         lambda: kernels.group4_codes(flat.cpu(), 128, scale, lo)),
        ("4-bit dequantise", codes4.size,
         lambda: kernels.group4_dequantize(codes4, 128, scale, lo)),
        ("pack nibbles", codes4.size, lambda: kernels.pack_nibbles(codes4)),
        ("token delta", codes4.size,
         lambda: kernels.token_delta(codes4.reshape(-1, 32, 128), 1, 0x0F)),
        ("undo token delta", codes4.size,
         lambda: kernels.undo_token_delta(codes4.reshape(-1, 32, 128), 1, 0x0F)),
        ("gather blocks", raw.numel(), lambda: kernels.gather_blocks(raw, offsets, block_bytes)),
        ("paged write (one layer x 32)", x.numel() * 2, paged_write_every_layer),
    ]
    figures: list[dict[str, Any]] = []
    for name, nbytes, fn in track(cases, "kernels"):
        seconds = _time(fn, sync)
        figures.append({"kernel": name, "bytes": nbytes, "seconds": seconds,
                        "gb_per_s": nbytes / seconds / 1e9})
    anchor = figures[0]["gb_per_s"]
    rows = [[f["kernel"], where, round(f["bytes"] / 2**20, 1), round(f["gb_per_s"], 2),
             round(f["gb_per_s"] / anchor, 2)] for f in figures]
    ran = "CUDA kernels on device tensors" if where == "cuda" else "the CPU reference, no GPU"
    notes = [
        f"backend: {where} ({ran}); {mib} MiB of Llama-3-8B-shaped bf16 blocks; GB/s of "
        f"input bytes, median of {REPS}.",
        "The anchor is a device-to-device copy on a GPU, a numpy memcpy on the CPU.",
    ]
    return SuiteResult(
        suite="kernels",
        title="Conversion and copy kernels: GB/s against a plain copy",
        columns=["kernel", "backend", "MiB in", "GB/s", "vs copy"],
        rows=rows,
        figures={"backend": where, "mib": mib, "cases": figures},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "kernel", "GB/s", [f["kernel"] for f in figures],
                      {"GB/s": [f["gb_per_s"] for f in figures]}, log_y=True),
        quick=ctx.quick,
    )
