"""What this integration needs of a client: the methods and answers of
:class:`memkv.client.Client`, as Protocols (any client with them will do).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from memkv.protocol.services import LayoutSpec
from memkv.storage.layout import KVLayout

__all__ = ["BlockLike", "KVClient", "MatchLike", "SessionLike"]


class SessionLike(Protocol):
    """The fields of a session's state that :func:`restore` reads."""

    @property
    def session_id(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def layout(self) -> LayoutSpec: ...

    @property
    def tokens(self) -> int: ...

    @property
    def chain(self) -> Sequence[bytes]: ...


class BlockLike(Protocol):
    """One block as a client returns it."""

    @property
    def key(self) -> bytes: ...

    @property
    def tensor(self) -> torch.Tensor: ...

    @property
    def tier(self) -> Any: ...


class MatchLike(Protocol):
    """The answer of a prefix match: leading tokens cached, and their block keys."""

    @property
    def tokens(self) -> int: ...

    @property
    def blocks(self) -> Sequence[bytes]: ...


_TurnResult = TypeVar("_TurnResult", covariant=True)


class KVClient(Protocol[_TurnResult]):
    """The client methods this module calls (:class:`memkv.client.Client` has them all)."""

    def session(self, session_id: str) -> SessionLike: ...

    def append_turn(
        self,
        session_id: str,
        token_ids: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        *,
        turn: int | None = None,
    ) -> _TurnResult: ...

    def match(self, layout: KVLayout, namespace: str, token_ids: Sequence[int]) -> MatchLike: ...

    def read_blocks(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> Iterable[BlockLike]: ...

    def read_blocks_by_key(self, namespace: str, keys: Sequence[bytes]) -> Sequence[BlockLike]: ...
