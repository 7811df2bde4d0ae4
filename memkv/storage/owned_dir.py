"""A directory one process owns on its node: resolved there, and locked while in use.

Two things go wrong with a data directory on many nodes. A path written once in
a config (``$MEMKV_DATA_DIR/archive``, ``/mnt/nvme/$MEMKV_NODE_ID/archive``) must be
resolved where it is used, not where the config was read (a path resolved on
the head put every node's archive under the head's data directory):
:func:`resolve_on_node` expands ``~`` and ``$VARS`` in the using process and
refuses a variable it does not have, except ``$MEMKV_DATA_DIR``, the node's
data root, which is ``~/.cache/memkv`` where a node does not set it. And two
processes must never write one directory (two archives on nodes that share a
disk, a second deployment started over the first): :class:`DirectoryLock` holds
an ``flock`` on ``<dir>/LOCK`` for the owner's life. The kernel drops it when
the owner's process dies, however it dies, so a restarted owner takes it again
(after waiting out a predecessor that is still exiting).
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from pathlib import Path

from memkv.errors import ConfigError, ConflictError

__all__ = ["DATA_DIR_ENV", "DEFAULT_DATA_DIR", "LOCK_NAME", "DirectoryLock", "resolve_on_node"]

#: The root of a node's local data, read on the node that uses it.
DATA_DIR_ENV = "MEMKV_DATA_DIR"
#: ``$MEMKV_DATA_DIR`` where a node does not set it.
DEFAULT_DATA_DIR = "~/.cache/memkv"

LOCK_NAME = "LOCK"
#: How long an owner waits for the lock: a predecessor Ray is replacing may take
#: a few seconds to exit (and drop it).
LOCK_WAIT_S = 10.0
_LOCK_POLL_S = 0.1
_UNRESOLVED_RE = re.compile(r"\$(\w+|\{[^}]*\})")
_DATA_DIR_RE = re.compile(r"\$(?:\{MEMKV_DATA_DIR\}|MEMKV_DATA_DIR(?!\w))")


def resolve_on_node(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``~`` and ``$VARS`` expanded from this process's environment
    (``$MEMKV_DATA_DIR`` is ``~/.cache/memkv`` where it is not set).

    Raises:
        ConfigError: a variable is not set here (naming it and this host), so a
            node without it does not write to a literal ``$VAR`` directory.
    """
    text = os.fspath(path)
    if not os.environ.get(DATA_DIR_ENV):
        text = _DATA_DIR_RE.sub(lambda _: DEFAULT_DATA_DIR, text)
    # Variables first, then "~": a variable's value may start with one.
    text = os.path.expanduser(os.path.expandvars(os.path.expanduser(text)))
    missing = _UNRESOLVED_RE.search(text)
    if missing is not None:
        raise ConfigError(
            f"{os.fspath(path)!r} names {missing.group(0)}, which is not set on "
            f"{socket.gethostname()} (pid {os.getpid()}): set it in that node's environment "
            f"(Ray: runtime_env env_vars, a worker's env) or write the path out"
        )
    return Path(text)


class DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/LOCK`` (created if missing).

    Args:
        directory: the directory to own; it must exist.
        owner: what holds it, for the error a second owner gets.
        wait_s: how long to wait for a holder to let go (None: LOCK_WAIT_S).

    Raises:
        ConflictError: another process (or another open store in this one) holds it.
    """

    def __init__(self, directory: Path, owner: str, wait_s: float | None = None) -> None:
        self.path = directory / LOCK_NAME
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self._holder()
                    self.release()
                    raise ConflictError(
                        f"{directory} is in use by another {owner} ({holder}): each "
                        f"{owner} needs a directory of its own (on nodes that share a disk, "
                        f"put $VARS that differ per node in the path)"
                    ) from None
                time.sleep(_LOCK_POLL_S)
        # Who holds it, for the next one's error (advisory: the lock is the flock).
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)

    def _holder(self) -> str:
        assert self._fd is not None
        text = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
        return text or "holder unknown"

    def release(self) -> None:
        """Let go (idempotent); closing the descriptor drops the flock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
