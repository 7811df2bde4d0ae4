"""Tier sizes chosen from the memory a machine has free, for configs that say ``auto``.

A fixed default (2 GiB hot, 4 GiB warm, both prefaulted) committed 6 GB of a 24 GiB
machine before the first block arrived, and is far too small on a 2 TB host. ``auto``
takes a share of what is available when the device actor starts, split among the
device actors of the node, kept between a floor and a cap; the arenas it sizes are
never prefaulted, so memory is committed only as blocks arrive.

Available means: host memory the kernel reports as available (``MemAvailable``), no
more than the container's cgroup leaves (``memory.max - memory.current``); the warm
tier lives in ``/dev/shm`` and never takes more than its free space; a GPU's hot tier
takes a share of the device memory free at start (what the engine left).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class MemoryProbe:
    """What one node had free when a device actor started, in bytes."""

    host_available: int
    shm_free: int | None  # None where there is no /dev/shm to measure
    device_free: int | None  # None for a CPU device (its hot tier is host memory)


class TierShare(BaseModel):
    """How ``auto`` sizes one tier: ``share`` of the available bytes, within [floor, cap]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float = Field(gt=0, le=1, description="Share of the available bytes (0-1].")
    floor_bytes: int = Field(gt=0, description="Never less than this, however little is free.")
    cap_bytes: int = Field(gt=0, description="Never more than this, however much is free.")

    @model_validator(mode="after")
    def _floor_under_cap(self) -> TierShare:
        if self.floor_bytes > self.cap_bytes:
            raise ValueError(
                f"floor_bytes ({self.floor_bytes}) must not exceed cap_bytes ({self.cap_bytes})"
            )
        return self

    def size(self, available: int, *, split: int, unit: int, limit: int | None = None) -> int:
        """Bytes for one of ``split`` device actors, rounded down to whole ``unit``s.

        ``limit`` bounds even the floor: what physically exists (the free space of
        /dev/shm, where a segment larger than it faults on first touch).
        """
        raw = int(available * self.share) // max(1, split)
        clamped = min(self.cap_bytes, max(self.floor_bytes, raw))
        if limit is not None:
            clamped = min(clamped, limit // max(1, split))
        return max(unit, clamped // unit * unit)


@dataclass(frozen=True, slots=True)
class SizedTier:
    """A tier's capacity and where it came from (for the start-up line and stats)."""

    capacity_bytes: int
    auto: bool
    basis: str  # "configured", or e.g. "auto: 10% of 18.2 GiB available memory"


def probe_memory(device: str) -> MemoryProbe:
    """Measure this node's free memory for a device actor on ``device`` ('cpu', 'cuda:N')."""
    device_free = None
    if device.startswith("cuda"):
        import torch

        device_free, _ = torch.cuda.mem_get_info(torch.device(device))
    return MemoryProbe(
        host_available=_host_available(),
        shm_free=_shm_free(),
        device_free=device_free,
    )


def _host_available() -> int:
    available = _meminfo_available()
    cgroup_left = _cgroup_left()
    return available if cgroup_left is None else min(available, cgroup_left)


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    # No /proc (macOS): all physical pages, the best a portable call offers.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_left() -> int | None:
    """Bytes the process's cgroup v2 still allows, or None when it sets no limit."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _shm_free() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def format_bytes(n: int) -> str:
    """1.5 GiB, 256 MiB: the sizes people configure."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} B"


GIB = 1 << 30
MIB = 1 << 20


class AutoCapacity(BaseModel):
    """How ``auto`` sizes the hot and warm tiers of a device actor.

    On a CPU device both tiers are host memory: together 30% of what is available.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    hot: TierShare = Field(
        default=TierShare(share=0.10, floor_bytes=256 * MIB, cap_bytes=16 * GIB),
        description="Hot tier: a share of the free device memory (host memory for a CPU "
        "device).",
    )
    warm: TierShare = Field(
        default=TierShare(share=0.20, floor_bytes=256 * MIB, cap_bytes=64 * GIB),
        description="Warm tier: a share of the available host memory (no more than "
        "/dev/shm has free).",
    )


@dataclass(frozen=True, slots=True)
class TierSizes:
    """The hot and warm capacities a device actor starts with."""

    hot: SizedTier
    warm: SizedTier

    @property
    def auto_tiers(self) -> frozenset[Literal["hot", "warm"]]:
        """Names of the tiers ``auto`` sized ('hot', 'warm')."""
        named: tuple[tuple[Literal["hot", "warm"], SizedTier], ...] = (
            ("hot", self.hot), ("warm", self.warm)
        )
        return frozenset(name for name, tier in named if tier.auto)

    def describe(self) -> str:
        """One line for the start-up output: what was reserved, why, how to change it."""
        parts = [
            f"{name} {format_bytes(t.capacity_bytes)} ({t.basis})"
            for name, t in (("hot", self.hot), ("warm", self.warm))
        ]
        line = ", ".join(parts)
        if self.auto_tiers:
            line += (
                "; committed as blocks arrive. Set device.hot_capacity_bytes / "
                "device.warm_capacity_bytes (or MEMKV_DEVICE__HOT_CAPACITY_BYTES, "
                "MEMKV_DEVICE__WARM_CAPACITY_BYTES) to fix them, or tune "
                "device.auto_capacity"
            )
        return line


def size_tiers(
    hot: int | None,
    warm: int | None,
    auto: AutoCapacity,
    *,
    device: str,
    unit: int,
    devices_on_node: int = 1,
    probe: MemoryProbe | None = None,
) -> TierSizes:
    """The capacities of one device actor's tiers.

    Args:
        hot, warm: configured bytes, or None for ``auto``.
        auto: the shares, floors and caps of ``auto``.
        device: the actor's concrete device ('cpu', 'cuda:N'), probed when needed.
        unit: allocator unit; auto sizes are whole units.
        devices_on_node: device actors sharing the node's host memory.
        probe: what the node has free; measured here when None and needed.
    """
    if hot is not None and warm is not None:
        return TierSizes(_fixed(hot), _fixed(warm))
    probe = probe if probe is not None else probe_memory(device)
    if probe.device_free is not None:
        # A GPU's hot tier is its own memory, not shared with the node's other GPUs.
        hot_sized = _fixed(hot) if hot is not None else _auto(
            auto.hot, probe.device_free, "free device memory", split=1, unit=unit
        )
        shm_left = probe.shm_free
    else:
        # A CPU device's hot tier is a shared-memory segment too (same-node readers
        # map it): both tiers come out of /dev/shm, which they split by their shares.
        hot_limit = None
        if probe.shm_free is not None:
            hot_limit = probe.shm_free
            if warm is None:
                hot_limit = int(hot_limit * auto.hot.share / (auto.hot.share + auto.warm.share))
        hot_sized = _fixed(hot) if hot is not None else _auto(
            auto.hot, probe.host_available, "available memory",
            split=devices_on_node, unit=unit, limit=hot_limit,
        )
        shm_left = (
            None if probe.shm_free is None
            else max(0, probe.shm_free - hot_sized.capacity_bytes * devices_on_node)
        )
    warm_sized = _fixed(warm) if warm is not None else _auto(
        auto.warm, probe.host_available, "available memory",
        split=devices_on_node, unit=unit, limit=shm_left,
    )
    return TierSizes(hot_sized, warm_sized)


def _fixed(nbytes: int) -> SizedTier:
    return SizedTier(nbytes, auto=False, basis="configured")


def _auto(
    share: TierShare,
    available: int,
    what: str,
    *,
    split: int,
    unit: int,
    limit: int | None = None,
) -> SizedTier:
    per = "" if split == 1 else f" / {split} devices"
    basis = f"auto: {share.share:.0%} of {format_bytes(available)} {what}{per}"
    nbytes = share.size(available, split=split, unit=unit, limit=limit)
    if limit is not None and nbytes < share.size(available, split=split, unit=unit):
        basis += f", bounded by {SHM_DIR}'s free space"
    return SizedTier(nbytes, auto=True, basis=basis)
