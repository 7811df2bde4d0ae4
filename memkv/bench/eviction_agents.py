"""Eviction suite on an agent-fleet trace (memkv.bench.agent_trace), beside Mooncake's.

The policies were never tuned on this workload: shared system prompts and tool
schemas, sessions idle for minutes to an hour that come back, and one-shot
long documents passing through. Same table as the ``eviction`` suite.
"""

from __future__ import annotations

from dataclasses import replace

from memkv.bench.agent_trace import AgentFleet, agent_fleet_trace
from memkv.bench.context import BenchContext
from memkv.bench.eviction import evaluate
from memkv.bench.report import SuiteResult

__all__ = ["FLEET", "QUICK_FLEET", "SEED", "run"]

FLEET = AgentFleet()
QUICK_FLEET = replace(AgentFleet(), agents=60, turns=(2, 10))
SEED = 0


def run(ctx: BenchContext) -> SuiteResult:
    fleet = QUICK_FLEET if ctx.quick else FLEET
    requests = agent_fleet_trace(fleet, seed=SEED)
    source = (f"agent fleet (memkv.bench.agent_trace, seed {SEED}: {fleet.agents} agents, "
              f"{fleet.system_prompts} system prompts x {fleet.tool_sets} tool sets, "
              f"idle p={fleet.idle_probability}, documents {fleet.document_share:.0%})")
    return evaluate(requests, source, ctx, suite="eviction-agents",
                    title="prefix-hit ratio on an agent-fleet trace, by cache size")
