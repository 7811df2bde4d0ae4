"""The article's throughput claim is read from the fleet suite's result, not typed in."""

from __future__ import annotations

from memkv.bench.claims import claims_table


def _fleet(runs: list[dict], targets: dict | None = None) -> dict:
    return {"suite": "fleet", "columns": [], "rows": [],
            "figures": {"runs": runs, "targets": targets or {}}}


def test_the_throughput_claim_is_the_fleet_suites_figure():
    runs = [{"setting": "KV space < fleet", "engine": "vLLM alone", "requests_per_s": 0.5},
            {"setting": "KV space < fleet", "engine": "vLLM + memkv (same node)",
             "requests_per_s": 1.0}]
    targets = {"routed_requests_per_s_vs_round_robin": {"measured": 1.25, "target": 1.3}}
    line = next(row for row in claims_table([_fleet(runs, targets)]) if "12 -> 21" in row)
    assert "0.50 -> 1.00 requests/s (2.00x)" in line and "1.25x a round-robin" in line
    missing = next(row for row in claims_table([]) if "12 -> 21" in row)
    assert "not measured (no fleet result" in missing
