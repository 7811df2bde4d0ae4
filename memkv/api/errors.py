"""How the gateway answers errors: one JSON envelope, a status chosen from memkv's
exception hierarchy (only the gateway maps exceptions to HTTP), and the OpenAPI
document that lists every status a route may answer."""

from __future__ import annotations

import logging
from typing import Any, TypedDict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
)
from ray.exceptions import RayError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from memkv.actors.handles import ACTOR_GONE_ERRORS
from memkv.api.answers import MESSAGE_ANSWERS
from memkv.errors import (
    BlockLostError,
    CapacityError,
    ClosedError,
    ConflictError,
    CorruptDataError,
    ForbiddenError,
    InvalidInputError,
    MemkvError,
    NotFoundError,
    OutOfRangeError,
    UnauthorizedError,
    plain_message,
)
from memkv.protocol import http_form

__all__ = [
    "BodyTimeout",
    "PayloadTooLarge",
    "any_error_document",
    "error_document",
    "error_response",
    "install_error_handlers",
    "internal_response",
    "openapi_with_errors",
    "unavailable_response",
]

logger = logging.getLogger(__name__)


# Most specific first: the first isinstance match decides the status.
_STATUS: list[tuple[type[BaseException], int]] = [
    (UnauthorizedError, 401),
    (ForbiddenError, 403),
    (ConflictError, 409),
    (OutOfRangeError, 400),
    (NotFoundError, 404),
    (BlockLostError, 410),
    (InvalidInputError, 422),
    (CapacityError, 507),
    (CorruptDataError, 500),
    (ClosedError, 503),
    (MemkvError, 500),
]


class PayloadTooLarge(InvalidInputError):
    """A request body is larger than the gateway accepts."""


class BodyTimeout(InvalidInputError):
    """A request body stalled (no bytes for the gateway's body timeout)."""


class ErrorDocument(TypedDict):
    """An error as the HTTP API and the block port answer it (``{"error": ...}``)."""

    type: str  # the error's class name (memkv.errors), e.g. "NotFoundError"
    message: str
    status: int  # the HTTP status it maps to


def error_document(exc: BaseException) -> ErrorDocument:
    """How an error is answered: ``{"type", "message", "status"}`` (HTTP and block port)."""
    # Errors raised in an actor arrive wrapped (RayTaskError subclasses the cause);
    # report the cause's own type and message, not the remote traceback.
    cause = getattr(exc, "cause", None)
    shown = cause if isinstance(cause, BaseException) else exc
    status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)
    if isinstance(exc, PayloadTooLarge):
        status = 413
    elif isinstance(exc, BodyTimeout):
        status = 408
    if status >= 500 or shown is not exc:
        logger.warning("memkv error answered %d: %s", status, exc)
    return ErrorDocument(type=type(shown).__name__, message=plain_message(shown), status=status)


def error_response(exc: BaseException) -> JSONResponse:
    error = error_document(exc)
    status = error["status"]
    headers = (
        {"WWW-Authenticate": "Bearer"}
        if status == 401
        else {"Retry-After": "1"}
        if status == 503
        else None
    )
    return JSONResponse(
        {"error": error},
        status_code=status,
        headers=headers,
    )


_RESTARTING = ErrorDocument(type="ClosedError", status=503,
                            message="a memkv service is restarting; retry shortly")
_INTERNAL = ErrorDocument(type="InternalError", message="internal error", status=500)


def any_error_document(exc: BaseException) -> ErrorDocument:
    """:func:`error_document` of any exception, as the HTTP exception handlers answer it
    (the block port answers with this)."""
    if isinstance(exc, ACTOR_GONE_ERRORS):
        logger.warning("a memkv actor is unavailable: %s", exc)
        return _RESTARTING.copy()
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayError) and isinstance(cause, MemkvError):
        return error_document(cause)
    if isinstance(exc, MemkvError):
        return error_document(exc)
    logger.error("unexpected error in the gateway", exc_info=exc)
    return _INTERNAL.copy()


def unavailable_response(exc: BaseException) -> JSONResponse:
    # Ray's message names actor ids, pids and addresses: the log gets it, the client not.
    logger.warning("a memkv actor is unavailable: %s", exc)
    return JSONResponse({"error": _RESTARTING}, status_code=503, headers={"Retry-After": "1"})


def internal_response(exc: BaseException) -> JSONResponse:
    # A bug, or an error of a library under us: logged with its traceback, never
    # shown (it may carry paths, pids, actor ids).
    logger.error("unexpected error in the gateway", exc_info=exc)
    return JSONResponse({"error": _INTERNAL}, status_code=500)


