"""The ``memkv`` command: ``up``, ``status``, ``demo``, ``bench``.

``memkv up`` with no address starts the embedded default (a local Ray on
127.0.0.1 with one CPU device, an archive and the router) and serves the HTTP
gateway until interrupted. With ``--address`` it joins a Ray cluster (from the
start commands of ``configs/ray-cluster-*.yaml``) and creates the named,
detached actors that are missing; the head also serves the gateway, worker
nodes pass ``--no-gateway`` and return.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

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
) -> None:
    """Start memkv (embedded) or bring up its actors on a Ray cluster, and serve the gateway."""
    from memkv.api.server import GatewayServer
    from memkv.cluster import connect

    cluster = connect(address, config, profile=profile)
    summary: dict[str, Any] = {
        "devices": sorted(cluster.devices),
        "archives": sorted(cluster.archives),
        "router": cluster.config.cluster.router_name,
        "namespace": cluster.config.cluster.namespace,
    }
    if not gateway:
        typer.echo(json.dumps(summary, indent=2))
        typer.echo("memkv actors are up; this command can exit.")
        cluster.disconnect()
        return
    settings = cluster.config.gateway
    server = GatewayServer.start(
        cluster, host=settings.host, port=settings.port, max_body_bytes=settings.max_body_bytes
    )
    summary["gateway"] = server.url
    typer.echo(json.dumps(summary, indent=2))
    where = "the embedded default" if address is None else f"the cluster at {address}"
    typer.echo(f"memkv is serving {server.url} on {where}; Ctrl-C stops it.")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    cluster.shutdown()
    typer.echo("memkv stopped.")


@app.command()
def status(address: AddressOpt = "auto", config: ConfigOpt = None) -> None:
    """Print the cluster's session and tier statistics as JSON."""
    import logging

    import ray

    from memkv.config import load_config

    cfg = load_config(config)
    ray.init(address=address, namespace=cfg.cluster.namespace, logging_level=logging.ERROR)
    try:
        router = ray.get_actor(cfg.cluster.router_name, namespace=cfg.cluster.namespace)
        stats: Any = ray.get(router.stats.remote())
        typer.echo(json.dumps(stats, indent=2, default=str))
    finally:
        ray.shutdown()


@app.command()
def demo(
    sessions: Annotated[int, typer.Option(min=2, help="Agent sessions.")] = 4,
    seed: Annotated[int, typer.Option(help="Model and token seed.")] = 0,
) -> None:
    """Run the demonstration (see ``make demo``)."""
    from memkv.demo import main as demo_main

    raise typer.Exit(demo_main(["--sessions", str(sessions), "--seed", str(seed)]))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def bench(ctx: typer.Context) -> None:
    """Run the benchmark suites (``memkv bench --help`` lists them and their options)."""
    from memkv.bench import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
