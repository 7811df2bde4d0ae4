"""kill -9 of the router, and of the whole embedded ``memkv up``: what was acknowledged survives.

The router test kills the router of the fault tests' own deployment
(``fault_cluster``) by pid (Ray restarts it; it rebuilds its table from the
journal and reattaches to the devices). The
whole-process test runs ``memkv up`` in a session of its own, writes through
its gateway, kills the entire process group with SIGKILL and starts it again on
the same data directory.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.exceptions import RayActorError

from memkv.client import Client
from memkv.errors import BlockLostError
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv
from ..memkv_up import start_memkv_up

LAYOUT = KVLayout("restart-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)


def kv(tokens, seed):
    return random_kv(LAYOUT, tokens, seed)


def _wait_for(router, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(router.ping.remote(), timeout=10)
        except (RayActorError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_killed_router_comes_back_with_every_session(fault_cluster):
    sessions = {}
    for sid, ack, seed in (("r-mem", "memory", 1), ("r-arch", "archive", 2), ("r-susp", None, 3)):
        fault_cluster.create_session(sid, LAYOUT, namespace="restart", ack=ack)
        keys, values = kv(8, seed)
        fault_cluster.put_kv(sid, list(range(seed * 100, seed * 100 + 8)), keys, values)
        sessions[sid] = split_kv(LAYOUT, keys, values)
    fault_cluster.suspend("r-susp")
    router = fault_cluster.router
    pid = ray.get(router.__ray_call__.remote(lambda _self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    _wait_for(router)
    assert ray.get(router.__ray_call__.remote(lambda _self: os.getpid())) != pid
    for sid, blocks in sessions.items():
        got = [b.clone() for _, b in fault_cluster.read_session(sid)]
        assert len(got) == len(blocks) and all(
            torch.equal(a, b) for a, b in zip(got, blocks, strict=True)
        ), sid
    assert fault_cluster.session("r-arch").ack == "archive"
    assert fault_cluster.session("r-susp").state in ("suspended", "archived")
    # It keeps working: another turn, a delete.
    keys, values = kv(12, 9)
    fault_cluster.put_kv("r-mem", list(range(100, 112)), keys, values)
    assert fault_cluster.session("r-mem").turn == 2
    for sid in sessions:
        fault_cluster.delete_session(sid)


def _up(data_dir: Path, log: Path) -> tuple[subprocess.Popen, dict]:
    return start_memkv_up(
        data_dir,
        log,
        {
            "MEMKV_CLUSTER__NAMESPACE": "memkv-restart-test",
            "MEMKV_CLUSTER__EMBEDDED_OBJECT_STORE_BYTES": str(100 * 1024 * 1024),
            "MEMKV_DEVICE__HOT_CAPACITY_BYTES": str(1 << 20),
            "MEMKV_DEVICE__WARM_CAPACITY_BYTES": str(1 << 20),
            "MEMKV_DEVICE__ALLOCATOR__MIN_UNIT_BYTES": str(1 << 20),
            "MEMKV_DEVICE__PREFAULT": "false",
        },
    )


@pytest.mark.slow
def test_a_killed_memkv_up_serves_acknowledged_sessions_again(tmp_path):
    data = tmp_path / "data"
    log = tmp_path / "up.log"
    proc, summary = _up(data, log)
    token = (data / "gateway-token").read_text().strip()
    try:
        with Client(summary["gateway"], token=token) as c:
            expected = {}
            for sid, ack, seed in (
                ("dur", "archive", 1),
                ("sus", "memory", 2),
                ("vol", "memory", 3),
            ):
                c.create_session(sid, LAYOUT, ack=ack)
                # One KV of 14 tokens; turn 1 sends its first 8 (KV only ever
                # under the tokens it was computed from), turn 2 all of it.
                keys, values = kv(14, seed)
                for turn, tokens in ((1, 8), (2, 14)):
                    c.append_turn(
                        sid,
                        list(range(seed * 100, seed * 100 + tokens)),
                        [k[:, :tokens] for k in keys],
                        [v[:, :tokens] for v in values],
                        turn=turn,
                    )
                expected[sid] = [b.numpy().tobytes() for b in split_kv(LAYOUT, keys, values)]
            c.suspend("sus")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # everything, at once, no clean-up
        proc.wait(timeout=30)
    time.sleep(0.5)  # the killed processes' sockets and shared memory go

    proc, summary = _up(data, log)
    try:
        with Client(summary["gateway"], token=token) as c:
            for sid in ("dur", "sus"):
                got = [b.array.tobytes() for b in c.read_blocks(sid)]
                assert got == expected[sid], sid
                assert c.session(sid).turn == 2
            assert c.session("dur").ack == "archive"
            # An active memory-mode session: served again as far as its blocks had
            # reached the archive (the session says how many tokens it lost), or
            # lost when not even its first block had. Never other bytes.
            try:
                got = [b.array.tobytes() for b in c.read_blocks("vol")]
            except BlockLostError:
                pass
            else:
                vol = c.session("vol")
                assert got == expected["vol"][: len(got)]
                assert vol.tokens + vol.lost_tokens == 14
                assert (vol.lost_tokens > 0) == (len(got) < len(expected["vol"]))
            # The restarted cluster takes new turns.
            keys, values = kv(20, 7)
            c.append_turn("dur", list(range(700, 720)), keys, values, turn=3)
            got = [b.array.tobytes() for b in c.read_blocks("dur")]
            assert got == [b.numpy().tobytes() for b in split_kv(LAYOUT, keys, values)]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


SOAK = os.environ.get("MEMKV_SOAK") == "1"
#: Restart cycles of the wedge sequence: two at least (the wedge needs a previous run),
#: make soak runs more.
RESTART_CYCLES = 5 if SOAK else 2


def _descendants_named(root: int, needle: str) -> list[int]:
    """Processes under our own ``memkv up`` (its process tree) whose command line has
    ``needle``: the test kills only what it started, by pid."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdlines[int(entry.name)] = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            if needle in cmdlines.get(child, ""):
                found.append(child)
    return found


