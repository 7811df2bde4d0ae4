"""One validated, typed, frozen configuration of a memkv deployment.

The storage engine has one settings class per component
(:mod:`memkv.storage.config`); this module groups them per *process role* of a
deployment — a device actor, an archive actor, the router, the cluster
bootstrap, the gateway — and loads them from YAML.

Where values come from, lowest precedence first:

1. the field defaults of the models below;
2. the base sections of the YAML file (``path``, else the packaged
   ``memkv/configs/memkv.yaml``, which equals the defaults and documents every
   field);
3. the selected **profile**: ``profiles.<name>`` of the file, deep-merged over
   its base. The packaged profiles (``default``, ``a100``, ``h100``, ``edge``)
   are always available; a profile of the same name in your own file replaces
   the packaged one. The name comes from the ``profile`` argument, else
   ``$MEMKV_PROFILE``, else the file's ``profile:`` key, else ``default``;
4. the environment: ``MEMKV_<SECTION>__<FIELD>[__<FIELD>…]``
   variables, e.g. ``MEMKV_GATEWAY__PORT=9000`` or
   ``MEMKV_DEVICE__ALLOCATOR__MIN_UNIT_BYTES=8388608``; values are parsed as
   YAML scalars, as in the file (``null`` for None);
5. the ``overrides`` argument (explicit arguments beat the environment).

``$MEMKV_DATA_DIR`` (a node's root of local data, ``~/.cache/memkv`` where
unset) is not read when loading: paths written with it (the default
``archive.directory`` is ``$MEMKV_DATA_DIR/archive``) are resolved on the node
that opens them, so each host's archive writes where its own host says.

Unknown keys anywhere raise :class:`~memkv.errors.ConfigError` naming the key
path, where it came from and the valid keys; so does every value pydantic
rejects.

Example:
    >>> cfg = load_config(profile="h100", environ={})
    >>> cfg.device.allocator.min_unit_bytes == 8 * MIB
    True

The models are in :mod:`memkv.config.schema`, the loading in :mod:`memkv.config.loading`.
"""

from __future__ import annotations

from memkv.config.base import GIB
from memkv.config.gateway import (
    AuthSettings,
    GatewaySettings,
    InferenceEngineSettings,
    RoutingSettings,
)
from memkv.config.loading import (
    DATA_DIR_ENV,
    DEFAULT_PROFILE,
    ENV_PREFIX,
    PROFILE_ENV,
    data_dir,
    dump_config,
    load_config,
    packaged_config_path,
)
from memkv.config.schema import (
    DEFAULT_DATA_DIR,
    ArchiveSettings,
    ClusterSettings,
    DeviceSettings,
    MemkvConfig,
    RouterSettings,
)

__all__ = [
    "DATA_DIR_ENV",
    "DEFAULT_DATA_DIR",
    "DEFAULT_PROFILE",
    "ENV_PREFIX",
    "GIB",
    "PROFILE_ENV",
    "ArchiveSettings",
    "AuthSettings",
    "ClusterSettings",
    "DeviceSettings",
    "GatewaySettings",
    "InferenceEngineSettings",
    "MemkvConfig",
    "RouterSettings",
    "RoutingSettings",
    "data_dir",
    "dump_config",
    "load_config",
    "packaged_config_path",
]
