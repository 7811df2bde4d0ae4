"""Codec benchmark: ratio, speed and error of every memkv codec on model KV.

Builds the reference Llama architecture with random weights (fixed seed, no
download), runs one forward pass with ``use_cache=True``, cuts the cache into
memkv blocks (fp16 layout) and, for each codec configuration, measures:

* ratio versus the fp16 bytes (frame bytes, headers included),
* encode and decode speed on one core, in MB (10^6 bytes) of fp16 input per
  second, best of ``--reps`` passes over all blocks,
* max-abs and RMS error against the fp16 blocks.

``memkv bench codecs`` runs these measurements (on random and trained KV) and
writes the table; this module holds the cases and the measuring.

Random-weight KV is close to Gaussian noise: it has none of the outlier
channels, token-to-token correlation or peaked distributions of a trained
model's cache, so lossy ratios here are a floor and error figures are not
perplexity. A later benchmark measures a trained model.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memkv.protocol.checksum import crc32
from memkv.storage.codecs import Codec, get_codec, get_codec_for, peek_header
from memkv.storage.config import CodecConfig
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.precision import dequantize_int8, measure_error, quantize_int8

# The project's reference model: a small Llama (GQA 8 query / 2 KV heads).
REFERENCE_MODEL: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
SEED = 0
BLOCK_TOKENS = 256
MB = 1_000_000


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the table: a label and how to encode/decode a block."""

    label: str
    codec: str
    params: dict[str, Any]
    stage: str  # what this row adds, for the per-stage breakdown


@dataclass(frozen=True, slots=True)
class Row:
    """Measured figures of one case."""

    label: str
    codec: str
    params: dict[str, Any]
    stage: str
    ratio_vs_fp16: float
    encode_mb_s: float
    decode_mb_s: float
    max_abs_err: float
    rms_err: float
    rel_rms_err: float
    error_bound: str


def _configured_delta_rl() -> dict[str, Any]:
    """The delta_rl parameters memkv's default config builds."""
    return get_codec_for(CodecConfig(), "delta_rl").params()


def stepped_label(step: float) -> str:
    """The row of stepped codes at ``step`` (zstd level 1, as configured)."""
    return f"delta_rl stepped {step:g}"


#: Steps (x the RMS of a key channel / value token) of the stepped rows.
STEPS = (0.3, 0.4, 0.5, 0.6, 0.75, 1.0)
CASES: tuple[Case, ...] = (
    Case("none", "none", {}, "raw + crc32"),
    Case("lz4", "lz4", {"shuffle": False}, "lz4"),
    Case("lz4+shuffle", "lz4", {"shuffle": True}, "lz4 after byte shuffle"),
    Case("zstd-3", "zstd", {"shuffle": False, "level": 3}, "zstd"),
    Case("zstd-3+shuffle", "zstd", {"shuffle": True, "level": 3}, "zstd after byte shuffle"),
    Case("delta_rl 8b q only", "delta_rl",
         {"bits": 8, "run_length": False, "level": None}, "int8 codes + scales"),
    Case("delta_rl 8b +zstd", "delta_rl",
         {"bits": 8, "run_length": False, "level": 3}, "+ entropy (zstd)"),
    Case("delta_rl 8b +rl+zstd", "delta_rl",
         {"bits": 8, "run_length": True, "level": 3}, "+ run-length"),
    Case("delta_rl 8b +delta+rl+zstd", "delta_rl",
         {"bits": 8, "token_delta": True, "run_length": True, "level": 3}, "+ token delta"),
    Case("delta_rl 4b g32 q only", "delta_rl",
         {"bits": 4, "group": 32, "run_length": False, "level": None}, "4-bit codes + tables"),
    Case("delta_rl 4b g32 +zstd", "delta_rl",
         {"bits": 4, "group": 32, "run_length": False, "level": 3}, "+ entropy (zstd)"),
    Case("delta_rl 4b g32 +rl+zstd", "delta_rl",
         {"bits": 4, "group": 32, "run_length": True, "level": 3}, "+ run-length"),
    Case("delta_rl 4b g32 +delta+rl+zstd", "delta_rl",
         {"bits": 4, "group": 32, "token_delta": True, "run_length": True, "level": 3},
         "+ token delta"),
    Case("delta_rl 4b g32 K per-token", "delta_rl",
         {"bits": 4, "group": 32, "k_grouping": "token"}, "keys grouped per token"),
    Case("delta_rl 4b g64", "delta_rl", {"bits": 4, "group": 64}, "group 64"),
    Case("delta_rl 4b g128", "delta_rl", {"bits": 4, "group": 128}, "group 128"),
    *(Case(stepped_label(step), "delta_rl",
           {"bits": 8, "step": step, "level": 1}, f"int8 steps of {step:g} x RMS")
      for step in STEPS),
    Case("delta_rl stepped 0.5 zstd-3", "delta_rl", {"bits": 8, "step": 0.5, "level": 3},
         "zstd level 3 instead of 1"),
    Case("delta_rl default", "delta_rl", _configured_delta_rl(), "memkv's configured default"),
)


