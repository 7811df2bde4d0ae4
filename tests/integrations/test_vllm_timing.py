"""[2/6] item 6 through the OpenAI front door: an engine shared by two tenants
(``tenants: ["*"]``), memkv's connector on it. Before, its connector kept every
tenant's KV under its own token's namespace: one tenant's prompt hit blocks
another had computed, and answered faster (vLLM's own prefix cache was already
salted per tenant). Now the front door names a partition per tenant for a shared
engine and the connector keeps each one's KV apart. The prober times one request
per candidate; the victim itself, probing the same way, is the control (its own
prompts do hit).
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from memkv.bench.fleet import FULL_MODEL as PROBE_MODEL
from memkv.bench.timing_probe import front_door_probe
from memkv.bench.vllm import _model

from .test_front_door_vllm import MODEL, _free_port, _serve, _stop, _wait_healthy

pytestmark = pytest.mark.slow
#: Pairs of candidates (victim's, others): noise alone puts the two-sided AUC past 0.75
#: less than once in a thousand runs.
PAIRS = 32
MAX_AUC = 0.75
#: The control's sample and bound: its hits read AUC 0.90-1.0 here, 0.897 once on a
#: loaded CI machine at 32 pairs. At 64 pairs noise alone (no hits to see) reads past
#: 0.85 less than once in a million runs, so the control still proves the probe sees hits.
CONTROL_PAIRS = 64
MIN_CONTROL_AUC = 0.85
#: A model whose prefill of a probe's prompt costs far more than loading its KV (the
#: fleet's: 8 layers, 32 KiB of KV per token), so that the control sees its hits: with
#: the quick 2-layer model a 384-token prompt computes faster than any load (measured:
#: hits 69 ms, misses 54 ms).
PROBE_TOKENS = 768


@pytest.fixture(scope="module")
def shared_engine(memkv_deployment, tmp_path_factory):
    connector = {"transport": "gateway", "url": memkv_deployment.url,
                 "token": memkv_deployment.token, "model_id": f"probe-{uuid.uuid4().hex[:8]}"}
    log = open(tmp_path_factory.mktemp("probe-engine") / "engine.log", "ab")  # noqa: SIM115
    port = _free_port()
    proc = _serve(str(_model(PROBE_MODEL)), port, connector, log,
                  max_model_len=PROBE_TOKENS + 256)
    http = httpx.Client(base_url=memkv_deployment.url, timeout=300,
                        headers={"Authorization": f"Bearer {memkv_deployment.token}"})
    try:
        _wait_healthy({"shared": (proc, port)})
        made = http.post("/v1/engines", json={"url": f"http://127.0.0.1:{port}",
                                              "model": MODEL, "engine_id": "shared",
                                              "tenants": ["*"]})
        assert made.status_code == 201, made.text
        yield memkv_deployment
    finally:
        http.delete("/v1/engines/shared")
        http.close()
        _stop(proc)
        log.close()


@pytest.mark.timeout(600)  # an engine's start and 96 probe pairs: 217 s alone here
def test_a_tenant_cannot_time_another_tenants_prompts_through_a_shared_engine(shared_engine):
    d = shared_engine
    vocab = int(PROBE_MODEL["vocab_size"])
    probe = front_door_probe(d.url, MODEL, victim=d.other_token, attacker=d.token,
                             prompts=PAIRS, tokens=PROBE_TOKENS, vocab=vocab, seed=1)
    control = front_door_probe(d.url, MODEL, victim=d.other_token, attacker=d.token,
                               prompts=CONTROL_PAIRS, tokens=PROBE_TOKENS, vocab=vocab, seed=2,
                               same_tenant=True)
    for result in (probe, control):
        print(f"{result.path}: ROC AUC {result.auc:.3f} (medians {result.positive_ms:.1f} / "
              f"{result.negative_ms:.1f} ms)")
    assert control.auc > MIN_CONTROL_AUC  # the probe works: the victim's own prompts hit
    assert probe.auc <= MAX_AUC, probe
