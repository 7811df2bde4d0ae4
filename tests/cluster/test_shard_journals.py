"""Journals are kept per shard count; a start with another count is refused."""

import pytest

from memkv.cluster.connect import check_journal_layout, router_journal_dir
from memkv.config import load_config
from memkv.errors import ConfigError


def test_each_shard_journals_in_its_own_directory(tmp_path):
    cfg = load_config(overrides={"router": {"journal_dir": str(tmp_path / "j")}}, environ={})
    assert router_journal_dir(cfg) == tmp_path / "j"  # one shard: as before shards existed
    assert router_journal_dir(cfg, 2, 4) == tmp_path / "j" / "shard-2-of-4"


def test_a_start_over_journals_of_another_shard_count_is_refused(tmp_path):
    check_journal_layout(tmp_path / "none-yet", 4)  # nothing there: any count
    one = tmp_path / "one"
    one.mkdir()
    (one / "journal.log").write_bytes(b"")
    check_journal_layout(one, 1)
    with pytest.raises(ConfigError, match=r"journals of \[1\] shard\(s\), this config says 2"):
        check_journal_layout(one, 2)
    four = tmp_path / "four"
    (four / "shard-0-of-4").mkdir(parents=True)
    check_journal_layout(four, 4)
    with pytest.raises(ConfigError, match=r"router.shards: 4"):
        check_journal_layout(four, 1)
