"""The comparisons the data-plane suite measures memkv against, brought up as their users run them.

* A raw-socket request/response server and client: the transport's ceiling
  (a 16-byte request, then the 4 MiB payload one way and a 2-byte answer).
* A bare ASGI app under uvicorn, set up as the gateway's server is (uvloop,
  httptools): GET answers the payload in one ``send``, PUT copies the body into
  a reused buffer. Nothing memkv does is in it, so it is the ceiling of the
  HTTP stack the gateway is built on, measured beside the raw socket.
* Redis from Debian's package (``redis-server``, installed with apt when it is
  missing and this process may), driven by redis-py with hiredis, which is how
  LMCache's remote tier talks to it.

Clients run in processes of their own (see :mod:`memkv.bench.clients`), so a
server and its client never share one interpreter lock.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

__all__ = [
    "RAW_GET",
    "RAW_PUT",
    "bare_asgi_server",
    "ensure_redis_server",
    "raw_socket_server",
    "redis_server",
]

RAW_GET = b"G"
RAW_PUT = b"P"
RAW_REQUEST_BYTES = 16
RAW_ACK = b"ok"
_START_TIMEOUT_S = 15.0
_POLL_S = 0.05
_APT_TIMEOUT_S = 300


def _serve_raw(conn: socket.socket, nbytes: int) -> None:
    import numpy as np

    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    sink = bytearray(nbytes)
    view = memoryview(sink)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            # Exactly one request's bytes (pipelined clients send the next one early).
            request = conn.recv(RAW_REQUEST_BYTES, socket.MSG_WAITALL)
            if len(request) < RAW_REQUEST_BYTES:
                return
            if request[:1] == RAW_GET:
                conn.sendall(payload.data)
            else:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if not n:
                        return
                    got += n
                conn.sendall(RAW_ACK)


def raw_server_main(port_file: str, nbytes: int) -> None:
    """Entry point of the raw-socket server process: one thread per connection."""
    server = socket.create_server(("127.0.0.1", 0))
    with open(port_file, "w") as f:
        f.write(str(server.getsockname()[1]))
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve_raw, args=(conn, nbytes), daemon=True).start()


def bare_asgi_main(port_file: str, nbytes: int) -> None:
    """Entry point of the bare-ASGI server process: uvicorn as the gateway runs it."""
    import asyncio

    import numpy as np
    import uvicorn
    import uvloop

    from memkv.api.server import UVICORN_SETTINGS  # the gateway's own settings

    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).data
    sink = memoryview(bytearray(nbytes))
    length = [(b"content-length", str(nbytes).encode())]

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": length})
            await send({"type": "http.response.body", "body": payload})
            return
        got = 0
        while True:
            message = await receive()
            body = message.get("body", b"")
            sink[got : got + len(body)] = body
            got += len(body)
            if not message.get("more_body", False):
                break
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": RAW_ACK})

    sock = socket.create_server(("127.0.0.1", 0))
    with open(port_file, "w") as f:
        f.write(str(sock.getsockname()[1]))
    server = uvicorn.Server(uvicorn.Config(app, **UVICORN_SETTINGS))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(server.serve(sockets=[sock]))


@contextmanager
def _server_process(main: Callable[[str, int], None], nbytes: int, what: str) -> Iterator[int]:
    """``main(port_file, nbytes)`` in a process of its own on 127.0.0.1; yields its port."""
    import multiprocessing
    import tempfile

    with tempfile.TemporaryDirectory(prefix="memkv-peer-") as tmp:
        port_file = os.path.join(tmp, "port")
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=main, args=(port_file, nbytes), daemon=True)
        proc.start()
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not (os.path.exists(port_file) and os.path.getsize(port_file)):
                if time.monotonic() > deadline or not proc.is_alive():
                    raise RuntimeError(f"the {what} server did not start")
                time.sleep(_POLL_S)
            with open(port_file) as f:
                yield int(f.read())
        finally:
            proc.terminate()
            proc.join()


def raw_socket_server(nbytes: int) -> AbstractContextManager[int]:
    """A raw-socket server in a process of its own on 127.0.0.1; yields its port."""
    return _server_process(raw_server_main, nbytes, "raw-socket")


def bare_asgi_server(nbytes: int) -> AbstractContextManager[int]:
    """A bare ASGI app under uvicorn (uvloop, httptools) in a process of its own; its port."""
    return _server_process(bare_asgi_main, nbytes, "bare ASGI")


def ensure_redis_server(*, install: bool = True) -> tuple[str | None, str]:
    """``(path of redis-server, how it was found)``; installs Debian's package if it may.

    Returns ``(None, reason)`` when there is none and it cannot be installed.
    """
    exe = shutil.which("redis-server")
    if exe is not None:
        return exe, "Debian's redis-server (found on PATH)"
    if not install:
        return None, "redis-server not found (quick runs do not install it)"
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        return None, "redis-server not found, and apt-get as root is not available to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "redis-server"]):
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=_APT_TIMEOUT_S)
        if done.returncode != 0:
            return None, f"installing Debian's redis-server failed: {done.stderr[-300:]!r}"
    exe = shutil.which("redis-server")
    if exe is None:
        return None, "apt left no redis-server"
    return exe, "Debian's redis-server (installed by this run)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(*, install: bool = True) -> Iterator[tuple[int | None, str]]:
    """A throwaway redis-server on 127.0.0.1 (no persistence); yields ``(port or None, note)``."""
    exe, how = ensure_redis_server(install=install)
    if exe is None:
        yield None, how
        return
    import redis

    port = _free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(_POLL_S)
        yield port, how
    finally:
        proc.terminate()
        proc.wait()
