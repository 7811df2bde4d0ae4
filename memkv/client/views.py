"""What the gateway answers, as the client returns it (frozen dataclasses), and the
JSON it is parsed from and the bodies it is asked with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from memkv.protocol.exactness import LOSSY_STEPS
from memkv.protocol.hashing import token_array
from memkv.protocol.layout import KVLayout

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class SessionView:
    session_id: str
    namespace: str
    layout: KVLayout
    priority: str
    state: str
    tokens: int
    turn: int
    chain: list[bytes]
    device_id: str | None
    ack: str = "memory"  # when appends are answered: in memory, or fsynced in the archive
    finite_only: bool = False  # appends holding NaN or inf are refused
    # Tokens whose blocks were lost (a device restarted before they were archived):
    # the session serves its first ``tokens``, an engine recomputes the rest, and
    # the next append sends the blocks after them again. ``partial_reason`` says why.
    lost_tokens: int = 0
    partial_reason: str | None = None


@dataclass(frozen=True, slots=True)
class TurnResult:
    chain: list[bytes]
    new_blocks: int
    deduplicated_blocks: int
    released_blocks: int
    turn: int
    replayed: bool


@dataclass(frozen=True, slots=True)
class Match:
    tokens: int
    blocks: list[bytes]
    #: In a public namespace: the publisher (tenant) whose blocks these are.
    publisher: str | None = None


@dataclass(frozen=True, slots=True)
class Block:
    """One block as read: its bytes in ``array`` ``[layers, 2, kv_heads, tokens, head_dim]``.

    ``array`` is float32/float16, or uint16 holding bfloat16 bits (numpy has
    no bfloat16); ``tensor`` gives the torch view (no copy). ``exact`` is False
    when memkv kept the block lossily; ``lossy`` names the step (``int8``,
    ``float16`` of fp32, ``delta_rl``) and ``bound`` the error it can make.
    """

    index: int
    key: bytes
    array: np.ndarray
    dtype: str
    tier: str | None  # where the block was found (hot, warm, cold)
    exact: bool = True
    lossy: str = ""

    @property
    def bound(self) -> str:
        """The error the block's lossy step can make (memkv.protocol.exactness)."""
        step = LOSSY_STEPS.get(self.lossy)
        if step is None or (not self.lossy and not self.exact):
            return "lossy: by a step this client does not know of"
        return step.bound

    @property
    def tensor(self) -> torch.Tensor:
        """The block as a torch tensor sharing ``array``'s memory (imports torch)."""
        import torch

        t = torch.from_numpy(self.array)
        return t.view(torch.bfloat16) if self.dtype == "bfloat16" else t


@dataclass(frozen=True, slots=True)
class ResumeView:
    session_id: str
    tokens: int
    blocks: list[tuple[bytes, str, int]]  # (key, tier, tokens)


# -- shared request building and response parsing (sync and async alike) --------------------


def parse_session(data: dict[str, Any]) -> SessionView:
    return SessionView(
        session_id=data["session_id"],
        namespace=data["namespace"],
        layout=KVLayout.from_dict(data["layout"]),
        priority=data["priority"],
        state=data["state"],
        tokens=int(data["tokens"]),
        turn=int(data["turn"]),
        chain=[bytes.fromhex(k) for k in data["chain"]],
        device_id=data.get("device_id"),
        ack=data.get("ack", "memory"),
        finite_only=bool(data.get("finite_only", False)),
        lost_tokens=int(data.get("lost_tokens", 0)),
        partial_reason=data.get("partial_reason"),
    )


def create_body(
    session_id: str,
    layout: KVLayout,
    namespace: str | None,
    priority: str,
    ack: str | None,
    exact_only: bool,
    finite_only: bool,
    near: str | None = None,
) -> dict[str, Any]:
    """A create's JSON body. ``finite_only``: appends with NaN or inf are refused (422);
    ``near``: ``"gateway"`` or a Ray node id to place the session on."""
    body: dict[str, Any] = {
        "session_id": session_id,
        "layout": layout.to_dict(),
        "namespace": namespace,
        "priority": priority,
        "ack": ack,
        "exact_only": exact_only,
    }
    if finite_only:  # only when asked: a gateway before it knows no such field
        body["finite_only"] = True
    if near is not None:
        body["near"] = near
    return body


def parse_turn(data: dict[str, Any]) -> TurnResult:
    return TurnResult(
        chain=[bytes.fromhex(k) for k in data["chain"]],
        new_blocks=int(data["new_blocks"]),
        deduplicated_blocks=int(data["deduplicated_blocks"]),
        released_blocks=int(data["released_blocks"]),
        turn=int(data["turn"]),
        replayed=bool(data.get("replayed", False)),
    )


def parse_resume(data: dict[str, Any]) -> ResumeView:
    return ResumeView(
        data["session_id"],
        int(data["tokens"]),
        [(bytes.fromhex(b["key"]), b["tier"], int(b["tokens"])) for b in data["blocks"]],
    )


def after_append(session: SessionView, result: TurnResult, tokens: int) -> SessionView:
    return replace(session, chain=list(result.chain), turn=result.turn, tokens=tokens)


def match_body(
    layout: KVLayout, namespace: str | None, token_ids: Sequence[int] | np.ndarray
) -> dict[str, Any]:
    """A ``/v1/match`` body."""
    return {
        "layout": layout.to_dict(),
        "namespace": namespace,
        "token_ids": token_array(token_ids).tolist(),
    }


def parse_match(data: dict[str, Any]) -> Match:
    return Match(int(data["tokens"]), [bytes.fromhex(k) for k in data["blocks"]],
                 data.get("publisher"))
