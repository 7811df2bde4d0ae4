"""Where a benchmark window's CPU went (memkv.bench.cpu_roles)."""

import os
import time

from memkv.bench.cpu_roles import ROLES, cpu_by_role, cpu_seconds, role_of


def test_processes_are_told_apart_by_their_command_lines():
    assert role_of("VLLM::EngineCore") == "engines"
    assert role_of("/venv/bin/python -m vllm.entrypoints.cli.main serve /m --port 1") == "engines"
    assert role_of("ray::DeviceCache.put") == role_of("ray::SessionRouterShell") == "memkv"
    assert role_of("ray::NodeArchive") == "memkv"
    assert role_of("/venv/bin/python -m memkv.cli bench fleet") == "memkv"
    assert role_of("/venv/lib/ray/core/src/ray/raylet/raylet --x") == "ray"
    assert role_of("ray::IDLE") == "ray"
    assert role_of("/venv-vllm/bin/python -m memkv.bench.fleet_driver m out {}") == "driver"
    assert role_of("/venv-vllm/bin/lmcache server --port 5") == "peers"
    assert role_of("/usr/sbin/sshd -D") == "other"


def test_a_busy_window_is_counted_for_this_process_and_a_new_one_from_zero():
    before = cpu_seconds()
    end = time.process_time() + 0.2
    while time.process_time() < end:  # this process (pytest: "memkv") burns 0.2 s
        pass
    after = cpu_seconds()
    spent = cpu_by_role(before, after)
    assert list(spent) == list(ROLES)
    assert spent["memkv"] >= 0.15
    # A process that started meanwhile counts from zero; one that ended is not seen.
    assert cpu_by_role({}, {os.getpid(): ("memkv", 1.0)})["memkv"] == 1.0
    assert cpu_by_role({os.getpid(): ("memkv", 1.0)}, {})["memkv"] == 0.0
