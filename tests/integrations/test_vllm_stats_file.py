"""The connector's stats file: the scheduler's and the workers' figures together ([1/5] 14).

Both wrote the whole file; the last writer won (the log said 2 save failures,
the file 0). Runs without vLLM: the file's logic imports none.
"""

import json
import multiprocessing

from memkv.integrations.vllm.stats_file import write_part


def _write(path, part, figures):
    write_part(path, part, figures)


def test_every_process_part_is_kept_and_summed(tmp_path):
    path = str(tmp_path / "connector.json")
    write_part(path, "worker-1", {"save_failures": 2, "saves_queued": 3, "saves_done": 3})
    # The scheduler writes after the worker: its figures must not replace the worker's.
    write_part(path, "scheduler-2", {"save_failures": 0, "hit_tokens": 64, "saves_queued": 0})
    doc = json.loads((tmp_path / "connector.json").read_text())
    assert doc["save_failures"] == 2 and doc["hit_tokens"] == 64 and doc["saves_done"] == 3
    # A part written again replaces only itself.
    write_part(path, "worker-1", {"save_failures": 5, "saves_queued": 4, "saves_done": 4})
    doc = json.loads((tmp_path / "connector.json").read_text())
    assert (doc["save_failures"], doc["saves_queued"], doc["hit_tokens"]) == (5, 4, 64)
    assert set(doc["parts"]) == {"worker-1", "scheduler-2"}


def test_writers_in_several_processes_lose_no_part(tmp_path):
    path = str(tmp_path / "connector.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write, args=(path, f"p{i}", {"loads": i})) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    doc = json.loads((tmp_path / "connector.json").read_text())
    assert doc["loads"] == sum(range(6)) and len(doc["parts"]) == 6


def test_saves_count_as_settled_only_when_done_covers_queued_and_nothing_moves(tmp_path):
    import threading

    from memkv.integrations.vllm.stats_file import saves_settled

    path = str(tmp_path / "stats.json")
    assert saves_settled(path, timeout_s=0.1, calm_s=0.01) is None  # nothing written
    write_part(path, "worker-1", {"saves_queued": 1, "saves_done": 1})
    # A finished request's last save is queued a step later: seen as it comes.
    late = threading.Timer(0.1, write_part, (path, "worker-1",
                                             {"saves_queued": 2, "saves_done": 1}))
    late.start()
    assert saves_settled(path, timeout_s=0.6, calm_s=0.3) is None  # 2 queued, 1 done
    late.join()
    write_part(path, "worker-1", {"saves_queued": 2, "saves_done": 2})
    doc = saves_settled(path, timeout_s=5, calm_s=0.05)
    assert doc is not None and doc["saves_done"] == 2
