"""The vLLM connector's in-cluster transport: joining memkv is bounded, and it works
from a process that imported Ray before memkv could set its loopback variables
(a vLLM engine does exactly that)."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from memkv.integrations.vllm.transport import _Joining

# The child imports Ray first, with none of memkv's variables set: it must still
# find the loopback cluster (before: Ray rewrote 127.0.0.1 into the machine's
# outward address and waited there forever).
_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import ray  # before memkv: Ray reads its environment now
    from memkv.integrations.vllm.transport import transport_from_config
    from memkv.protocol.layout import KVLayout

    layout = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                      block_tokens=4)
    started = time.monotonic()
    transport = transport_from_config(layout, json.loads(sys.argv[1]))
    try:
        transport.warm_up()
        matched, _ = transport.match(list(range(8)))
        print(json.dumps({"ok": True, "matched": matched, "s": time.monotonic() - started}))
    except Exception as e:
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                          "s": time.monotonic() - started}))
    transport.close()
    """
)


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_MODE"] = "disabled"  # the suite's cluster runs without auth
    return env


def _run_child(extra: dict, timeout_s: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(extra)],
        env=_child_env(), capture_output=True, text=True, timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_that_imported_ray_first_joins_a_loopback_memkv(cluster):
    import ray

    answer = _run_child(
        {
            "transport": "cluster",
            "ray_address": ray.get_runtime_context().gcs_address,
            "ray_namespace": cluster.config.cluster.namespace,
            "connect_timeout_s": 60,
        },
        timeout_s=120,
    )
    assert answer["ok"], answer
    assert answer["matched"] == 0  # nothing of that layout is stored: a miss, not a hang


def test_joining_nothing_ends_within_the_bound_and_requests_then_compute():
    # A port nothing listens on: Ray would retry for minutes.
    answer = _run_child(
        {"transport": "cluster", "ray_address": "127.0.0.1:9", "connect_timeout_s": 3},
        timeout_s=90,
    )
    assert not answer["ok"]
    assert "TimeoutError" in answer["error"] and "connect_timeout_s" in answer["error"]
    assert answer["s"] < 30


def _once_joined(joining: _Joining) -> object:
    """What the background join gave, polled for a second (it never waits itself)."""
    for _ in range(100):
        try:
            return joining.get()
        except TimeoutError:
            time.sleep(0.01)
    pytest.fail("the background join never became usable")


def test_joining_waits_until_the_first_deadline_only():
    release = threading.Event()
    joining = _Joining(lambda: release.wait() and "cluster", address="x", timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not joined within 0.2 s"):
        joining.get()
    assert time.monotonic() - started >= 0.15
    started = time.monotonic()
    with pytest.raises(TimeoutError):  # past the deadline: no waiting per request
        joining.get()
    assert time.monotonic() - started < 0.1
    release.set()
    assert _once_joined(joining) == "cluster"


def test_a_failed_join_is_retried_after_the_retry_interval():
    attempts: list[int] = []

    def join():
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("no GCS")
        return "cluster"

    joining = _Joining(join, address="x", timeout_s=5, retry_s=0.0)
    with pytest.raises(ConnectionError, match="no GCS"):
        joining.get()  # raises the attempt's own error; and starts the next one
    assert _once_joined(joining) == "cluster"
    assert len(attempts) == 2
