"""Scale suite: many sessions with a shared prefix through the router.

Creates 10,000 sessions (``--quick``: 200) whose first block is one shared
system prompt, measures:

* session operations per second at the router (create, lookup, delete), the
  calls submitted concurrently as an inference fleet would;
* a burst of turns (the shared prefix, deduplicated, plus one own block per
  session) through the in-cluster API, one caller;
* gateway requests per second for small requests (session lookups) from
  client threads;
* the router process' resident memory per idle session (from /proc, same node);
* the hot tier's occupancy after the burst;
* router shards: session creates per second with the table split over 1, 2
  and 4 router actors (100,000 sessions each; ``--quick``: 2,000), beside bare
  calls spread over the same shards, all from one driver.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
import torch

from memkv.actors.handles import SessionServiceHandle
from memkv.actors.router import SessionRouterActor
from memkv.actors.router_shards import RouterShards
from memkv.bench.context import BenchContext
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, percentile, track
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import CreateSession, CreateSessions, LayoutSpec, encode
from memkv.protocol.stats import ClusterStats

__all__ = ["run"]

SESSIONS = 10_000
QUICK_SESSIONS = 200
#: Router calls in flight at once (an inference fleet's worth of callers).
IN_FLIGHT = 256
GATEWAY_THREADS = 8
#: Sessions per call of the batched create.
BATCH = 256
GATEWAY_REQUESTS = 4000
QUICK_GATEWAY_REQUESTS = 200
#: One 16-token block per step: 1 layer x 2 x 1 head x 16 tokens x 16 dims fp16 = 1 KiB.
LAYOUT = KVLayout("bench-scale", num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16)
NAMESPACE = "bench-scale"
_KIB = 1024
_MS = 1000.0
_P50, _P99 = 50, 99
#: Shard counts of the scale-out rows, and the sessions each creates.
SHARD_COUNTS = (1, 2, 4)
SHARD_SESSIONS = 100_000
QUICK_SHARD_SESSIONS = 2_000
BARE_CALLS = 20_000


def _rss_bytes(pid: int) -> int | None:
    """Resident set size of a local process, from /proc (None elsewhere)."""
    status = Path(f"/proc/{pid}/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * _KIB
    except OSError:
        return None
    return None


def _router_pid(router: Any) -> int | None:
    import ray

    try:
        return int(ray.get(router.__ray_call__.remote(lambda _self: os.getpid())))
    except (AttributeError, TypeError, ray.exceptions.RayError):
        return None  # an older Ray without __ray_call__: memory is not measured


def _create(session_id: str) -> CreateSession:
    return CreateSession(session_id=session_id, layout=LayoutSpec.of(LAYOUT), namespace=NAMESPACE)


def _rate(submit: Callable[[int], Any], n: int, what: str) -> float:
    """Operations per second of ``n`` router calls, ``IN_FLIGHT`` outstanding at a time."""
    import ray

    start = time.perf_counter()
    for lo in track(range(0, n, IN_FLIGHT), what, total=-(-n // IN_FLIGHT)):
        ray.get([submit(i) for i in range(lo, min(n, lo + IN_FLIGHT))])
    return n / (time.perf_counter() - start)


def _gateway_rate(url: str, sids: list[str], requests: int) -> dict[str, float]:
    import httpx

    per = max(1, requests // GATEWAY_THREADS)

    def worker(t: int) -> list[float]:
        lat: list[float] = []
        with httpx.Client(base_url=url) as http:
            for i in range(per):
                sid = sids[(t * per + i) % len(sids)]
                t0 = time.perf_counter()
                r = http.get(f"/v1/sessions/{sid}")
                lat.append(time.perf_counter() - t0)
                if r.status_code != httpx.codes.OK:
                    raise RuntimeError(f"gateway answered {r.status_code} to a session lookup")
        return lat

    start = time.perf_counter()
    with ThreadPoolExecutor(GATEWAY_THREADS) as pool:
        lat = [x for part in pool.map(worker, range(GATEWAY_THREADS)) for x in part]
    wall = time.perf_counter() - start
    return {"requests": len(lat), "req_s": len(lat) / wall,
            "p50_ms": percentile(lat, _P50) * _MS, "p99_ms": percentile(lat, _P99) * _MS}


def _shard_scaling(n: int, run_id: str, namespace: str) -> dict[int, dict[str, Any]]:
    """Creates/s and bare calls/s at each shard count, on shards of their own."""
    return {shards: _on_shards(shards, n, run_id, namespace) for shards in SHARD_COUNTS}


def _on_shards(shards: int, n: int, run_id: str, namespace: str) -> dict[str, Any]:
    """``n`` creates over ``shards`` fresh router actors (no devices, no journal: a
    create touches only the table), named apart from the deployment's, killed after."""
    name = f"bench-shards-{run_id}-{shards}"
    handles: list[Any] = [
        SessionRouterActor.options(
            name=name if i == 0 else f"{name}-{i}", namespace=namespace, num_cpus=0
        ).remote(background_prefetch_interval_s=3600, shard=i, shards=shards, router_name=name)
        for i in range(shards)
    ]
    try:
        ray.get([h.ping.remote() for h in handles])
        routers = RouterShards(handles)
        sids = [f"shard-{run_id}-{shards}-{i}" for i in range(n)]
        # The ceiling at this count; a rate needs fewer calls than the table.
        calls = min(n, BARE_CALLS)
        before = _cpu_seconds(handles)
        bare = _rate(lambda i: handles[i % shards].ping.remote(), calls,
                     f"scale: bare calls over {shards} shard(s)")
        bare_cpu = sum(_cpu_seconds(handles)) - sum(before)
        # Where the time goes: CPU seconds of the driver and of every shard over the
        # creates (what bounds the rate once each has a core of its own).
        driver_before, shards_before = time.process_time(), _cpu_seconds(handles)
        creates = _rate(lambda i: routers.service(sids[i]).create_session(
            _create(sids[i])).ref, n,
            f"scale: creates over {shards} shard(s)")
        driver_cpu = time.process_time() - driver_before
        shard_cpu = [a - b for a, b in zip(_cpu_seconds(handles), shards_before, strict=True)]
        held: list[ClusterStats] = ray.get([h.stats.remote(False) for h in handles])
        return {"create_ops_s": creates, "bare_call_ops_s": bare,
                "sessions_per_shard": [h.sessions for h in held],
                "driver_cpu_us_per_create": driver_cpu / n * 1e6,
                "shard_cpu_us_per_create": sum(shard_cpu) / n * 1e6,
                "shard_cpu_us_per_bare_call": bare_cpu / calls * 1e6,
                "busiest_shard_cpu_share": max(shard_cpu) / max(sum(shard_cpu), 1e-9)}
    finally:
        for h in handles:
            ray.kill(h, no_restart=True)


