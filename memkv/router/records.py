"""The router journal's records: what a snapshot writes, and how each is replayed.

The journal (:class:`~memkv.storage.journal.Journal`) is the session table's
only persistence: every change is one record, and a restarted router rebuilds
:class:`~memkv.storage.router.state.RouterState` by replaying them
(``docs/durability.md``). A snapshot rewrites the journal as the fewest records
that replay to the table as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memkv.errors import CorruptDataError
from memkv.protocol.enums import SessionState
from memkv.storage.sessions import parse_priority

if TYPE_CHECKING:
    from memkv.storage.router.state import RouterState

__all__ = ["apply_record", "snapshot_records"]


def snapshot_records(state: RouterState) -> list[dict[str, Any]]:
    """The records that replay to ``state``'s table (devices, archives, sessions)."""
    records: list[dict[str, Any]] = [{"op": "device", "name": n} for n in state.known_devices]
    records += [{"op": "archive", "name": n} for n in state.known_archives]
    for r in state.sessions:
        records.append(
            {
                "op": "create",
                "id": r.session_id,
                "ns": r.namespace,
                "layout": r.layout.to_dict(),
                "prio": r.priority.value,
                "durable": r.durable,
                "exact_only": r.exact_only,
                "finite_only": r.finite_only,
            }
        )
        if r.chain or r.turn:
            records.append(
                {
                    "op": "put",
                    "id": r.session_id,
                    "chain": [bytes(k) for k in r.chain],
                    "tokens": r.tokens,
                    "turn": r.turn,
                    "tail": r.tail_rewrites,
                    "device": r.device_id,
                }
            )
        if not r.active:
            records.append({"op": "state", "id": r.session_id, "state": r.state.value})
        if r.partial_reason is not None:
            records.append(
                {
                    "op": "truncate",
                    "id": r.session_id,
                    "keep": len(r.chain),
                    "lost_tokens": r.lost_tokens,
                    "reason": r.partial_reason,
                }
            )
        if r.lost_reason is not None:
            records.append({"op": "lost", "id": r.session_id, "reason": r.lost_reason})
    return records


def apply_record(state: RouterState, entry: dict[str, Any]) -> None:
    """Replay one journal record onto ``state`` (the journal is the table's history)."""
    op = entry["op"]
    if op == "device":
        if entry["name"] not in state.known_devices:
            state.known_devices.append(entry["name"])
    elif op == "forget_device":
        state.forget_device(entry["name"])
    elif op == "forget_archive":
        if entry["name"] in state.known_archives:
            state.known_archives.remove(entry["name"])
    elif op == "archive":
        if entry["name"] not in state.known_archives:
            state.known_archives.append(entry["name"])
    elif op == "create":
        state.create(
            entry["id"],
            entry["layout"],
            entry["ns"],
            entry["prio"],
            durable=bool(entry.get("durable", False)),
            exact_only=bool(entry.get("exact_only", False)),
            finite_only=bool(entry.get("finite_only", False)),
        )
    elif op == "put":
        record = state.sessions.lookup(entry["id"])
        if record is not None:
            state.restore_chain(record, entry["chain"], int(entry["tokens"]), int(entry["turn"]),
                                int(entry.get("tail", 0)), entry.get("device"))
    elif op in ("state", "prio"):
        found = state.sessions.lookup(entry["id"])
        if found is not None and op == "state":
            found.state = SessionState(entry["state"])
        elif found is not None:
            found.priority = parse_priority(entry["prio"])
    elif op == "move":
        state.move(entry["id"], entry["device"])
    elif op == "delete":
        if entry["id"] in state.sessions:
            state.delete(entry["id"])
    elif op == "lost":
        if entry["id"] in state.sessions:
            state.mark_lost(entry["id"], entry["reason"])
    elif op == "truncate":
        found = state.sessions.lookup(entry["id"])
        if found is not None and 0 < int(entry["keep"]) <= len(found.chain):
            state.truncate(entry["id"], int(entry["keep"]), str(entry["reason"]))
            found.lost_tokens = int(entry["lost_tokens"])
    else:
        raise CorruptDataError(f"unknown router journal record {op!r}")

