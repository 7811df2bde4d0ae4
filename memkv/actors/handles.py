"""Typed handles over Ray actor handles: callers never write ``.remote`` or method names.

A handle's call returns a :class:`Pending` answer, awaitable in a gateway's
event loop and resolvable with :meth:`Pending.result` in a synchronous client,
so one handle serves both (as Ray's object references do).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import ray

from memkv.protocol.enums import Priority
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    CreateSession,
    ResumeAnswer,
    SessionView,
    decode,
    encode,
)

__all__ = ["Pending", "SessionServiceHandle"]

_T = TypeVar("_T")


class Pending(Generic[_T]):
    """An answer on its way: ``await`` it, or :meth:`result` outside an event loop."""

    __slots__ = ("_ref", "_read")

    def __init__(self, ref: Any, read: Callable[[Any], _T]) -> None:
        self._ref = ref
        self._read = read

    @property
    def ref(self) -> Any:
        """The Ray object reference (for ``ray.wait`` over many); it holds the
        undecoded answer."""
        return self._ref

    def __await__(self) -> Generator[Any, None, _T]:
        raw = yield from self._ref.__await__()
        return self._read(raw)

    def result(self, timeout: float | None = None) -> _T:
        return self._read(ray.get(self._ref, timeout=timeout))


def _none(_: Any) -> None:
    return None


def _view(document: bytes) -> SessionView:
    return decode(SessionView, document)


def _appended(document: bytes) -> AppendAnswer:
    return decode(AppendAnswer, document)


def _resumed(document: bytes) -> ResumeAnswer:
    return decode(ResumeAnswer, document)


class SessionServiceHandle:
    """The session service (:class:`memkv.protocol.services.SessionService`) of one
    router shard, over its Ray handle: every message travels as one document to
    the ``*_wire`` methods of :class:`memkv.actors.router.SessionRouterShell`."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def create_session(self, request: CreateSession) -> Pending[SessionView]:
        return Pending(self.actor.create_session_wire.remote(encode(request)), _view)

    def session(self, session_id: str) -> Pending[SessionView]:
        return Pending(self.actor.session_wire.remote(session_id), _view)

    def put_blocks(self, request: AppendTurn, blocks: list[Any]) -> Pending[AppendAnswer]:
        return Pending(self.actor.put_blocks_wire.remote(encode(request), blocks), _appended)

    def resume(self, session_id: str) -> Pending[ResumeAnswer]:
        return Pending(self.actor.resume_wire.remote(session_id), _resumed)

    def suspend(self, session_id: str, offline: bool = False) -> Pending[SessionView]:
        return Pending(self.actor.suspend_wire.remote(session_id, offline), _view)

    def set_priority(self, session_id: str, priority: Priority) -> Pending[SessionView]:
        return Pending(self.actor.set_priority_wire.remote(session_id, priority.value), _view)

    def delete_session(self, session_id: str) -> Pending[None]:
        return Pending(self.actor.delete_session.remote(session_id), _none)
