"""Suite-wide settings: keep Ray (in later suites) on loopback; skip GPU tests without a GPU."""

import os

import pytest

for _name, _value in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(_name, _value)


def _gpu_available() -> bool:
    try:
        import cupy  # noqa: F401

        return bool(cupy.is_available())
    except ImportError:
        import torch

        return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cupy.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
