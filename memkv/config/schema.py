"""The deployment's settings, one frozen pydantic model per process role (device,
archive, router, cluster, gateway) and :class:`MemkvConfig` over them; every field
is declared once, with its default and its check."""

from __future__ import annotations

import re
import reprlib
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Annotated, Any, Final, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from memkv.config.base import Frozen
from memkv.config.gateway import (
    GatewaySettings,
)
from memkv.errors import ConfigError
from memkv.storage import owned_dir
from memkv.storage.codecs import CodecPolicy
from memkv.storage.config import (
    MIB,
    ArchiveConfig,
    EngineSettings,
    StoreConfig,
)
from memkv.storage.sizing import AutoCapacity, MemoryProbe, TierSizes, size_tiers

#: Where local data goes where ``$MEMKV_DATA_DIR`` is not set; ``~`` is expanded
#: when a path is used, not when the config is loaded, so one config serves every
#: node's user.
DEFAULT_DATA_DIR: Final = Path(owned_dir.DEFAULT_DATA_DIR)
#: The archive's default directory, resolved on the node that opens it
#: (:func:`memkv.storage.owned_dir.resolve_on_node`): each node's own data root.
NODE_ARCHIVE_DIR: Final = Path(f"${owned_dir.DATA_DIR_ENV}") / "archive"

# Ray refuses an object store smaller than this
# (ray._private.ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES); not imported
# so that loading a config does not import Ray.
_RAY_MIN_OBJECT_STORE_BYTES: Final = 75 * MIB
# An embedded (single-machine) cluster with more device actors than this is a
# typo rather than a plan: each one reserves its own hot and warm arenas.
_MAX_EMBEDDED_DEVICES: Final = 64

_DEVICE_RE: Final = re.compile(r"^(auto|cpu|cuda:\d+)$")
_CONCRETE_DEVICE_RE: Final = re.compile(r"^(cpu|cuda:\d+)$")
# Ray resource and actor names end up in shell commands and dashboards: keep them plain.
_NAME_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_PROFILE_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_ARCHIVE_SUBDIR: Final = "archive"
#: Profile used when neither the caller, the environment nor the file picks one.
DEFAULT_PROFILE: Final = "default"


def _archive_default(name: str) -> Any:
    """The storage ArchiveConfig's default of ``name``, so the two never drift apart."""
    return ArchiveConfig.model_fields[name].default


