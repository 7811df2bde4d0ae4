"""The routing policy without engines: sticky, then the KV's node, then least loaded;
spill past the threshold; failover avoids what was tried."""

from __future__ import annotations

from memkv.api.engines.policy import EngineLoad, Reason, SpillThreshold, choose_engine


def engine(eid: str, *, node: str = "", requests: int = 0, kv: float = 0.0,
           healthy: bool = True, model: str = "m") -> EngineLoad:
    return EngineLoad(eid, model, node, healthy, requests, kv)


FLEET = [engine("e1", node="n1", requests=3), engine("e2", node="n2", requests=1),
         engine("e3", node="n2", requests=0), engine("other", model="x")]


def test_least_loaded_of_the_model_when_nothing_else_is_known():
    choice = choose_engine("m", FLEET)
    assert choice is not None and (choice.engine_id, choice.reason) == ("e3", Reason.LEAST_LOADED)
    assert choose_engine("nope", FLEET) is None


def test_a_session_stays_on_its_engine_while_it_is_healthy_and_under_the_threshold():
    choice = choose_engine("m", FLEET, sticky="e1", kv_node="n2")
    assert choice is not None and (choice.engine_id, choice.reason) == ("e1", Reason.STICKY)


def test_the_kv_node_wins_over_load():
    choice = choose_engine("m", [engine("e1", node="n1"), engine("e2", node="n2", requests=5)],
                           kv_node="n2")
    assert choice is not None and (choice.engine_id, choice.reason) == ("e2", Reason.KV_NODE)


def test_an_engine_over_the_threshold_spills_to_another_and_the_kv_follows():
    spill = SpillThreshold(max_requests=4, max_kv_use=0.9)
    busy = [engine("e1", node="n1", requests=4), engine("e2", node="n2", requests=1)]
    choice = choose_engine("m", busy, sticky="e1", kv_node="n1", spill=spill)
    assert choice is not None and (choice.engine_id, choice.reason) == ("e2", Reason.SPILL)
    full = [engine("e1", kv=0.95), engine("e2", kv=0.2)]
    choice = choose_engine("m", full, sticky="e1", spill=spill)
    assert choice is not None and choice.engine_id == "e2"
    # Everyone over: the sticky engine keeps it (no better place).
    all_busy = [engine("e1", requests=9), engine("e2", requests=9)]
    choice = choose_engine("m", all_busy, sticky="e1", spill=spill)
    assert choice is not None and (choice.engine_id, choice.reason) == ("e1", Reason.STICKY)


def test_unhealthy_and_already_tried_engines_are_passed_over():
    fleet = [engine("e1", node="n1", healthy=False), engine("e2", node="n1"), engine("e3")]
    choice = choose_engine("m", fleet, sticky="e1", kv_node="n1")
    assert choice is not None and choice.engine_id == "e2"
    choice = choose_engine("m", fleet, sticky="e1", kv_node="n1", avoid=frozenset({"e2"}))
    assert choice is not None and choice.engine_id == "e3"
    assert choose_engine("m", fleet, avoid=frozenset({"e2", "e3"})) is None


def test_an_engine_s_own_bound_overrides_the_threshold():
    small = EngineLoad("e1", "m", "", True, 2, 0.0, max_requests=2)
    big = EngineLoad("e2", "m", "", True, 6, 0.0)  # under the default 32
    choice = choose_engine("m", [small, big], sticky="e1")
    assert choice is not None and (choice.engine_id, choice.reason) == ("e2", Reason.SPILL)
    roomy = EngineLoad("e1", "m", "", True, 40, 0.0, max_requests=64)
    choice = choose_engine("m", [roomy, big], sticky="e1")
    assert choice is not None and (choice.engine_id, choice.reason) == ("e1", Reason.STICKY)
