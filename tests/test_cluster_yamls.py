"""configs/ray-cluster-*.yaml: Ray's own validator, offline, plus memkv's contract.

``prepare_config`` only merges the provider's packaged ``defaults.yaml`` (and, for
the local provider, rewrites the node types); it never calls a cloud API. The
cloud bootstrap that does (``bootstrap_aws`` & co., run by ``ray up``) is not
called here. For AWS the node configs are also checked against EC2's
RunInstances input model that botocore ships, which is offline too.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from memkv.config import ClusterSettings, load_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAMLS = sorted((REPO / "configs").glob("ray-cluster-*.yaml"))
CLUSTER = ClusterSettings()
DEVICE, NVME = CLUSTER.device_resource, CLUSTER.nvme_resource

# GPUs per instance/machine type used in the YAMLs: memkv_device must match it.
GPUS_PER_TYPE = {
    "p4d.24xlarge": 8,
    "p4de.24xlarge": 8,
    "p5.48xlarge": 8,
    "g5.12xlarge": 4,
    "g5.48xlarge": 8,
    "a2-highgpu-1g": 1,
    "a2-highgpu-4g": 4,
    "a2-highgpu-8g": 8,
    "a3-highgpu-8g": 8,
}
_GPU_TYPE = re.compile(r"^(p\d|g\d|a2-|a3-|g2-)")
_URL = re.compile(r"https?://[^\s\"']+")
_PLACEHOLDER_URL = "https://github.com/OWNER/memkv"


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def _machine_type(node_config: dict[str, Any]) -> str:
    return str(node_config.get("InstanceType") or node_config.get("machineType") or "")


def _memkv_up(commands: list[str]) -> list[str]:
    return [c for c in commands if re.search(r"(^|\s)memkv up(\s|$)", c)]


def _all_commands(cfg: dict[str, Any]) -> list[str]:
    keys = (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    )
    out = [c for k in keys for c in cfg.get(k, [])]
    for node_type in cfg.get("available_node_types", {}).values():
        out += node_type.get("worker_setup_commands", [])
    return out


def test_the_expected_yamls_exist() -> None:
    names = {p.name for p in CLUSTER_YAMLS}
    assert {"ray-cluster-aws.yaml", "ray-cluster-local.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_passes_rays_validator(path: Path) -> None:
    raw = _load(path)
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    # Nothing of ours was replaced by the provider defaults.
    assert prepared["head_start_ray_commands"] == raw["head_start_ray_commands"]
    assert prepared["worker_start_ray_commands"] == raw["worker_start_ray_commands"]


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_start_commands_bring_up_memkv_after_ray(path: Path) -> None:
    cfg = _load(path)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        commands = cfg[key]
        ups = _memkv_up(commands)
        assert ups, f"{key} never runs `memkv up`"
        first_up = commands.index(ups[0])
        assert any("ray start" in c for c in commands[:first_up]), f"{key}: memkv up before ray"
        for command in ups:
            args = shlex.split(command.split("memkv up", 1)[1].split(">", 1)[0])
            assert args[args.index("--address") + 1] == "auto"
            config_path = args[args.index("--config") + 1]
            _assert_mounted_config(cfg, config_path)
            if "--profile" in args:
                # The profile named must be one the shipped config defines.
                load_config(profile=args[args.index("--profile") + 1], environ={})


def _assert_mounted_config(cfg: dict[str, Any], remote: str) -> None:
    """``remote`` lies under a file mount whose local side holds the shipped memkv.yaml."""
    for target, source in cfg["file_mounts"].items():
        target = target.rstrip("/")
        if remote == target or remote.startswith(target + "/"):
            local = REPO / source / remote[len(target) :].lstrip("/")
            assert local.resolve() == (REPO / "configs" / "memkv.yaml").resolve(), local
            return
    pytest.fail(f"--config {remote} is not under any file_mounts target")


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_node_types_advertise_memkv_resources(path: Path) -> None:
    cfg = _load(path)
    if cfg["provider"]["type"] == "local":
        # One node type: each node computes its resources in `ray start --resources`.
        for key in ("head_start_ray_commands", "worker_start_ray_commands"):
            starts = [c for c in cfg[key] if "ray start" in c]
            assert starts, key
            for command in starts:
                assert f'\\"{DEVICE}\\"' in command and f'\\"{NVME}\\"' in command, command
        return
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get(DEVICE, 0) == 0, "the head runs the router and gateway only"
    gpu_types = [t for t in types.values() if _GPU_TYPE.match(_machine_type(t["node_config"]))]
    assert gpu_types, "no GPU worker type"
    for node_type in gpu_types:
        machine = _machine_type(node_type["node_config"])
        assert machine in GPUS_PER_TYPE, f"add {machine}'s GPU count to GPUS_PER_TYPE"
        assert node_type["resources"].get(DEVICE) == GPUS_PER_TYPE[machine], machine
        assert node_type.get("min_workers", 0) >= 1
    archive_types = [t for t in types.values() if NVME in t["resources"]]
    assert archive_types, "no archive (NVMe) worker type"
    for node_type in archive_types:
        assert node_type["resources"][NVME] == 1, "one archive actor per node"
    assert all(DEVICE not in t["resources"] for t in archive_types)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_every_node_installs_memkv_and_gpu_nodes_the_gpu_extra(path: Path) -> None:
    cfg = _load(path)
    common = cfg["setup_commands"]
    assert any("pip install" in c and "memkv" in c for c in common)
    for node_type in cfg.get("available_node_types", {}).values():
        # A node type's own list replaces the common one: it must install memkv itself.
        own = node_type.get("worker_setup_commands")
        if own is not None:
            assert any("pip install" in c and "memkv" in c for c in own)
        if _GPU_TYPE.match(_machine_type(node_type["node_config"])):
            assert own is not None and any("memkv[gpu]" in c for c in own)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_data_dir_is_the_same_nvme_path_everywhere(path: Path) -> None:
    cfg = _load(path)
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    dirs = {m for c in starts for m in re.findall(r"MEMKV_DATA_DIR=(\S+)", c)}
    assert dirs == {"/mnt/nvme/memkv"}
    # The setup makes that directory exist on every node.
    assert any("/mnt/nvme/memkv" in c for c in cfg["setup_commands"])


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_the_head_ships_health_checks_that_notice_a_lost_node_in_seconds(path: Path) -> None:
    # Ray's defaults take ~30 s to declare a node dead (57 s for a partition on the
    # namespace hosts); the GCS on the head reads these at start.
    (head,) = [c for c in _load(path)["head_start_ray_commands"] if "ray start --head" in c]
    words = shlex.split(head.split("ray start --head")[0].split(";")[-1])
    env = dict(w.split("=", 1) for w in words if "=" in w)
    period, timeout, misses = (int(env[f"RAY_health_check_{k}"])
                               for k in ("period_ms", "timeout_ms", "failure_threshold"))
    assert period * misses + timeout <= 10_000


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_commands_are_valid_bash(path: Path) -> None:
    for command in _all_commands(_load(path)):
        result = subprocess.run(
            ["bash", "-n", "-c", command], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, f"{command!r}: {result.stderr}"


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_no_real_hosts_beyond_the_placeholder(path: Path) -> None:
    urls = _URL.findall(path.read_text())
    assert urls, "memkv is installed from the placeholder git URL"
    assert all(u.startswith(_PLACEHOLDER_URL) for u in urls), urls


def test_aws_node_configs_match_ec2_run_instances() -> None:
    botocore_session = pytest.importorskip("botocore.session")
    from botocore.validate import ParamValidator

    shape = (
        botocore_session.get_session()
        .get_service_model("ec2")
        .operation_model("RunInstances")
        .input_shape
    )
    instance_types = set(shape.members["InstanceType"].enum)
    cfg = _load(REPO / "configs" / "ray-cluster-aws.yaml")
    for name, node_type in cfg["available_node_types"].items():
        node_config = node_type["node_config"]
        assert node_config["InstanceType"] in instance_types, name
        # Ray adds MinCount/MaxCount itself when it launches a node.
        report = ParamValidator().validate({**node_config, "MinCount": 1, "MaxCount": 1}, shape)
        assert not report.has_errors(), f"{name}: {report.generate_report()}"


# -- the validator really rejects broken files --------------------------------------------------


def _aws() -> dict[str, Any]:
    return _load(REPO / "configs" / "ray-cluster-aws.yaml")


def test_unknown_top_level_key_fails() -> None:
    broken = _aws()
    broken["head_start_commands"] = ["memkv up"]  # typo of head_start_ray_commands
    with pytest.raises(jsonschema.ValidationError, match="head_start_commands"):
        validate_config(prepare_config(broken))


def test_misspelt_node_type_field_fails() -> None:
    broken = _aws()
    gpu = broken["available_node_types"]["memkv.gpu"]
    gpu["resource"] = gpu.pop("resources")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_non_integer_resource_fails() -> None:
    broken = _aws()
    broken["available_node_types"]["memkv.gpu"]["resources"][DEVICE] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_min_workers_beyond_max_workers_fails() -> None:
    broken = _aws()
    broken["max_workers"] = 1
    with pytest.raises(ValueError, match="max_workers"):
        validate_config(prepare_config(broken))


def test_broken_start_command_fails_the_bash_check() -> None:
    result = subprocess.run(
        ["bash", "-n", "-c", "if true; then memkv up"], capture_output=True, check=False
    )
    assert result.returncode != 0


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_memkv_up_commands_parse_with_the_real_cli(path: Path) -> None:
    import typer

    from memkv.cli import app

    command = typer.main.get_command(app)
    cfg = _load(path)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for line in _memkv_up(cfg[key]):
            args = shlex.split(line.split("memkv up", 1)[1].split(">", 1)[0].split("&", 1)[0])
            args = [a.replace("~", "/home/ray") for a in args]
            up = command.commands["up"]  # type: ignore[attr-defined]
            # --config must exist to parse; check the flags and values without it.
            flags = [a for a in args if a.startswith("--")]
            assert set(flags) <= {p.opts[0] for p in up.params} | {"--no-gateway"}, flags
            # The head serves the gateway; worker nodes must return (no gateway).
            assert ("--no-gateway" in args) == (key == "worker_start_ray_commands"), line
