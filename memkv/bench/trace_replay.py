"""Replay a Mooncake-style request trace through memkv's eviction policies.

Each line of the trace is one request: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, the request's prompt blocks in chain order.
The replay uses memkv's own policy classes (:func:`memkv.storage.eviction.make_policy`)
with **prefix semantics**: a request hits only its leading run of cached blocks
(the first miss ends the hits, since a reader needs the whole prefix); then
every block of the request is accessed, or inserted under the previous block
as its parent, evicting until the cache is back within capacity. The hit ratio
is hit blocks / requested blocks. ``now`` is the trace timestamp, advanced by a
tiny sub-step per block so that times are strictly increasing.

Usage::

    python -m memkv.bench.trace_replay ../shared/data/mooncake_conversation_trace.jsonl \\
        [--capacities 0.02,0.05,0.10,0.20] [--k 3] [--policies lru_k_plain,...] \\
        [--json benchmarks/results/replay_trace.json]

Prints one table (capacity, blocks, LRU hit ratio, LRU-K hit ratio, delta) and
writes the same rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memkv.storage.config import EvictionConfig
from memkv.storage.eviction import EvictionPolicy, LRUKPolicy, make_policy

__all__ = [
    "ReplayResult",
    "Request",
    "distinct_blocks",
    "load_trace",
    "main",
    "replay",
]

DEFAULT_CAPACITIES = (0.02, 0.05, 0.10, 0.20)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "replay_trace.json"

#: Time added per block when the trace clock does not move (ms). Far below the
#: trace's 1 ms resolution yet ~2000 float ulps at the trace's largest timestamps.
SUBSTEP_MS = 1e-6


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request: when (ms) and which prompt blocks, in chain order."""

    timestamp: float
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one policy achieved at one capacity."""

    policy: str
    capacity: int
    hit_blocks: int
    requested_blocks: int
    evictions: int
    seconds: float

    @property
    def hit_ratio(self) -> float:
        """Hit blocks / requested blocks (0 for an empty trace)."""
        return self.hit_blocks / self.requested_blocks if self.requested_blocks else 0.0


def load_trace(path: Path) -> list[Request]:
    """Parse a JSONL trace (``timestamp`` and ``hash_ids`` per line; other fields ignored)."""
    requests: list[Request] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(Request(float(row["timestamp"]), tuple(row["hash_ids"])))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace request ({e})") from e
    return requests


def distinct_blocks(requests: Iterable[Request]) -> int:
    """How many different blocks the trace names."""
    seen: set[int] = set()
    for r in requests:
        seen.update(r.hash_ids)
    return len(seen)


def replay(
    requests: Sequence[Request], capacity: int, policy: EvictionPolicy[int], name: str = ""
) -> ReplayResult:
    """Run ``requests`` through ``policy`` with room for ``capacity`` blocks.

    Args:
        requests: the trace, in time order.
        capacity: blocks the cache may hold (>= 1).
        policy: an empty policy; it is driven through its public interface only.
        name: label of the result.

    Returns:
        Hits (leading cached run of each request), requested blocks, evictions.

    Raises:
        ValueError: ``capacity < 1``.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    hits = requested = evictions = 0
    now = float("-inf")
    start = time.perf_counter()
    for req in requests:
        blocks = req.hash_ids
        requested += len(blocks)
        for b in blocks:
            if b not in policy:
                break
            hits += 1
        parent: int | None = None
        for b in blocks:
            now = max(req.timestamp, now + SUBSTEP_MS)
            if b in policy:
                policy.access(b, now)
            else:
                policy.insert(b, now, parent)
                while len(policy) > capacity:
                    if policy.pop_victim(now) is None:
                        break  # everything pinned: cannot happen here (nothing pins)
                    evictions += 1
            parent = b
    return ReplayResult(
        name, capacity, hits, requested, evictions, time.perf_counter() - start
    )


def _policy_factory(name: str, k: int) -> Callable[[], EvictionPolicy[int]]:
    config = EvictionConfig.model_validate({"policy": name, "k": k})
    return lambda: make_policy(config)


#: Ablations selectable by ``--policies``: name -> LRUKPolicy keyword arguments.
ABLATIONS: dict[str, dict[str, bool]] = {
    "lru_k_plain": {"inherit": False, "recency_guard": False},
    "lru_k_inherit": {"inherit": True, "recency_guard": False},
    "lru_k_guard": {"inherit": False, "recency_guard": True},
    "lru_k_flat": {"prefix_aware": False, "recency_guard": False},
}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the replay at each capacity, print the table, write the JSON; return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="JSONL trace (Mooncake format)")
    parser.add_argument(
        "--capacities",
        default=",".join(f"{c:.2f}" for c in DEFAULT_CAPACITIES),
        help="cache sizes as fractions of the distinct blocks, comma-separated",
    )
    parser.add_argument("--k", type=int, default=EvictionConfig().k, help="LRU-K's K")
    parser.add_argument(
        "--policies",
        default="",
        help=f"extra LRU-K ablations to print, comma-separated, from {sorted(ABLATIONS)}",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    fractions = [float(x) for x in args.capacities.split(",") if x.strip()]
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        parser.error(f"capacities must be fractions in (0, 1], got {args.capacities!r}")

    extra = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in extra if x not in ABLATIONS]
    if unknown:
        parser.error(f"unknown --policies {unknown}; expected from {sorted(ABLATIONS)}")

    t0 = time.perf_counter()
    requests = load_trace(args.trace)
    distinct = distinct_blocks(requests)
    total = sum(len(r.hash_ids) for r in requests)
    print(
        f"{args.trace.name}: {len(requests)} requests, {total} block reads, "
        f"{distinct} distinct blocks (loaded in {time.perf_counter() - t0:.1f} s)"
    )
    rows: list[dict[str, Any]] = []
    header = f"{'capacity':>8} {'blocks':>7} {'LRU':>7} {f'LRU-{args.k} (memkv)':>16} {'delta':>8}"
    print(header)
    print("-" * len(header))
    for frac in fractions:
        capacity = max(1, int(frac * distinct))
        lru = replay(requests, capacity, _policy_factory("lru", args.k)(), "lru")
        lruk = replay(requests, capacity, _policy_factory("lru_k", args.k)(), "lru_k")
        delta = lruk.hit_ratio - lru.hit_ratio
        ablations = {
            name: replay(requests, capacity, LRUKPolicy(args.k, **ABLATIONS[name]), name)
            for name in extra
        }
        print(
            f"{frac:>8.0%} {capacity:>7} {lru.hit_ratio:>7.4f} {lruk.hit_ratio:>16.4f} "
            f"{delta:>+8.4f}   ({lru.seconds:.1f} s / {lruk.seconds:.1f} s)"
            + "".join(f"  {n}={r.hit_ratio:.4f}" for n, r in ablations.items()),
            flush=True,
        )
        rows.append(
            {
                "capacity_fraction": frac,
                "capacity_blocks": capacity,
                "lru_hit_ratio": lru.hit_ratio,
                "lru_k_hit_ratio": lruk.hit_ratio,
                "delta": delta,
                "lru": asdict(lru),
                "lru_k": asdict(lruk),
                "ablations": {n: asdict(r) for n, r in ablations.items()},
            }
        )
    result: dict[str, Any] = {
        "benchmark": "eviction_trace_replay",
        "trace": str(args.trace),
        "requests": len(requests),
        "requested_blocks": total,
        "distinct_blocks": distinct,
        "k": args.k,
        "semantics": "prefix hits (leading cached run); every block then accessed/inserted",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
