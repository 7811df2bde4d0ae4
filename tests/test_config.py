"""memkv/config.py: loading, profiles, environment overrides, validation, round trips,
and the shipped YAML (identical copies, defaults, every field documented)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from memkv.config import (
    GIB,
    ArchiveSettings,
    DeviceSettings,
    MemkvConfig,
    dump_config,
    load_config,
    packaged_config_path,
)
from memkv.errors import ConfigError
from memkv.storage.config import MIB, UNIT_PROFILES, ArchiveConfig
from memkv.storage.owned_dir import resolve_on_node
from memkv.storage.precision import PrecisionPolicy, StoredPrecision
from memkv.store import TieredStore

REPO = Path(__file__).resolve().parents[1]
ROOT_CONFIG = REPO / "configs" / "memkv.yaml"
NO_ENV: dict[str, str] = {}


def _write(tmp_path: Path, data: Any, name: str = "memkv.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False) if not isinstance(data, str) else data)
    return path


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= _leaf_paths(ann, f"{prefix}{name}.")
        else:
            out.add(f"{prefix}{name}")
    return out


# -- defaults and the shipped file ---------------------------------------------------------


def test_defaults_load_and_equal_the_model_defaults() -> None:
    cfg = load_config(environ=NO_ENV)
    assert cfg == MemkvConfig()
    assert cfg.profile == "default"
    assert cfg.device.hot_capacity_bytes == cfg.device.warm_capacity_bytes == "auto"
    assert cfg.device.allocator.min_unit_bytes == 4 * MIB
    assert cfg.gateway.port == 8080
    assert cfg.archive.directory == Path("$MEMKV_DATA_DIR/archive")


def test_root_config_is_the_packaged_config() -> None:
    assert packaged_config_path().read_bytes() == ROOT_CONFIG.read_bytes()


def test_shipped_base_values_are_the_model_defaults() -> None:
    doc = yaml.safe_load(ROOT_CONFIG.read_text())
    expected = dump_config(MemkvConfig())
    for section in ("device", "archive", "router", "cluster", "gateway"):
        assert doc[section] == expected[section], section
    assert doc["profile"] == "default"


def test_shipped_yaml_documents_every_field() -> None:
    """Every key of the base sections has a comment on its line or just above it."""
    documented: set[str] = set()
    present: set[str] = set()
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in ROOT_CONFIG.read_text().splitlines():
        if line.startswith("profiles:"):
            break
        match = re.match(r"^(\s*)([a-z_0-9]+):(.*)$", line)
        if match:
            indent, key, rest = len(match[1]), match[2], match[3]
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([*(k for _, k in stack), key])
            stack.append((indent, key))
            present.add(path)
            inline = "#" in rest
            above = previous.strip().startswith("#") and (
                len(previous) - len(previous.lstrip()) == indent
            )
            if inline or above:
                documented.add(path)
        if line.strip():
            previous = line
    fields = _leaf_paths(MemkvConfig)
    assert fields <= present, f"fields missing from the YAML: {sorted(fields - present)}"
    sections = {p.rsplit(".", 1)[0] for p in fields if "." in p}
    assert fields | sections <= documented, sorted((fields | sections) - documented)


# -- profiles --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "unit"), [("default", 4 * MIB), ("a100", 4 * MIB), ("h100", 8 * MIB), ("edge", MIB)]
)
def test_profile_units(profile: str, unit: int) -> None:
    cfg = load_config(profile=profile, environ=NO_ENV)
    assert cfg.profile == profile
    assert cfg.device.allocator.min_unit_bytes == unit == UNIT_PROFILES[profile]


def test_profile_tier_sizes() -> None:
    # The default sizes itself from free memory; the hardware profiles are explicit.
    sizes = {p: load_config(profile=p, environ=NO_ENV).device for p in ("edge", "a100", "h100")}
    assert sizes["edge"].hot_capacity_bytes == 256 * MIB
    assert sizes["edge"].warm_capacity_bytes == 512 * MIB
    order = ["edge", "a100", "h100"]
    for small, big in zip(order, order[1:], strict=False):
        assert sizes[small].hot_capacity_bytes < sizes[big].hot_capacity_bytes
        assert sizes[small].warm_capacity_bytes < sizes[big].warm_capacity_bytes


def test_profile_merges_deeply_over_the_base() -> None:
    cfg = load_config(profile="edge", environ=NO_ENV)
    assert cfg.device.prefetch.max_prefetch_blocks == 4
    # Fields of the same sub-model that the profile does not name keep the base value.
    assert cfg.device.prefetch.lookahead_window == 5
    assert cfg.device.eviction.k == 3


def test_profile_precedence(tmp_path: Path) -> None:
    path = _write(tmp_path, {"profile": "edge"})
    assert load_config(path, environ=NO_ENV).profile == "edge"
    env = {"MEMKV_PROFILE": "a100"}
    assert load_config(path, environ=env).profile == "a100"
    assert load_config(path, profile="h100", environ=env).profile == "h100"


def test_unknown_profile() -> None:
    with pytest.raises(ConfigError, match=r"unknown profile 'h200'.*'a100', 'default'"):
        load_config(profile="h200", environ=NO_ENV)
    with pytest.raises(ConfigError, match=r"MEMKV_PROFILE"):
        load_config(environ={"MEMKV_PROFILE": "nope"})


def test_user_file_gets_packaged_profiles_and_may_replace_or_add(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {
            "profile": "h100",
            "gateway": {"port": 9100},
            "profiles": {"edge": {"gateway": {"port": 9200}}, "lab": {"router": {"k": 1}}},
        },
    )
    with pytest.raises(ConfigError, match=r"profiles\.lab: unknown key 'router\.k'"):
        load_config(path, environ=NO_ENV)
    path = _write(
        tmp_path,
        {
            "profile": "h100",
            "gateway": {"port": 9100},
            "profiles": {
                "edge": {"gateway": {"port": 9200}},
                "lab": {"router": {"hotness_half_life_s": 5}},
            },
        },
    )
    h100 = load_config(path, environ=NO_ENV)
    assert h100.device.allocator.min_unit_bytes == 8 * MIB  # packaged profile
    assert h100.gateway.port == 9100  # the file's base
    edge = load_config(path, profile="edge", environ=NO_ENV)
    assert edge.gateway.port == 9200
    # The file's edge replaces the packaged one: its 1 MiB unit is gone.
    assert edge.device.allocator.min_unit_bytes == 4 * MIB
    assert load_config(path, profile="lab", environ=NO_ENV).router.hotness_half_life_s == 5


# -- environment and explicit overrides -----------------------------------------------------------


def test_env_overrides_are_typed_and_nested(tmp_path: Path) -> None:
    env = {
        "MEMKV_GATEWAY__PORT": "9000",
        "MEMKV_DEVICE__ALLOCATOR__MIN_UNIT_BYTES": str(8 * MIB),
        "MEMKV_DEVICE__EVICTION__PREFIX_AWARE": "false",
        "MEMKV_ARCHIVE__CAPACITY_BYTES": "1000000",
        "MEMKV_DEVICE__DEVICE": "cuda:1",
        "MEMKV_GATEWAY__HOST": "0.0.0.0",
        "MEMKV_UNRELATED": "ignored: no double underscore",
        "PATH": "/bin",
    }
    cfg = load_config(environ=env)
    assert cfg.gateway.port == 9000
    assert cfg.device.allocator.min_unit_bytes == 8 * MIB
    assert cfg.device.eviction.prefix_aware is False
    assert cfg.archive.capacity_bytes == 1_000_000
    assert cfg.device.device == "cuda:1"
    assert cfg.gateway.host == "0.0.0.0"
    assert (
        load_config(environ={"MEMKV_ARCHIVE__CAPACITY_BYTES": "null"}).archive.capacity_bytes
        is None
    )


def test_env_beats_profile_and_overrides_beat_env() -> None:
    env = {"MEMKV_DEVICE__HOT_CAPACITY_BYTES": str(3 * GIB)}
    cfg = load_config(profile="h100", environ=env)
    assert cfg.device.hot_capacity_bytes == 3 * GIB
    assert cfg.device.allocator.min_unit_bytes == 8 * MIB
    cfg = load_config(
        profile="h100", environ=env, overrides={"device": {"hot_capacity_bytes": 5 * GIB}}
    )
    assert cfg.device.hot_capacity_bytes == 5 * GIB


def test_data_dir_is_resolved_where_the_archive_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loading process's $MEMKV_DATA_DIR is not baked into the config: every node's
    # archive resolves it from its own environment (a head's path on every host put
    # all archives under the head's disk).
    cfg = load_config(environ={"MEMKV_DATA_DIR": "/head/only"})
    assert cfg.archive.directory == Path("$MEMKV_DATA_DIR/archive")
    monkeypatch.setenv("MEMKV_DATA_DIR", str(tmp_path))
    assert resolve_on_node(cfg.archive.archive_config().directory) == tmp_path / "archive"
    # An explicit directory is taken as written.
    env = {"MEMKV_DATA_DIR": str(tmp_path), "MEMKV_ARCHIVE__DIRECTORY": str(tmp_path / "x")}
    assert load_config(environ=env).archive.directory == tmp_path / "x"


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMKV_GATEWAY__PORT", "9443")
    monkeypatch.setenv("MEMKV_PROFILE", "edge")
    cfg = load_config()
    assert (cfg.gateway.port, cfg.profile) == (9443, "edge")


@settings(max_examples=40, deadline=None)
@given(port=st.integers(min_value=1, max_value=65535), half_life=st.floats(0.001, 1e6))
def test_env_values_parse_like_yaml(port: int, half_life: float) -> None:
    env = {"MEMKV_GATEWAY__PORT": str(port),
           "MEMKV_ROUTER__HOTNESS_HALF_LIFE_S": repr(half_life)}
    cfg = load_config(environ=env)
    assert cfg.gateway.port == port
    assert cfg.router.hotness_half_life_s == half_life


def test_malformed_env_names() -> None:
    with pytest.raises(ConfigError, match=r"MEMKV_GATEWAY____PORT.*MEMKV_<SECTION>__<FIELD>"):
        load_config(environ={"MEMKV_GATEWAY____PORT": "1"})
    with pytest.raises(
        ConfigError, match=r"MEMKV_GATEWAY__PROT: unknown key 'gateway\.prot'.*'port'"
    ):
        load_config(environ={"MEMKV_GATEWAY__PROT": "1"})
    with pytest.raises(ConfigError, match=r"MEMKV_WEB__PORT: unknown key 'web'.*'gateway'"):
        load_config(environ={"MEMKV_WEB__PORT": "1"})


# -- unknown keys and bounds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "pattern"),
    [
        ({"gateways": {}}, r"unknown key 'gateways'; valid keys: \['archive', 'cluster'"),
        (
            {"device": {"allocator": {"min_unit": 1}}},
            r"unknown key 'device\.allocator\.min_unit'; valid keys under "
            r"'device\.allocator': \['min_unit_bytes'\]",
        ),
        ({"device": {"eviction": {"K": 2}}}, r"unknown key 'device\.eviction\.K'.*'k'"),
        (
            {"profiles": {"x": {"gateway": {"prot": 1}}}},
            r"profiles\.x: unknown key 'gateway\.prot'",
        ),
        ({"profiles": {"x": {"profile": "y"}}}, r"profiles\.x: unknown key 'profile'"),
    ],
)
def test_unknown_keys_in_files(tmp_path: Path, doc: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(_write(tmp_path, doc), environ=NO_ENV)


def test_unknown_keys_in_overrides() -> None:
    with pytest.raises(ConfigError, match=r"overrides: unknown key 'router\.placment'"):
        load_config(overrides={"router": {"placment": "x"}}, environ=NO_ENV)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"gateway": {"port": -1}}, r"gateway\.port: Input should be greater than or equal to 0"),
        ({"gateway": {"port": 65536}}, r"gateway\.port"),
        ({"gateway": {"max_body_bytes": 0}}, r"gateway\.max_body_bytes"),
        ({"device": {"hot_capacity_bytes": 0}}, r"device\.hot_capacity_bytes"),
        ({"device": {"warm_capacity_bytes": MIB}}, r"warm_capacity_bytes .* allocator unit"),
        ({"device": {"allocator": {"min_unit_bytes": 3 * MIB}}}, r"power of two"),
        ({"device": {"eviction": {"k": 0}}}, r"device\.eviction\.k"),
        ({"device": {"prefetch": {"prefetch_threshold": 1.5}}}, r"prefetch_threshold"),
        ({"device": {"device": "gpu0"}}, r"'auto', 'cpu' or 'cuda:N'"),
        ({"device": {"codecs": {"cold_codec": "brotli"}}}, r"cold_codec.*'zstd'"),
        ({"device": {"codecs": {"warm_codec": "delta_rl"}}}, r"warm_codec must be lossless"),
        ({"device": {"precision": {"later_dtype": "int4"}}}, r"later_dtype"),
        ({"archive": {"compact_garbage_ratio": 0}}, r"archive\.compact_garbage_ratio"),
        ({"archive": {"fsync": "sometimes"}}, r"archive\.fsync"),
        ({"archive": {"capacity_bytes": -1}}, r"archive\.capacity_bytes"),
        ({"archive": {"compact_interval_s": 0}}, r"archive\.compact_interval_s"),
        ({"router": {"hotness_half_life_s": 0}}, r"router\.hotness_half_life_s"),
        # Knobs that never did anything are gone, and named as unknown.
        ({"router": {"placement": "least_loaded"}}, r"router\.placement"),
        ({"router": {"high_priority_hot_share": 0.5}}, r"router\.high_priority_hot_share"),
        ({"cluster": {"embedded_object_store_bytes": MIB}}, r"embedded_object_store_bytes"),
        ({"cluster": {"embedded_devices": 0}}, r"cluster\.embedded_devices"),
        ({"cluster": {"devices_per_node": 0}}, r"cluster\.devices_per_node"),
        ({"cluster": {"nvme_resource": "memkv_device"}}, r"must differ"),
        ({"cluster": {"device_resource": "my device"}}, r"cluster\.device_resource"),
        ({"cluster": {"namespace": ""}}, r"cluster\.namespace"),
        ({"cluster": {"embedded_resources": {"a b": 1}}}, r"embedded_resources name"),
        ({"cluster": {"embedded_resources": {"extra": 0}}}, r"embedded_resources\['extra'\]"),
        ({"cluster": {"embedded_resources": {"memkv_nvme": 2}}}, r"own resources"),
    ],
)
def test_bounds_enforced(overrides: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=overrides, environ=NO_ENV)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("- a\n- b\n", r"must hold a mapping, got list"),
        ("device: [unclosed\n", r"not valid YAML"),
        ("profiles: [a]\n", r"'profiles' must map"),
        ("profiles:\n  x: 3\n", r"profiles\.x must be a mapping"),
        ("profile: 7\n", r"'profile' must be a profile name"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(_write(tmp_path, text), environ=NO_ENV)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope\.yaml"):
        load_config(tmp_path / "nope.yaml", environ=NO_ENV)


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, ""), environ=NO_ENV) == MemkvConfig()


def test_configs_are_frozen() -> None:
    cfg = load_config(environ=NO_ENV)
    with pytest.raises(ValidationError):
        cfg.gateway.port = 1  # type: ignore[misc]


# -- round trips and "auto" -------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["default", "a100", "h100", "edge"])
def test_dump_round_trips_through_a_file(tmp_path: Path, profile: str) -> None:
    # The env override collides with a field the profile sets: a naive dump would lose it.
    env = {"MEMKV_DEVICE__HOT_CAPACITY_BYTES": str(3 * GIB), "MEMKV_DATA_DIR": str(tmp_path)}
    cfg = load_config(profile=profile, environ=env)
    dumped = dump_config(cfg)
    assert isinstance(dumped["archive"]["directory"], str)
    again = load_config(_write(tmp_path, dumped, "dump.yaml"), environ=NO_ENV)
    assert again == cfg
    assert MemkvConfig.model_validate(cfg.model_dump()) == cfg


def test_later_dtype_auto(tmp_path: Path) -> None:
    cfg = load_config(environ=NO_ENV)
    assert cfg.device.precision.later_dtype == "auto"
    # auto: a bf16 model stays bf16 (fp16 could overflow); fp32 drops to fp16.
    assert PrecisionPolicy(cfg.device.precision, "bfloat16").later_dtype is StoredPrecision.BFLOAT16
    assert PrecisionPolicy(cfg.device.precision, "float32").later_dtype is StoredPrecision.FLOAT16
    forced = load_config(environ={"MEMKV_DEVICE__PRECISION__LATER_DTYPE": "float16"})
    assert (
        PrecisionPolicy(forced.device.precision, "bfloat16").later_dtype is StoredPrecision.FLOAT16
    )
    again = load_config(_write(tmp_path, dump_config(forced)), environ=NO_ENV)
    assert again.device.precision.later_dtype == "float16"


# -- building the storage configs ---------------------------------------------------------------


def test_resolve_device() -> None:
    auto = DeviceSettings()
    assert auto.resolve_device(None) == "cpu"
    assert auto.resolve_device(0) == "cuda:0"
    assert DeviceSettings(device="cpu").resolve_device(0) == "cpu"
    assert DeviceSettings(device="cuda:3").resolve_device(None) == "cuda:3"
    with pytest.raises(ConfigError, match="local_gpu"):
        auto.resolve_device(-1)


def test_store_config_wiring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMKV_DATA_DIR", str(tmp_path))
    cfg = load_config(
        profile="edge",
        environ={"MEMKV_DATA_DIR": str(tmp_path), "MEMKV_ARCHIVE__CAPACITY_BYTES": str(GIB)},
    )
    store = cfg.store_config(device="cpu", archive_subdir="device-0")
    assert store.device == "cpu"
    assert store.hot_capacity_bytes == 256 * MIB
    assert store.allocator.min_unit_bytes == MIB
    assert store.cold_capacity_bytes == GIB
    assert store.prefetch == cfg.device.prefetch
    assert resolve_on_node(store.archive.directory) == tmp_path / "archive" / "device-0"
    assert store.archive.segment_max_bytes == cfg.archive.segment_max_bytes == 64 * MIB
    with pytest.raises(ConfigError, match="concrete device"):
        cfg.store_config(device="auto")


@pytest.mark.parametrize("subdir", ["", "..", "a/b", "/abs", "."])
def test_archive_subdir_must_be_one_component(subdir: str) -> None:
    with pytest.raises(ConfigError, match="single plain path component"):
        ArchiveSettings().archive_config(subdir)


def test_archive_defaults_follow_the_storage_engine() -> None:
    built = ArchiveSettings().archive_config()
    assert built.directory == Path("$MEMKV_DATA_DIR/archive")
    reference = ArchiveConfig(directory=built.directory)
    assert built == reference


def test_a_store_opens_from_a_loaded_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMKV_DATA_DIR", str(tmp_path))  # the opening process's own
    cfg = load_config(
        profile="edge",
        overrides={"device": {"hot_capacity_bytes": 4 * MIB, "warm_capacity_bytes": 4 * MIB}},
    )
    with TieredStore(cfg.store_config(device="cpu", archive_subdir="dev0")) as store:
        stats = store.stats()
        assert stats.sessions == 0
    assert (tmp_path / "archive" / "dev0").is_dir()