def _check_name(value: str, what: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(
            f"{what} must start with a letter or '_' and hold only letters, digits, "
            f"'_', '.', '-'; got {value!r}"
        )
    return value


# Bytes, or "auto": sized from the node's free memory when the device actor starts.
_Capacity = Annotated[int, Field(gt=0)] | Literal["auto"]


class KVEventsSettings(Frozen):
    """``device.kv_events``: the device's tier changes as vLLM's KV events over ZMQ."""

    endpoint: str = Field(
        default="tcp://*:5557",
        pattern=r"^(tcp|ipc|inproc)://",
        description="ZMQ PUB endpoint the device binds (PORT plus the device's local GPU "
        "index, as vLLM offsets by data-parallel rank; port 0: the system chooses, the "
        "device's log names it), or with connect, a collector's.",
    )
    connect: bool = Field(default=False,
                          description="Connect to endpoint (a collector) rather than bind it.")
    interval_s: float = Field(default=0.05, gt=0, le=10,
                              description="How often queued changes are sent as one batch.")


class DeviceSettings(EngineSettings):
    """One device actor: its hot (device) and warm (host) tiers; the engine's policies
    come from :class:`~memkv.storage.config.EngineSettings`."""

    hot_capacity_bytes: _Capacity = Field(
        default="auto",
        description="Hot tier bytes in device memory (GPU HBM, or RAM for a CPU device), "
        "rounded down to whole allocator units; 'auto' = a share of what is free at start "
        "(device.auto_capacity), committed as blocks arrive.",
    )
    warm_capacity_bytes: _Capacity = Field(
        default="auto",
        description="Warm tier bytes of host shared memory (pinned on GPU hosts), rounded "
        "down to whole allocator units; 'auto' = a share of the available host memory "
        "(device.auto_capacity), committed as blocks arrive.",
    )
    auto_capacity: AutoCapacity = Field(
        default_factory=AutoCapacity,
        description="Shares, floors and caps of the tiers sized 'auto'.",
    )
    device: str = Field(
        default="auto",
        description="'auto' = cuda:<the actor's GPU> when the actor has one, else cpu; "
        "or an explicit 'cpu' / 'cuda:N'.",
    )
    unified_memory: bool = Field(
        default=False,
        description="GPU devices only: the hot arena from CUDA managed memory preferring the "
        "device (cudaMemAdvise), and a CUDA stream per high-priority session with its blocks "
        "attached to it; never more than the device has free. Off by default.",
    )
    kv_events: KVEventsSettings | None = Field(
        default=None,
        description="Publish the device's tier changes (blocks stored on, removed from hot, "
        "warm, cold) as vLLM's KV events over ZMQ, for KV-aware routers (docs/engines.md). "
        "Off unless set.",
    )
    same_node_reads: bool = Field(
        default=False,
        description="Serve read plans: processes on the device's node (the gateway, an "
        "engine beside it) copy blocks straight out of its shared memory. Every process "
        "that can map the segments can read every block in them, whatever its tenant: "
        "turn it on where everything on the node is trusted.",
    )

    @field_validator("device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        if not _DEVICE_RE.match(v):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda:N'; got {v!r}")
        return v

    @model_validator(mode="after")
    def _tiers_hold_a_unit(self) -> DeviceSettings:
        # The store would refuse these at start-up on some remote node; refuse at load.
        unit = self.allocator.min_unit_bytes
        for name in ("hot_capacity_bytes", "warm_capacity_bytes"):
            if getattr(self, name) != "auto" and getattr(self, name) < unit:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be at least one allocator unit "
                    f"(allocator.min_unit_bytes = {unit})"
                )
        return self

    @model_validator(mode="after")
    def _codecs_exist(self) -> DeviceSettings:
        # The engine checks codec names only when a store starts, on some node; the
        # policy's own check (an InvalidInputError, a ValueError) runs at load instead.
        CodecPolicy(self.codecs)
        return self

    def resolve_device(self, local_gpu: int | None) -> str:
        """The concrete torch device of an actor.

        Args:
            local_gpu: index of the actor's GPU as the actor sees it (under Ray,
                usually 0: Ray narrows ``CUDA_VISIBLE_DEVICES``), or None when
                the actor has no GPU.

        Returns:
            ``device`` unless it is ``"auto"``; then ``cuda:<local_gpu>``, or
            ``cpu`` without a GPU.

        Raises:
            ConfigError: ``local_gpu`` is negative.
        """
        if local_gpu is not None and local_gpu < 0:
            raise ConfigError(f"local_gpu must be a GPU index >= 0 or None, got {local_gpu}")
        if self.device != "auto":
            return self.device
        return "cpu" if local_gpu is None else f"cuda:{local_gpu}"

    def tier_sizes(
        self, device: str, *, devices_on_node: int = 1, probe: MemoryProbe | None = None
    ) -> TierSizes:
        """The hot and warm capacities of an actor on ``device`` ('cpu', 'cuda:N').

        ``auto`` tiers are sized from ``probe`` (this node's free memory, measured when
        None), split among ``devices_on_node`` device actors.
        """
        return size_tiers(
            None if self.hot_capacity_bytes == "auto" else self.hot_capacity_bytes,
            None if self.warm_capacity_bytes == "auto" else self.warm_capacity_bytes,
            self.auto_capacity,
            device=device,
            unit=self.allocator.min_unit_bytes,
            devices_on_node=devices_on_node,
            probe=probe,
        )

    def store_config(
        self,
        *,
        device: str,
        archive: ArchiveConfig | None,
        cold_capacity_bytes: int | None = None,
        sizes: TierSizes | None = None,
    ) -> StoreConfig:
        """The storage engine's :class:`StoreConfig` of one device actor.

        Args:
            device: the concrete device, ``cpu`` or ``cuda:N`` (see
                :meth:`resolve_device`).
            archive: where the store's own cold tier writes (see
                :meth:`ArchiveSettings.archive_config`); None when the cold
                tier is a cluster archive actor instead.
            cold_capacity_bytes: cap of that cold tier; None = the disk.
            sizes: the tiers' capacities (see :meth:`tier_sizes`); None sizes them
                here, measuring this node when a tier is ``auto``.

        Returns:
            A validated, frozen StoreConfig; ``auto`` tiers are never prefaulted.

        Raises:
            ConfigError: ``device`` is not concrete, or a value is out of bounds.
        """
        if not _CONCRETE_DEVICE_RE.match(device):
            raise ConfigError(
                f"store_config needs a concrete device, 'cpu' or 'cuda:N'; got {device!r} "
                "(resolve 'auto' with resolve_device first)"
            )
        sizes = sizes if sizes is not None else self.tier_sizes(device)
        try:
            return StoreConfig(
                hot_capacity_bytes=sizes.hot.capacity_bytes,
                warm_capacity_bytes=sizes.warm.capacity_bytes,
                lazy_tiers=sizes.auto_tiers,
                cold_capacity_bytes=cold_capacity_bytes,
                device=device,
                unified_memory=self.unified_memory,
                archive=archive,
                **self.engine_settings(),
            )
        except ValidationError as e:
            raise ConfigError(f"invalid StoreConfig: {_format_errors(e)}") from e


