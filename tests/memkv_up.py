"""``memkv up`` in a process group of its own, as a deployment runs it (tests' helper)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memkv.bench.process_groups import stop_group

START_TIMEOUT_S = 120


def start_memkv_up(
    data_dir: Path, log: Path, settings: dict[str, str]
) -> tuple[subprocess.Popen, dict]:
    """Start it with ``settings`` ($MEMKV_... variables) and wait for its gateway.

    Returns the process (stop it with SIGINT or SIGKILL to its group) and the
    summary it printed (``gateway``: its URL; the token is in
    ``data_dir / "gateway-token"``).
    """
    env = {
        **os.environ,
        "MEMKV_DATA_DIR": str(data_dir),
        "MEMKV_GATEWAY__PORT": "0",
        "MEMKV_GATEWAY__BLOCK_PORT": "0",
        **settings,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "memkv.cli", "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(log, "ab"),  # noqa: SIM115 - the child holds it
        text=True,
        start_new_session=True,  # its own process group: Ray's processes included
    )
    lines = []
    deadline = time.monotonic() + START_TIMEOUT_S
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops it" in line or time.monotonic() > deadline:
            break
    if not lines or "Ctrl-C stops it" not in lines[-1]:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"memkv up did not start: {''.join(lines)[-2000:]}")
    return proc, json.loads("".join(lines[:-1]))


def stop_memkv_up(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGINT (a planned stop), then SIGKILL of the group if it overstays."""
    stop_group(proc, timeout_s, signal.SIGINT)
