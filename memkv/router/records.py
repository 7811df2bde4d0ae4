"""The router journal's records, typed: what each change writes, and how each is replayed.

The journal (:class:`~memkv.storage.journal.Journal`) is the session table's
only persistence: every change is one record, and a restarted router rebuilds
:class:`~memkv.router.state.RouterState` by replaying them
(``docs/durability.md``). A snapshot rewrites the journal as the fewest records
that replay to the table as it is.

Each record is a frozen struct of a tagged union (:data:`JournalRecord`, tagged
by ``op``), written as the same msgpack map the journal has always held, so
journals of earlier versions replay unchanged. Replay dispatches on the type
against :class:`Table`, the part of the state a record changes, so this module
does not import the state it rebuilds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import msgspec

from memkv.errors import CorruptDataError
from memkv.protocol.enums import Priority, SessionState
from memkv.router.response_table import ResponseTable
from memkv.router.sessions import SessionRecord, SessionTable, parse_priority

__all__ = [
    "ArchiveKnown",
    "ArchiveForgotten",
    "ChainPut",
    "DeviceForgotten",
    "DeviceKnown",
    "JournalRecord",
    "PriorityChanged",
    "ResponseDeleted",
    "ResponseStored",
    "SessionCreated",
    "SessionDeleted",
    "SessionLost",
    "SessionMoved",
    "SessionTruncated",
    "StateChanged",
    "Table",
    "apply_record",
    "decode_record",
    "encode_record",
    "snapshot_records",
]


class _Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="op"):
    pass


class DeviceKnown(_Record, frozen=True, tag="device"):
    name: str


class DeviceForgotten(_Record, frozen=True, tag="forget_device"):
    name: str


class ArchiveKnown(_Record, frozen=True, tag="archive"):
    name: str


class ArchiveForgotten(_Record, frozen=True, tag="forget_archive"):
    name: str


class SessionCreated(_Record, frozen=True, tag="create"):
    id: str
    ns: str
    layout: dict[str, Any]  # KVLayout.to_dict(): parsed once per distinct dict on replay
    prio: str
    durable: bool = False
    exact_only: bool = False
    finite_only: bool = False


class ChainPut(_Record, frozen=True, tag="put"):
    id: str
    chain: list[bytes]
    tokens: int
    turn: int
    tail: int = 0
    device: str | None = None


class StateChanged(_Record, frozen=True, tag="state"):
    id: str
    state: SessionState


class PriorityChanged(_Record, frozen=True, tag="prio"):
    id: str
    prio: str


class SessionMoved(_Record, frozen=True, tag="move"):
    id: str
    device: str


class SessionDeleted(_Record, frozen=True, tag="delete"):
    id: str


class SessionLost(_Record, frozen=True, tag="lost"):
    id: str
    reason: str


class SessionTruncated(_Record, frozen=True, tag="truncate"):
    id: str
    keep: int
    lost_tokens: int
    reason: str


class ResponseStored(_Record, frozen=True, tag="response"):
    """A stored response of the session (:mod:`memkv.protocol.responses`), kept whole."""

    id: str
    rid: str
    doc: bytes  # the StoredResponse, msgpack


class ResponseDeleted(_Record, frozen=True, tag="forget_response"):
    id: str
    rid: str


JournalRecord = (
    DeviceKnown | DeviceForgotten | ArchiveKnown | ArchiveForgotten | SessionCreated
    | ChainPut | StateChanged | PriorityChanged | SessionMoved | SessionDeleted | SessionLost
    | SessionTruncated | ResponseStored | ResponseDeleted
)


def encode_record(record: JournalRecord) -> dict[str, Any]:
    """The record as the journal stores it (a msgpack map of plain values)."""
    entry: dict[str, Any] = msgspec.to_builtins(record, builtin_types=(bytes,))
    return entry


def decode_record(entry: Any) -> JournalRecord:
    """A stored record, typed.

    Raises:
        CorruptDataError: an unknown ``op`` or a field of the wrong type (named).
    """
    try:
        record: JournalRecord = msgspec.convert(entry, JournalRecord)
    except msgspec.ValidationError as e:
        raise CorruptDataError(f"a router journal record that does not decode: {e}") from None
    return record


class Table(Protocol):
    """What a replayed record changes (:class:`memkv.router.state.RouterState`)."""

    known_devices: list[str]
    known_archives: list[str]
    sessions: SessionTable
    responses: ResponseTable

    def forget_device(self, device_id: str) -> None: ...

    def create(self, session_id: str, layout: dict[str, Any], namespace: str,
               priority: Priority | str, durable: bool = False, exact_only: bool = False,
               finite_only: bool = False) -> SessionRecord: ...

    def restore_chain(self, record: SessionRecord, chain: Sequence[bytes], tokens: int,
                      turn: int, tail_rewrites: int, device_id: str | None) -> None: ...

    def move(self, session_id: str, device_id: str) -> None: ...

    def delete(self, session_id: str) -> list[bytes]: ...

    def mark_lost(self, session_id: str, reason: str) -> None: ...

    def truncate(self, session_id: str, keep_blocks: int, reason: str) -> list[bytes]: ...


def apply_record(table: Table, record: JournalRecord) -> None:
    """Replay one journal record onto ``table`` (the journal is the table's history)."""
    match record:
        case DeviceKnown(name=name):
            if name not in table.known_devices:
                table.known_devices.append(name)
        case DeviceForgotten(name=name):
            table.forget_device(name)
        case ArchiveKnown(name=name):
            if name not in table.known_archives:
                table.known_archives.append(name)
        case ArchiveForgotten(name=name):
            if name in table.known_archives:
                table.known_archives.remove(name)
        case SessionCreated():
            table.create(record.id, record.layout, record.ns, record.prio,
                         durable=record.durable, exact_only=record.exact_only,
                         finite_only=record.finite_only)
        case ChainPut():
            found = table.sessions.lookup(record.id)
            if found is not None:
                table.restore_chain(found, record.chain, record.tokens, record.turn,
                                    record.tail, record.device)
        case StateChanged():
            found = table.sessions.lookup(record.id)
            if found is not None:
                found.state = record.state
        case PriorityChanged():
            found = table.sessions.lookup(record.id)
            if found is not None:
                found.priority = parse_priority(record.prio)
        case SessionMoved():
            table.move(record.id, record.device)
        case SessionDeleted():
            if record.id in table.sessions:
                table.delete(record.id)
        case SessionLost():
            if record.id in table.sessions:
                table.mark_lost(record.id, record.reason)
        case SessionTruncated():
            found = table.sessions.lookup(record.id)
            if found is not None and 0 < record.keep <= len(found.chain):
                table.truncate(record.id, record.keep, record.reason)
                found.lost_tokens = record.lost_tokens
        case ResponseStored():
            table.responses.restore(record.id, record.rid, record.doc)
        case ResponseDeleted():
            table.responses.remove(record.id, record.rid)


def snapshot_records(known_devices: Iterable[str], known_archives: Iterable[str],
                     sessions: Iterable[SessionRecord],
                     responses: Iterable[tuple[str, str, bytes]] = ()) -> list[JournalRecord]:
    """The records that replay to a table of these members, sessions and stored
    responses (``(session, response id, document)``)."""
    records: list[JournalRecord] = [DeviceKnown(name=n) for n in known_devices]
    records += [ArchiveKnown(name=n) for n in known_archives]
    for r in sessions:
        records.append(SessionCreated(
            id=r.session_id, ns=r.namespace, layout=r.layout.to_dict(), prio=r.priority.value,
            durable=r.durable, exact_only=r.exact_only, finite_only=r.finite_only))
        if r.chain or r.turn:
            records.append(ChainPut(id=r.session_id, chain=[bytes(k) for k in r.chain],
                                    tokens=r.tokens, turn=r.turn, tail=r.tail_rewrites,
                                    device=r.device_id))
        if not r.active:
            records.append(StateChanged(id=r.session_id, state=r.state))
        if r.partial_reason is not None:
            records.append(SessionTruncated(id=r.session_id, keep=len(r.chain),
                                            lost_tokens=r.lost_tokens, reason=r.partial_reason))
        if r.lost_reason is not None:
            records.append(SessionLost(id=r.session_id, reason=r.lost_reason))
    records += [ResponseStored(id=s, rid=rid, doc=doc) for s, rid, doc in responses]
    return records
