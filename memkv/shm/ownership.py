"""Who owns a memkv shared-memory segment: named per owner, reclaimed after a crash.

A device's warm pool and CPU hot arena are POSIX shared memory, which outlives
a process that dies without unlinking it (kill -9, ``ray.kill``). Populated
arenas hold real memory, gigabytes per device, so a leaked one must not stay
until the next reboot. Each device holds an ``flock`` on a lock file beside
its segments for as long as it lives; a device starting up reclaims every
memkv segment whose lock nobody holds (its owner is gone), on any device id.
"""

from __future__ import annotations

import fcntl
import os
import re
from multiprocessing.shared_memory import SharedMemory

from memkv.errors import ConflictError

__all__ = ["SegmentOwnership", "reclaim_orphans", "warm_segment_name"]

SHM_DIR = "/dev/shm"
_PREFIX = "memkv-warm-"
_LOCK_SUFFIX = ".lock"
#: Segments of one device: the warm pool and (CPU devices) the hot arena.
_SUFFIXES = ("", "-hot")
_LOCK_MODE = 0o600


def warm_segment_name(device_id: str) -> str:
    """The shared-memory segment name of a device's warm pool (POSIX-safe)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)[:200]
    return f"{_PREFIX}{safe}"


def _unlink(name: str) -> None:
    try:
        stale = SharedMemory(name=name)
    except FileNotFoundError:
        return
    stale.close()
    stale.unlink()


class SegmentOwnership:
    """The lock that says a device's segments are in use; held until :meth:`release`."""

    def __init__(self, base: str) -> None:
        self.base = base
        path = os.path.join(SHM_DIR, base + _LOCK_SUFFIX)
        self._fd = os.open(path, os.O_CREAT | os.O_RDWR, _LOCK_MODE)
        try:
            # Free once its holder is dead: a restarted device takes its name over.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise ConflictError(
                f"a live device already holds the segments named {base!r} (device ids must "
                "be unique on a node)"
            ) from None
        for suffix in _SUFFIXES:
            _unlink(base + suffix)  # left by a crashed predecessor of this device

    def release(self) -> None:
        """Give the name up (segments are unlinked by their arenas)."""
        if self._fd >= 0:
            try:
                os.unlink(os.path.join(SHM_DIR, self.base + _LOCK_SUFFIX))
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


def reclaim_orphans() -> list[str]:
    """Unlink the segments of every device whose lock nobody holds; their names."""
    reclaimed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return reclaimed
    for name in names:
        if not (name.startswith(_PREFIX) and name.endswith(_LOCK_SUFFIX)):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its device is alive
        try:
            base = name[: -len(_LOCK_SUFFIX)]
            for suffix in _SUFFIXES:
                _unlink(base + suffix)
            os.unlink(path)
            reclaimed.append(base)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return reclaimed
