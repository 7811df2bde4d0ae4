"""Codecs suite: ratio versus fp16, speed per core, error and perplexity cost of every codec.

Two kinds of KV:

* a small byte-level Llama trained here on the standard library's sources
  (:mod:`memkv.bench.accuracy`; trained once, cached under the user's cache
  directory): the table's ratio, error, speed and perplexity rise, with real
  statistics (outlier channels, token correlation, peaked distributions);
* the reference model with random weights (near-Gaussian KV, larger blocks),
  reusing ``memkv/bench/codec_measure.py``: the "ratio (random KV)" column, a floor.

Perplexity: held-out windows of 192 + 64 bytes; the 192-byte prefix's cache
goes through each precision or codec (encode + decode of real memkv frames),
then the next 64 bytes are scored on it against the unmodified fp32 cache.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from memkv.bench.accuracy import (
    DEFAULT_CONT,
    DEFAULT_PREFIX,
    KVTransform,
    PerplexityResult,
    TrainedModel,
    codec_transform,
    int8_transform,
    perplexity_with_codecs,
    precision_transform,
    train_byte_llama,
    trained_kv_blocks,
)
from memkv.bench.context import BenchContext
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, track
from memkv.protocol.checksum import CRC32_BACKEND
from memkv.storage.codecs import get_codec
from memkv.storage.layout import KVLayout

__all__ = ["QUICK_CASES", "run"]

TOKENS = 2048
QUICK_TOKENS = 256
REPS = 5
QUICK_REPS = 1
#: Held-out windows scored per codec (each 64 bytes on a 192-byte cache).
WINDOWS = 128
QUICK_WINDOWS = 2
#: Blocks of the trained model's KV (one 256-token held-out window each) for speed and error.
TRAINED_BLOCKS = 8
QUICK_TRAINED_BLOCKS = 2
#: Cases of --quick: one lossless, the int8 and 4-bit Delta+RL archives.
QUICK_CASES = ("zstd-3+shuffle", "delta_rl 8b +delta+rl+zstd", "delta_rl default")
INT8_LABEL = "int8 (precision.py)"
#: Precision rows: label -> (dtype the cache is kept in, its error bound).
PRECISIONS: dict[str, tuple[torch.dtype, str]] = {
    "fp32 (unmodified)": (torch.float32, "exact (the reference)"),
    "fp16": (torch.float16, "fp16 rounding, |err| <= 2^-11 |x|"),
    "bf16": (torch.bfloat16, "bf16 rounding, |err| <= 2^-8 |x|"),
}
COLUMNS = ["codec", "ratio vs fp16", "ppl rise %", "rel RMS err", "encode MB/s",
           "decode MB/s", "ratio (random KV)", "error bound"]


def _transforms(cases: Sequence[Any], layout: KVLayout) -> dict[str, KVTransform]:
    out: dict[str, KVTransform] = {
        label: precision_transform(dtype) for label, (dtype, _) in PRECISIONS.items()
    }
    out[INT8_LABEL] = int8_transform(layout)
    for case in cases:
        out[case.label] = codec_transform(get_codec(case.codec, **case.params), layout)
    return out


def _model_note(info: TrainedModel, ppl: PerplexityResult) -> str:
    m = info.manifest
    cfg = m["recipe"]["config"]
    where = f"loaded from {info.path}" if info.cached else (
        f"trained in this run, saved to {info.path}" if info.path else "trained in this run")
    return (
        f"Trained KV: byte-level Llama ({cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
        f"{cfg['num_key_value_heads']} KV heads, {m['parameters']:,} parameters), trained "
        f"{m['train_s']:.0f} s on this CPU ({m['steps']} AdamW steps, {m['tokens_seen']:,} "
        f"bytes seen) on {m['corpus_files']} standard-library .py files, "
        f"{m['held_out_files']} held out by file; held-out loss {m['held_out_loss']:.3f} "
        f"nats/byte; {where}. Perplexity over {ppl.windows} held-out windows of "
        f"{DEFAULT_PREFIX} + {DEFAULT_CONT} bytes ({ppl.scored_tokens} bytes scored); "
        f"reference {ppl.reference:.3f} on the unmodified fp32 cache. Codec rows store fp16 "
        f"blocks, so their rise includes fp16's rounding."
    )


def run(ctx: BenchContext) -> SuiteResult:
    """Every codec case and precision on the trained model's KV, plus ratios on random KV."""
    from memkv.bench import codec_measure as bc
    tokens = QUICK_TOKENS if ctx.quick else TOKENS
    reps = QUICK_REPS if ctx.quick else REPS
    cases = [c for c in bc.CASES if not ctx.quick or c.label in QUICK_CASES]
    with tempfile.TemporaryDirectory(prefix="memkv-byte-llama-") as scratch:
        # --quick trains a tiny model for seconds in a scratch dir, never the user's cache;
        # otherwise the model is trained once and reused from the user's cache dir.
        model, info = train_byte_llama(Path(scratch) if ctx.quick else None, quick=ctx.quick)
    held_out = info.corpus.held_out
    layout, trained_blocks = trained_kv_blocks(
        model, held_out, QUICK_TRAINED_BLOCKS if ctx.quick else TRAINED_BLOCKS)
    ppl = perplexity_with_codecs(
        model, held_out, _transforms(cases, layout), prefix=DEFAULT_PREFIX, cont=DEFAULT_CONT,
        n_windows=QUICK_WINDOWS if ctx.quick else WINDOWS)

    rlayout, blocks, meta = bc.build_kv(tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # codec figures are per core
    try:
        crc = bc.crc32_gb_s(blocks, reps)
        random_rows = [bc.run_case(c, blocks, reps) for c in track(cases, "codecs: random KV")]
        random_rows.append(bc.run_int8(blocks, reps))
        trained_rows = [bc.run_case(c, trained_blocks, reps)
                        for c in track(cases, "codecs: trained KV")]
        trained_rows.append(bc.run_int8(trained_blocks, reps))
    finally:
        torch.set_num_threads(threads)

    random_ratio = {r.label: r.ratio_vs_fp16 for r in random_rows}
    rows: list[list[Any]] = [
        [label, ppl[label].ratio_vs_fp16, ppl[label].rise_pct, None, None, None, None, bound]
        for label, (_, bound) in PRECISIONS.items()
    ]
    rows += [[r.label, ppl[r.label].ratio_vs_fp16, ppl[r.label].rise_pct, r.rel_rms_err,
              r.encode_mb_s, r.decode_mb_s, random_ratio[r.label], r.error_bound]
             for r in [trained_rows[-1], *trained_rows[:-1]]]  # int8 first, then the codecs
    stages: dict[str, Any] = {}
    if not ctx.quick:
        stages = {"trained": bc.stage_contributions(trained_rows),
                  "random": bc.stage_contributions(random_rows)}
    reference = next(iter(ppl.values()))
    notes = [
        _model_note(info, reference),
        f"Speed and error: {len(trained_blocks)} blocks of {list(layout.block_shape())} fp16 "
        f"of the trained model's KV, best of {reps} per block; MB/s = 10^6 fp16 input bytes "
        f"per second on one core; CRC32 ({CRC32_BACKEND}) {crc:.2f} GB/s (checked on every "
        "decode).",
        f"Ratio (random KV): {tokens} tokens of the reference Llama with random weights (seed "
        f"{bc.SEED}), {len(blocks)} blocks of {list(rlayout.block_shape())} fp16: "
        "near-Gaussian, so lossy ratios there are a floor.",
    ]
    for kind, chains in stages.items():
        for name, steps in chains.items():
            notes.append(f"{name} ratio by stage ({kind} KV): "
                         + ", ".join(f"{k} ×{v:.3f}" for k, v in steps.items()))
    labels = [r[0] for r in rows]
    return SuiteResult(
        suite="codecs",
        title="codec ratio vs fp16, perplexity rise, speed per core (trained byte-Llama KV)",
        columns=COLUMNS,
        rows=rows,
        figures={
            "tokens": tokens, "reps": reps, "forward_s": meta["forward_s"], "crc32_gb_s": crc,
            "results": [asdict(r) for r in random_rows],
            "trained_results": [asdict(r) for r in trained_rows],
            "stage_contributions": stages,
            "perplexity": {label: asdict(p) for label, p in ppl.items()},
            "trained_model": {**info.manifest, "path": str(info.path) if info.path else None,
                              "cached": info.cached},
        },
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "codec", "ratio vs fp16", labels,
                      {"trained KV": [r[1] for r in rows],
                       "random KV": [r[6] for r in rows]}),
        quick=ctx.quick,
    )
