"""The vLLM connector's gateway transport: leases given back off the engine's thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from memkv.integrations.vllm.transport import GatewayTransport
from memkv.protocol.layout import KVLayout


class _Client:
    """A client whose lease releases wait until the test lets them go."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.go = threading.Event()

    def lease_blocks(self, namespace, keys):
        plans = [SimpleNamespace(lease_id="lease-1.dev0"), SimpleNamespace(lease_id="lease-2.dev1")]
        return SimpleNamespace(local=True, plans=plans, blocks=[None] * len(keys))

    def release_lease(self, lease_id: str) -> None:
        assert self.go.wait(10)
        self.released.append(lease_id)

    def close(self) -> None:
        pass


def _transport() -> tuple[GatewayTransport, _Client]:
    transport = GatewayTransport(KVLayout("t", 1, 1, 8), url="http://127.0.0.1:1", token=None,
                                 namespace=None)
    client = _Client()
    transport._client = client  # type: ignore[assignment]
    return transport, client


def test_a_release_returns_at_once_and_every_lease_goes_back():
    transport, client = _transport()
    leased = transport.lease([b"k" * 16])
    assert leased is not None
    _, release = leased
    release()  # does not wait for the gateway
    assert client.released == []
    client.go.set()
    transport.close()  # waits for the releases in flight
    assert client.released == ["lease-1.dev0", "lease-2.dev1"]


def test_a_release_after_close_is_still_given_back():
    transport, client = _transport()
    _, release = transport.lease([b"k" * 16])  # type: ignore[misc]
    client.go.set()
    transport.close()
    release()
    assert client.released == ["lease-1.dev0", "lease-2.dev1"]