class ArchiveSettings(Frozen):
    """One archive actor: the cold tier's segment files on a node's NVMe path.

    Which cold codec a block gets (and ``cold_min_turns_old``) is codec policy
    and lives in ``device.codecs``.
    """

    directory: Path = Field(
        default=NODE_ARCHIVE_DIR,
        description="Directory of the segment files, created if missing. '~' and $VARS are "
        "expanded on the node that opens it, from that node's environment; "
        "$MEMKV_DATA_DIR is ~/.cache/memkv where a node does not set it.",
    )
    capacity_bytes: int | None = Field(
        default=None, gt=0, description="Cold tier bytes on disk; None = limited by the disk."
    )
    segment_max_bytes: int = Field(
        default=_archive_default("segment_max_bytes"),
        ge=4096,
        description="A segment file is sealed when it reaches this size.",
    )
    fsync: Literal["always", "batch", "never"] = Field(
        default=_archive_default("fsync"),
        description="always: fsync every record; batch: every fsync_batch records and on "
        "flush/close; never: leave it to the OS (tests, benchmarks).",
    )
    fsync_batch: int = Field(
        default=_archive_default("fsync_batch"),
        ge=1,
        description="Records per fsync in batch mode.",
    )
    verify_on_open: bool = Field(
        default=_archive_default("verify_on_open"),
        description="Verify every payload checksum when opening (else sealed segments' "
        "payloads are verified on each read).",
    )
    compact_garbage_ratio: float = Field(
        default=_archive_default("compact_garbage_ratio"),
        gt=0,
        le=1,
        description="Compact a sealed segment once this share of it is dead.",
    )
    compact_interval_s: float = Field(
        default=60.0, gt=0, description="Seconds between the archive actor's compaction passes."
    )
    replicas: int = Field(
        default=2,
        ge=1,
        description="Copies of each cold block, on archives of distinct nodes (one archive per "
        "node); an archive-mode append is acknowledged once every copy is fsynced (or those "
        "that were within replica_timeout_s). Capped by "
        "the archives there are: one archive node keeps one copy.",
    )
    repair_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="Seconds between the router's passes that copy blocks held by fewer "
        "than `replicas` live archives (after an archive's node is lost).",
    )
    replica_timeout_s: float | None = Field(
        default=5.0,
        gt=0,
        description="How long a cold write waits for each copy: an archive that has not "
        "answered by then (a slow or cut-off host) is passed over, the next archive takes "
        "the copy or the write is answered with the copies it has (the repair adds the "
        "rest), so one slow host does not stall every session's writes. With no copy in "
        "time the write waits for the first. null = wait for every copy (an archive-mode "
        "append then has `replicas` fsynced copies when answered, however long that takes).",
    )

    def archive_config(self, subdir: str | None = None) -> ArchiveConfig:
        """The storage engine's :class:`ArchiveConfig` under this directory.

        Args:
            subdir: one path component below ``directory`` (e.g. a per-actor
                name, so two actors never share segment files), or None.

        Returns:
            A validated, frozen ArchiveConfig; its directory is still as written
            (``~`` and ``$VARS`` are expanded on the node that opens it).

        Raises:
            ConfigError: ``subdir`` is empty, absolute, or not a single plain
                path component.
        """
        directory = self.directory
        if subdir is not None:
            parts = PurePath(subdir).parts
            if len(parts) != 1 or parts[0] in (".", "..") or PurePath(subdir).is_absolute():
                raise ConfigError(
                    f"subdir must be a single plain path component like 'device-0'; got {subdir!r}"
                )
            directory = directory / subdir
        try:
            return ArchiveConfig(
                directory=directory,
                segment_max_bytes=self.segment_max_bytes,
                fsync=self.fsync,
                fsync_batch=self.fsync_batch,
                verify_on_open=self.verify_on_open,
                compact_garbage_ratio=self.compact_garbage_ratio,
            )
        except ValidationError as e:
            raise ConfigError(f"invalid ArchiveConfig: {_format_errors(e)}") from e


