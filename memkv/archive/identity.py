"""Whose directory an archive opens: the host it belongs to, kept in the directory.

An archive's directory stands for its host's disk. Opened by an archive of
another host (a path resolved on the wrong node, a disk image copied over, a
network filesystem shared by mistake), it would serve and extend another
host's blocks as its own, and the host they belong to would later reopen a
directory that no longer says what it holds. So the first archive to open a
directory writes ``IDENTITY`` into it (an id of its own, and its host), and
every later one must be of that host: a restarted archive, or the node that
rejoins after a replacement, takes the same identity up again.

The host is ``$MEMKV_HOST_ID`` where set (a Kubernetes node name, when a pod's
hostname changes with every restart), else the hostname.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from memkv.errors import ConfigError, CorruptDataError

__all__ = ["HOST_ID_ENV", "IDENTITY_FILE", "ArchiveIdentity", "claim_directory", "host_id"]

IDENTITY_FILE = "IDENTITY"
HOST_ID_ENV = "MEMKV_HOST_ID"


def host_id() -> str:
    """This host's name for archive ownership: ``$MEMKV_HOST_ID``, else the hostname."""
    return os.environ.get(HOST_ID_ENV) or socket.gethostname()


@dataclass(frozen=True, slots=True)
class ArchiveIdentity:
    """Who owns an archive directory."""

    archive_id: str  # made once, when the directory was first opened
    host: str
    created_at: float  # seconds since the epoch


def claim_directory(directory: Path) -> ArchiveIdentity:
    """The identity of ``directory`` (an archive's, created if missing), written there
    the first time.

    Raises:
        ConfigError: the directory belongs to another host (naming it and how to
            hand the directory over on purpose).
        CorruptDataError: its identity file cannot be read (named; left untouched).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / IDENTITY_FILE
    here = host_id()
    if not path.exists():
        identity = ArchiveIdentity(uuid.uuid4().hex, here, time.time())
        _write(path, identity)
        return identity
    found = _read(path)
    if found.host != here:
        raise ConfigError(
            f"archive directory {directory} belongs to host {found.host!r} (archive "
            f"{found.archive_id[:12]}, made {time.ctime(found.created_at)}), not to this host "
            f"{here!r}: an archive opens only its own host's directory. Check archive.directory "
            f"and $MEMKV_DATA_DIR on this host; if that disk was moved here on purpose, start "
            f"this host with {HOST_ID_ENV}={found.host}"
        )
    return found


def _read(path: Path) -> ArchiveIdentity:
    try:
        doc = json.loads(path.read_text())
        return ArchiveIdentity(str(doc["archive_id"]), str(doc["host"]), float(doc["created_at"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptDataError(
            f"{path} is not an archive identity ({e}); it was left as it is"
        ) from e


def _write(path: Path, identity: ArchiveIdentity) -> None:
    # Written whole or not at all: a crash mid-write leaves no half identity.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    doc = {"archive_id": identity.archive_id, "host": identity.host,
           "created_at": identity.created_at}
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
