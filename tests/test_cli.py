"""`memkv up` on the embedded default: starts, serves the gateway, stops cleanly on SIGINT."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from memkv.cli import app


def test_help_lists_the_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("up", "status", "drain", "demo"):
        assert command in result.output


@pytest.mark.slow
def test_up_embedded_starts_and_stops_cleanly(tmp_path: Path):
    env = {
        **os.environ,
        "MEMKV_DATA_DIR": str(tmp_path),
        "MEMKV_CLUSTER__NAMESPACE": "memkv-cli-test",
        "MEMKV_CLUSTER__EMBEDDED_OBJECT_STORE_BYTES": str(100 * 1024 * 1024),
        # The default 'auto' tiers, kept small here by their floor and cap.
        **{
            f"MEMKV_DEVICE__AUTO_CAPACITY__{tier}__{bound}": str(4 << 20)
            for tier in ("HOT", "WARM")
            for bound in ("FLOOR_BYTES", "CAP_BYTES")
        },
        "MEMKV_GATEWAY__PORT": "0",  # any free port
        "MEMKV_GATEWAY__BLOCK_PORT": "0",
        "MEMKV_GATEWAY__WORKERS": "2",  # a second gateway process on the same ports
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "memkv.cli", "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until `up` reports (Ray start takes seconds)
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        summary = json.loads("".join(lines[:-1]))
        assert len(summary["devices"]) == 1 and len(summary["archives"]) == 1
        assert summary["namespace"] == "memkv-cli-test"
        # What each device reserved, why, and how to change it.
        (reserved,) = summary["reserved"].values()
        assert reserved.startswith("hot 4.0 MiB (auto: 10% of ") and "warm 4.0 MiB" in reserved
        assert "MEMKV_DEVICE__HOT_CAPACITY_BYTES" in reserved
        assert summary["gateway"].startswith("http://127.0.0.1:")
        assert httpx.get(summary["gateway"] + "/readyz", timeout=30).json() == {"status": "ready"}
        # Authentication is on by default: a token for tenant 'default' was made, private.
        token_file = tmp_path / "gateway-token"
        assert summary["auth"] == f"token in {token_file}"
        assert token_file.stat().st_mode & 0o777 == 0o600
        stats = summary["gateway"] + "/v1/stats"
        assert httpx.get(stats, timeout=30).status_code == 401
        token = token_file.read_text().strip()
        assert summary["gateway_workers"] == 2
        workers = set()
        for _ in range(64):  # a new connection each time: both workers answer, with the token
            answer = httpx.get(stats, headers={"authorization": f"Bearer {token}"}, timeout=30)
            assert answer.status_code == 200 and answer.json()["sessions"] == 0
            workers.add(answer.json()["gateway"]["worker"])
            if workers == {0, 1}:
                break
        assert workers == {0, 1}
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert "memkv stopped." in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "archive").is_dir()


def test_bench_and_demo_options_are_typed():
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0 and "--quick" in result.output and "dataplane" in result.output
    refused = runner.invoke(app, ["bench", "nope"])
    assert refused.exit_code == 2 and "nope" in refused.output
    too_few = runner.invoke(app, ["demo", "--sessions", "1"])
    assert too_few.exit_code == 2  # they share a system prompt: at least 2


def test_status_prints_tables_or_json_from_a_gateway(gateway):
    from memkv.client import Client
    from memkv.storage.layout import KVLayout

    with Client(gateway.url) as client:
        client.create_session("status-cli", KVLayout("status-cli", 2, 2, 8, block_tokens=4))
    runner = CliRunner()
    raw = runner.invoke(app, ["status", "--url", gateway.url, "--json"])
    assert raw.exit_code == 0, raw.output
    stats = json.loads(raw.output)
    assert stats["sessions"] >= 1 and len(stats["devices"]) == 2
    shown = runner.invoke(app, ["status", "--url", gateway.url], env={"COLUMNS": "160"})
    assert shown.exit_code == 0, shown.output
    for heading in ("memkv cluster", "tiers", "device activity", "archives", "tenants"):
        assert heading in shown.output
    device = sorted(stats["devices"])[0]
    assert device in shown.output and "hot" in shown.output and "warm" in shown.output


def test_human_bytes():
    from memkv.status_view import human_bytes

    assert [human_bytes(n) for n in (0, 1023, 1024, 3 << 30, None)] == [
        "0 B", "1023 B", "1.0 KiB", "3.0 GiB", "-"
    ]


def test_compacting_every_archive(cluster):
    from memkv.status_view import compact_archives

    done = compact_archives(cluster.archives, force=True)
    assert set(done) == set(cluster.archives)
    for result in done.values():
        assert min(result.segments_in, result.segments_out, result.bytes_reclaimed) >= 0
