"""Loading a :class:`~memkv.config.schema.MemkvConfig`: the packaged YAML, a profile,
the environment and explicit overrides, merged in that order; unknown keys and bad
values named with where they came from."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ValidationError

from memkv.config.schema import (
    _PROFILE_NAME_RE,
    DEFAULT_DATA_DIR,
    DEFAULT_PROFILE,
    MemkvConfig,
    _format_errors,
)
from memkv.errors import ConfigError
from memkv.storage import owned_dir

#: Environment variables of the form MEMKV_<SECTION>__<FIELD> override fields.
ENV_PREFIX: Final = "MEMKV_"
# Double underscore separates nesting levels: field names themselves contain "_".
_ENV_NESTING: Final = "__"
#: Root of a node's local data (the archive lives in its ``archive`` subdirectory),
#: read on the node that uses it.
DATA_DIR_ENV: Final = owned_dir.DATA_DIR_ENV
#: Picks the profile when ``load_config`` gets none.
PROFILE_ENV: Final = "MEMKV_PROFILE"


# The default YAML ships inside the package so an installed memkv finds it
# without a checkout; configs/memkv.yaml at the repo root is a byte-identical
# copy for `ray up` file mounts (a test keeps the two equal).
_PACKAGE: Final = "memkv"
_PACKAGED_CONFIG: Final = ("configs", "memkv.yaml")




# Top-level sections of a config document (everything but the bookkeeping keys).
_SECTIONS: Final = tuple(name for name in MemkvConfig.model_fields if name != "profile")
_DOC_KEYS: Final = ("profile", "profiles", *_SECTIONS)


def packaged_config_path() -> Path:
    """Path of the default YAML shipped inside the package.

    Raises:
        ConfigError: the file is missing (an install without package data).
    """
    traversable = resources.files(_PACKAGE)
    for part in _PACKAGED_CONFIG:
        traversable = traversable.joinpath(part)
    path = Path(str(traversable))
    if not path.is_file():
        raise ConfigError(
            f"the packaged default config {path} is missing; reinstall memkv with its "
            "package data, or pass a config path"
        )
    return path


def load_config(
    path: str | Path | None = None,
    *,
    profile: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> MemkvConfig:
    """Load, merge and validate a memkv configuration (precedence: module docstring).

    Args:
        path: a YAML config file; None = the packaged default.
        profile: profile to apply; None = ``$MEMKV_PROFILE``, else the file's
            ``profile:`` key, else ``default``.
        overrides: nested section -> field -> value mapping merged last.
        environ: the environment to read ``MEMKV_*`` from; None = ``os.environ``.

    Returns:
        The validated, frozen config; its ``profile`` names the profile applied.

    Raises:
        ConfigError: unreadable or malformed file, unknown profile, unknown key
            (named with its path and source, and the valid keys), or a value
            out of bounds.
    """
    env = os.environ if environ is None else environ
    packaged_source = packaged_config_path()
    packaged = _read_document(packaged_source)
    if path is None:
        doc, source = packaged, str(packaged_source)
    else:
        source = str(path)
        doc = _read_document(Path(path).expanduser())

    profiles = {**packaged.get("profiles", {}), **doc.get("profiles", {})}
    name = profile or env.get(PROFILE_ENV) or doc.get("profile") or DEFAULT_PROFILE
    if not isinstance(name, str) or name not in profiles:
        raise ConfigError(
            f"unknown profile {name!r} (from {_profile_source(profile, env, doc)}); "
            f"expected one of {sorted(profiles)}"
        )

    merged = {key: copy.deepcopy(value) for key, value in doc.items() if key in _SECTIONS}
    layers: list[tuple[Mapping[str, Any], str]] = [
        (profiles[name], f"{source} profiles.{name}"),
        *_env_layers(env),
    ]
    if overrides is not None:
        layers.append((overrides, "overrides"))
    for layer, layer_source in layers:
        _check_sections(layer, layer_source)
        merged = _deep_merge(merged, layer)
    merged["profile"] = name
    # A bad value may come from any layer: name them all (the checks above named keys exactly).
    applied = [f"{source} with profile {name!r}", *(s for _, s in layers[1:])]
    return _validate(merged, " + ".join(applied))


def dump_config(config: MemkvConfig) -> dict[str, Any]:
    """A plain, YAML/JSON-friendly dict of ``config`` that loads back to the same config.

    Paths become strings. The dict carries ``profile`` and redefines that
    profile as empty (``profiles: {name: {}}``): its values already include the
    profile, and re-applying it on load would undo later overrides of fields
    the profile sets.

    Args:
        config: the config to dump.

    Returns:
        ``{"profile": ..., "profiles": {profile: {}}, "device": {...}, ...}``;
        ``load_config`` of a YAML file holding it gives back ``config``.
    """
    data: dict[str, Any] = config.model_dump(mode="json")
    data["profiles"] = {config.profile: {}}
    return data


# -- loading helpers ---------------------------------------------------------------------------


def _read_document(path: Path) -> dict[str, Any]:
    """Parse a config file and check its shape (not yet its values)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(doc).__name__}")
    _check_keys(doc, _DOC_KEYS, "", str(path))
    _check_sections({k: v for k, v in doc.items() if k in _SECTIONS}, str(path))
    profiles = doc.get("profiles", {})
    if profiles is None:
        profiles = doc["profiles"] = {}
    if not isinstance(profiles, dict):
        raise ConfigError(f"{path}: 'profiles' must map profile names to overrides")
    for name, body in profiles.items():
        if body is None:
            profiles[name] = body = {}
        if not isinstance(name, str) or not _PROFILE_NAME_RE.match(name):
            raise ConfigError(
                f"{path}: profile names must be plain names like 'h100'; got {name!r}"
            )
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: profiles.{name} must be a mapping of sections")
        _check_sections(body, f"{path} profiles.{name}")
    chosen = doc.get("profile")
    if chosen is not None and not isinstance(chosen, str):
        raise ConfigError(f"{path}: 'profile' must be a profile name, got {chosen!r}")
    return doc


