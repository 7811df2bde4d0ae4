"""What the gateway answers, as the client returns it, and the JSON it is parsed from
and the bodies it is asked with.

A session, an append's answer and a resume's answer are the session service's own
messages (:mod:`memkv.protocol.services`), decoded from their HTTP form
(:mod:`memkv.protocol.http_form`); a session's ``layout`` is a ``LayoutSpec``
(``session.layout.layout()`` is its :class:`KVLayout`). What only a client makes
(a block as read, a match) is declared here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from memkv.protocol import http_form
from memkv.protocol.exactness import LOSSY_STEPS
from memkv.protocol.hashing import token_array
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import AppendAnswer, ResumeAnswer, SessionView

if TYPE_CHECKING:
    import torch


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


# -- shared request building and response parsing (sync and async alike) --------------------


def parse_session(data: object) -> SessionView:
    return http_form.from_builtins(data, SessionView)


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


def parse_turn(data: object) -> AppendAnswer:
    return http_form.from_builtins(data, AppendAnswer)


def parse_resume(data: object) -> ResumeAnswer:
    return http_form.from_builtins(data, ResumeAnswer)


def after_append(session: SessionView, result: AppendAnswer, tokens: int) -> SessionView:
    return msgspec.structs.replace(session, chain=result.chain, turn=result.turn, tokens=tokens)


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