def build_kv(tokens: int) -> tuple[KVLayout, list[torch.Tensor], dict[str, Any]]:
    """Run the reference model once; return its KV as fp16 memkv blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**REFERENCE_MODEL)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(
        0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(SEED + 1)
    )
    start = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    forward_s = time.perf_counter() - start
    cache = out.cache  # transformers 5.x: a DynamicCache with .layers[i].keys/.values
    layout = KVLayout.from_model_config(
        config, model_id="llama-ref-random", dtype="float16", block_tokens=BLOCK_TOKENS
    )
    keys = [layer.keys.to(torch.float16) for layer in cache.layers]
    values = [layer.values.to(torch.float16) for layer in cache.layers]
    blocks = split_kv(layout, keys, values)
    return layout, blocks, {"forward_s": round(forward_s, 2)}


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Smallest wall time of ``reps`` calls."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def best_total(fn: Callable[[Any], object], items: Sequence[Any], reps: int) -> float:
    """Sum over items of the best of ``reps`` calls on each.

    Per-item minima shrug off interference from other processes on a shared
    machine better than the best of whole passes.
    """
    return sum(best_time(functools.partial(fn, item), reps) for item in items)


def _errors(blocks: Sequence[torch.Tensor], decoded: Sequence[torch.Tensor]) -> tuple[float, ...]:
    ref = torch.cat([b.reshape(-1) for b in blocks]).float()
    got = torch.cat([d.reshape(-1) for d in decoded]).float()
    e = measure_error(ref, got)
    return e.max_abs, e.rms, e.rel_rms


def run_case(case: Case, blocks: Sequence[torch.Tensor], reps: int) -> Row:
    """Measure one codec configuration over all blocks."""
    codec: Codec = get_codec(case.codec, **case.params)
    raw = sum(b.numel() * b.element_size() for b in blocks)
    frames = [codec.encode(b) for b in blocks]
    enc = best_total(codec.encode, blocks, reps)
    dec = best_total(codec.decode, frames, reps)
    decoded = [codec.decode(f) for f in frames]
    if codec.lossless:
        for b, d in zip(blocks, decoded, strict=True):
            if not torch.equal(b.view(torch.int16), d.view(torch.int16)):
                raise RuntimeError(f"{case.label}: lossless round trip is not bit-exact")
    max_abs, rms, rel = _errors(blocks, decoded)
    return Row(
        label=case.label,
        codec=case.codec,
        params={**codec.params(), **({"stages": peek_header(frames[0]).params}
                                     if case.codec == "delta_rl" else {})},
        stage=case.stage,
        ratio_vs_fp16=raw / sum(len(f) for f in frames),
        encode_mb_s=raw / enc / MB,
        decode_mb_s=raw / dec / MB,
        max_abs_err=max_abs,
        rms_err=rms,
        rel_rms_err=rel,
        error_bound=codec.error_bound(),
    )


def run_int8(blocks: Sequence[torch.Tensor], reps: int) -> Row:
    """precision.py's int8 quantisation alone (codes + fp32 scales, no framing)."""
    raw = sum(b.numel() * b.element_size() for b in blocks)
    qs = [quantize_int8(b) for b in blocks]
    enc = best_total(quantize_int8, blocks, reps)
    dec = best_total(dequantize_int8, qs, reps)
    max_abs, rms, rel = _errors(blocks, [dequantize_int8(q) for q in qs])
    return Row(
        label="int8 (precision.py)",
        codec="precision.quantize_int8",
        params={},
        stage="int8 K per channel / V per token, in memory",
        ratio_vs_fp16=raw / sum(q.nbytes for q in qs),
        encode_mb_s=raw / enc / MB,
        decode_mb_s=raw / dec / MB,
        max_abs_err=max_abs,
        rms_err=rms,
        rel_rms_err=rel,
        error_bound="|err| <= scale/2, scale = absmax/127 per K channel / V token",
    )


def crc32_gb_s(blocks: Sequence[torch.Tensor], reps: int) -> float:
    """CRC32 throughput (memkv.protocol.checksum) on the block bytes (its share of every decode)."""
    data = [b.reshape(-1).view(torch.uint8).numpy() for b in blocks]
    raw = sum(d.nbytes for d in data)
    return raw / best_total(lambda d: crc32(d.data), data, reps) / 1e9


def stage_contributions(rows: Sequence[Row]) -> dict[str, dict[str, float]]:
    """Ratio gained by each delta_rl stage over the row before it (x factor)."""
    by_label = {r.label: r for r in rows}
    chains = {
        "8bit": ["delta_rl 8b q only", "delta_rl 8b +zstd", "delta_rl 8b +rl+zstd",
                 "delta_rl 8b +delta+rl+zstd"],
        "4bit_g32": ["delta_rl 4b g32 q only", "delta_rl 4b g32 +zstd",
                     "delta_rl 4b g32 +rl+zstd", "delta_rl 4b g32 +delta+rl+zstd"],
    }
    out: dict[str, dict[str, float]] = {}
    for name, chain in chains.items():
        steps = {"quantise": by_label[chain[0]].ratio_vs_fp16}
        for prev, cur in zip(chain, chain[1:], strict=False):
            steps[by_label[cur].stage] = by_label[cur].ratio_vs_fp16 / by_label[prev].ratio_vs_fp16
        out[name] = steps
    return out