def _retried(call, timeout_s: float = 90.0):
    """``call()``, retried while the router comes back (503 meanwhile)."""
    from memkv.errors import ClosedError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except ClosedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _create_and_append(c: Client, sid: str, seed: int) -> list[bytes]:
    """A new memory-mode session and one turn of 8 tokens."""
    from memkv.errors import ConflictError

    def create():
        try:
            c.create_session(sid, LAYOUT, ack="memory")
        except ConflictError:  # a retry of a create the router took before it died
            pass

    _retried(create)
    keys, values = kv(8, seed)
    _retried(
        lambda: c.append_turn(sid, list(range(seed * 10, seed * 10 + 8)), keys, values, turn=1)
    )
    return [b.numpy().tobytes() for b in split_kv(LAYOUT, keys, values)]


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> str:
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)  # its sockets and shared memory go
    return out or ""


@pytest.mark.slow
def test_restarts_and_router_kills_never_wedge_new_sessions(tmp_path):
    """Items 1 and 2 of [1/5]: start, append, stop (SIGTERM), start again, create and
    append, kill -9 the router, create and append: repeated.

    A planned stop drains memory-mode sessions to the archive, so they are served
    again byte for byte; after every router kill new sessions are placed on a live
    device and take their appends (the wedge placed them on the previous run's
    device and answered 503 forever).
    """
    data = tmp_path / "data"
    log = tmp_path / "up.log"
    expected: dict[str, list[bytes]] = {}
    seed = 1
    for cycle in range(RESTART_CYCLES):
        proc, summary = _up(data, log)
        token = (data / "gateway-token").read_text().strip()
        try:
            with Client(summary["gateway"], token=token) as c:
                for sid, blocks in expected.items():  # everything before the last stop
                    got = [b.array.tobytes() for b in c.read_blocks(sid)]
                    assert got == blocks, (cycle, sid)
                for step in ("before-kill", "after-kill"):
                    if step == "after-kill":
                        routers = _descendants_named(proc.pid, "SessionRouter")
                        assert routers, "no router process found in memkv up's group"
                        for pid in routers:
                            os.kill(pid, signal.SIGKILL)
                    for i in range(2):
                        sid = f"c{cycle}-{step}-{i}"
                        expected[sid] = _create_and_append(c, sid, seed)
                        seed += 1
                    for sid in [s for s in expected if s.startswith(f"c{cycle}-{step}")]:
                        got = [b.array.tobytes() for b in c.read_blocks(sid)]
                        assert got == expected[sid], (cycle, sid)
        finally:
            out = _stop(proc)
        assert "every session is in the archive" in out, out[-2000:]