def _check_keys(data: Mapping[str, Any], valid: Sequence[str], where: str, source: str) -> None:
    for key in data:
        if key not in valid:
            at = f"{where}.{key}" if where else str(key)
            raise ConfigError(
                f"{source}: unknown key {at!r}; valid keys"
                f"{' under ' + repr(where) if where else ''}: {sorted(valid)}"
            )


def _check_sections(data: Mapping[str, Any], source: str) -> None:
    """Reject unknown keys of a partial config (sections and their fields), recursively."""
    _check_keys(data, _SECTIONS, "", source)
    for key, value in data.items():
        _check_model_keys(value, MemkvConfig.model_fields[key].annotation, key, source)


def _check_model_keys(value: Any, annotation: Any, where: str, source: str) -> None:
    # Only mappings meant for a nested model are walked; a wrong type is pydantic's to report.
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return
    if not isinstance(value, Mapping):
        return
    fields = annotation.model_fields
    _check_keys(value, tuple(fields), where, source)
    for key, inner in value.items():
        _check_model_keys(inner, fields[key].annotation, f"{where}.{key}", source)


def _env_layers(env: Mapping[str, str]) -> list[tuple[dict[str, Any], str]]:
    """Overrides from the environment, as (partial config, source) in merge order."""
    layers: list[tuple[dict[str, Any], str]] = []
    # ($MEMKV_DATA_DIR is not read here: paths under it are resolved on the node that
    # uses them, from that node's environment; see memkv.storage.owned_dir.)
    # Sorted so that the merge (and any error) does not depend on the environment's order.
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or _ENV_NESTING not in var:
            continue
        parts = var[len(ENV_PREFIX) :].lower().split(_ENV_NESTING)
        if any(not part for part in parts):
            raise ConfigError(
                f"environment variable {var}: expected MEMKV_<SECTION>__<FIELD>, "
                "e.g. MEMKV_GATEWAY__PORT"
            )
        value: Any = _parse_env_value(env[var])
        for part in reversed(parts):
            value = {part: value}
        layers.append((value, f"environment variable {var}"))
    return layers


def _parse_env_value(raw: str) -> Any:
    # YAML scalars, as in the file: "9000" -> 9000, "true" -> True, "null" -> None.
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in: mappings recursively, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _profile_source(profile: str | None, env: Mapping[str, str], doc: Mapping[str, Any]) -> str:
    if profile:
        return "the profile argument"
    if env.get(PROFILE_ENV):
        return f"${PROFILE_ENV}"
    return "the file's 'profile' key" if doc.get("profile") else "the default"


def _validate(data: dict[str, Any], source: str) -> MemkvConfig:
    try:
        return MemkvConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid config ({source}): {_format_errors(e)}") from e


def data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Root of local data: ``$MEMKV_DATA_DIR``, else ``~/.cache/memkv`` (``~`` expanded)."""
    env = os.environ if environ is None else environ
    return Path(env.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR).expanduser()
