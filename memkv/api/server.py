"""Running the gateway: uvicorn (uvloop + httptools) on a socket we bind ourselves."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, TypedDict

import ray
import uvicorn
import uvloop

from memkv.actors.router_shards import RouterShards
from memkv.api.app import create_app
from memkv.api.auth import Authenticator
from memkv.api.block_port import BlockPortServer
from memkv.api.blocks import READ_HOLD_S
from memkv.api.engines.book import RayKvBook
from memkv.api.engines.front_door import EngineSpec, FrontDoorOptions
from memkv.api.guarded_send import DEFAULT_STALL_S, TransportScopeProtocol
from memkv.shm.staging import PutStaging, staging_for

__all__ = ["UVICORN_SETTINGS", "GatewayServer", "UvicornSettings"]


class UvicornSettings(TypedDict):
    """The keywords of :class:`uvicorn.Config` memkv sets."""

    loop: Literal["uvloop"]
    http: Literal["httptools"]
    log_level: str
    access_log: bool
    lifespan: Literal["off"]

#: How the gateway runs uvicorn (the dataplane suite's bare-ASGI ceiling uses the same).
UVICORN_SETTINGS = UvicornSettings(
    loop="uvloop", http="httptools", log_level="warning", access_log=False, lifespan="off",
)

# How long start() waits for uvicorn to report that it is serving.
_STARTUP_TIMEOUT_S = 30.0
_POLL_S = 0.02


def _bound(host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class GatewayServer:
    """A uvicorn server for the gateway app, in a background thread.

    Example:
        >>> with GatewayServer.start(cluster, port=0) as gw:   # doctest: +SKIP
        ...     print(gw.url)
    """

    def __init__(
        self,
        server: uvicorn.Server,
        sock: socket.socket,
        thread: threading.Thread,
        app: Any = None,
        loops: list[asyncio.AbstractEventLoop] | None = None,
        staging: PutStaging | None = None,
        port_sock: socket.socket | None = None,
    ):
        self._server = server
        self._sock = sock
        self._thread = thread
        self._app = app
        self._loops = loops if loops is not None else []  # the serving loop, once it runs
        self._staging = staging
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self._port_sock = port_sock
        #: The block port (memkv.api.block_port), or None when it is off.
        self.block_port: int | None = port_sock.getsockname()[1] if port_sock else None

    @classmethod
    def start(
        cls,
        cluster: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        max_body_bytes: int = 1 << 30,
        same_node_reads: bool = True,
        plan_cache_bytes: int = 256 << 20,
        put_staging_bytes: int = 256 << 20,
        auth: Authenticator | None = None,
        block_port: int | None = 0,
        body_timeout_s: float = 30.0,
        read_stall_s: float = DEFAULT_STALL_S,
        read_hold_s: float = READ_HOLD_S,
        reuse_port: bool = False,
        worker: int = 0,
        engines: Sequence[EngineSpec] = (),
        routing: FrontDoorOptions | None = None,
    ) -> GatewayServer:
        """Bind ``host:port`` (0 = any free port) and serve until :meth:`stop`.

        Args:
            cluster: a :class:`memkv.cluster.MemkvCluster`, or the router shards
                (:class:`RouterShards`) of one (a gateway worker gets those).
            put_staging_bytes: shared memory for append bodies (memkv.shm.staging),
                made only where a device runs on this node; 0 = none.
            same_node_reads, plan_cache_bytes, auth: see :func:`memkv.api.app.create_app`.
            block_port: the TCP port of the block port on ``host`` (0: any free
                one; None: no block port, HTTP only).
            body_timeout_s: an append body (HTTP or block port) that sends nothing
                for this long is answered 408 and its buffers let go.
            read_stall_s: a block reader that takes no bytes this long is cut off.
            read_hold_s: how long a block read pins the blocks it announced.
            reuse_port: bind both ports with ``SO_REUSEPORT``, so that other
                worker processes of this gateway can bind them too and the
                kernel spreads connections over them (memkv.api.workers).
            worker: this process's index among them (``/healthz`` and stats say it).
            engines: engines the OpenAI front door routes to (``gateway.engines``).
            routing: how it chooses and checks them (``gateway.routing``).
        """
        routers = cluster if isinstance(cluster, RouterShards) else cluster.routers
        staging = staging_for(routers.first_service.devices().result().values(),
                              put_staging_bytes) if put_staging_bytes > 0 else None
        app = create_app(
            routers,
            max_body_bytes=max_body_bytes,
            same_node_reads=same_node_reads,
            plan_cache_bytes=plan_cache_bytes,
            staging=staging,
            auth=auth,
            body_timeout_s=body_timeout_s,
            read_stall_s=read_stall_s,
            read_hold_s=read_hold_s,
            engines=engines,
            routing=routing,
            # Every gateway process of the Ray cluster (workers, other nodes' gateways)
            # routes to the same engines.
            engine_book=RayKvBook(ray.get_runtime_context().namespace),
        )
        app.state.worker = worker
        sock = _bound(host, port, reuse_port)
        port_sock = None
        if block_port is not None:
            port_sock = _bound(host, block_port, reuse_port)
            port_sock.listen(128)
        # httptools with the transport in each request's scope: block reads keep nothing
        # of shared memory in it past its pin (memkv.api.guarded_send).
        server = uvicorn.Server(uvicorn.Config(
            app, loop=UVICORN_SETTINGS["loop"], http=TransportScopeProtocol,
            log_level=UVICORN_SETTINGS["log_level"], access_log=UVICORN_SETTINGS["access_log"],
            lifespan=UVICORN_SETTINGS["lifespan"]))

        loops: list[asyncio.AbstractEventLoop] = []

        async def serve_and_note_loop() -> None:
            loops.append(asyncio.get_running_loop())
            port_server = None
            if port_sock is not None:
                # On the same loop as HTTP: one gateway state, one staging segment.
                port_server = BlockPortServer(app)
                await port_server.start(port_sock)
            try:
                await server.serve(sockets=[sock])
            finally:
                if port_server is not None:
                    await port_server.stop()

        def serve() -> None:
            # uvloop for the gateway's event loop, as uvicorn's own run() would set up.
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(serve_and_note_loop())

        thread = threading.Thread(
            target=serve,
            name="memkv-gateway",
            daemon=True,
        )
        thread.start()
        gateway = cls(server, sock, thread, app, loops, staging, port_sock)
        gateway._wait_started()
        return gateway

    def _wait_started(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the gateway thread exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not start within {_STARTUP_TIMEOUT_S} s")
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """Give back the read plans the gateway holds, stop the front door's engine checks,
        stop serving and join the thread."""
        if self._loops and self._app is not None and self._thread.is_alive():
            door = self._app.state.gateway.door
            for wind_down in (self._app.state.release_plans,
                              door.close if door is not None else None):
                if wind_down is None:
                    continue
                done = asyncio.run_coroutine_threadsafe(wind_down(), self._loops[0])
                try:
                    done.result(timeout=_STARTUP_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - leases run out by themselves anyway
                    pass
        self._server.should_exit = True
        self._thread.join(timeout=_STARTUP_TIMEOUT_S)
        self._sock.close()
        if self._port_sock is not None:
            self._port_sock.close()
        if self._staging is not None and not self._thread.is_alive():
            self._staging.close()
            self._staging = None
        if self._app is not None:
            self._app.state.gateway.client_segments.close()  # clients' staging, unmapped

    def __enter__(self) -> GatewayServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
