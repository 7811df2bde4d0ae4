"""The connector's running totals in one JSON file shared by its processes.

vLLM makes one connector in the scheduler process and one in each worker; all
write ``stats_path``. Each used to replace the whole file with its own figures,
so the last writer won (two save failures in the log, 0 in the file: the
scheduler's figures overwrote the worker's). Each process now writes its own
part under a file lock, and the top level is the sum over the parts, the
totals a reader wants. Imports no vLLM (tested on its own).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import Any

__all__ = ["saves_settled", "write_part"]

#: How long the counters must stay put, every save done, before they count as settled.
SETTLED_CALM_S = 0.5


def write_part(path: str, part: str, figures: dict[str, Any]) -> dict[str, Any]:
    """Record ``figures`` as ``part`` (e.g. ``worker-<pid>``) of ``path``; return the document.

    The document: ``{"parts": {part: figures, ...}, <key>: sum over the parts, ...}``
    for every numeric key. Written whole and renamed into place, so a reader never
    sees half a file; the lock beside it (``path + ".lock"``) orders the writers.
    """
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                parts = dict(json.load(f).get("parts", {}))
        except (OSError, ValueError, AttributeError):
            parts = {}  # no file yet, or one of an older layout
        parts[part] = figures
        totals: dict[str, int | float] = {}
        for figs in parts.values():
            for key, value in figs.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    totals[key] = totals.get(key, 0) + value
        doc: dict[str, Any] = {**totals, "parts": parts}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        return doc


def saves_settled(path: str, timeout_s: float, calm_s: float = SETTLED_CALM_S,
                  ) -> dict[str, Any] | None:
    """The totals of ``path`` once every save the engine queued is stored (or failed);
    None when that did not happen within ``timeout_s`` (or nothing was written).

    Saves run behind the engine, and a finished request's last save is handed to
    the workers a step after its output came back (vLLM keeps its blocks until
    then): done must cover queued with nothing new for ``calm_s``, not only once.
    """
    deadline = time.monotonic() + timeout_s
    seen: tuple[int, int] | None = None
    calm_since = time.monotonic()
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                doc = json.load(f)
            now: tuple[int, int] | None = (int(doc["saves_queued"]), int(doc["saves_done"]))
        except (OSError, ValueError, KeyError):
            now = None  # not written yet, or no save queued, or mid-replace
        if now != seen:
            calm_since, seen = time.monotonic(), now
        elif now is not None and now[1] >= now[0] and time.monotonic() - calm_since >= calm_s:
            return doc
        time.sleep(0.02)  # another process's file: nothing to wait on but the clock
    return None
