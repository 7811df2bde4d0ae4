"""Managed memory and priority streams, against a fake CUDA runtime (no GPU here)."""

import pytest

from memkv.errors import CapacityError
from memkv.gpu_kernels.unified import ManagedArena, PriorityStreams


class FakeRuntime:
    cudaMemAttachGlobal, cudaMemAttachSingle = 1, 4
    cudaMemAdviseSetPreferredLocation, cudaMemAdviseSetAccessedBy = 3, 5
    streamNonBlocking = 1

    def __init__(self, free):
        self.free_bytes, self.calls, self.streams = free, [], 0

    def setDevice(self, device):  # noqa: N802 - CUDA's names
        self.calls.append(("setDevice", device))

    def memGetInfo(self):  # noqa: N802
        return self.free_bytes, 2 * self.free_bytes

    def mallocManaged(self, n, flags):  # noqa: N802
        self.calls.append(("mallocManaged", n, flags))
        return 0x10000

    def memAdvise(self, ptr, n, advice, device):  # noqa: N802
        self.calls.append(("memAdvise", ptr, n, advice, device))

    def streamCreateWithFlags(self, flags):  # noqa: N802
        self.streams += 1
        return f"stream-{self.streams}"

    def streamAttachMemAsync(self, stream, ptr, n, flags):  # noqa: N802
        self.calls.append(("attach", stream, ptr, n, flags))

    def streamDestroy(self, stream):  # noqa: N802
        self.calls.append(("destroy", stream))

    def free(self, ptr):
        self.calls.append(("free", ptr))


def test_a_managed_arena_prefers_its_device_and_never_oversubscribes():
    rt = FakeRuntime(free=1 << 30)
    arena = ManagedArena(1 << 20, 1, runtime=rt)
    assert rt.calls[:2] == [("setDevice", 1), ("mallocManaged", 1 << 20, rt.cudaMemAttachGlobal)]
    assert ("memAdvise", 0x10000, 1 << 20, rt.cudaMemAdviseSetPreferredLocation, 1) in rt.calls
    assert ("memAdvise", 0x10000, 1 << 20, rt.cudaMemAdviseSetAccessedBy, 1) in rt.calls
    arena.close()
    arena.close()  # once
    assert rt.calls.count(("free", 0x10000)) == 1
    with pytest.raises(CapacityError, match="would oversubscribe"):
        ManagedArena(2 << 30, 0, runtime=FakeRuntime(free=1 << 30))


def test_each_priority_session_gets_a_stream_its_blocks_are_attached_to():
    rt = FakeRuntime(free=1 << 30)
    streams = PriorityStreams(ManagedArena(1 << 20, 0, runtime=rt))
    streams.attach("vip", 4096, 8192)
    streams.attach("vip", 0, 4096)
    streams.attach("other-vip", 65536, 4096)
    assert streams.sessions() == ["other-vip", "vip"]
    attached = [c for c in rt.calls if c[0] == "attach"]
    assert attached[0] == ("attach", "stream-1", 0x10000 + 4096, 8192, rt.cudaMemAttachSingle)
    assert attached[1][1] == "stream-1" and attached[2][1] == "stream-2"
    with pytest.raises(ValueError, match="not inside"):
        streams.attach("vip", (1 << 20) - 10, 4096)
    streams.release("vip")
    assert ("destroy", "stream-1") in rt.calls and streams.sessions() == ["other-vip"]


def test_a_high_priority_sessions_hot_blocks_are_attached_to_its_stream(tmp_path):
    from memkv.actors.device import attach_priority_session
    from memkv.protocol.enums import Priority
    from tests.storage.test_store import LAYOUT, kv, make_store

    store = make_store(tmp_path)
    try:
        store.create_session("vip", LAYOUT)
        keys, values = kv(10)
        store.put_kv("vip", list(range(10)), keys, values)
        chain = [bytes(k) for k in store.session("vip").chain]
        rt = FakeRuntime(free=1 << 30)
        streams = PriorityStreams(ManagedArena(1 << 20, 0, runtime=rt))
        # Without unified memory there are no streams: nothing happens.
        assert attach_priority_session(None, store.pool, "vip", chain, Priority.HIGH) == 0
        assert attach_priority_session(streams, store.pool, "vip", chain, Priority.HIGH) == 3
        located = store.pool.hot_locations(chain)
        attached = [(c[2] - 0x10000, c[3]) for c in rt.calls if c[0] == "attach"]
        assert attached == located and len(located) == 3
        assert streams.sessions() == ["vip"]
        # Back to normal: its stream goes.
        attach_priority_session(streams, store.pool, "vip", chain, Priority.NORMAL)
        assert streams.sessions() == []
    finally:
        store.close()
