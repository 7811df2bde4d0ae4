"""Benchmark clients in processes of their own, started together, timed by themselves.

Each client process connects, prepares (untimed), waits at a barrier for the
others, then runs its operations and reports its latencies and the wall
interval it ran in. Throughput is bytes over the union of those intervals
(``time.perf_counter`` is the same clock in every process on Linux).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ClientRun", "run_clients"]

_JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ClientRun:
    latencies: list[float]
    start: float
    end: float
    cpu_s: float = 0.0  # the client process's CPU time over its operations


def _worker(kind: str, params: dict[str, Any], index: int, barrier: Any, queue: Any) -> None:
    try:
        op = _OPS[kind](params, index)
        barrier.wait()  # prepared
        barrier.wait()  # the parent's before_start has run: go
        start, cpu = time.perf_counter(), time.process_time()
        latencies = op()
        queue.put((index, ClientRun(latencies, start, time.perf_counter(),
                                    time.process_time() - cpu), None))
    except BaseException as e:  # reported to the parent, which raises it
        barrier.abort()  # nobody waits at the barrier for a client that is gone
        queue.put((index, None, f"{type(e).__name__}: {e}"))


def run_clients(
    kind: str,
    params: dict[str, Any],
    concurrency: int,
    before_start: Callable[[], None] | None = None,
) -> list[ClientRun]:
    """Run ``concurrency`` client processes of ``kind`` with ``params``; their results.

    ``before_start`` runs once every client has prepared and before any is
    timed (e.g. to let background work of the servers finish).

    Raises:
        RuntimeError: a client failed (its error is in the message).
    """
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(concurrency + 1)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(kind, params, i, barrier, queue), daemon=True)
        for i in range(concurrency)
    ]
    for p in procs:
        p.start()
    try:
        try:
            barrier.wait(timeout=_JOIN_TIMEOUT_S)
            if before_start is not None:
                before_start()
            barrier.wait(timeout=_JOIN_TIMEOUT_S)
        except threading.BrokenBarrierError:
            pass  # a client failed while preparing: its error is on the queue
        results: dict[int, ClientRun] = {}
        for _ in procs:
            index, run, error = queue.get(timeout=_JOIN_TIMEOUT_S)
            if error is not None:
                raise RuntimeError(f"{kind} client {index} failed: {error}")
            results[index] = run
        return [results[i] for i in range(concurrency)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def _timed(fn: Callable[[int], object], n: int, pause_s: float = 0.0) -> list[float]:
    """Seconds of each of ``n`` calls; ``pause_s`` untimed before each."""
    out = []
    for i in range(n):
        if pause_s:
            time.sleep(pause_s)
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


# -- the clients -------------------------------------------------------------------------------


def _raw(params: dict[str, Any], index: int) -> Callable[[], list[float]]:
    import socket

    import numpy as np

    from memkv.bench.peers import RAW_ACK, RAW_GET, RAW_PUT, RAW_REQUEST_BYTES

    nbytes, ops, op = params["nbytes"], params["ops"], params["op"]
    conn = socket.create_connection(("127.0.0.1", params["port"]))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dst = np.empty(nbytes, dtype=np.uint8)
    src = np.random.default_rng(index).integers(0, 255, nbytes, dtype=np.uint8)
    view = dst.data

    def get(_: int) -> None:
        conn.sendall(RAW_GET * RAW_REQUEST_BYTES)
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:])

    def put(_: int) -> None:
        conn.sendall(RAW_PUT * RAW_REQUEST_BYTES)
        conn.sendall(memoryview(src))
        if conn.recv(len(RAW_ACK), socket.MSG_WAITALL) != RAW_ACK:
            raise RuntimeError("the raw server did not acknowledge")

    def pipelined_puts() -> list[float]:
        """``window`` PUTs on the wire at once; each one's latency, send to ack."""
        sent: list[float] = []
        latencies = []
        for i in range(ops + window):
            if i >= window:  # the oldest request's ack frees a place in the window
                if conn.recv(len(RAW_ACK), socket.MSG_WAITALL) != RAW_ACK:
                    raise RuntimeError("the raw server did not acknowledge")
                latencies.append(time.perf_counter() - sent[i - window])
            if i < ops:
                sent.append(time.perf_counter())
                conn.sendall(RAW_PUT * RAW_REQUEST_BYTES)
                conn.sendall(memoryview(src))
        return latencies

    window = int(params.get("window", 1))
    if op == "put" and window > 1:
        return pipelined_puts
    return lambda: _timed(get if op == "get" else put, ops)


