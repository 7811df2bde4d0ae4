"""How the clients reach a gateway: connections per thread (http.client for block
bodies, the block port), retries of what is transient, and errors mapped back to
memkv's own exceptions."""

from __future__ import annotations

import http.client
import logging
import os
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx
import tenacity

from memkv import errors
from memkv.errors import MemkvError
from memkv.port_connection import PortConnection, PortError
from memkv.protocol.wire import (
    WireError,
)

logger = logging.getLogger(__name__)


#: The bearer token a client sends when it is given none.
TOKEN_ENV = "MEMKV_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8080"
# Retried statuses: the gateway or the cluster is briefly unavailable.
RETRY_STATUSES = frozenset({502, 503, 504})
BACKOFF_S = 0.2

_ERRORS: dict[str, type[MemkvError]] = {
    name: getattr(errors, name)
    for name in errors.__all__
    if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), MemkvError)
}
_ERRORS.update({"WireError": errors.InvalidInputError, "PayloadTooLarge": errors.InvalidInputError})


def error_from(status: int, body: bytes) -> MemkvError:
    try:
        import json

        error = json.loads(body)["error"]
        cls = _ERRORS.get(error["type"], MemkvError)
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        cls, message = MemkvError, body[:500].decode("utf-8", "replace")
    error = cls(f"{message} (HTTP {status})")
    error.http_status = status  # type: ignore[attr-defined]  # read by the retry policy
    return error


def transient(exc: BaseException) -> bool:
    """Worth another attempt: the gateway or the cluster is briefly unavailable
    (502/503/504), or the connection failed before an answer came."""
    if isinstance(exc, MemkvError):
        return getattr(exc, "http_status", None) in RETRY_STATUSES
    return isinstance(exc, httpx.TransportError | OSError | http.client.HTTPException | WireError)


def retrying(retries: int) -> tenacity.Retrying:
    """The sync clients' policy: ``retries`` more attempts of what is :func:`transient`,
    0.2 s, 0.4 s, ... apart; the last error is raised as it was."""
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(retries + 1),
        wait=tenacity.wait_exponential(multiplier=BACKOFF_S),
        retry=tenacity.retry_if_exception(transient),
        reraise=True,
    )


def async_retrying(retries: int) -> tenacity.AsyncRetrying:
    """:func:`retrying` for the async client (it sleeps without blocking the loop)."""
    return tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(retries + 1),
        wait=tenacity.wait_exponential(multiplier=BACKOFF_S),
        retry=tenacity.retry_if_exception(transient),
        reraise=True,
    )


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise error_from(response.status_code, response.content)


class PerThread:
    """One connection per thread, each closed by :meth:`close` (what both kinds share)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()

    def _keep(self, conn: Any) -> None:
        self._local.conn = conn
        with self._lock:
            self._all.append(conn)

    def drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


class HttpConnections(PerThread):
    """One persistent ``http.client`` connection per thread, for the block routes.

    Block bodies skip httpx: ``http.client`` sends a list of memoryviews with
    ``sendall`` (no join) and reads each payload with ``readinto`` straight
    into its array (httpx reads 64 KiB chunks through h11 and joins them).
    """

    def __init__(self, base_url: str, timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise errors.InvalidInputError(f"expected an http(s) URL, got {base_url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._timeout = timeout
        super().__init__()

    def get(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._timeout)
            self._keep(conn)
        return conn


class PortConnections(PerThread):
    """One block-port connection per thread, once the gateway has advertised its port.

    A port that cannot be reached is not tried again: HTTP carries everything.
    """

    def __init__(
        self, base_url: str, auth: dict[str, str], timeout: float, discover: Any
    ) -> None:
        super().__init__()
        self._host = urlsplit(base_url).hostname or "127.0.0.1"
        self._token = bearer(auth)
        self._timeout = timeout
        self._discover = discover
        self._port: int | None = None
        self._known = False
        self.usable = False

    def get(self) -> PortConnection | None:
        conn: PortConnection | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.broken:
            return conn
        if not self._known:
            self._port, self._known = self._discover(), True
        if self._port is None:
            return None
        try:
            conn = PortConnection(self._host, self._port, token=self._token,
                                  timeout=self._timeout)
        except OSError as e:
            logger.warning("block port %s:%s unreachable (%s): KV over HTTP from now on",
                           self._host, self._port, e)
            self._port, self.usable = None, False
            return None
        self.usable = True
        self._keep(conn)
        return conn


def bearer(auth: dict[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer`` header dict (the block port's hello)."""
    return auth.get("authorization", "")[len("Bearer ") :] or None


def port_error(e: PortError) -> MemkvError:
    import json

    return error_from(e.status, json.dumps({"error": e.error}).encode())


def auth_headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"authorization": f"Bearer {token}"} if token else {}