class RouterSettings(Frozen):
    """The cluster's SessionRouterActor.

    When background prefetch may run (hot-tier use below a share) is
    ``device.prefetch.hot_idle_fraction``: one knob, read by the router.
    """

    hotness_half_life_s: float = Field(
        default=300.0, gt=0, description="Half-life of a session's decayed access rate."
    )
    background_prefetch_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between background prefetch rounds."
    )
    prefix_affinity: bool = Field(
        default=True,
        description="Place a new session on the device that already holds its longest "
        "cached prefix, when that device has room.",
    )
    default_ack: Literal["memory", "archive"] = Field(
        default="memory",
        description="Acknowledgement mode of sessions that name none: memory = an append "
        "answers once its blocks are in device memory (a crash may cost the newest turns, "
        "which are recomputed); archive = once they are fsynced in the cold tier.",
    )
    journal: bool = Field(
        default=True,
        description="Keep the session table in a journal + snapshot, so a restarted router "
        "(or machine) serves every session again.",
    )
    rebalance_on_join: bool = Field(
        default=True,
        description="A device that joins takes sessions from the devices with the most "
        "(idle and cold ones first) until loads are even, in the background.",
    )
    journal_replicas: int = Field(
        default=2,
        ge=0,
        description="Keep each shard's journal on this many archives (of nodes other than "
        "the router's first) instead of journal_dir, so the table outlives the router's "
        "node; capped by the archives there are. 0: journal_dir on the router's node.",
    )
    journal_dir: Path | None = Field(
        default=None,
        description="Where the journal lives; None = <archive.directory>/router on the "
        "router's node.",
    )
    journal_fsync: bool = Field(
        default=True,
        description="fsync the journal (group commit) before answering changes of archive-"
        "mode sessions, suspends and deletes.",
    )
    shards: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Router actors the session table is split across, by a hash of the "
        "session id (each owns its sessions; clients find the owner themselves). Fixed for a "
        "deployment's life: its journals are kept per shard count.",
    )


