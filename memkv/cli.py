"""The ``memkv`` command: ``up``, ``status``, ``drain``, ``compact``, ``demo``, ``bench``.

``memkv up`` with no address starts the embedded default (a local Ray on
127.0.0.1 with one CPU device, an archive and the router) and serves the HTTP
gateway until interrupted. With ``--address`` it joins a Ray cluster (from the
start commands of ``configs/ray-cluster-*.yaml``) and creates the named,
detached actors that are missing; the head also serves the gateway, worker
nodes pass ``--no-gateway`` and return.
"""

from __future__ import annotations

import enum
import json
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from memkv.bench import ALL, SUITES
from memkv.demo_settings import DemoSettings

_DEMO = DemoSettings()

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])

AddressOpt = Annotated[
    str | None,
    typer.Option("--address", help="Ray address to join ('auto', 'host:6379'); none = embedded."),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", exists=True, dir_okay=False, help="memkv YAML config.")
]
ProfileOpt = Annotated[
    str | None, typer.Option("--profile", help="Config profile: default, a100, h100, edge.")
]


@app.command()
def up(
    address: AddressOpt = None,
    config: ConfigOpt = None,
    profile: ProfileOpt = None,
    gateway: Annotated[
        bool, typer.Option(help="Serve the HTTP gateway here (worker nodes pass --no-gateway).")
    ] = True,
    engine: Annotated[
        list[str] | None,
        typer.Option(help="An engine's URL (vllm serve) for the OpenAI front door; repeatable."),
    ] = None,
) -> None:
    """Start memkv (embedded) or bring up its actors on a Ray cluster, and serve the gateway."""
    from memkv.api.auth import deployment_authenticator
    from memkv.api.engines.front_door import EngineSpec, FrontDoorOptions
    from memkv.api.engines.policy import SpillThreshold
    from memkv.api.workers import Gateway
    from memkv.cluster import connect
    from memkv.config import data_dir

    cluster = connect(address, config, profile=profile)
    summary: dict[str, Any] = {
        "devices": sorted(cluster.devices),
        "archives": sorted(cluster.archives),
        "router": cluster.config.cluster.router_name,
        "router_shards": len(cluster.routers),
        "namespace": cluster.config.cluster.namespace,
        "reserved": _reservations(cluster),
    }
    if not gateway:
        typer.echo(json.dumps(summary, indent=2))
        typer.echo("memkv actors are up; this command can exit.")
        cluster.disconnect()
        return
    settings = cluster.config.gateway
    auth, dev_token = deployment_authenticator(settings.auth, data_dir())
    server = Gateway.start(
        cluster,
        workers=settings.workers,
        host=settings.host,
        port=settings.port,
        block_port=settings.block_port,
        max_body_bytes=settings.max_body_bytes,
        put_staging_bytes=settings.put_staging_bytes,
        read_stall_s=settings.read_stall_s,
        read_hold_s=settings.read_hold_s,
        auth=auth,
        engines=[EngineSpec(e.url, e.model, e.node, e.priority_scheduling, e.max_requests,
                            None if e.tenants is None else frozenset(e.tenants))
                 for e in settings.engines] + [EngineSpec(url) for url in engine or ()],
        routing=FrontDoorOptions(
            SpillThreshold(settings.routing.spill_requests, settings.routing.spill_kv_use),
            check_interval_s=settings.routing.check_interval_s,
            failures_to_down=settings.routing.failures_to_down,
            request_timeout_s=settings.routing.request_timeout_s,
        ),
    )
    summary["gateway"] = server.url
    summary["block_port"] = server.block_port
    summary["gateway_workers"] = server.workers
    summary["auth"] = (
        "off" if not auth.enabled else f"token in {dev_token}" if dev_token else "tokens"
    )
    typer.echo(json.dumps(summary, indent=2))
    where = "the embedded default" if address is None else f"the cluster at {address}"
    typer.echo(f"memkv is serving {server.url} on {where}; Ctrl-C stops it.")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()  # no new appends from here on
    _drain(cluster)
    cluster.shutdown()
    typer.echo("memkv stopped.")


def _reservations(cluster: Any) -> dict[str, str]:
    """Each device's tier sizes and where they came from (``auto`` or configured)."""
    import ray

    names = sorted(cluster.devices)
    lines = ray.get([cluster.devices[n].reserved.remote() for n in names])
    return dict(zip(names, lines, strict=True))


