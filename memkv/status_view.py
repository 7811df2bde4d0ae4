"""``memkv status`` in the terminal: the cluster's stats document as rich tables.

The document is the router's ``stats()`` (what ``/v1/stats`` serves); this module
only lays it out, so the CLI can read it from Ray or from a gateway alike.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table

__all__ = ["compact_archives", "human_bytes", "status_tables"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} {_UNITS[0]}" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def _ratio(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _summary(stats: dict[str, Any]) -> Table:
    table = Table(title="memkv cluster", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    devices = stats.get("devices", {})
    reads = sum(t.get("hits", 0) for d in devices.values() for t in d.get("tiers", {}).values())
    misses = sum(d.get("misses", 0) for d in devices.values())
    states = ", ".join(f"{k} {v}" for k, v in sorted(stats.get("session_states", {}).items()))
    priorities = ", ".join(
        f"{k} {v}" for k, v in sorted(stats.get("session_priorities", {}).items())
    )
    table.add_row("sessions", f"{stats.get('sessions', 0)}  ({states or 'none'})")
    table.add_row("by priority", priorities or "-")
    if len(stats.get("shard_sessions", ())) > 1:  # a sharded table: sessions per shard
        table.add_row("router shards", " / ".join(str(n) for n in stats["shard_sessions"]))
    table.add_row("KV held (logical)", human_bytes(stats.get("logical_bytes", 0)))
    table.add_row("devices / archives", f"{len(devices)} / {len(stats.get('archives', {}))}")
    served = f"{reads} of {reads + misses} ({_ratio(reads, reads + misses)})"
    table.add_row("block reads served", served)
    return table


def _tiers(devices: dict[str, Any]) -> Table:
    table = Table(title="tiers", title_justify="left")
    for column in ("device", "tier", "used", "capacity", "use", "blocks", "hits", "evictions"):
        table.add_column(column, justify="left" if column in ("device", "tier") else "right")
    for name, device in sorted(devices.items()):
        for tier in ("hot", "warm", "cold"):
            t = device.get("tiers", {}).get(tier)
            if t is None:
                continue
            capacity = t.get("capacity_bytes")
            table.add_row(
                name, tier, human_bytes(t.get("used_bytes")), human_bytes(capacity),
                _ratio(t.get("used_bytes", 0), capacity or 0), str(t.get("blocks", 0)),
                str(t.get("hits", 0)), str(t.get("evictions", 0)),
            )
    return table


def _device_counters(devices: dict[str, Any]) -> Table:
    table = Table(title="device activity", title_justify="left")
    columns = ("device", "kernels", "misses", "promoted", "demoted", "prefetched (used)",
               "dedup saved", "lossy", "leases")
    for column in columns:
        table.add_column(column, justify="left" if column == "device" else "right")
    for name, d in sorted(devices.items()):
        prefetched = d.get("prefetched", 0)
        leases = d.get("leases", {})
        table.add_row(
            name, str(d.get("kernels", "-")), str(d.get("misses", 0)), str(d.get("promotions", 0)),
            str(d.get("demotions", 0)),
            f"{prefetched} ({_ratio(d.get('prefetch_used', 0), prefetched)})",
            human_bytes(d.get("dedup_bytes_saved", 0)), str(d.get("lossy_conversions", 0)),
            f"{leases.get('active', 0)} active, {leases.get('granted', 0)} granted",
        )
    return table


def _archives(archives: dict[str, Any]) -> Table:
    table = Table(title="archives (cold tier)", title_justify="left")
    for column in ("archive", "blocks", "live", "dead", "on disk", "corrupt"):
        table.add_column(column, justify="left" if column == "archive" else "right")
    for name, a in sorted(archives.items()):
        table.add_row(
            name, str(a.get("blocks", 0)), human_bytes(a.get("live_bytes")),
            human_bytes(a.get("dead_bytes")), human_bytes(a.get("bytes_on_disk")),
            str(a.get("corrupt_records", 0)),
        )
    return table


def _tenants(tenants: dict[str, Any]) -> Table:
    table = Table(title="tenants (largest first)", title_justify="left")
    for column in ("tenant", "sessions", "KV bytes"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for name, use in sorted(tenants.items(), key=lambda kv: -kv[1].get("bytes", 0)):
        table.add_row(name or "(unscoped)", str(use.get("sessions", 0)),
                      human_bytes(use.get("bytes", 0)))
    return table


def status_tables(stats: dict[str, Any]) -> Group:
    """The stats document as a group of tables (print it with a rich Console)."""
    parts: list[Table] = [_summary(stats)]
    devices = stats.get("devices", {})
    if devices:
        parts += [_tiers(devices), _device_counters(devices)]
    if stats.get("archives"):
        parts.append(_archives(stats["archives"]))
    if stats.get("tenants"):
        parts.append(_tenants(stats["tenants"]))
    return Group(*parts)


def print_status(stats: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(status_tables(stats))


def compact_archives(archives: dict[str, Any], *, force: bool = False) -> dict[str, Any]:
    """Compact each archive actor (one at a time, under a progress bar on stderr)."""
    import ray
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    out: dict[str, Any] = {}
    columns = (TextColumn("[bold]compacting archives"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        for name in progress.track(sorted(archives), description="archives"):
            out[name] = ray.get(archives[name].compact.remote(force))
    return out
