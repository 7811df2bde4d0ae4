"""helm/memkv: lints, renders, passes the Kubernetes schemas, and carries the values through.

Offline, with no helm binary: helm-python-sdk lints and renders the chart (Helm's
Go code through its C ABI), kubernetes-validate checks the core kinds against the
API schemas, and the RayCluster is checked against the KubeRay fields it uses
(raycluster.schema.json). The rendered memkv.yaml is loaded by memkv itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

CHART = Path(__file__).resolve().parents[2] / "helm" / "memkv"
CI_VALUES = yaml.safe_load((CHART / "ci" / "ci-values.yaml").read_text())
RAYCLUSTER_SCHEMA = json.loads(Path(__file__).with_name("raycluster.schema.json").read_text())
KUBE_VERSION = "1.36.0"
#: Kinds the API schemas know; CRDs (RayCluster, ServiceMonitor) are checked apart.
CORE_KINDS = {
    "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Ingress", "PodDisruptionBudget",
    "Secret", "Service", "ServiceAccount",
}


def render(values: dict | None = None) -> list[dict]:
    chart = helm.Chart.load(CHART)
    manifests = chart.render(values, name="kv", namespace="memkv", is_install=True)
    docs = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = by_kind(docs, kind)
    return doc


@pytest.mark.parametrize("values", [None, CI_VALUES], ids=["default", "ci"])
def test_the_chart_lints_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    errors = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    # "icon is recommended" is the only note, and only informational.
    assert errors == [], errors


@pytest.mark.parametrize("values", [None, CI_VALUES], ids=["default", "ci"])
def test_rendered_manifests_pass_the_kubernetes_and_kuberay_schemas(values):
    docs = render(values)
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "Deployment", "Service", "ConfigMap", "Secret"} <= kinds
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    jsonschema.validate(one(docs, "RayCluster"), RAYCLUSTER_SCHEMA)
    if values is CI_VALUES:
        assert {"Ingress", "HorizontalPodAutoscaler", "ServiceMonitor"} <= kinds


def test_the_rendered_config_is_one_memkv_accepts(tmp_path):
    from memkv.config import load_config

    for values in (None, CI_VALUES):
        config = one(render(values), "ConfigMap")["data"]["memkv.yaml"]
        path = tmp_path / "memkv.yaml"
        path.write_text(config)
        cfg = load_config(path, environ={})
        assert cfg.gateway.host == "0.0.0.0" and cfg.gateway.auth.enabled
        assert str(cfg.gateway.auth.tokens_file) == "/etc/memkv/tokens/tokens.yaml"
        assert cfg.gateway.block_port == 8081
        assert cfg.gateway.workers == 2  # the pod's two requested cores, one event loop each


def test_gateway_workers_are_a_value_and_checked_by_the_schema():
    config = json.loads(one(render({"gateway": {"workers": 4}}), "ConfigMap")["data"]["memkv.yaml"])
    assert config["gateway"]["workers"] == 4
    with pytest.raises(Exception, match="workers"):
        render({"gateway": {"workers": 0}})


def test_engines_and_routing_reach_the_front_door_config(tmp_path):
    from memkv.config import load_config

    values = {"gateway": {
        "engines": [{"url": "http://vllm-0.vllm:8000", "model": "llama", "maxRequests": 8,
                     "tenants": ["acme"]},
                    {"url": "http://vllm-1.vllm:8000", "priorityScheduling": True}],
        "routing": {"spillRequests": 16, "spillKvUse": 0.9}}}
    path = tmp_path / "memkv.yaml"
    path.write_text(one(render(values), "ConfigMap")["data"]["memkv.yaml"])
    gateway = load_config(path, environ={}).gateway
    assert [(e.url, e.model, e.priority_scheduling, e.max_requests) for e in gateway.engines] == [
        ("http://vllm-0.vllm:8000", "llama", False, 8),
        ("http://vllm-1.vllm:8000", None, True, None)]
    assert gateway.engines[0].tenants == ["acme"] and gateway.engines[1].tenants is None
    assert (gateway.routing.spill_requests, gateway.routing.spill_kv_use) == (16, 0.9)
    with pytest.raises(Exception, match="url"):
        render({"gateway": {"engines": [{"model": "llama"}]}})


def test_the_block_port_is_served_beside_http_or_turned_off():
    docs = render(None)
    service = one(docs, "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["blocks"]["port"] == 8081 and ports["blocks"]["targetPort"] == "blocks"
    deployment = one(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "blocks", "containerPort": 8081} in container["ports"]
    off = render({"gateway": {"blockPort": 0}})
    assert [p["name"] for p in one(off, "Service")["spec"]["ports"]] == ["http"]
    config = json.loads(one(off, "ConfigMap")["data"]["memkv.yaml"])
    assert config["gateway"]["block_port"] is None


def test_values_reach_the_manifests():
    docs = render(CI_VALUES)
    cluster = one(docs, "RayCluster")["spec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"gpu", "archive"}  # spare-gpu is disabled
    gpu, archive = groups["gpu"], groups["archive"]
    # GPU count: the pods ask for 2 GPUs, Ray gets 2 and memkv 2 device actors.
    container = gpu["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert gpu["rayStartParams"]["num-gpus"] == "2"
    assert json.loads(json.loads(gpu["rayStartParams"]["resources"])) == {"memkv_device": 2}
    assert (gpu["replicas"], gpu["minReplicas"], gpu["maxReplicas"]) == (2, 1, 6)
    assert json.loads(json.loads(archive["rayStartParams"]["resources"])) == {"memkv_nvme": 1}
    # Tier sizes: into memkv's config, and /dev/shm sized for the warm tiers.
    config = json.loads(one(docs, "ConfigMap")["data"]["memkv.yaml"])
    assert config["device"] == {"hot_capacity_bytes": 4 << 30, "warm_capacity_bytes": 8 << 30}
    assert config["profile"] == "h100"
    (shm,) = [v for v in gpu["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == 2 * (8 << 30) + (1 << 30)
    # Archive storage: hostPath here, mounted where memkv's archive writes.
    (volume,) = archive["template"]["spec"]["volumes"]
    assert volume["hostPath"]["path"] == "/mnt/nvme0/memkv"
    assert config["archive"]["directory"] == "/var/lib/memkv"
    # The archive's host is the Kubernetes node whose disk it writes (the pod's name
    # changes with every restart; an archive refuses a directory of another host).
    env = {e["name"]: e for e in archive["template"]["spec"]["containers"][0]["env"]}
    assert env["MEMKV_HOST_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The token Secret holds the digests given, and the gateway mounts it.
    secret = one(docs, "Secret")
    document = yaml.safe_load(secret["stringData"]["tokens.yaml"])
    assert document["tokens"][0]["tenant"] == "acme" and "token" not in secret["stringData"]
    deployment = one(docs, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tokens"]["secret"]["secretName"] == secret["metadata"]["name"]
    # The HPA owns the replica count; /metrics closed means the scrape carries a token.
    assert "replicas" not in deployment["spec"]
    monitor = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert monitor["authorization"]["credentials"]["name"] == secret["metadata"]["name"]


def test_storage_class_and_generated_token_by_default():
    docs = render({"workerGroups": {"archive": {"storage": {"storageClassName": "local-nvme",
                                                            "size": "500Gi"}}}})
    archive = next(
        g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
        if g["groupName"] == "archive"
    )
    claim = archive["template"]["spec"]["volumes"][0]["ephemeral"]["volumeClaimTemplate"]
    # An ephemeral volume lives and dies with its pod: the pod is its host.
    (env,) = archive["template"]["spec"]["containers"][0]["env"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "500Gi"
    # No tokens given: one is generated, and only its digest goes to the gateway.
    secret = one(docs, "Secret")["stringData"]
    token = secret["token"]
    document = yaml.safe_load(secret["tokens.yaml"])
    assert document["tokens"] == [
        {"sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": "default",
         "roles": ["write", "admin"]}
    ]
    # The gateway probes memkv's health routes and joins the head's GCS.
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "kv-memkv-ray-head-svc.memkv.svc:6379" in container["args"][0]


def test_the_head_can_outlive_its_pod_with_gcs_fault_tolerance():
    # Off by default: nothing asks KubeRay for it, and the head's health checks are
    # the chart's (a lost node noticed in seconds, not Ray's ~30 s).
    cluster = one(render(), "RayCluster")["spec"]
    assert "gcsFaultToleranceOptions" not in cluster
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in head["env"]}
    assert (env["RAY_health_check_period_ms"], env["RAY_health_check_timeout_ms"],
            env["RAY_health_check_failure_threshold"]) == ("1000", "2000", "5")
    cluster = one(render({"gcsFaultTolerance": {
        "enabled": True, "redisAddress": "redis.memkv.svc:6379",
        "redisPasswordSecret": {"name": "redis-auth", "key": "password"}}}), "RayCluster")
    options = cluster["spec"]["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == "redis.memkv.svc:6379"
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth",
                                                                     "key": "password"}
    jsonschema.validate(cluster, RAYCLUSTER_SCHEMA)


def test_worker_groups_can_be_disabled_or_added():
    docs = render({"workerGroups": {
        "gpu": {"disabled": True},
        "l4": {"kind": "device", "gpus": 1, "replicas": 0, "minReplicas": 0, "maxReplicas": 10},
    }})
    groups = {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"archive", "l4"}
    assert groups["l4"]["maxReplicas"] == 10


def test_worker_pods_drain_before_they_stop():
    docs = render({"drain": {"enabled": True, "timeoutSeconds": 120},
                   "memkv": {"config": {"cluster": {"namespace": "kv-prod"}}}})
    for group in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:2] == ["/bin/bash", "-c"]
        assert ("timeout 120 memkv drain self --address auto --namespace kv-prod"
                in hook[2]), hook[2]
        assert "did not finish" in hook[2]  # the outcome is logged either way
        assert pod["terminationGracePeriodSeconds"] == 150
    off = render({"drain": {"enabled": False, "timeoutSeconds": 1}})
    for group in one(off, "RayCluster")["spec"]["workerGroupSpecs"]:
        assert "lifecycle" not in group["template"]["spec"]["containers"][0]
        assert "terminationGracePeriodSeconds" not in group["template"]["spec"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"workerGroups": {"gpu": {"kind": "tpu"}}}, "kind"),
        ({"workerGroups": {"gpu": {"gpus": 0}}}, "gpus"),
        ({"gateway": {"port": 70000}}, "port"),
        ({"auth": {"tokens": [{"sha256": "not-a-digest", "tenant": "t", "roles": ["write"]}]}},
         "sha256"),
        ({"unknownKey": 1}, "unknownKey"),
        ({"drain": {"enabled": True, "timeoutSeconds": 0}}, "timeoutSeconds"),
        ({"gcsFaultTolerance": {"enabled": True}}, "redisAddress"),
        ({"gcsFaultTolerance": {"enabled": True, "redisAddress": "no-port"}}, "redisAddress"),
    ],
)
def test_bad_values_are_refused_by_the_schema(values, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        render(values)