#: What each status of the error envelope means, for the OpenAPI document.
_ERROR_DOCS = {
    400: "A request the gateway cannot read (a malformed body, or a client that left "
         "mid-body), a fork or rewind outside the session's tokens; on the OpenAI routes, "
         "a malformed request in OpenAI's error shape (error.message, error.type).",
    401: "No valid bearer token.",
    403: "The token may not do this (role or namespace).",
    404: "No such session or block (another tenant's answers the same).",
    408: "The request body stalled.",
    409: "Conflict with the session's state: the id is taken, a turn is out of order, the "
         "layout differs, the session has no blocks yet.",
    410: "The session's blocks are lost (its device restarted before they were archived).",
    413: "The body is larger than the gateway accepts.",
    422: "Invalid input (the message names what was expected).",
    500: "Internal error (logged by the gateway, never detailed here).",
    503: "A memkv service is restarting or recovering: retry after Retry-After seconds.",
    507: "Over a tenant's quota or a tier's capacity: nothing was stored.",
}
#: Errors every authenticated route may answer, and those of particular routes.
_COMMON_ERRORS = (400, 401, 403, 422, 500, 503)
_ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/sessions"): (409, 507),
    ("get", "/v1/sessions/{session_id}"): (404, 410),
    ("delete", "/v1/sessions/{session_id}"): (404,),
    ("post", "/v1/sessions/{session_id}/suspend"): (404, 409, 410),
    ("post", "/v1/sessions/{session_id}/resume"): (404, 409, 410),
    ("post", "/v1/sessions/{session_id}/input-end"): (404, 409, 410),
    ("post", "/v1/sessions/{session_id}/fork"): (404, 409, 410, 507),
    ("post", "/v1/sessions/{session_id}/rewind"): (404, 409, 410),
    ("post", "/v1/sessions/{session_id}/turns"): (404, 408, 409, 410, 413, 507),
    ("post", "/v1/sessions/{session_id}/reservations"): (404, 409, 410, 507),
    ("get", "/v1/sessions/{session_id}/blocks"): (404, 410),
    ("post", "/v1/blocks/read"): (404, 410),
    ("post", "/v1/blocks/lease"): (404, 410),
    ("delete", "/v1/blocks/lease/{lease_id}"): (404,),
    ("post", "/v1/match"): (),
    ("get", "/v1/stats"): (),
    ("post", "/v1/chat/completions"): (404, 413),
    ("post", "/v1/completions"): (404, 413),
    ("post", "/v1/responses"): (404, 413),
    ("get", "/v1/responses/{response_id}"): (404,),
    ("get", "/v1/responses/{response_id}/input_items"): (404,),
    ("delete", "/v1/responses/{response_id}"): (404,),
    ("get", "/v1/models"): (),
    ("post", "/v1/engines"): (),
    ("get", "/v1/engines"): (),
    ("delete", "/v1/engines/{engine_id}"): (404,),
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message", "status"],
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string"},
                "status": {"type": "integer"},
            },
        }
    },
}


def openapi_with_errors(app: FastAPI) -> dict[str, Any]:  # FastAPI's own type for it
    """FastAPI's document, with every status a route may answer and its media types."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = _ERROR_SCHEMA
    # The session service's messages, described from their one declaration; a name the
    # request models already declared (an enum) keeps FastAPI's description.
    for name, message_schema in http_form.schema_components(MESSAGE_ANSWERS).items():
        components.setdefault(name, message_schema)
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, operations in schema["paths"].items():
        if not path.startswith("/v1/"):
            continue  # probes and docs: no token, no body
        for method, operation in operations.items():
            extra = _ROUTE_ERRORS.get((method, path), ())
            for code in (*_COMMON_ERRORS, *extra):
                operation["responses"][str(code)] = {"description": _ERROR_DOCS[code],
                                                     "content": error}
    health = schema["paths"]
    health["/metrics"]["get"]["responses"]["200"]["content"] = {
        CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}
    }
    health["/metrics"]["get"]["responses"]["401"] = {
        "description": _ERROR_DOCS[401],
        "content": error,
    }
    health["/readyz"]["get"]["responses"]["503"] = {
        "description": "The router does not answer.",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    app.openapi_schema = schema
    return schema


def _allowed(app: FastAPI, scope: Any) -> list[str]:
    """Every method some route of ``scope``'s path serves (routers included: FastAPI
    keeps them as routers, whose routes are the ones with paths and methods)."""
    methods: set[str] = set()
    pending = list(app.routes)
    while pending:
        route = pending.pop()
        inner = getattr(route, "original_router", None)
        if inner is not None:
            pending.extend(inner.routes)
            continue
        match, _ = route.matches({**scope, "method": "\0"})  # any method: the path only
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def validation_message(problems: Any) -> str:
    """Pydantic's findings as one plain line: where, and what was expected."""
    lines = []
    for problem in list(problems)[:3]:
        where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body") or "the body"
        lines.append(f"{where}: {problem.get('msg', 'invalid')}")
    more = len(list(problems)) - len(lines)
    return "; ".join(lines) + (f" (and {more} more)" if more > 0 else "")


def install_error_handlers(app: FastAPI) -> None:
    """Every exception a route raises answers in the one envelope, with its status."""

    @app.exception_handler(MemkvError)
    async def _memkv_error(request: Request, exc: MemkvError) -> JSONResponse:
        return error_response(exc)

    async def _actor_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # An actor is restarting (or its node is gone): the router recovers it or
        # moves its sessions; the client may retry.
        return unavailable_response(exc)

    for gone in ACTOR_GONE_ERRORS:
        app.add_exception_handler(gone, _actor_unavailable)

    @app.exception_handler(RayError)
    async def _ray_error(request: Request, exc: RayError) -> JSONResponse:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, MemkvError):
            return error_response(cause)
        return internal_response(exc)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # A client that went away mid-body: nothing of it is stored, nobody reads the
        # answer. One line, not a traceback (it is not the gateway's error).
        logger.info("%s %s: the client left before its body was read", request.method,
                    request.url.path)
        return JSONResponse({"error": ErrorDocument(
            type="ClientDisconnect", status=400, message="the client left")}, status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own (404 unknown route, 405, 400 unreadable body): one envelope too.
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route of the path only; a path
            # served by several (GET and DELETE of a session) allows them all.
            headers["Allow"] = ", ".join(_allowed(app, request.scope))
        return JSONResponse(
            {"error": {"type": kind, "message": str(exc.detail), "status": exc.status_code}},
            status_code=exc.status_code,
            headers=headers or None,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {"error": {"type": "InvalidInputError", "message": validation_message(exc.errors()),
                       "status": 422}},
            status_code=422,
        )
