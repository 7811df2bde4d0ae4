"""``memkv bench timing``: can a tenant time another tenant's cached prompts? ([2/6] item 6)

A gateway with tokens for a victim, an attacker and a public namespace's owner,
over the bench's cluster. Rows (memkv.bench.timing_probe): the attacker's ROC AUC
through ``/v1/match`` and by-key reads (the victim's keys, hashed knowing its
tenant), and, where the vLLM venv is there, through the OpenAI front door with
one ``vllm serve`` (memkv's connector) the tenants share, beside the victim
probing its own prompts the same way (the control: they do hit). Target: two-sided
AUC <= 0.55 across tenants; a declared public prefix still hits.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from memkv.api.auth import Authenticator, TokenEntry, hash_token
from memkv.bench.context import BenchContext
from memkv.bench.engine_cores import engine_env
from memkv.bench.fleet import FULL_MODEL as PROBE_MODEL
from memkv.bench.process_groups import die_with_parent
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult
from memkv.bench.timing_probe import TARGET_AUC, ProbeResult, front_door_probe, gateway_probe
from memkv.bench.vllm import BLOCK_SIZE, VLLM_PYTHON, _model
from memkv.protocol.layout import KVLayout

__all__ = ["run"]

#: Prompts long enough, on a model heavy enough (the fleet's: 8 layers, 32 KiB of KV per
#: token), that a hit is far cheaper than computing: the control must see its hits (on
#: the quick 2-layer model a 384-token prompt computed faster than it loaded).
#: 128 front-door pairs: with no leak the AUC's standard error is ~0.036 (0.07 at 32, too
#: coarse to hold against a 0.55 goal).
FULL = {"gateway_pairs": 100, "front_door_pairs": 128, "prompt_tokens": 768}
QUICK = {"gateway_pairs": 10, "front_door_pairs": 8, "prompt_tokens": 512}
LAYOUT = KVLayout("timing-probe", 2, 2, 8, block_tokens=4)
PUBLIC = "shared-prompts"
MODEL = "timing"
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(url: str, token: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    connector = {"transport": "gateway", "url": url, "token": token,
                 "model_id": f"timing-{uuid.uuid4().hex[:8]}"}
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(_model(PROBE_MODEL)), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
            "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
            "--max-model-len", "1024", "--enable-prefix-caching",
            "--kv-transfer-config", json.dumps({
                "kv_connector": "MemkvConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "memkv.integrations.vllm.connector",
                "kv_connector_extra_config": connector})]
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True,
                                env=engine_env({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}),
                                preexec_fn=die_with_parent)
    engine_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} (log: {log})")
        try:
            if httpx.get(f"{engine_url}/health", timeout=2).status_code == 200:
                return proc, engine_url
        except httpx.HTTPError:
            time.sleep(0.5)  # loading: nothing to wait on but its port
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError(f"vllm serve did not start within {STARTUP_TIMEOUT_S} s")


def run(ctx: BenchContext) -> SuiteResult:
    from memkv.api.server import GatewayServer

    sizes = QUICK if ctx.quick else FULL
    tokens = {name: secrets.token_urlsafe(16) for name in ("victim", "attacker", "owner")}
    roles = frozenset({"write", "admin"})
    auth = Authenticator([
        TokenEntry(hash_token(tokens["victim"]), "victim", roles),
        TokenEntry(hash_token(tokens["attacker"]), "attacker", roles, read=frozenset({PUBLIC})),
        TokenEntry(hash_token(tokens["owner"]), "owner", roles, publish=frozenset({PUBLIC})),
    ], owners={PUBLIC: ("owner",)})
    results: list[ProbeResult] = []
    notes: list[str] = []
    with GatewayServer.start(ctx.get_cluster(), host="127.0.0.1", port=0, auth=auth) as gw:
        results += gateway_probe(gw.url, victim=tokens["victim"], attacker=tokens["attacker"],
                                 victim_namespace="victim", layout=LAYOUT,
                                 prompts=sizes["gateway_pairs"])
        public_hits = _public_prefix_hits(gw.url, tokens["owner"], tokens["attacker"])
        if VLLM_PYTHON.exists():
            log = ctx.out / "timing-engine.log"
            ctx.out.mkdir(parents=True, exist_ok=True)
            proc, engine_url = _engine(gw.url, tokens["owner"], log)
            admin = {"Authorization": f"Bearer {tokens['owner']}"}
            try:
                made = httpx.post(f"{gw.url}/v1/engines", headers=admin, timeout=60, json={
                    "url": engine_url, "model": MODEL, "engine_id": "shared", "tenants": ["*"]})
                made.raise_for_status()
                for same_tenant, seed in ((False, 1), (True, 2)):
                    results.append(front_door_probe(
                        gw.url, MODEL, victim=tokens["victim"], attacker=tokens["attacker"],
                        prompts=sizes["front_door_pairs"], tokens=sizes["prompt_tokens"],
                        vocab=int(PROBE_MODEL["vocab_size"]), seed=seed,
                        same_tenant=same_tenant))
                httpx.delete(f"{gw.url}/v1/engines/shared", headers=admin, timeout=60)
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        else:
            notes.append(f"The front door rows were not measured: no vLLM venv at "
                         f"{VLLM_PYTHON} (make vllm-venv).")
    across = [r for r in results if "control" not in r.path]
    worst = max(r.auc for r in across)
    rows: list[list[Any]] = [
        [r.path, round(r.auc, 3), r.probes, round(r.positive_ms, 2), round(r.negative_ms, 2),
         r.hits, "control" if "control" in r.path else
         ("met" if r.auc <= TARGET_AUC else "not met")]
        for r in results]
    rows.append(["gateway /v1/match, a declared public prefix (control)", "-", 1, "-", "-",
                 public_hits, "hits" if public_hits else "NO HIT"])
    notes = [
        f"Target ([2/6]): across tenants the attacker's ROC AUC <= {TARGET_AUC} (two-sided: "
        f"max(a, 1 - a)); worst measured {worst:.3f}. The published attack on shared "
        "prefix caches reaches 0.99 (vLLM PR #39082).",
        "Each row: the attacker times candidates, half of them the victim's cached prompts, "
        "interleaved with the others (the same moments of a shared machine); a faster answer "
        "scores higher. Through the gateway: /v1/match in its own namespace (the only one it "
        "may name), and by-key reads of the victim's keys hashed knowing the victim's tenant "
        "(answered 404 like missing ones). Through the front door: one vllm serve with "
        "memkv's connector, registered for every tenant (tenants ['*']): the front door "
        "salts vLLM's prefix cache per tenant and names a memkv partition per tenant; the "
        "victim probing its own prompts the same way is the control (they hit).",
        *notes,
    ]
    return SuiteResult(
        suite="timing",
        title="Cross-tenant timing probes: ROC AUC of an attacker's timing",
        columns=["path", "ROC AUC", "probes of each kind", "victim's ms (median)",
                 "others' ms (median)", "hits", "target"],
        rows=rows,
        figures={"results": [r.__dict__ for r in results], "target_auc": TARGET_AUC,
                 "worst_across_tenants": worst, "public_prefix_hits": public_hits},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "path", "ROC AUC", [r.path for r in results],
                      {"ROC AUC": [r.auc for r in results]}),
        quick=ctx.quick,
    )


def _public_prefix_hits(url: str, owner: str, reader: str) -> int:
    """Tokens a reader that names no publisher finds of a prefix the namespace's declared
    owner published (the control: public prefixes are for every reader)."""
    import numpy as np

    from memkv.client import Client

    prompt = list(range(7000, 7016))
    with Client(url, token=owner) as o, Client(url, token=reader) as r:
        name = f"public-{uuid.uuid4().hex[:6]}"
        o.create_session(name, LAYOUT, namespace=PUBLIC)
        o.append_turn(name, prompt, start_block=0, blocks=[
            np.zeros(LAYOUT.block_shape(4), dtype=np.float16) for _ in range(4)])
        return int(r.match(LAYOUT, PUBLIC, prompt + [1]).tokens)
