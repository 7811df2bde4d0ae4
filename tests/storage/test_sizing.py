"""Tiers sized from free memory ('auto'): shares, floors, caps, /dev/shm, and no prefault."""

import pytest
from pydantic import ValidationError

from memkv.config import DeviceSettings, load_config
from memkv.storage.block_pool import BlockPool
from memkv.storage.config import ArchiveConfig, StoreConfig
from memkv.storage.shm_arena import SharedHostArena
from memkv.storage.sizing import (
    AutoCapacity,
    MemoryProbe,
    TierShare,
    probe_memory,
    size_tiers,
)

MIB = 1 << 20
GIB = 1 << 30
UNIT = 4 * MIB
ROOMY = MemoryProbe(host_available=20 * GIB, shm_free=24 * GIB, device_free=None)


def _auto(**kw: object) -> object:
    return size_tiers(None, None, AutoCapacity(), device="cpu", unit=UNIT, **kw)  # type: ignore[arg-type]


def test_the_default_config_sizes_its_tiers_from_free_memory() -> None:
    device = load_config(environ={}).device
    assert device.hot_capacity_bytes == device.warm_capacity_bytes == "auto"
    sizes = device.tier_sizes("cpu", probe=ROOMY)
    # 10% and 20% of 20 GiB, whole 4 MiB units.
    assert sizes.hot.capacity_bytes == 2 * GIB - 2 * GIB % UNIT
    assert sizes.warm.capacity_bytes == 4 * GIB - 4 * GIB % UNIT
    assert sizes.auto_tiers == {"hot", "warm"}
    line = sizes.describe()
    assert "auto: 10% of 20.0 GiB available memory" in line
    assert "MEMKV_DEVICE__HOT_CAPACITY_BYTES" in line and "device.auto_capacity" in line


def test_floor_cap_and_split_among_the_nodes_devices() -> None:
    tiny = MemoryProbe(host_available=512 * MIB, shm_free=None, device_free=None)
    assert _auto(probe=tiny).hot.capacity_bytes == 256 * MIB  # floor
    huge = MemoryProbe(host_available=2048 * GIB, shm_free=None, device_free=None)
    sizes = _auto(probe=huge)
    assert (sizes.hot.capacity_bytes, sizes.warm.capacity_bytes) == (16 * GIB, 64 * GIB)  # caps
    split = _auto(probe=ROOMY, devices_on_node=4)
    assert split.warm.capacity_bytes == (4 * GIB // 4) // UNIT * UNIT
    assert "/ 4 devices" in split.warm.basis


def test_shared_memory_bounds_even_the_floor() -> None:
    # A container's 64 MiB /dev/shm: a bigger segment would fault on first touch.
    small_shm = MemoryProbe(host_available=20 * GIB, shm_free=64 * MIB, device_free=None)
    sizes = _auto(probe=small_shm)
    assert sizes.hot.capacity_bytes + sizes.warm.capacity_bytes <= 64 * MIB
    assert "bounded by /dev/shm" in sizes.hot.basis and "bounded by /dev/shm" in sizes.warm.basis


def test_a_gpu_hot_tier_takes_a_share_of_free_device_memory() -> None:
    gpu = MemoryProbe(host_available=4 * GIB, shm_free=24 * GIB, device_free=8 * GIB)
    sizes = size_tiers(None, None, AutoCapacity(), device="cuda:0", unit=UNIT,
                       devices_on_node=8, probe=gpu)
    assert sizes.hot.capacity_bytes == (8 * GIB // 10) // UNIT * UNIT  # not split: its own HBM
    assert "free device memory" in sizes.hot.basis
    assert sizes.warm.capacity_bytes == 256 * MIB  # 0.8 GiB / 8 devices, floored


def test_configured_bytes_are_kept_and_never_probed() -> None:
    # A probe would be taken on 'cuda:7', which does not exist here.
    sizes = DeviceSettings(hot_capacity_bytes=8 * MIB, warm_capacity_bytes=12 * MIB).tier_sizes(
        "cuda:7"
    )
    assert (sizes.hot.capacity_bytes, sizes.warm.capacity_bytes) == (8 * MIB, 12 * MIB)
    assert sizes.auto_tiers == frozenset() and "committed as blocks" not in sizes.describe()


def test_probe_reads_this_machine() -> None:
    probe = probe_memory("cpu")
    assert probe.host_available > 0 and probe.device_free is None


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"share": 0, "floor_bytes": 1, "cap_bytes": 2}, "share"),
        ({"share": 0.5, "floor_bytes": 3, "cap_bytes": 2}, "floor_bytes"),
    ],
)
def test_bad_shares_are_refused(values: dict[str, float], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        TierShare(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lazy", "prefaulted"), [(frozenset(), 2), (frozenset({"warm"}), 1), ({"hot", "warm"}, 0)]
)
def test_only_configured_arenas_are_prefaulted(
    tmp_path, monkeypatch: pytest.MonkeyPatch, lazy: frozenset[str], prefaulted: int
) -> None:
    touched: list[int] = []
    real = SharedHostArena.prefault

    def spy(self: SharedHostArena, **kw: int) -> int:
        touched.append(self.capacity_bytes)
        return real(self, **kw)

    monkeypatch.setattr(SharedHostArena, "prefault", spy)
    config = StoreConfig(
        hot_capacity_bytes=2 * UNIT,
        warm_capacity_bytes=3 * UNIT,
        lazy_tiers=frozenset(lazy),
        archive=ArchiveConfig(directory=tmp_path, fsync="never"),
    )
    with BlockPool(config) as pool:
        assert pool.prefault_done.wait(30)
    assert len(touched) == prefaulted
    if prefaulted == 1:
        assert touched == [2 * UNIT]  # the hot arena: only the warm one is lazy


def _rss_bytes() -> int:
    """Resident bytes of this process, shared-memory pages it touched included."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_the_default_store_commits_little_before_its_first_block(tmp_path) -> None:
    # The shipped defaults once prefaulted 2 GiB + 4 GiB at start: 6 GB resident
    # in every default device actor before any block arrived.
    store = load_config(environ={"MEMKV_DATA_DIR": str(tmp_path)}).store_config(
        device="cpu", archive_subdir="d0"
    )
    assert store.lazy_tiers == {"hot", "warm"}
    before = _rss_bytes()
    with BlockPool(store) as pool:
        assert pool.prefault_done.wait(120)
        grown = _rss_bytes() - before
    assert grown < 256 * MIB, f"the default store made {grown / MIB:.0f} MiB resident"
