"""A seeded generator of agent-fleet traces, which differ from chat traces.

What an agent fleet does that a chat service does not, and how it is modelled
(every draw from one ``random.Random(seed)``):

- **Shared prefixes.** Each agent runs one of ``system_prompts`` system prompts
  (``system_blocks`` blocks each) followed by one of ``tool_sets`` tool-schema
  sets (``tool_blocks`` blocks). Blocks are chained like memkv's hashes: a
  block's id is a function of its parent's id and its content, so the same
  schema after another system prompt is another block.
- **Turns that grow the context.** A session's turn re-reads its whole history
  and appends 1-4 new blocks (the user message, a tool call and its output).
- **Long idle stretches.** Between turns an agent usually thinks for seconds
  (exponential, mean ``think_ms``) but with probability ``idle_probability``
  goes idle for a long stretch (log-uniform between 1 and 60 minutes) — waiting
  on a human or a slow tool — and then comes back to the same context.
- **One-shot documents.** A share ``document_share`` of requests are one-shot
  reads of a long document (``document_blocks`` fresh blocks after a system
  prompt) that never return: a scan that an LRU admits and loses by.

Times are in milliseconds, as in the Mooncake trace; requests come out sorted
by time as :class:`memkv.bench.trace_replay.Request` objects.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import struct
from dataclasses import dataclass

from memkv.bench.trace_replay import Request

__all__ = ["AgentFleet", "TurnHint", "agent_fleet_trace", "agent_fleet_turns"]


@dataclass(frozen=True, slots=True)
class AgentFleet:
    """The fleet's shape (see the module docstring for each knob)."""

    agents: int = 600
    turns: tuple[int, int] = (3, 30)
    system_prompts: int = 4
    system_blocks: int = 6
    tool_sets: int = 8
    tool_blocks: int = 4
    think_ms: float = 4_000.0
    idle_probability: float = 0.25
    idle_ms: tuple[float, float] = (60_000.0, 3_600_000.0)
    document_share: float = 0.05
    document_blocks: tuple[int, int] = (20, 60)
    arrival_window_ms: float = 1_800_000.0  # agents start over the first 30 minutes


def _chain(parent: int, content: int) -> int:
    digest = hashlib.blake2b(struct.pack("<qq", parent, content), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit id


def _prefix(system: int, tools: int, fleet: AgentFleet) -> list[int]:
    ids: list[int] = []
    parent = -1
    for i in range(fleet.system_blocks):
        parent = _chain(parent, 1_000 * system + i)
        ids.append(parent)
    for i in range(fleet.tool_blocks):
        parent = _chain(parent, 1_000_000 + 1_000 * tools + i)
        ids.append(parent)
    return ids


@dataclass(frozen=True, slots=True)
class TurnHint:
    """What a request's session says of itself when its turn ends (docs/front-door.md):
    it pauses for about ``pause_ms`` (an agent waiting on a human or a slow tool
    says so, not knowing the gap exactly), it is done (``final``: its last turn, or
    a one-shot document read), or nothing (it is thinking, back within seconds)."""

    session: int
    pause_ms: float | None = None
    final: bool = False


#: How far off an agent's stated pause is: the true gap times e^N(0, sigma).
PAUSE_ESTIMATE_SIGMA = 0.5


def agent_fleet_trace(fleet: AgentFleet = AgentFleet(), seed: int = 0) -> list[Request]:
    """The trace of ``fleet``, deterministic for ``seed``."""
    return [request for request, _ in agent_fleet_turns(fleet, seed)]


def agent_fleet_turns(fleet: AgentFleet = AgentFleet(),
                      seed: int = 0) -> list[tuple[Request, TurnHint]]:
    """The trace of ``fleet`` with each request's lifecycle hint (the same requests as
    :func:`agent_fleet_trace`; the hints' estimates draw from a second generator)."""
    rng = random.Random(seed)
    estimates = random.Random(seed + 1_000_003)
    fresh = iter(range(10**9, 2 * 10**9))  # content ids of new blocks, never repeated
    # (time, tie-breaker, agent) of each agent's next turn.
    queue: list[tuple[float, int, int]] = []
    history: dict[int, list[int]] = {}
    turns_left: dict[int, int] = {}
    for agent in range(fleet.agents):
        history[agent] = _prefix(rng.randrange(fleet.system_prompts),
                                 rng.randrange(fleet.tool_sets), fleet)
        turns_left[agent] = rng.randint(*fleet.turns)
        heapq.heappush(queue, (rng.uniform(0, fleet.arrival_window_ms), agent, agent))
    requests: list[tuple[Request, TurnHint]] = []
    documents_due = 0.0
    while queue:
        t, _, agent = heapq.heappop(queue)
        chain = history[agent]
        for _ in range(rng.randint(1, 4)):
            chain.append(_chain(chain[-1], next(fresh)))
        turn = len(requests)
        requests.append((Request(t, tuple(chain)), TurnHint(agent, final=True)))
        # One-shot documents, interleaved at their share of the traffic.
        documents_due += fleet.document_share / (1 - fleet.document_share)
        while documents_due >= 1:
            documents_due -= 1
            doc = _prefix(rng.randrange(fleet.system_prompts), 0, fleet)[: fleet.system_blocks]
            for _ in range(rng.randint(*fleet.document_blocks)):
                doc.append(_chain(doc[-1], next(fresh)))
            requests.append((Request(t + rng.uniform(0, 1), tuple(doc)),
                             TurnHint(-len(requests) - 1, final=True)))  # one-shot
        turns_left[agent] -= 1
        if turns_left[agent] > 0:
            hint = TurnHint(agent)  # thinking: back within seconds
            if rng.random() < fleet.idle_probability:
                lo, hi = fleet.idle_ms
                gap = math.exp(rng.uniform(math.log(lo), math.log(hi)))
                hint = TurnHint(agent, pause_ms=gap * math.exp(
                    estimates.gauss(0.0, PAUSE_ESTIMATE_SIGMA)))
            else:
                gap = rng.expovariate(1 / fleet.think_ms)
            requests[turn] = (requests[turn][0], hint)
            heapq.heappush(queue, (t + gap, len(requests), agent))
    requests.sort(key=lambda pair: pair[0].timestamp)
    return [(Request(float(int(r.timestamp)), r.hash_ids), hint) for r, hint in requests]
