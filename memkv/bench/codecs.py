"""Codecs suite: ratio versus fp16, encode/decode MB/s per core and error of every codec.

Reuses ``benchmarks/bench_codecs.py`` (its cases, its one-core timing and its
error measures) on the reference model's KV.

Not measured yet: perplexity with the KV passed through each codec, which
needs a small byte-level Llama trained once on the standard library's sources
(see the note in the results); the KV here is from a random-weight model, so
lossy ratios are a floor and errors are not perplexity.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from memkv.bench.context import BenchContext, load_benchmark_script
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, track

__all__ = ["QUICK_CASES", "run"]

TOKENS = 2048
QUICK_TOKENS = 256
REPS = 5
QUICK_REPS = 1
#: Cases of --quick: one lossless, the int8 and 4-bit Delta+RL archives.
QUICK_CASES = ("zstd-3+shuffle", "delta_rl 8b +delta+rl+zstd", "delta_rl default")
PERPLEXITY_TODO = (
    "perplexity per codec is not measured yet: it needs a small byte-level Llama trained "
    "once on the Python standard library's sources (cached under ~/.cache/memkv); figures "
    "here are on random-weight KV (near-Gaussian), so lossy ratios are a floor."
)


def run(ctx: BenchContext) -> SuiteResult:
    """Every codec case on the reference model's fp16 KV, one core."""
    bc = load_benchmark_script("bench_codecs")
    tokens = QUICK_TOKENS if ctx.quick else TOKENS
    reps = QUICK_REPS if ctx.quick else REPS
    layout, blocks, meta = bc.build_kv(tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # codec figures are per core
    try:
        cases = [c for c in bc.CASES if not ctx.quick or c.label in QUICK_CASES]
        crc = bc.crc32_gb_s(blocks, reps)
        rows_obj = [bc.run_case(c, blocks, reps) for c in track(cases, "codecs: cases")]
        rows_obj.append(bc.run_int8(blocks, reps))
    finally:
        torch.set_num_threads(threads)
    rows = [[r.label, r.ratio_vs_fp16, r.encode_mb_s, r.decode_mb_s, r.max_abs_err,
             r.rel_rms_err, r.error_bound] for r in rows_obj]
    stages: dict[str, Any] = {}
    if not ctx.quick:
        stages = bc.stage_contributions(rows_obj)
    notes = [
        f"{tokens} tokens of KV from the reference Llama (random weights, seed {bc.SEED}): "
        f"{len(blocks)} blocks of {list(layout.block_shape())} fp16; best of {reps} per block; "
        f"MB/s = 10^6 fp16 input bytes per second on one core; zlib.crc32 {crc:.2f} GB/s "
        "(checked on every decode).",
        bc.NOTE,
        PERPLEXITY_TODO,
    ]
    for name, steps in stages.items():
        notes.append(f"{name} ratio by stage: "
                     + ", ".join(f"{k} ×{v:.3f}" for k, v in steps.items()))
    labels = [r.label for r in rows_obj]
    return SuiteResult(
        suite="codecs",
        title="codec ratio vs fp16, speed per core and error (reference-model KV)",
        columns=["codec", "ratio vs fp16", "encode MB/s", "decode MB/s", "max |err|",
                 "rel RMS err", "error bound"],
        rows=rows,
        figures={"tokens": tokens, "reps": reps, "forward_s": meta["forward_s"],
                 "crc32_gb_s": crc, "results": [asdict(r) for r in rows_obj],
                 "stage_contributions": stages, "perplexity": None},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "codec", "ratio vs fp16", labels,
                      {"ratio vs fp16": [r.ratio_vs_fp16 for r in rows_obj]}),
        quick=ctx.quick,
    )
