"""Where a benchmark window's CPU went, by role: the engines, memkv, Ray, the rest.

On a machine whose engines compute on every core, whatever memkv's processes
spend is taken from the engines; a side-by-side ratio says how much that costs,
this says where. Read from ``/proc`` (every process's user + system time) at the
window's start and end, so processes of any parent count, and classified by
their command line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ROLES", "cpu_by_role", "cpu_seconds", "role_of"]

#: In the order a reader wants them.
ROLES = ("engines", "memkv", "ray", "peers", "driver", "other")
_TICKS = os.sysconf("SC_CLK_TCK")


def role_of(cmdline: str) -> str:
    """The role of a process with this command line (arguments joined by spaces)."""
    if "VLLM::" in cmdline or "vllm serve" in cmdline or "vllm.entrypoints" in cmdline:
        return "engines"
    if "lmcache" in cmdline.lower() or "round_robin_proxy" in cmdline:
        return "peers"
    if "fleet_driver" in cmdline or "vllm_engine" in cmdline:
        return "driver"
    if cmdline.startswith("ray::") and any(
            name in cmdline for name in ("Device", "Router", "Archive", "Gateway")):
        return "memkv"
    if "memkv.cli" in cmdline or "memkv " in cmdline or "pytest" in cmdline:
        return "memkv"  # the bench process: the gateway's event loop runs there
    if "ray" in cmdline:
        return "ray"  # raylet, GCS, idle workers, the dashboard agents
    return "other"


def _processes() -> Iterator[tuple[int, str, float]]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
        # Fields after the command name (which may hold spaces): utime, stime are 14, 15.
        fields = stat[stat.rindex(")") + 2:].split()
        yield int(entry.name), cmdline or stat[stat.index("(") + 1:stat.rindex(")")], \
            (int(fields[11]) + int(fields[12])) / _TICKS


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process now: pid -> (role, CPU seconds so far)."""
    return {pid: (role_of(cmdline), seconds) for pid, cmdline, seconds in _processes()}


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
                ) -> dict[str, float]:
    """CPU seconds each role spent between two :func:`cpu_seconds` readings (a process
    that started meanwhile counts from zero; one that ended meanwhile is not seen)."""
    out = dict.fromkeys(ROLES, 0.0)
    for pid, (role, seconds) in after.items():
        start = before.get(pid)
        out[role] += seconds - (start[1] if start is not None and start[0] == role else 0.0)
    return {role: round(seconds, 2) for role, seconds in out.items()}
