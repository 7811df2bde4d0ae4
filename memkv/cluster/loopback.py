"""Keeping Ray on 127.0.0.1 when memkv's cluster lives there.

Ray decides at import whether a machine may form a cluster
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, on by default on Linux), and when it
may, it rewrites a loopback address into the machine's outward one: a
process that imported Ray before memkv set the variable (a vLLM engine does)
then looks for memkv's loopback-only GCS on an address nothing listens on,
and waits there forever. So memkv sets the variables for the processes it
starts, and tells an already imported Ray the same thing, but only when the
cluster it joins is on loopback: a real cluster needs the node's real address.
"""

from __future__ import annotations

import os
import sys

__all__ = ["LOOPBACK_ADDRESS", "LOOPBACK_ENV", "is_loopback_address", "keep_ray_on_loopback"]

#: Keep a local Ray on loopback, with no usage reporting (set before ray.init).
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
LOOPBACK_ADDRESS = "127.0.0.1"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def keep_ray_on_loopback() -> None:
    """Set :data:`LOOPBACK_ENV` (where unset) and make an imported Ray honour it."""
    for name, value in LOOPBACK_ENV.items():
        os.environ.setdefault(name, value)
    if "ray" in sys.modules and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        # Ray read the variable at import; this is the flag it set from it
        # (ray._private.services.get_node_ip_address reads it on each call).
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``"auto"``, ``"host:port"``) names a cluster on loopback.

    ``"auto"`` is the cluster this machine last started or joined (``RAY_ADDRESS``
    or Ray's session file); ``ray://`` (Ray Client) never counts: it starts no node.
    """
    if address.startswith("ray://"):
        return False
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        try:
            found = get_ray_address_from_environment("auto", None)
        except (ConnectionError, OSError, ValueError):
            return False
        if not found or found == "local":
            return False
        address = found
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in _LOOPBACK_HOSTS
