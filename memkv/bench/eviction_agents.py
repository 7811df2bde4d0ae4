"""Eviction suite on an agent-fleet trace (memkv.bench.agent_trace), beside Mooncake's.

The policies were never tuned on this workload: shared system prompts and tool
schemas, sessions idle for minutes to an hour that come back, and one-shot
long documents passing through. Same table as the ``eviction`` suite, plus the
lifecycle policy (memkv/storage/eviction/lifecycle.py) replayed with the
sessions' own hints: each turn says whether its agent is thinking, pausing (with
a stated gap, e^N(0, 0.5) off the true one) or done, as an agent says it
through the front door (``memkv.pause``, ``memkv.final``, a response that ends
in tool calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from memkv.bench.agent_trace import AgentFleet, TurnHint, agent_fleet_turns
from memkv.bench.context import BenchContext
from memkv.bench.eviction import HINTED_LABEL, PolicyResult, evaluate
from memkv.bench.report import SuiteResult
from memkv.bench.trace_replay import SUBSTEP_MS, Request
from memkv.storage.eviction.lifecycle import LifecyclePolicy

__all__ = ["FLEET", "QUICK_FLEET", "SEED", "replay_hinted", "run"]

FLEET = AgentFleet()
QUICK_FLEET = replace(AgentFleet(), agents=60, turns=(2, 10))
SEED = 0


def replay_hinted(turns: Sequence[tuple[Request, TurnHint]], capacity: int) -> PolicyResult:
    """The lifecycle policy on ``turns`` with prefix semantics (as
    :func:`memkv.bench.trace_replay.replay`): each request is a turn of its
    session, and its hint ends the turn."""
    import time

    policy: LifecyclePolicy[int] = LifecyclePolicy()
    hits = requested = 0
    now = float("-inf")
    start = time.perf_counter()
    for request, hint in turns:
        blocks = request.hash_ids
        requested += len(blocks)
        for b in blocks:
            if b not in policy:
                break
            hits += 1
        now = max(request.timestamp, now + SUBSTEP_MS)
        policy.start_turn(hint.session, now)
        parent: int | None = None
        for b in blocks:
            now = max(request.timestamp, now + SUBSTEP_MS)
            if b in policy:
                policy.access(b, now)
            else:
                policy.insert(b, now, parent)
                while len(policy) > capacity and policy.pop_victim(now) is not None:
                    pass
            parent = b
        policy.end_turn(hint.session, now, pause_ms=hint.pause_ms, final=hint.final)
    return PolicyResult(HINTED_LABEL, capacity, hits, requested, time.perf_counter() - start)


def run(ctx: BenchContext) -> SuiteResult:
    fleet = QUICK_FLEET if ctx.quick else FLEET
    turns = agent_fleet_turns(fleet, seed=SEED)
    requests = [request for request, _ in turns]
    source = (f"agent fleet (memkv.bench.agent_trace, seed {SEED}: {fleet.agents} agents, "
              f"{fleet.system_prompts} system prompts x {fleet.tool_sets} tool sets, "
              f"idle p={fleet.idle_probability}, documents {fleet.document_share:.0%})")
    return evaluate(requests, source, ctx, suite="eviction-agents",
                    title="prefix-hit ratio on an agent-fleet trace, by cache size",
                    hinted=lambda capacity: replay_hinted(turns, capacity))
