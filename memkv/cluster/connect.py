"""``connect()``: the embedded default, or a Ray cluster started with ``ray up``.

With no address memkv starts its own local Ray bound to 127.0.0.1 with one CPU
"device" actor (or ``cluster.embedded_devices``), one archive actor under a
local data directory and the router, and shuts down only what it started.
With an address it joins that cluster and finds (or creates) the named actors:
one device actor per unit of the ``memkv_device`` resource on each node, one
archive actor per node advertising ``memkv_nvme``, and the router.
Both answer a :class:`~memkv.cluster.memkv_cluster.MemkvCluster`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from memkv.actors.archive import ArchiveActor
from memkv.actors.archive_journal import journal_shard_counts
from memkv.actors.device import DeviceCacheActor, replica_order
from memkv.actors.router import SessionRouterActor
from memkv.actors.router_shards import RouterShards
from memkv.cluster.loopback import (
    LOOPBACK_ADDRESS,
    LOOPBACK_ENV,
    is_loopback_address,
    keep_ray_on_loopback,
)
from memkv.cluster.memkv_cluster import MemkvCluster
from memkv.config import MemkvConfig, load_config
from memkv.errors import ConfigError
from memkv.protocol.shards import shard_name
from memkv.storage.owned_dir import resolve_on_node

logger = logging.getLogger(__name__)

__all__ = ["LOOPBACK_ENV", "MemkvCluster", "attach", "connect"]

#: What of ``cluster.router_resource`` a router shard takes: any number of shards
#: fit a node that advertises one unit.
ROUTER_RESOURCE_SHARE = 0.001


def attach(address: str, *, namespace: str | None = None) -> MemkvCluster:
    """Join a running memkv cluster as a client: find its actors, create none.

    For processes that use a cluster someone else runs (an inference engine's
    connector, tools): unlike :func:`connect`, nothing is started or
    registered, and ``shutdown()`` only disconnects.

    Args:
        address: the Ray address (``"auto"``, ``"host:6379"``, ``"ray://host:10001"``).
        namespace: the Ray namespace memkv's actors live in (default: the
            config's ``cluster.namespace``).

    Raises:
        ConfigError: no memkv router runs in that namespace.
    """
    cfg = load_config()
    ns = namespace or cfg.cluster.namespace
    if not ray.is_initialized():
        if is_loopback_address(address):
            keep_ray_on_loopback()
        ray.init(address=address, namespace=ns, logging_level=logging.WARNING)
    try:
        routers = RouterShards.find(cfg.cluster.router_name, ns)
    except ValueError as e:
        raise ConfigError(
            f"no memkv router {cfg.cluster.router_name!r} in Ray namespace {ns!r} at {address}: "
            f"start memkv there first (memkv up), or name its namespace"
        ) from e
    devices = dict(ray.get(routers.first.devices.remote()))
    archives = dict(ray.get(routers.first.archives.remote()))
    return MemkvCluster(cfg, routers, devices, archives, owned=[], started_ray=False)


def connect(
    address: str | None = None,
    config: MemkvConfig | str | Path | None = None,
    *,
    profile: str | None = None,
    detached: bool | None = None,
) -> MemkvCluster:
    """Start the embedded default (``address=None``) or join a Ray cluster.

    Args:
        address: a Ray address (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``),
            or None for an embedded local Ray on 127.0.0.1.
        config: a :class:`MemkvConfig`, a YAML path, or None for the defaults.
        profile: a named profile of the config (``a100``, ``h100``, ``edge``).
        detached: whether the actors outlive this process. None: only when
            joining a cluster (a deployment others share; ``shutdown()`` only
            disconnects). False: they live as long as this process and
            ``shutdown()`` stops them (a deployment of its own, e.g. a second
            namespace on a Ray this process already uses).

    Returns:
        A :class:`MemkvCluster`; call ``shutdown()`` (or use ``with``) when done.
    """
    cfg = config if isinstance(config, MemkvConfig) else load_config(config, profile=profile)
    settings = cfg.cluster
    started = False
    if address is None:
        if ray.is_initialized():
            raise ConfigError(
                "Ray is already initialised in this process; pass its address to join it"
            )
        keep_ray_on_loopback()
        ray.init(
            address="local",
            namespace=settings.namespace,
            num_cpus=settings.embedded_num_cpus,
            resources={
                **settings.embedded_resources,
                settings.device_resource: settings.embedded_devices,
                settings.nvme_resource: 1,
            },
            object_store_memory=settings.embedded_object_store_bytes,
            include_dashboard=False,
            _node_ip_address=LOOPBACK_ADDRESS,
            configure_logging=True,
            logging_level=logging.WARNING,
        )
        started = True
    elif not ray.is_initialized():
        if is_loopback_address(address):
            keep_ray_on_loopback()
        ray.init(address=address, namespace=settings.namespace)
    try:
        return _bring_up(
            cfg, detached=(not started) if detached is None else detached, started_ray=started
        )
    except BaseException:
        if started:
            ray.shutdown()
        raise


def _bring_up(cfg: MemkvConfig, *, detached: bool, started_ray: bool) -> MemkvCluster:
    settings = cfg.cluster
    lifetime = "detached" if detached else None
    owned: list[ActorHandle] = []
    # num_cpus=0: these are long-lived services placed by memkv's own resources;
    # Ray's default of one CPU each would leave a second device unscheduled on a
    # small node (it waits for a CPU the first one never gives back).
    common = {
        "namespace": settings.namespace,
        "get_if_exists": True,
        "lifetime": lifetime,
        "num_cpus": 0,
    }

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    archives: dict[str, ActorHandle] = {}
    archive_by_node: dict[str, str] = {}
    for node in nodes:
        if node["Resources"].get(settings.nvme_resource, 0) < 1:
            continue
        node_id = node["NodeID"]
        name = f"memkv-archive-{node_id[:12]}"
        handle = ArchiveActor.options(
            name=name,
            resources={settings.nvme_resource: 1},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            **common,
        ).remote(
            cfg.archive.archive_config(),
            compact_interval_s=cfg.archive.compact_interval_s,
            capacity_bytes=cfg.archive.capacity_bytes,
        )
        archives[name] = handle
        archive_by_node[node_id] = name
    if not archives:
        raise ConfigError(
            f"no node advertises the {settings.nvme_resource!r} resource: memkv needs at least "
            f"one archive node"
        )
    fallback_archive = next(iter(archives))
    replicas = cfg.archive.replicas
    if started_ray and replicas > len(archives):
        # The embedded default's archives are all it will ever have: asking for more
        # copies would count every cold block as under-replicated, and the repair would
        # look for an archive that cannot join. (On a cluster one can: keep the setting.)
        logger.info("the embedded default runs %d archive(s): cold blocks are kept in %d "
                    "(archive.replicas = %d applies on a cluster)", len(archives),
                    len(archives), replicas)
        replicas = len(archives)

    archive_names = list(archives)
    devices: dict[str, ActorHandle] = {}
    for node in nodes:
        node_id = node["NodeID"]
        gpus = int(node["Resources"].get("GPU", 0))
        count = int(node["Resources"].get(settings.device_resource, 0))
        if settings.devices_per_node is not None:
            count = min(count, settings.devices_per_node)
        for i in range(count):
            name = f"memkv-device-{node_id[:12]}-{i}"
            handle = DeviceCacheActor.options(
                name=name,
                num_gpus=1 if gpus > i else 0,
                resources={settings.device_resource: 1},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                **common,
            ).remote(
                name,
                cfg.device,
                archive_by_node.get(node_id, fallback_archive),
                devices_on_node=count,
                namespace=settings.namespace,
                # Its own node's archive first; the second copies of the devices
                # of a node spread over the other archives.
                archives=replica_order(
                    archive_by_node.get(node_id, fallback_archive),
                    archive_names,
                    spread=len(devices),
                ),
                archive_replicas=replicas,
                replica_timeout_s=cfg.archive.replica_timeout_s,
            )
            devices[name] = handle
    if not devices:
        raise ConfigError(
            f"no node advertises the {settings.device_resource!r} resource: memkv needs at "
            f"least one device"
        )

    shards = cfg.router.shards
    if cfg.router.journal:
        check_journal_layout(router_journal_dir(cfg), shards)
        if cfg.router.journal_replicas > 0:
            check_archive_journals(archives, settings.router_name, shards)
    # (Ray's stubs type an actor class's .remote() too loosely to call methods on.)
    handles: list[Any] = [
        SessionRouterActor.options(
            name=shard_name(settings.router_name, i),
            resources={settings.router_resource: ROUTER_RESOURCE_SHARE}
            if settings.router_resource else None,
            **common,
        ).remote(
            hotness_half_life_s=cfg.router.hotness_half_life_s,
            prefix_affinity=cfg.router.prefix_affinity,
            background_prefetch_interval_s=cfg.router.background_prefetch_interval_s,
            hot_idle_fraction=cfg.device.prefetch.hot_idle_fraction,
            head_blocks=cfg.device.prefetch.max_prefetch_blocks,
            journal_dir=str(router_journal_dir(cfg, i, shards)) if cfg.router.journal else None,
            journal_archives=archive_names if cfg.router.journal else (),
            journal_replicas=cfg.router.journal_replicas,
            journal_fsync=cfg.router.journal_fsync,
            default_ack=cfg.router.default_ack,
            archive_replicas=replicas,
            repair_interval_s=cfg.archive.repair_interval_s,
            rebalance_on_join=cfg.router.rebalance_on_join,
            shard=i,
            shards=shards,
            router_name=settings.router_name,
            namespace=settings.namespace,
        )
        for i in range(shards)
    ]
    # get_if_exists: a running deployment's shards answer; their count must match.
    infos: list[dict[str, int]] = ray.get([h.shard_info.remote() for h in handles])
    for i, info in enumerate(infos):
        if info != {"shard": i, "shards": shards}:
            raise ConfigError(
                f"router {shard_name(settings.router_name, i)!r} runs as shard "
                f"{info['shard']} of {info['shards']}, this config says {shards} shards: the "
                f"shard count is fixed for a deployment's life"
            )
    routers = RouterShards(handles)
    # Every shard knows every archive and device (each places its own sessions).
    ray.get([r.register_archive.remote(n, h) for r in routers for n, h in archives.items()])
    ray.get([r.register_device.remote(n, h) for r in routers for n, h in devices.items()])
    if not detached:
        owned = [*routers, *devices.values(), *archives.values()]
    return MemkvCluster(cfg, routers, devices, archives, owned=owned, started_ray=started_ray)


def check_archive_journals(archives: dict[str, ActorHandle], router_name: str,
                           shards: int) -> None:
    """Refuse to start N shards over archived journals of another shard count.

    Raises:
        ConfigError: naming the archive and the counts it holds journals of.
    """
    held: list[list[str]] = ray.get([a.journal_names.remote() for a in archives.values()])
    for name, names in zip(archives, held, strict=True):
        other = sorted(journal_shard_counts(names, router_name) - {shards})
        if other:
            raise ConfigError(
                f"archive {name} holds router journals of {other} shard(s), this config says "
                f"{shards}: the shard count is fixed for a deployment's life (start with "
                f"router.shards: {other[0]})"
            )


def router_journal_dir(cfg: MemkvConfig, shard: int = 0, shards: int = 1) -> Path:
    """Where a router shard keeps its journal: under ``router.journal_dir``, else beside
    the archive; one shard uses the directory itself, N shards ``shard-<i>-of-<N>``."""
    # As written: the router resolves "~" and $VARS on its own node.
    base = (
        cfg.router.journal_dir
        if cfg.router.journal_dir is not None
        else cfg.archive.directory / "router"
    )
    return base if shards == 1 else base / f"shard-{shard}-of-{shards}"


def check_journal_layout(base: Path, shards: int) -> None:
    """Refuse to start N shards over journals written by another shard count.

    Their sessions hash to other shards: starting anyway would serve none of
    them (and a later start with the old count would find them stale).

    Raises:
        ConfigError: naming the journals found and the count they were written with.
    """
    try:
        base = resolve_on_node(base)  # this node's view (where the router usually starts)
    except ConfigError:
        return  # a path only the router's node can resolve: its journal checks itself
    if not base.is_dir():
        return
    found = {1} if any(p.is_file() for p in base.iterdir()) else set()
    for p in base.glob("shard-*-of-*"):
        found.add(int(p.name.rsplit("-", 1)[1]))
    other = sorted(found - {shards})
    if other:
        raise ConfigError(
            f"{base} holds router journals of {other} shard(s), this config says {shards}: "
            f"the shard count is fixed for a deployment's life (start with router.shards: "
            f"{other[0]}, or move those journals away)"
        )
