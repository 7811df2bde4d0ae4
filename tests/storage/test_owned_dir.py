"""A data directory is resolved on the node that uses it and owned by one store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from memkv.errors import ConfigError, ConflictError
from memkv.storage import owned_dir
from memkv.storage.config import ArchiveConfig
from memkv.storage.owned_dir import DirectoryLock, resolve_on_node
from memkv.storage.segments import SegmentStore

FP = bytes(16)


def test_variables_are_expanded_from_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMKV_TEST_NODE", "node-7")
    assert resolve_on_node("/data/$MEMKV_TEST_NODE/archive") == Path("/data/node-7/archive")
    assert resolve_on_node("/data/${MEMKV_TEST_NODE}") == Path("/data/node-7")


def test_a_variable_this_node_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMKV_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"\$MEMKV_TEST_UNSET.*not set on"):
        resolve_on_node("/data/$MEMKV_TEST_UNSET/archive")


def test_the_data_root_is_this_nodes_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default archive directory names $MEMKV_DATA_DIR: each node's archive writes
    # under its own host's value, or the per-user default where the host sets none.
    monkeypatch.setenv("MEMKV_DATA_DIR", "/mnt/nvme0/memkv")
    assert resolve_on_node("$MEMKV_DATA_DIR/archive") == Path("/mnt/nvme0/memkv/archive")
    monkeypatch.setenv("MEMKV_DATA_DIR", "~/elsewhere")
    assert resolve_on_node("${MEMKV_DATA_DIR}/archive") == Path.home() / "elsewhere/archive"
    monkeypatch.delenv("MEMKV_DATA_DIR")
    assert resolve_on_node("$MEMKV_DATA_DIR/archive") == Path.home() / ".cache/memkv/archive"
    # Only that variable has a default: a longer name is still refused when unset.
    monkeypatch.delenv("MEMKV_DATA_DIRS", raising=False)
    with pytest.raises(ConfigError, match=r"\$MEMKV_DATA_DIRS"):
        resolve_on_node("$MEMKV_DATA_DIRS/archive")


def test_a_second_store_on_one_directory_is_refused_and_the_first_keeps_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owned_dir, "LOCK_WAIT_S", 0.2)
    config = ArchiveConfig(directory=tmp_path)
    with SegmentStore(config) as first:
        first.put(b"k" * 16, b"frame", fingerprint=FP, codec_id=1)
        with pytest.raises(ConflictError, match=r"in use by another segment store .*pid"):
            SegmentStore(config)
        assert first.get(b"k" * 16) == b"frame"
    with SegmentStore(config) as again:  # closed: the directory is free
        assert again.get(b"k" * 16) == b"frame"


def test_the_lock_goes_with_its_process_however_it_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path;"
         "from memkv.storage.owned_dir import DirectoryLock;"
         f"lock = DirectoryLock(Path({str(tmp_path)!r}), 'test');"
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConflictError):
            DirectoryLock(tmp_path, "test", wait_s=0.1)
    finally:
        holder.kill()
        holder.wait()
    DirectoryLock(tmp_path, "test", wait_s=5).release()
