"""Admitting sessions to one router shard: quotas that span shards, placement near a
node, and the adoption of chains whose blocks are all archived already.

The journal is the caller's: it makes the records durable before it answers.
"""

from __future__ import annotations

from msgspec.structs import asdict as msgspec_asdict

from memkv.errors import InvalidInputError
from memkv.protocol.enums import AckMode, SessionState
from memkv.protocol.layout import block_token_count
from memkv.protocol.services import CreateSession
from memkv.router.members import Members
from memkv.router.peers import ShardPeers
from memkv.router.sessions import SessionRecord
from memkv.router.state import RouterState, tenant_of

__all__ = ["Admission"]


class Admission:
    """New sessions of one shard, admitted against the tenant's quota everywhere."""

    def __init__(self, state: RouterState, members: Members, peers: ShardPeers, owner: str,
                 default_ack: str) -> None:
        self.state = state
        self.members = members
        self.peers = peers
        self.owner = owner
        self.default_ack = default_ack

    async def admit(self, request: CreateSession,
                    elsewhere: dict[str, tuple[int, int]]) -> SessionRecord:
        """Admit and record one session; ``elsewhere``: other shards' use per tenant,
        filled as asked (a bulk create asks once per tenant)."""
        session_id = request.session_id
        self.peers.check_owned(session_id)
        ack = self.default_ack if request.ack is None else request.ack.value
        if request.quota is not None:
            quota = request.quota.limits()
            tenant = tenant_of(session_id)
            if tenant not in elsewhere:
                elsewhere[tenant] = await self.peers.usage_elsewhere(session_id, quota)
            self.state.check_quota(session_id, max_sessions=quota[0], new_session=True,
                                   elsewhere=elsewhere[tenant])
        record = self.state.create(
            session_id,
            msgspec_asdict(request.layout),
            request.namespace,
            request.priority.value,
            durable=ack == AckMode.ARCHIVE,
            exact_only=request.exact_only,
            finite_only=request.finite_only,
        )
        if request.near_node:
            # Placed now, on that node if it has a live device (else as any session
            # is, at its first append). Not journaled: a router restarted before the
            # first append places it again, by load.
            self.state.place_near(session_id, request.near_node)
        return record

    async def adopt(self, request: CreateSession, chain: list[bytes], tokens: int,
                    turn: int) -> SessionRecord:
        """A session whose blocks are all in the cold tier already (an earlier
        version's records, another store's): registered archived, its chain held
        whole by a device.

        Raises:
            BlockLostError: a block is in no tier (nothing is registered).
            InvalidInputError: the chain does not cover ``tokens``.
        """
        layout = request.layout.layout()
        need = len(block_token_count(layout, tokens))
        if len(chain) != need:
            raise InvalidInputError(
                f"the chain has {len(chain)} blocks; {tokens} tokens take {need}")
        record = await self.admit(request, {})
        session_id = request.session_id
        try:
            update = self.state.sessions.plan_append(session_id, tokens, chain, 0)
            device_id = self.state.place(session_id, chain)
            await self.members.call(device_id, session_id, lambda d: d.adopt(
                layout, chain, block_token_count(layout, tokens), record.priority.value,
                record.exact_only, self.owner, False))
        except BaseException:
            self.state.delete(session_id)
            raise
        record.turn = max(turn, 1) - 1  # the put below is its turn
        self.state.record_put(session_id, update)
        self.state.record_state(session_id, SessionState.ARCHIVED)
        return record