def _cpu_seconds(handles: list[Any]) -> list[float]:
    """Each actor process's CPU time so far (user + system)."""
    return [float(t) for t in ray.get(
        [h.__ray_call__.remote(lambda _self: time.process_time()) for h in handles])]


def _table_bytes_per_session(n: int) -> float:
    """Python heap the router's session table takes per idle session (tracemalloc).

    Measured on a :class:`RouterState` in this process, after a warm-up, so the
    figure is the table's own, without Ray's or the interpreter's start-up.
    """
    import tracemalloc

    from memkv.router.state import RouterState

    state = RouterState()
    layout = LAYOUT.to_dict()
    for i in range(1000):  # warm-up: the dicts' first growth, interned strings
        state.create(f"warm-{i}", layout, NAMESPACE, "normal")
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(n):
            state.create(f"idle-session-{i:07d}", layout, NAMESPACE, "normal")
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return grown / n


def run(ctx: BenchContext) -> SuiteResult:
    """Create, fill, look up and delete many sessions; the table is rates and memory."""
    n = QUICK_SESSIONS if ctx.quick else SESSIONS
    cluster = ctx.get_cluster()
    router = cluster.router
    run_id = uuid.uuid4().hex[:6]
    sids = [f"scale-{run_id}-{i}" for i in range(n)]
    bt = LAYOUT.block_tokens
    prefix = list(range(bt))  # the shared "system prompt" block
    block = torch.randn(LAYOUT.block_shape()).to(torch.float16)
    pid = _router_pid(router)
    rss_before = _rss_bytes(pid) if pid is not None else None

    # The ceiling: bare calls to the same actor, measured the same way in this run.
    ping_s = _rate(lambda i: router.ping.remote(), n, "scale: bare actor calls")
    # The two ways a typed message can cross: Ray pickling the message object, or
    # one msgpack document each way (what SessionServiceHandle sends).
    create_s = _rate(lambda i: router.create_session.remote(_create(sids[i])),
                     n, "scale: create sessions")
    packed_ids = [f"scale-{run_id}-packed-{i}" for i in range(n)]
    service = SessionServiceHandle(router)
    packed_s = _rate(lambda i: service.create_session(_create(packed_ids[i])).ref, n,
                     "scale: packed creates")
    # The transport's share: a no-op call carrying a packed create's argument and
    # answering as many bytes as a packed create does.
    probe = encode(_create(f"scale-{run_id}-echo-probe"))
    answer_bytes = len(ray.get(router.create_session_wire.remote(probe)))
    echo_s = _rate(lambda i: router.echo.remote(probe, answer_bytes), n,
                   "scale: no-op calls with a create's bytes")
    ray.get(router.delete_session.remote(f"scale-{run_id}-echo-probe"))
    rss_idle = _rss_bytes(pid) if pid is not None else None
    # Bulk work in batches: one call per BATCH creates.
    batch_ids = [f"scale-{run_id}-batch-{i}" for i in range(n)]
    start = time.perf_counter()
    for lo in track(range(0, n, BATCH), "scale: batched creates", total=-(-n // BATCH)):
        batch = CreateSessions(requests=tuple(_create(sid) for sid in batch_ids[lo : lo + BATCH]))
        service.create_sessions(batch).result()
    batch_create_s = n / (time.perf_counter() - start)
    lookup_s = _rate(lambda i: service.session(sids[i]).ref, n, "scale: look up sessions")

    start = time.perf_counter()
    for i in track(range(n), "scale: burst of turns"):
        own = list(range(bt * (i + 1), bt * (i + 2)))
        cluster.put_blocks(sids[i], prefix + own, [block, block])
    put_s = n / (time.perf_counter() - start)
    stats = cluster.stats()
    hot_usage = {d: s.hot_usage for d, s in stats.devices.items()}
    dedup = {d: s.dedup_hits for d, s in stats.devices.items()}

    requests = QUICK_GATEWAY_REQUESTS if ctx.quick else GATEWAY_REQUESTS
    gateway = _gateway_rate(ctx.get_gateway_url(), sids, requests)
    delete_s = _rate(lambda i: router.delete_session.remote(sids[i]), n, "scale: delete sessions")
    for others in (batch_ids, packed_ids):  # the batch-created and packed ones go too
        for lo in range(0, n, IN_FLIGHT):
            ray.get([router.delete_session.remote(s) for s in others[lo : lo + IN_FLIGHT]])

    per_session = ((rss_idle - rss_before) / n
                   if rss_idle is not None and rss_before is not None else None)
    table_bytes = _table_bytes_per_session(n)
    shard_n = QUICK_SHARD_SESSIONS if ctx.quick else SHARD_SESSIONS
    scaling = _shard_scaling(shard_n, run_id, cluster.config.cluster.namespace)
    one = scaling[SHARD_COUNTS[0]]
    rows: list[list[Any]] = [
        ["bare actor call (router.ping)", ping_s, f"{IN_FLIGHT} in flight: the ceiling"],
        ["create session, message pickled by Ray (router)", create_s,
         f"{IN_FLIGHT} in flight; {create_s / ping_s:.2f}x bare calls"],
        ["create session, one document each way (router)", packed_s,
         f"{IN_FLIGHT} in flight; the CreateSession and SessionView msgpack documents the "
         f"gateway sends; {packed_s / ping_s:.2f}x bare calls"],
        ["no-op call with a packed create's bytes (router.echo)", echo_s,
         f"{IN_FLIGHT} in flight; {len(probe)} B argument, {answer_bytes} B answer; "
         f"{echo_s / ping_s:.2f}x bare calls: Ray's cost of the bytes, before any work; a "
         f"packed create is {packed_s / echo_s:.2f}x this"],
        ["create sessions, batched (router)", batch_create_s,
         f"{BATCH} per call, one call at a time; {batch_create_s / ping_s:.1f}x bare calls"],
        ["look up session (router)", lookup_s, f"{IN_FLIGHT} in flight"],
        ["turn: shared prefix + 1 block (in-cluster API)", put_s, "one caller, sequential"],
        ["look up session (gateway HTTP)", gateway["req_s"],
         f"{GATEWAY_THREADS} client threads; P50 {gateway['p50_ms']:.2f} ms, "
         f"P99 {gateway['p99_ms']:.2f} ms"],
        ["delete session (router)", delete_s, f"{IN_FLIGHT} in flight"],
    ]
    for shards, fig in scaling.items():
        rows.append([
            f"create session, {shards} router shard(s)", fig["create_ops_s"],
            f"{shard_n} sessions, {IN_FLIGHT} in flight from one driver; "
            f"{fig['create_ops_s'] / one['create_ops_s']:.2f}x one shard; bare calls over "
            f"the same shards {fig['bare_call_ops_s']:.0f}/s; CPU per create: driver "
            f"{fig['driver_cpu_us_per_create']:.0f} us, shards "
            f"{fig['shard_cpu_us_per_create']:.0f} us (a bare call: "
            f"{fig['shard_cpu_us_per_bare_call']:.0f} us); per shard "
            f"{fig['sessions_per_shard']}",
        ])
    notes = [
        f"{n} sessions, layout {list(LAYOUT.block_shape())} fp16 ({LAYOUT.block_nbytes()} B "
        f"blocks); every session's first block is the same shared prefix (stored once).",
        "router resident memory per idle session: "
        + (f"{per_session:.0f} B (RSS {rss_before} -> {rss_idle} B over {n} creates)"
           if per_session is not None else "not measured (router pid not reachable)"),
        f"router session table per idle session (tracemalloc, {n} sessions after a "
        f"warm-up): {table_bytes:.0f} B (target <= 2048 B).",
        f"hot-tier occupancy after the burst: {hot_usage}; dedup hits: {dedup}.",
        f"router shards: this machine has {os.cpu_count()} cores for the driver, the raylet "
        f"and every shard, and one driver submits every call, so the rate stays where the "
        f"driver's CPU per call puts it ({one['driver_cpu_us_per_create']:.0f} us per create at "
        f"one shard: at most {1e6 / one['driver_cpu_us_per_create']:.0f}/s per driver core). A "
        f"shard's own CPU per create ({one['shard_cpu_us_per_create']:.0f} us at one shard) "
        f"bounds one shard at {1e6 / one['shard_cpu_us_per_create']:.0f}/s per core: N shards "
        f"on N free cores, fed by enough drivers, reach N times that (a projection from "
        f"measured CPU, not a measured rate).",
    ]
    return SuiteResult(
        suite="scale",
        title=f"{n} sessions with a shared prefix: operations per second",
        columns=["operation", "ops/s", "how"],
        rows=rows,
        figures={"sessions": n, "create_ops_s": create_s, "lookup_ops_s": lookup_s,
                 "turn_ops_s": put_s, "delete_ops_s": delete_s, "gateway": gateway,
                 "batch_create_ops_s": batch_create_s, "packed_create_ops_s": packed_s,
                 "router_rss_before": rss_before, "router_rss_idle": rss_idle,
                 "router_bytes_per_idle_session": per_session,
                 "table_bytes_per_idle_session": table_bytes, "bare_call_ops_s": ping_s,
                 "create_vs_bare_calls": create_s / ping_s,
                 "echo_ops_s": echo_s, "echo_vs_bare_calls": echo_s / ping_s,
                 "packed_create_vs_echo": packed_s / echo_s, "hot_usage": hot_usage,
                 "dedup_hits": dedup,
                 "shard_scaling": {str(k): v for k, v in scaling.items()},
                 "shard_sessions": shard_n},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "operation", "operations / s", [r[0] for r in rows],
                      {"ops/s": [float(r[1]) for r in rows]}, log_y=True),
        quick=ctx.quick,
    )
