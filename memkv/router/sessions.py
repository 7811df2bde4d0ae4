"""The session table: the one owner of session state.

A session's chain, tokens, turn, state, priority, placement and manifest live
here and nowhere else. The router holds one table for the cluster (and for a
single-process :class:`~memkv.store.TieredStore`, a shell over the
router and one device). Block stores never see sessions: an append becomes a
:class:`~memkv.protocol.messages.ChainUpdate` (which blocks the session holds,
drops and keeps), computed here and applied by the block store.

Session ids follow one rule (:func:`~memkv.protocol.ids.check_session_id`),
checked once, at :meth:`SessionTable.create`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from memkv.errors import (
    BlockLostError,
    ConflictError,
    InvalidInputError,
    UnknownSessionError,
)
from memkv.protocol.enums import AckMode, Priority, SessionState, parse_priority
from memkv.protocol.hashing import BlockHash
from memkv.protocol.ids import check_stored_session_id
from memkv.protocol.layout import KVLayout, block_token_count
from memkv.protocol.messages import ChainUpdate
from memkv.protocol.services import LayoutSpec, SessionView

__all__ = ["SessionRecord", "SessionTable", "parse_priority"]


@dataclass(slots=True)
class SessionRecord:
    """One session, as its owner knows it."""

    session_id: str
    namespace: str
    layout: KVLayout
    priority: Priority
    created_at: float
    last_access: float
    chain: list[BlockHash] = field(default_factory=list)
    tokens: int = 0
    turn: int = 0
    tail_rewrites: int = 0  # how often the partial last block was replaced
    state: SessionState = SessionState.ACTIVE
    # Acknowledgement mode: True = an append answers once its blocks are fsynced
    # in the cold tier ("archive"); False = once they are in device memory ("memory").
    durable: bool = False
    # Never a lossy step for this session's blocks (precision, codecs).
    exact_only: bool = False
    # Appends carrying NaN or inf are refused (422) instead of stored as sent.
    finite_only: bool = False
    # Placement and hotness: the router's (a single-process store leaves them be).
    device_id: str | None = None  # placed at the first append (prefix affinity needs tokens)
    hotness: float = 0.0
    lost_reason: str | None = None  # set: the session's blocks are gone for good
    # Tokens whose blocks were lost (a device restart before they were archived)
    # while a prefix survived: the session serves that prefix, the engine
    # recomputes the rest. ``partial_reason`` says what happened.
    lost_tokens: int = 0
    partial_reason: str | None = None

    @property
    def active(self) -> bool:
        return self.state is SessionState.ACTIVE

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def view(self) -> SessionView:
        """The session as its owner answers it (a typed message)."""
        return SessionView(
            session_id=self.session_id,
            namespace=self.namespace,
            layout=LayoutSpec.of(self.layout),
            priority=self.priority,
            device_id=self.device_id,
            chain=tuple(bytes(k) for k in self.chain),
            tokens=self.tokens,
            turn=self.turn,
            state=SessionState.LOST if self.lost else self.state,
            ack=AckMode.ARCHIVE if self.durable else AckMode.MEMORY,
            exact_only=self.exact_only,
            finite_only=self.finite_only,
            archived=not self.active,
            hotness=self.hotness,
            lost_reason=self.lost_reason,
            lost_tokens=self.lost_tokens,
            partial_reason=self.partial_reason,
        )

    def manifest(self) -> dict[str, Any]:
        """What the cold tier keeps of a suspended session, to serve it again after a restart."""
        return {
            "session_id": self.session_id,
            "namespace": self.namespace,
            "layout": self.layout.to_dict(),
            "priority": self.priority.value,
            "tokens": self.tokens,
            "turn": self.turn,
            "chain": [bytes(k) for k in self.chain],
            "durable": self.durable,
            "exact_only": self.exact_only,
        }


class SessionTable:
    """Sessions by id, and the chain arithmetic of an append.

    Not thread-safe: its owner (an async actor, or a store under its lock)
    serialises calls.

    Args:
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[str, SessionRecord] = {}
        # Thousands of sessions use a few layouts and namespaces: one shared
        # object each (per-session copies were most of an idle session's bytes).
        self._layouts: dict[bytes, KVLayout] = {}

    # -- the table ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._records

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(list(self._records.values()))

    def ids(self) -> list[str]:
        return list(self._records)

    def create(
        self,
        session_id: str,
        layout: KVLayout,
        *,
        namespace: str = "default",
        priority: Priority | str = Priority.NORMAL,
        durable: bool = False,
        exact_only: bool = False,
        finite_only: bool = False,
    ) -> SessionRecord:
        """Register a new, empty session.

        Args:
            durable: appends are acknowledged once their blocks are fsynced in
                the cold tier (``archive`` mode), not once they are in memory.
            exact_only: its blocks never take a lossy step while it holds them.

        Raises:
            InvalidInputError: bad id, layout, namespace or priority.
            ConflictError: the id exists.
        """
        check_stored_session_id(session_id)  # the one rule, checked once, here
        if not isinstance(layout, KVLayout):
            raise InvalidInputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(namespace, str) or not namespace:
            raise InvalidInputError(f"namespace must be a non-empty str, got {namespace!r}")
        prio = parse_priority(priority)
        if session_id in self._records:
            raise ConflictError(f"session {session_id!r} already exists")
        now = self._clock()
        record = SessionRecord(
            session_id,
            sys.intern(namespace),
            self._layouts.setdefault(layout.fingerprint, layout),
            prio,
            created_at=now,
            last_access=now,
            durable=bool(durable),
            exact_only=bool(exact_only),
            finite_only=bool(finite_only),
        )
        self._records[session_id] = record
        return record

    def restore(self, manifest: dict[str, Any], *, state: SessionState) -> SessionRecord:
        """Register a session again from its :meth:`SessionRecord.manifest` (after a restart).

        Raises:
            KeyError, TypeError, ValueError: a malformed manifest (the caller
                reports it as corrupt data).
            ConflictError: the id exists.
        """
        session_id = str(manifest["session_id"])
        record = self.create(
            session_id,
            KVLayout.from_dict(manifest["layout"]),
            namespace=str(manifest["namespace"]),
            priority=str(manifest["priority"]),
            durable=bool(manifest.get("durable", False)),
            exact_only=bool(manifest.get("exact_only", False)),
        )
        tokens = int(manifest["tokens"])
        chain = [BlockHash(bytes(k)) for k in manifest["chain"]]
        blocks = len(block_token_count(record.layout, tokens))
        if blocks != len(chain):
            del self._records[session_id]
            raise ValueError(
                f"session {session_id!r}: {tokens} tokens make {blocks} blocks, but the chain "
                f"has {len(chain)}"
            )
        record.tokens = tokens
        record.turn = int(manifest["turn"])
        record.chain = chain
        record.state = state
        return record

    def get(self, session_id: str) -> SessionRecord:
        """The session's record.

        Raises:
            UnknownSessionError: no such session.
            BlockLostError: the session's blocks are gone (it can only be deleted).
        """
        record = self._records.get(session_id) if isinstance(session_id, str) else None
        if record is None:
            raise UnknownSessionError(f"no session {session_id!r}")
        if record.lost_reason is not None:
            raise BlockLostError(f"session {session_id!r} is lost: {record.lost_reason}")
        return record

    def lookup(self, session_id: str) -> SessionRecord | None:
        """The record, lost or not; None when there is none."""
        return self._records.get(session_id)

    def pop(self, session_id: str) -> SessionRecord:
        """Forget a session (lost ones too).

        Raises:
            UnknownSessionError: no such session.
        """
        record = self._records.pop(session_id, None)
        if record is None:
            raise UnknownSessionError(f"no session {session_id!r}")
        return record

    def mark_lost(self, session_id: str, reason: str) -> None:
        self._records[session_id].lost_reason = reason

    # -- appends ------------------------------------------------------------------

    def plan_append(
        self,
        session_id: str,
        token_count: int,
        chain: Sequence[bytes],
        start_block: int = 0,
    ) -> ChainUpdate:
        """What appending a turn of ``token_count`` tokens (hashed into ``chain``) changes.

        Nothing changes until :meth:`commit_append`; the block store applies
        the update in between (and may refuse it).

        Raises:
            InvalidInputError: the chain or start block do not fit the token count.
        """
        record = self.get(session_id)
        if token_count <= 0:
            # A turn's tokens are the whole session's: none would drop every block.
            raise InvalidInputError(
                f"an append needs at least one token, got {token_count} (a turn carries the "
                f"session's whole token list; delete the session to drop its KV)"
            )
        counts = block_token_count(record.layout, token_count)
        if len(chain) != len(counts):
            raise InvalidInputError(
                f"{token_count} tokens make {len(counts)} blocks, the chain given has {len(chain)}"
            )
        if isinstance(start_block, bool) or not isinstance(start_block, int):
            raise InvalidInputError(f"start_block must be an int, got {start_block!r}")
        if not 0 <= start_block <= len(counts):
            raise InvalidInputError(
                f"start_block must be in [0, {len(counts)}] for {token_count} tokens, "
                f"got {start_block}"
            )
        new = tuple(BlockHash(bytes(k)) for k in chain)
        old = dict.fromkeys(record.chain)
        unique = dict.fromkeys(new)
        tail_rewrites = record.tail_rewrites
        if record.chain and record.chain[-1] not in unique and len(record.chain) <= len(new):
            tail_rewrites += 1  # the old partial tail was replaced by a longer one
        return ChainUpdate(
            layout=record.layout,
            chain=new,
            tokens=tuple(counts),
            start_block=start_block,
            priority=record.priority,
            was_active=record.active,
            hold=tuple(k for k in unique if k not in old),
            drop=tuple(k for k in old if k not in unique),
            kept=tuple(k for k in unique if k in old),
            tail_rewrites=tail_rewrites,
            exact_only=record.exact_only,
            turn=record.turn,
        )

    def commit_append(self, session_id: str, update: ChainUpdate) -> SessionRecord:
        """The block store applied ``update``: the session moves to its next turn."""
        record = self.get(session_id)
        record.chain = [BlockHash(k) for k in update.chain]
        record.tokens = sum(update.tokens)
        record.turn += 1
        record.tail_rewrites = update.tail_rewrites
        record.state = SessionState.ACTIVE
        record.last_access = self._clock()
        return record

    def check_turn(
        self, session_id: str, turn: int, chain: Sequence[bytes] | None, tokens: int
    ) -> bool:
        """Whether an append that says it creates ``turn`` is a retry of the last one.

        True: the last applied turn, same chain (answer as before, store
        nothing). False: the next turn (go ahead).

        Raises:
            ConflictError: an applied turn with other tokens, or a turn out of order.
        """
        record = self.get(session_id)
        if turn == record.turn and chain is not None and list(chain) == record.chain:
            return True
        if turn <= record.turn:
            raise ConflictError(
                f"turn {turn} of session {session_id!r} was already applied with other "
                f"tokens; the session is at turn {record.turn} ({record.tokens} tokens, "
                f"this append has {tokens})"
            )
        if turn != record.turn + 1:
            raise ConflictError(
                f"turn {turn} is out of order: session {session_id!r} is at turn "
                f"{record.turn}, the next append is turn {record.turn + 1}"
            )
        return False