def _bare_http(params: dict[str, Any], index: int) -> Callable[[], list[float]]:
    """The bare ASGI server over ``http.client``, as memkv.client moves block bodies.

    GET reads the payload with ``readinto`` straight into a reused buffer; PUT
    sends the body as one memoryview.
    """
    import http.client

    import numpy as np

    nbytes, ops, op = params["nbytes"], params["ops"], params["op"]
    conn = http.client.HTTPConnection("127.0.0.1", params["port"])
    dst = np.empty(nbytes, dtype=np.uint8).data
    src = np.random.default_rng(index).integers(0, 255, nbytes, dtype=np.uint8).data

    def get(_: int) -> None:
        conn.request("GET", "/block")
        response = conn.getresponse()
        filled = 0
        while filled < nbytes:
            got = response.readinto(dst[filled:])
            if not got:
                raise RuntimeError("the bare ASGI server cut its response short")
            filled += got
        response.read()

    def put(_: int) -> None:
        conn.request("PUT", "/block", body=src, headers={"content-length": str(nbytes)})
        if conn.getresponse().read() != b"ok":
            raise RuntimeError("the bare ASGI server did not acknowledge")

    return lambda: _timed(get if op == "get" else put, ops)


def _redis(params: dict[str, Any], index: int) -> Callable[[], list[float]]:
    import numpy as np
    import redis

    nbytes, ops, op = params["nbytes"], params["ops"], params["op"]
    conn = redis.Redis(port=params["port"])
    payload = np.random.default_rng(index).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    prefix = f"{params['run']}:{index}"
    if op == "get":
        for i in range(ops):
            conn.set(f"{prefix}:{i}", payload)

        def get(i: int) -> None:
            got = conn.get(f"{prefix}:{i}")
            if not isinstance(got, bytes) or len(got) != nbytes:
                raise RuntimeError("redis returned another value than was stored")

        return lambda: _timed(get, ops)
    return lambda: _timed(lambda i: conn.set(f"{prefix}:{i}", payload), ops)


