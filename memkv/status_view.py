"""``memkv status`` in the terminal: the cluster's stats document as rich tables.

The document is the router's ``stats()`` (what ``/v1/stats`` serves); this module
only lays it out, so the CLI can read it from Ray or from a gateway alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.table import Table

from memkv.protocol.stats import ArchiveStats, ClusterStats, DeviceStats, TenantUse, cluster_stats

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from memkv.storage.segments import CompactionStats

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


def _summary(stats: ClusterStats) -> Table:
    table = Table(title="memkv cluster", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    reads = sum(d.reads for d in stats.devices.values())
    misses = sum(d.misses for d in stats.devices.values())
    states = ", ".join(f"{k} {v}" for k, v in sorted(stats.session_states.items()))
    priorities = ", ".join(f"{k} {v}" for k, v in sorted(stats.session_priorities.items()))
    table.add_row("sessions", f"{stats.sessions}  ({states or 'none'})")
    table.add_row("by priority", priorities or "-")
    if len(stats.shard_sessions) > 1:  # a sharded table: sessions per shard
        table.add_row("router shards", " / ".join(str(n) for n in stats.shard_sessions))
    table.add_row("KV held (logical)", human_bytes(stats.logical_bytes))
    table.add_row("devices / archives", f"{len(stats.devices)} / {len(stats.archives)}")
    if stats.repair is not None:
        r = stats.repair
        lost = f", lost: {', '.join(r.lost_archives)}" if r.lost_archives else ""
        table.add_row(
            "cold replicas",
            f"{min(r.replicas, max(r.live_archives, 1))} of {r.replicas} asked; "
            f"{r.under_replicated} blocks short; repaired {r.repaired_blocks} "
            f"({human_bytes(r.repaired_bytes)}){lost}",
        )
    served = f"{reads} of {reads + misses} ({_ratio(reads, reads + misses)})"
    table.add_row("block reads served", served)
    return table


def _tiers(devices: dict[str, DeviceStats]) -> Table:
    table = Table(title="tiers", title_justify="left")
    for column in ("device", "tier", "used", "capacity", "use", "blocks", "hits", "evictions"):
        table.add_column(column, justify="left" if column in ("device", "tier") else "right")
    for name, device in sorted(devices.items()):
        for tier in ("hot", "warm", "cold"):
            t = device.tiers.get(tier)
            if t is None:
                continue
            table.add_row(
                name, tier, human_bytes(t.used_bytes), human_bytes(t.capacity_bytes),
                _ratio(t.used_bytes, t.capacity_bytes or 0), str(t.blocks),
                str(t.hits), str(t.evictions),
            )
    return table


def _device_counters(devices: dict[str, DeviceStats]) -> Table:
    table = Table(title="device activity", title_justify="left")
    columns = ("device", "kernels", "misses", "promoted", "demoted", "prefetched (used)",
               "dedup saved", "lossy", "leases")
    for column in columns:
        table.add_column(column, justify="left" if column == "device" else "right")
    for name, d in sorted(devices.items()):
        table.add_row(
            name, d.kernels, str(d.misses), str(d.promotions), str(d.demotions),
            f"{d.prefetched} ({_ratio(d.prefetch_used, d.prefetched)})",
            human_bytes(d.dedup_bytes_saved), str(d.lossy_conversions),
            f"{d.leases.active} active, {d.leases.granted} granted",
        )
    return table


def _archives(archives: dict[str, ArchiveStats]) -> Table:
    table = Table(title="archives (cold tier)", title_justify="left")
    for column in ("archive", "host", "blocks", "live", "dead", "on disk", "room", "refused",
                   "corrupt"):
        table.add_column(column, justify="left" if column in ("archive", "host") else "right")
    for name, a in sorted(archives.items()):
        room = a.room_bytes
        table.add_row(
            name, a.host or "?", str(a.blocks), human_bytes(a.live_bytes),
            human_bytes(a.dead_bytes), human_bytes(a.bytes_on_disk),
            "?" if room is None else human_bytes(room),
            # Refusals say the disk filled: the copies went elsewhere.
            f"[red]{a.refused_writes}[/red]" if a.refused_writes else "0",
            str(a.corrupt_records),
        )
    return table


def _tenants(tenants: dict[str, TenantUse]) -> Table:
    table = Table(title="tenants (largest first)", title_justify="left")
    for column in ("tenant", "sessions", "KV bytes"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for name, use in sorted(tenants.items(), key=lambda kv: -kv[1].bytes):
        table.add_row(name or "(unscoped)", str(use.sessions), human_bytes(use.bytes))
    return table


def status_tables(document: dict[str, Any]) -> Group:
    """The stats document as a group of tables (print it with a rich Console).

    Raises:
        InvalidInputError: the document lacks a figure the tables show (named).
    """
    stats = cluster_stats(document)
    parts: list[Table] = [_summary(stats)]
    if stats.devices:
        parts += [_tiers(stats.devices), _device_counters(stats.devices)]
    if stats.archives:
        parts.append(_archives(stats.archives))
    if stats.tenants:
        parts.append(_tenants(stats.tenants))
    engines = (document.get("gateway") or {}).get("engines")
    if engines:
        parts.append(_engines(engines))
    return Group(*parts)


def _engines(engines: list[dict[str, Any]]) -> Table:
    """The OpenAI front door's engines (a gateway's stats): state, load, what was routed."""
    table = Table(title="engines (OpenAI front door)", title_justify="left")
    for column in ("engine", "model", "node", "tenants", "healthy", "requests", "KV use",
                   "memkv saved / skipped", "routed"):
        table.add_column(column, justify="right" if column in ("requests", "KV use") else "left")
    for e in engines:
        routed = ", ".join(f"{k} {v}" for k, v in sorted(e.get("routed", {}).items())) or "-"
        tenants = e.get("tenants")
        # Running + waiting there, or what this gateway has in flight if more (the
        # figure routing uses).
        requests = max(int(e["requests"]), int(e.get("inflight", 0)))
        table.add_row(str(e["id"]), str(e["model"]), str(e["node"] or "-"),
                      "all" if tenants is None else ", ".join(tenants),
                      "yes" if e["healthy"] else f"no: {e.get('last_error', '')}"[:40],
                      str(requests), f"{e['kv_use']:.0%}", _saved(e.get("connector") or {}),
                      routed)
    return table


def _saved(counters: dict[str, int]) -> str:
    """An engine connector's blocks saved and not saved, with the reasons (- : none)."""
    if not counters:
        return "-"
    reasons = ", ".join(f"{k.removeprefix('save_skipped_blocks_').replace('_', ' ')} {v}"
                        for k, v in sorted(counters.items())
                        if k.startswith("save_skipped_blocks_") and v)
    skipped = counters.get("save_skipped_blocks", 0)
    return f"{counters.get('save_blocks', 0)} / {skipped}" + (f" ({reasons})" if reasons else "")


def print_status(stats: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(status_tables(stats))


def compact_archives(archives: dict[str, ActorHandle], *, force: bool = False
                     ) -> dict[str, CompactionStats]:
    """Compact each archive actor (one at a time, under a progress bar on stderr)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from memkv.actors.handles import ArchiveHandle  # imports Ray: only when compacting

    out: dict[str, CompactionStats] = {}
    columns = (TextColumn("[bold]compacting archives"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        for name in progress.track(sorted(archives), description="archives"):
            out[name] = ArchiveHandle(archives[name]).compact(force).result()
    return out