class ClusterSettings(Frozen):
    """Finding Ray, naming and placing the actors, and the embedded local Ray."""

    namespace: str = Field(
        default="memkv", min_length=1, description="Ray namespace of memkv's named actors."
    )
    router_name: str = Field(
        default="memkv-router", min_length=1, description="Ray name of the SessionRouterActor."
    )
    devices_per_node: int | None = Field(
        default=None,
        ge=1,
        description="Device actors per node; None = one per GPU of the node, or one CPU "
        "device where it has none.",
    )
    device_resource: str = Field(
        default="memkv_device",
        description="Custom Ray resource a node advertises once per device actor it hosts.",
    )
    nvme_resource: str = Field(
        default="memkv_nvme",
        description="Custom Ray resource of nodes with an NVMe archive path (one archive "
        "actor each).",
    )
    router_resource: str | None = Field(
        default=None,
        description="Custom Ray resource the router shards need (a thousandth each): they "
        "run only on nodes that advertise it, and Ray restarts them on another such node "
        "when theirs is lost. None: anywhere Ray chooses.",
    )
    embedded_devices: int = Field(
        default=1,
        ge=1,
        le=_MAX_EMBEDDED_DEVICES,
        description="Device actors of the embedded local Ray (no cluster address given).",
    )
    embedded_object_store_bytes: int = Field(
        default=512 * MIB,
        ge=_RAY_MIN_OBJECT_STORE_BYTES,
        description="Object store of the embedded local Ray (Ray's minimum is 75 MiB).",
    )
    embedded_num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs the embedded Ray may use; None = all."
    )
    embedded_resources: dict[str, float] = Field(
        default_factory=dict,
        description="More custom resources the embedded local Ray advertises: room for a "
        "second deployment (another namespace, its own device_resource and nvme_resource "
        "names) joining it by address.",
    )
    stop_drain_timeout_s: float = Field(
        default=120.0,
        ge=0,
        description="A planned stop of `memkv up` (SIGTERM, Ctrl-C) first writes every "
        "session's memory-only blocks to the archive, so that a restart loses nothing in "
        "either ack mode; this bounds it (0: no drain, as a crash).",
    )

    @field_validator("namespace", "router_name", "device_resource", "nvme_resource")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        return _check_name(v, "a Ray namespace, actor or resource name")

    @field_validator("embedded_resources")
    @classmethod
    def _plain_resources(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            _check_name(name, "an embedded_resources name")
            if amount <= 0:
                raise ValueError(f"embedded_resources[{name!r}] must be > 0; got {amount}")
        return v

    @model_validator(mode="after")
    def _distinct_resources(self) -> ClusterSettings:
        if self.device_resource == self.nvme_resource:
            raise ValueError(
                f"device_resource and nvme_resource must differ; both are {self.device_resource!r}"
            )
        own = {self.device_resource, self.nvme_resource} & set(self.embedded_resources)
        if own:
            raise ValueError(
                f"embedded_resources may not name this deployment's own resources {sorted(own)} "
                f"(embedded_devices sizes them)"
            )
        return self


class MemkvConfig(Frozen):
    """The whole configuration of a memkv deployment, validated and frozen."""

    profile: str = Field(
        default=DEFAULT_PROFILE,
        description="Name of the profile that was applied (see load_config).",
    )
    device: DeviceSettings = Field(
        default_factory=DeviceSettings, description="Every device actor (hot + warm tiers)."
    )
    archive: ArchiveSettings = Field(
        default_factory=ArchiveSettings, description="Every archive actor (cold tier)."
    )
    router: RouterSettings = Field(
        default_factory=RouterSettings, description="The session router."
    )
    cluster: ClusterSettings = Field(
        default_factory=ClusterSettings, description="Ray, actor names and placement."
    )
    gateway: GatewaySettings = Field(
        default_factory=GatewaySettings, description="The HTTP gateway."
    )

    @field_validator("profile")
    @classmethod
    def _profile_name(cls, v: str) -> str:
        if not _PROFILE_NAME_RE.match(v):
            raise ValueError(f"profile must be a plain name like 'h100'; got {v!r}")
        return v

    def store_config(self, *, device: str, archive_subdir: str | None = None) -> StoreConfig:
        """The StoreConfig of a device actor whose cold tier is this config's archive.

        Args:
            device: the concrete device, ``cpu`` or ``cuda:N``.
            archive_subdir: one path component under ``archive.directory``
                (give each actor its own), or None.

        Returns:
            ``device.store_config`` wired to ``archive.archive_config`` and
            ``archive.capacity_bytes``.

        Raises:
            ConfigError: as :meth:`DeviceSettings.store_config` and
                :meth:`ArchiveSettings.archive_config`.
        """
        return self.device.store_config(
            device=device,
            archive=self.archive.archive_config(archive_subdir),
            cold_capacity_bytes=self.archive.capacity_bytes,
        )


def _format_errors(error: ValidationError) -> str:
    """pydantic's errors as 'dotted.path: message (got value)' lines."""
    lines = []
    for err in error.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        value = err.get("input")
        # A model-level check's input is the whole section: its message says enough.
        got = "" if isinstance(value, Mapping) else f" (got {reprlib.repr(value)})"
        lines.append(f"{where}: {err['msg']}{got}")
    return "; ".join(lines)