def _drain(cluster: Any) -> None:
    """Before a planned stop, every held block to the archive (a progress line each batch)."""
    timeout_s = cluster.config.cluster.stop_drain_timeout_s
    if not cluster.owns_actors or timeout_s <= 0:
        return
    typer.echo(f"memkv is writing its sessions to the archive (at most {timeout_s:.0f} s) ...")

    def progress(device_id: str, written: int, left: int) -> None:
        typer.echo(f"  {device_id}: {written} blocks written, {left} left")

    complete = cluster.drain_to_archive(timeout_s, progress)
    typer.echo("  every session is in the archive." if complete else
               "  the drain did not finish: sessions with blocks left are lost on restart.")


@app.command()
def status(
    address: AddressOpt = "auto",
    config: ConfigOpt = None,
    url: Annotated[
        str | None,
        typer.Option("--url", help="Ask a gateway instead of Ray (needs an admin token)."),
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", envvar="MEMKV_TOKEN", help="The gateway token.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The raw stats document.")] = False,
) -> None:
    """The cluster's sessions, tiers, devices, archives and tenants, as tables (or --json)."""
    stats = _stats_over_http(url, token) if url else _stats_over_ray(address, config)
    if as_json:
        typer.echo(json.dumps(stats, indent=2, default=str))
        return
    from memkv.status_view import print_status

    print_status(stats)


def _stats_over_http(url: str, token: str | None) -> dict[str, Any]:
    from memkv.client import Client

    with Client(url, token=token) as client:
        return dict(client.stats())


def _stats_over_ray(address: str | None, config: Path | None) -> dict[str, Any]:
    import logging

    import ray

    from memkv.config import load_config

    cfg = load_config(config)
    ray.init(address=address, namespace=cfg.cluster.namespace, logging_level=logging.ERROR)
    try:
        from memkv.actors.router_shards import RouterShards, merge_stats
        from memkv.protocol.stats import as_document

        routers = RouterShards.find(cfg.cluster.router_name, cfg.cluster.namespace)
        return as_document(merge_stats(ray.get(routers.stats())))
    finally:
        ray.shutdown()


@app.command()
def compact(
    address: AddressOpt = "auto",
    config: ConfigOpt = None,
    force: Annotated[
        bool, typer.Option(help="Rewrite every segment, not only those past the dead share.")
    ] = False,
) -> None:
    """Compact every archive's segment files (reclaim dead records), with a progress bar."""
    import logging

    import ray

    from memkv.config import load_config
    from memkv.protocol.stats import ClusterStats
    from memkv.status_view import compact_archives, human_bytes

    cfg = load_config(config)
    ray.init(address=address, namespace=cfg.cluster.namespace, logging_level=logging.ERROR)
    try:
        router = ray.get_actor(cfg.cluster.router_name, namespace=cfg.cluster.namespace)
        stats: ClusterStats = ray.get(router.stats.remote())  # type: ignore[assignment]
        names = sorted(stats.archives)
        handles = {n: ray.get_actor(n, namespace=cfg.cluster.namespace) for n in names}
        for name, done in compact_archives(handles, force=force).items():
            typer.echo(f"{name}: {done.segments_in} segments -> {done.segments_out}, "
                       f"{human_bytes(done.bytes_reclaimed)} reclaimed")
    finally:
        ray.shutdown()


@app.command()
def drain(
    node: Annotated[
        str, typer.Argument(help="Ray node id (a unique prefix will do), or 'self': this node.")
    ],
    address: AddressOpt = "auto",
    namespace: Annotated[
        str | None, typer.Option(help="memkv's Ray namespace (default: the config's).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False,
) -> None:
    """Move every session off a node that is leaving (0 loss, reads served throughout):
    its devices hand their sessions to others, its archive's blocks are copied to the
    archives that stay. Exits 1 if anything was lost or left short of copies."""
    from memkv.cluster import attach
    from memkv.errors import MemkvError
    from memkv.status_view import human_bytes

    try:
        cluster = attach(address or "auto", namespace=namespace)
    except MemkvError as e:
        typer.echo(f"memkv drain: {e}", err=True)
        raise typer.Exit(2) from e
    try:
        typer.echo(f"memkv drain: moving everything off node {node} ...")
        done = cluster.drain_node(None if node == "self" else node)
    except MemkvError as e:
        typer.echo(f"memkv drain: {e}", err=True)
        raise typer.Exit(2) from e
    finally:
        cluster.disconnect()
    sessions_lost, tokens_lost = done.lost
    failed = bool(sessions_lost or tokens_lost or done.blocks_short)
    if as_json:
        typer.echo(json.dumps(done.document()))
        raise typer.Exit(1 if failed else 0)
    for report in done.reports:
        typer.echo(f"  {report.device}: {report.sessions_moved} sessions moved "
                   f"({human_bytes(report.bytes_moved)}), {report.blocks_archived} blocks "
                   f"archived first, in {report.seconds:.2f} s")
    rate = done.bytes_moved / done.seconds / 1e9 if done.seconds else 0.0
    typer.echo(
        f"memkv drain: node {done.node}: {done.sessions_moved} sessions moved off "
        f"{len(done.devices)} device(s), archive(s) {done.archives or 'none'} copied out; "
        f"{sessions_lost} sessions and {tokens_lost} tokens lost, {done.blocks_short} blocks "
        f"short of copies; {done.seconds:.2f} s ({rate:.3f} GB/s of KV)")
    if failed:
        raise typer.Exit(1)


@app.command()
def demo(
    sessions: Annotated[
        int, typer.Option(min=2, help="Agent sessions (at least 2: they share the system prompt).")
    ] = _DEMO.sessions,
    turns: Annotated[int, typer.Option(min=1, help="Turns per session.")] = _DEMO.turns,
    system_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens of the shared system prompt.")
    ] = _DEMO.system_tokens,
    user_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens of each user message.")
    ] = _DEMO.user_tokens,
    new_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens generated per turn.")
    ] = _DEMO.new_tokens,
    block_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens per memkv block.")
    ] = _DEMO.block_tokens,
    seed: Annotated[int, typer.Option(help="Model and token seed.")] = _DEMO.seed,
    repeats: Annotated[
        int, typer.Option(min=1, help="Timings of each prefill; the fastest is shown.")
    ] = _DEMO.repeats,
    model: Annotated[
        Path | None,
        typer.Option(file_okay=False, help="A local HF causal LM directory (default: built)."),
    ] = None,
    port: Annotated[
        int, typer.Option(min=0, help="Gateway port on 127.0.0.1 (0: a free one).")
    ] = _DEMO.port,
    data_dir: Annotated[
        Path | None, typer.Option(help="Cold-tier directory (default: a temporary one).")
    ] = None,
) -> None:
    """Agent sessions sharing a system prompt, through the HTTP gateway (``make demo``)."""
    from memkv.demo import run_demo

    settings = DemoSettings(
        sessions=sessions,
        turns=turns,
        system_tokens=system_tokens,
        user_tokens=user_tokens,
        new_tokens=new_tokens,
        block_tokens=block_tokens,
        seed=seed,
        repeats=repeats,
        model=model,
        port=port,
    )
    raise typer.Exit(0 if run_demo(settings, data_dir) else 1)


Suite = enum.StrEnum("Suite", {name: name for name in (ALL, *SUITES)})  # type: ignore[misc]
_ALL_SUITES = Suite(ALL)


@app.command()
def bench(
    suite: Annotated[
        Suite, typer.Argument(help="Which suite to run (all: every one, in order).")
    ] = _ALL_SUITES,
    quick: Annotated[bool, typer.Option(help="Small sizes: each suite runs in seconds.")] = False,
    trace: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="Mooncake-format JSONL trace (eviction)."),
    ] = None,
    model: Annotated[
        Path | None, typer.Option(file_okay=False, help="Local HF causal LM directory (resume).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Results folder.")] = Path("benchmarks/results"),
    markdown: Annotated[
        Path | None,
        typer.Option(help="The generated table (default: BENCHMARKS.md, or inside --out)."),
    ] = None,
) -> None:
    """Run the benchmark suites; each writes <out>/<suite>.json and .png, then BENCHMARKS.md."""
    from memkv.bench.runner import run

    raise typer.Exit(
        run(suite.value, quick=quick, trace=trace, model=model, out=out, markdown=markdown)
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
