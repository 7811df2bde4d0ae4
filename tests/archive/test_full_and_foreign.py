"""An archive on a full disk refuses writes and keeps what it holds; an archive opens
only its own host's directory. Real segment files, no Ray."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from memkv.archive import identity
from memkv.archive.identity import IDENTITY_FILE, claim_directory
from memkv.archive.service import ArchiveService
from memkv.errors import ConfigError, CorruptDataError, StorageFullError
from memkv.storage.codecs import encode_stored
from memkv.storage.config import ArchiveConfig, CodecConfig
from memkv.storage.segments import SegmentStore

FP = bytes(16)


def _frames(n: int, start: int = 0) -> list[tuple[bytes, bytes, bytes]]:
    g = torch.Generator().manual_seed(start)
    return [(bytes([start + i + 1]) * 16,
             encode_stored(CodecConfig(), "lz4", torch.randn(64, 64, generator=g).half()), FP)
            for i in range(n)]


def _archive(path: Path, **kwargs) -> ArchiveService:
    return ArchiveService(ArchiveConfig(directory=path, fsync="never"), **kwargs)


def test_capacity_bytes_is_enforced_and_what_is_stored_stays(tmp_path: Path) -> None:
    frames = _frames(4)
    one = len(frames[0][1])
    archive = _archive(tmp_path / "a", capacity_bytes=int(2.5 * one) + 200)
    try:
        assert archive.put_frames(frames[:2]) == 2
        with pytest.raises(StorageFullError, match=r"exceed its archive.capacity_bytes"):
            archive.put_frames(frames[2:])
        # Nothing stored was lost; a frame already stored is no new write (no refusal).
        assert archive.get_frames([k for k, _, _ in frames[:2]]) == [f for _, f, _ in frames[:2]]
        assert archive.put_frames(frames[:1]) == 0
        stats = archive.stats()
        assert stats.refused_writes == 1 and stats.blocks == 2
        assert stats.capacity_bytes == archive.capacity_bytes
        assert stats.room_bytes is not None and stats.room_bytes < one
        # Room made (the collector deletes, compaction reclaims): writes go on.
        archive.delete([frames[0][0]])
        archive.compact(force=True)
        assert archive.put_frames(frames[2:3]) == 1
    finally:
        archive.close()


def test_a_full_disk_is_a_storage_full_error_and_the_store_stays_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = _archive(tmp_path / "a")
    frames = _frames(3)
    real_put = SegmentStore.put

    def full_after_one(self, key, payload, **kwargs):
        if len(self) >= 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, key, payload, **kwargs)

    try:
        monkeypatch.setattr(SegmentStore, "put", full_after_one)
        with pytest.raises(StorageFullError, match=r"disk is full .*1 of 3 frames written"):
            archive.put_frames(frames)
        monkeypatch.setattr(SegmentStore, "put", real_put)  # the disk has room again
        assert archive.put_frames(frames) == 2
        assert archive.get_frames([k for k, _, _ in frames]) == [f for _, f, _ in frames]
        assert archive.stats().refused_writes == 1
    finally:
        archive.close()


def test_other_write_errors_are_not_called_full(tmp_path: Path, monkeypatch) -> None:
    archive = _archive(tmp_path / "a")

    def broken(self, key, payload, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    try:
        monkeypatch.setattr(SegmentStore, "put", broken)
        with pytest.raises(OSError, match="Input/output") as info:
            archive.put_frames(_frames(1))
        assert not isinstance(info.value, StorageFullError)
    finally:
        archive.close()


def test_a_directory_keeps_its_identity_across_restarts(tmp_path: Path) -> None:
    first = _archive(tmp_path / "a")
    made = first.identity
    first.put_frames(_frames(1))
    first.close()
    again = _archive(tmp_path / "a")
    try:
        assert again.identity == made  # a restarted archive takes its identity up again
        assert again.stats().archive_id == made.archive_id and again.stats().blocks == 1
    finally:
        again.close()


def test_another_hosts_directory_is_refused_and_left_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(identity.HOST_ID_ENV, "h1")
    owner = _archive(tmp_path / "a")
    owner.put_frames(_frames(2))
    owner.close()
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "a").iterdir())
    monkeypatch.setenv(identity.HOST_ID_ENV, "h2")
    with pytest.raises(ConfigError, match=r"belongs to host 'h1'.*not to this host 'h2'.*"
                                          r"MEMKV_HOST_ID=h1"):
        _archive(tmp_path / "a")
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "a").iterdir()) == before
    # Handed over on purpose: the old host's name.
    monkeypatch.setenv(identity.HOST_ID_ENV, "h1")
    back = _archive(tmp_path / "a")
    try:
        assert back.stats().blocks == 2
    finally:
        back.close()


def test_a_damaged_identity_is_reported_not_replaced(tmp_path: Path) -> None:
    (tmp_path / IDENTITY_FILE).write_text("{not json")
    with pytest.raises(CorruptDataError, match="not an archive identity"):
        claim_directory(tmp_path)
    assert (tmp_path / IDENTITY_FILE).read_text() == "{not json"
