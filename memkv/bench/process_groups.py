"""Processes a benchmark starts in sessions of their own (engines, LMCache's server,
drivers), and how they stop: none outlives the run that started it.

A driver that starts engines is stopped with SIGTERM first, so that its ``finally``
blocks stop those engines (Python runs no ``finally`` on a bare SIGTERM: a driver
calls :func:`exit_on_sigterm`); an engine also dies with its driver
(:func:`die_with_parent`), should the driver itself be killed outright.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

__all__ = ["die_with_parent", "exit_on_sigterm", "stop_group"]

_PR_SET_PDEATHSIG = 1


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 30.0,
               sig: int = signal.SIGTERM) -> None:
    """``sig`` to a process started in a session of its own (its whole group), SIGKILL
    if it has not exited within ``timeout_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=timeout_s)
    except ProcessLookupError:
        proc.wait()  # exited between the poll and the signal
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit in this process, so its ``finally`` blocks run."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def die_with_parent() -> None:
    """For ``Popen(preexec_fn=...)``: the child gets SIGTERM when the process that
    started it dies, however it dies (Linux's PR_SET_PDEATHSIG; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