def _gateway(params: dict[str, Any], index: int) -> Callable[[], list[float]]:
    """Appends of one block per turn in sessions of ``session_blocks``; reads of each once.

    A get client first writes the blocks it will read (untimed), then reads
    each once, into one reused destination buffer (as an engine reads into
    its own staging or paged memory).
    """
    import numpy as np

    from memkv.client import Client
    from memkv.protocol.layout import KVLayout

    layout = KVLayout.from_dict(params["layout"])
    ops, op, per_session = params["ops"], params["op"], params["session_blocks"]
    client = Client(params["url"], block_port=params["block_port"])
    block = np.random.default_rng(index).standard_normal(layout.block_shape()).astype(np.float16)
    bt = layout.block_tokens
    sessions: list[str] = []

    def put(i: int) -> None:
        n = i % per_session
        if n == 0:
            path = "port" if params["block_port"] else "http"
            sid = f"{params['run']}-{op}-{path}-{index}-{i // per_session}"
            client.create_session(sid, layout, namespace=params["namespace"])
            sessions.append(sid)
        # Tokens of their own per run, path, client and session: every put stores a
        # new block (the same tokens again would be deduplicated, and cost less).
        tokens = np.arange((n + 1) * bt, dtype=np.int64)
        tokens[0] = zlib.crc32(sessions[-1].encode())
        tokens[1] = 1_000_000 + index * 10_000 + i // per_session
        client.append_turn(sessions[-1], tokens, blocks=[block], start_block=n)

    if op == "put":
        return lambda: _timed(put, ops)
    for i in range(ops):
        put(i)
    dst = np.empty(layout.block_nbytes(), dtype=np.uint8)

    def get(i: int) -> None:
        got = list(
            client.read_blocks(
                sessions[i // per_session], i % per_session, i % per_session + 1, out=[dst]
            )
        )
        if len(got) != 1:
            raise RuntimeError(f"expected 1 block from the gateway, got {len(got)}")

    return lambda: _timed(get, ops)


def _gateway_pipelined(params: dict[str, Any], index: int) -> Callable[[], list[float]]:
    """:func:`_gateway`'s appends from one :class:`~memkv.client.AsyncClient`, ``window``
    of them in flight on its one block-port connection (each lane its own sessions);
    each one's latency."""
    import asyncio

    import numpy as np

    from memkv.client import AsyncClient
    from memkv.protocol.layout import KVLayout

    layout = KVLayout.from_dict(params["layout"])
    ops, window, per_session = params["ops"], params["window"], params["session_blocks"]
    block = np.random.default_rng(index).standard_normal(layout.block_shape()).astype(np.float16)
    bt = layout.block_tokens

    async def lane(client: AsyncClient, lane_index: int, count: int) -> list[float]:
        latencies = []
        for i in range(count):
            n = i % per_session
            sid = f"{params['run']}-pipelined-{index}-{lane_index}-{i // per_session}"
            if n == 0:
                await client.create_session(sid, layout, namespace=params["namespace"])
            tokens = np.arange((n + 1) * bt, dtype=np.int64)
            tokens[0] = zlib.crc32(sid.encode())  # new blocks, as _gateway's
            t0 = time.perf_counter()
            await client.append_turn(sid, tokens, blocks=[block], start_block=n)
            latencies.append(time.perf_counter() - t0)
        return latencies

    async def run() -> list[float]:
        async with AsyncClient(params["url"]) as client:
            await lane(client, -1, 2)  # the connection open and warm, untimed
            if client.block_path != "block port":
                raise RuntimeError("the gateway's block port was not used")
            lanes = await asyncio.gather(*(lane(client, k, ops // window)
                                           for k in range(window)))
        return [lat for latencies in lanes for lat in latencies]

    return lambda: asyncio.run(run())


def _gateway_session(params: dict[str, Any], index: int) -> Callable[[], list[float]]:
    """Reads of a whole stored session into preallocated buffers (the real-size row)."""
    import numpy as np

    from memkv.client import Client

    client = Client(params["url"], block_port=params["block_port"])
    client.session(params["session_id"])  # knows its turn: reads go straight to the device
    out = [np.empty(n, dtype=np.uint8) for n in params["block_bytes"]]

    def read(_: int) -> None:
        got = list(client.read_blocks(params["session_id"], out=out))
        if len(got) != len(out):
            raise RuntimeError(f"expected {len(out)} blocks, got {len(got)}")

    return lambda: _timed(read, params["ops"])


def _gateway_append(params: dict[str, Any], index: int) -> Callable[[], list[float]]:
    """Appends of ``blocks`` new blocks in one request each (a long turn), to fresh sessions.

    The sessions are made before the clock starts; each timed append is one
    request carrying every block of its turn.
    """
    import numpy as np

    from memkv.client import Client
    from memkv.protocol.layout import KVLayout

    layout = KVLayout.from_dict(params["layout"])
    ops, count = params["ops"], params["blocks"]
    client = Client(params["url"], block_port=params["block_port"])
    rng = np.random.default_rng(index)
    blocks = [rng.standard_normal(layout.block_shape()).astype(np.float16) for _ in range(count)]
    sessions = []
    for i in range(ops):
        sid = f"{params['run']}-append-{params['block_port']}-{index}-{i}"
        client.create_session(sid, layout, namespace=params["namespace"])
        sessions.append(client.session(sid))
    tokens = np.arange(count * layout.block_tokens, dtype=np.int64)
    sent = blocks
    if params.get("staged"):
        # A same-host writer: its one copy is into its staging, where the append names
        # the blocks (timed with the append below).
        staging = client.staging(2 * sum(b.nbytes for b in blocks))
        slot = staging.lease(sum(b.nbytes for b in blocks)) if staging is not None else None
        if slot is None:
            raise RuntimeError("no client staging on this host")
        sent = [np.frombuffer(slot.take(b.nbytes), dtype=b.dtype).reshape(b.shape)  # type: ignore[arg-type]
                for b in blocks]

    def append_to(sid: str) -> Any:
        tokens[0] = zlib.crc32(sid.encode())  # new blocks every time
        if sent is not blocks:
            for dst, src in zip(sent, blocks, strict=True):
                np.copyto(dst, src)
        return client.append_turn(sid, tokens, blocks=sent)

    def append(i: int) -> None:
        result = append_to(sessions[i].session_id)
        if params.get("staged") and not client.stages_appends:
            raise RuntimeError("the gateway did not take the staged blocks")
        if result.new_blocks != count:
            raise RuntimeError(f"expected {count} new blocks, got {result.new_blocks}")

    # A full device: sessions of as many bytes as its memory tiers hold, appended (and
    # demoted) before the clock starts; the timed appends land in what is left.
    ballast = []
    for i in range(-(-params.get("ballast_bytes", 0) // sum(b.nbytes for b in blocks))):
        sid = f"{params['run']}-ballast-{index}-{i}"
        client.create_session(sid, layout, namespace=params["namespace"])
        ballast.append(sid)
        append_to(sid)

    def timed_then_cleaned() -> list[float]:
        # An engine's turns are apart: pause_s between the appends, not timed.
        latencies = _timed(append, ops, float(params.get("pause_s", 0.0)))
        for sid in [s.session_id for s in sessions] + ballast:  # the bench cluster's memory back
            client.delete_session(sid)
        return latencies

    return timed_then_cleaned


_OPS: dict[str, Callable[[dict[str, Any], int], Callable[[], list[float]]]] = {
    "raw": _raw,
    "bare_http": _bare_http,
    "redis": _redis,
    "gateway": _gateway,
    "gateway_pipelined": _gateway_pipelined,
    "gateway_session": _gateway_session,
    "gateway_append": _gateway_append,
}
