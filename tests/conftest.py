"""Suite-wide fixtures and settings.

Ray stays on loopback; GPU tests skip without a GPU; and one embedded memkv
cluster (Ray can be initialised once per process, and it costs seconds and
about 1 GiB) plus one gateway serve every integration test of the session.
"""

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


UNIT = 4096


#: The resources of the fault tests' deployment (advertised by the suite's embedded Ray).
FAULT_DEVICE, FAULT_NVME = "memkv_fault_device", "memkv_fault_nvme"
#: ...and of the hardening tests' (tiers of MiB in shared memory, one device).
SHM_DEVICE, SHM_NVME = "memkv_shm_device", "memkv_shm_nvme"
#: ...and of the full-archive test's (an archive whose budget runs out).
FULL_DEVICE, FULL_NVME = "memkv_full_device", "memkv_full_nvme"


def _suite_config(archive_dir, cluster):
    from memkv.config import load_config

    return load_config(
        overrides={
            "cluster": {
                "embedded_devices": 2,
                "embedded_object_store_bytes": 200 * 1024 * 1024,
                "embedded_num_cpus": 2,
                **cluster,
            },
            # Small tiers (8 blocks of 512 bytes per unit) so pressure is cheap to create.
            "device": {
                "hot_capacity_bytes": 4 * UNIT,
                "warm_capacity_bytes": 4 * UNIT,
                "allocator": {"min_unit_bytes": UNIT},
                # Keep later rounds in the model dtype: fp32 models' caches then
                # round-trip exactly (the transformers tests compare generations).
                "precision": {"later_dtype": "float32"},
                "debug_refcounts": True,
                # The gateway copies blocks straight out of the devices' shared memory.
                "same_node_reads": True,
            },
            "archive": {"directory": str(archive_dir), "fsync": "never"},
            # Background prefetch (trigger 3) would promote suspended sessions behind
            # the tests' backs; its choice of sessions is tested on RouterState.
            "router": {"background_prefetch_interval_s": 3600},
        },
        environ={},
    )


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two device actors, one archive actor and the router on one local Ray.

    The Ray also advertises room for :func:`fault_cluster`'s deployment."""
    from memkv.cluster import connect

    config = _suite_config(
        tmp_path_factory.mktemp("archive"),
        {
            "namespace": "memkv-test",
            "embedded_resources": {FAULT_DEVICE: 2, FAULT_NVME: 1, SHM_DEVICE: 1, SHM_NVME: 1,
                                   FULL_DEVICE: 1, FULL_NVME: 1},
        },
    )
    with connect(config=config) as c:
        yield c


@pytest.fixture(scope="session")
def fault_cluster(cluster, tmp_path_factory):
    """A deployment of its own for the tests that kill members (SIGKILL of a device,
    the archive, the router): another namespace on the same Ray, on resources of
    its own, so a kill cannot disturb the tests that share :func:`cluster`.
    Stopped with the session (its actors are not detached)."""
    import ray

    from memkv.cluster import connect

    config = _suite_config(
        tmp_path_factory.mktemp("fault-archive"),
        {
            "namespace": "memkv-test-faults",
            "device_resource": FAULT_DEVICE,
            "nvme_resource": FAULT_NVME,
        },
    )
    address = ray.get_runtime_context().gcs_address
    with connect(address, config=config, detached=False) as c:
        yield c


@pytest.fixture(scope="session")
def shm_cluster(cluster, tmp_path_factory):
    """A deployment whose one device keeps MiB of blocks in shared memory (the suite's
    keeps KiB): for the tests of what the gateway sends from it. Its own namespace and
    resources on the suite's Ray, as :func:`fault_cluster`."""
    import ray

    from memkv.cluster import connect
    from memkv.config import load_config

    config = load_config(
        overrides={
            "cluster": {"namespace": "memkv-test-shm", "embedded_devices": 1,
                        "device_resource": SHM_DEVICE, "nvme_resource": SHM_NVME},
            "device": {"hot_capacity_bytes": 32 << 20, "warm_capacity_bytes": 8 << 20,
                       "allocator": {"min_unit_bytes": 64 << 10}, "same_node_reads": True},
            "archive": {"directory": str(tmp_path_factory.mktemp("shm-archive")),
                        "fsync": "never"},
            "router": {"background_prefetch_interval_s": 3600},
        },
        environ={},
    )
    address = ray.get_runtime_context().gcs_address
    with connect(address, config=config, detached=False) as c:
        yield c


@pytest.fixture(scope="session")
def gateway(cluster):
    """A real uvicorn serving the gateway on 127.0.0.1 (a free port)."""
    from memkv.api.server import GatewayServer

    with GatewayServer.start(cluster, host="127.0.0.1", port=0, max_body_bytes=8 << 20) as gw:
        yield gw


@pytest.fixture(scope="session")
def fault_gateway(fault_cluster):
    """A gateway over :func:`fault_cluster` (the load-under-kills test's)."""
    from memkv.api.server import GatewayServer

    with GatewayServer.start(fault_cluster, host="127.0.0.1", port=0, max_body_bytes=8 << 20) as gw:
        yield gw
