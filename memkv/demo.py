"""`make demo`: memkv doing its job for agent sessions on the embedded default.

Starts the embedded cluster (a local Ray on 127.0.0.1 with a device actor, an
archive actor and the router) and the HTTP gateway, builds the reference
Llama-architecture model offline (fixed seed; ``--model PATH`` loads any local
HF causal LM instead), and runs several agent sessions for several turns
through the gateway, all starting with one shared system prompt.

Each turn of each session: restore the session's cache from memkv (its own
chain, or — for a new session — the system prompt another session stored),
prefill only the tokens it does not cover, decode greedily, and save the new
cache. The same turn is also recomputed from scratch, and the table shows both
times to first token side by side, the tokens reused and the tier every
restored block was found in. One session is suspended to the cold tier between
turns and resumed lazily at its next one.

Checks (exit code 0 only if all pass): every restored block is byte-identical
to the KV that was saved, and every greedy continuation from a restored cache
equals the one from a full recompute. The KV is stored in the model's dtype
with later rounds kept in it too (``device.precision.later_dtype``), and the
cold tier's online codec is lossless, so both checks must hold exactly.

Every figure printed is measured in this run; the tokens are random ids
(random weights make no sense of text anyway).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import DynamicCache

from memkv.client import Client
from memkv.config import MemkvConfig, load_config
from memkv.demo_settings import DemoSettings
from memkv.integrations.reference_model import REFERENCE_MODEL_ID, build_reference_model
from memkv.integrations.transformers import (
    Generation,
    Restored,
    RestoreSource,
    cache_to_kv,
    greedy_decode,
    kv_to_cache,
    layout_for,
    restore,
    save_turn,
)
from memkv.protocol.hashing import chain_hashes
from memkv.storage.config import MIB
from memkv.storage.layout import KVLayout, join_blocks, split_kv

__all__ = ["DemoSettings", "run", "run_demo"]

NAMESPACE = "demo-tenant"
TIERS = ("hot", "warm", "cold")
# Hot and warm tiers of the demo's device, in blocks of the model: small on
# purpose, so blocks are demoted while the demo runs and every tier serves some.
HOT_BLOCKS = 3
WARM_BLOCKS = 2
# The allocator's unit for the demo's small tiers (the 'edge' profile's 1 MiB).
ALLOCATOR_UNIT = MIB
EMBEDDED_OBJECT_STORE_BYTES = 256 * MIB
# Tokens of a first forward pass that warms the model up before anything is timed.
WARMUP_TOKENS = 32
MS = 1e3


@dataclass(slots=True)
class _Checks:
    kv_exact: int = 0
    kv_total: int = 0
    same_tokens: int = 0
    turns: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures and self.turns > 0


def _load_model(settings: DemoSettings) -> tuple[Any, str]:
    """The model (eval mode) and the model id its caches are fingerprinted with."""
    if settings.model is None:
        model = build_reference_model(settings.seed)
        return model, f"{REFERENCE_MODEL_ID}-seed{settings.seed}"
    from transformers import AutoModelForCausalLM

    path = settings.model.expanduser().resolve()
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    return model, f"{path.name}@{path}"


def _cluster_config(layout: KVLayout, data_dir: Path) -> MemkvConfig:
    block = layout.block_nbytes()
    unit = ALLOCATOR_UNIT
    # Round the tiers up to whole units (the arena would round them down).
    hot = -(-HOT_BLOCKS * block // unit) * unit
    warm = -(-WARM_BLOCKS * block // unit) * unit
    return load_config(
        overrides={
            "cluster": {
                "namespace": "memkv-demo",
                "embedded_devices": 1,
                "embedded_object_store_bytes": EMBEDDED_OBJECT_STORE_BYTES,
            },
            "device": {
                "hot_capacity_bytes": hot,
                "warm_capacity_bytes": warm,
                "allocator": {"min_unit_bytes": unit},
                # Later rounds stay in the model dtype: the lossless path whose
                # exactness the demo checks (the default would keep them in fp16).
                "precision": {"later_dtype": layout.dtype},
            },
            "archive": {"directory": str(data_dir / "archive"), "fsync": "never"},
        },
        environ={},
    )


class _SavedBlocks:
    """The blocks this process saved, by key, to check what memkv gives back.

    The first writer of a key wins, as in the store (later writers deduplicate).
    """

    def __init__(self, layout: KVLayout, namespace: str) -> None:
        self._layout = layout
        self._namespace = namespace
        self._blocks: dict[bytes, torch.Tensor] = {}

    def add(self, token_ids: Sequence[int], keys: list[torch.Tensor],
            values: list[torch.Tensor]) -> None:
        chain = chain_hashes(token_ids, self._layout, self._namespace)
        for key, block in zip(chain, split_kv(self._layout, keys, values), strict=True):
            self._blocks.setdefault(bytes(key), block)

    def matches(
        self, restored: Restored, kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None
    ) -> bool:
        """Whether the restored KV is byte-identical to the blocks saved under its keys."""
        if kv is None:
            return restored.tokens == 0
        if any(k not in self._blocks for k in restored.keys):
            return False
        want_k, want_v = join_blocks(self._layout, [self._blocks[k] for k in restored.keys])
        got_k, got_v = kv
        n = restored.tokens
        return all(
            torch.equal(w[:, :n], g) for w, g in zip(want_k + want_v, got_k + got_v, strict=True)
        )


def _tier_counts(tiers: Sequence[str]) -> str:
    counts = Counter(tiers)
    return "/".join(str(counts.get(t, 0)) for t in TIERS)


def _print_header() -> None:
    print(
        f"\n{'session':<9} {'turn':>4} {'prompt':>6} {'reused':>6} {'from':<7} "
        f"{'h/w/c':>7} {'restore':>8} {'prefill':>7} {'TTFT memkv':>10} "
        f"{'TTFT recompute':>14} {'speedup':>7} {'saved':>5}  {'KV':<5} {'tokens':<6}"
    )
    print(
        f"{'':<9} {'':>4} {'tokens':>6} {'tokens':>6} {'':<7} {'blocks':>7} {'ms':>8} "
        f"{'tokens':>7} {'ms':>10} {'ms':>14} {'':>7} {'blk':>5}"
    )


def _print_tier_stats(stats: dict[str, Any]) -> None:
    print("\ntier statistics (from the gateway's /v1/stats)")
    print(f"  {'device':<22} {'tier':<5} {'blocks':>6} {'used MiB':>9} {'capacity MiB':>12} "
          f"{'hits':>6} {'evictions':>9}")
    for device_id, dev in sorted(stats.get("devices", {}).items()):
        for tier in TIERS:
            ts = dev.get("tiers", {}).get(tier)
            if ts is None:
                continue
            cap = ts.get("capacity_bytes")
            cap_s = f"{cap / MIB:12.1f}" if cap else f"{'disk':>12}"
            print(
                f"  {device_id[:22]:<22} {tier:<5} {ts['blocks']:>6} "
                f"{ts['used_bytes'] / MIB:>9.1f} {cap_s} {ts['hits']:>6} {ts['evictions']:>9}"
            )
        print(
            f"  {'':<22} distinct blocks {dev.get('blocks')}, stored as "
            f"{dev.get('unique_bytes', 0) / MIB:.1f} MiB (dedup saved "
            f"{dev.get('dedup_bytes_saved', 0) / MIB:.1f} MiB); promotions "
            f"{dev.get('promotions')}, demotions {dev.get('demotions')}, prefetched "
            f"{dev.get('prefetched')} ({dev.get('prefetch_used')} used)"
        )
    # Sessions are the router's: the devices hold blocks only.
    print(
        f"  sessions {stats.get('sessions')}, logical KV "
        f"{stats.get('logical_bytes', 0) / MIB:.1f} MiB (every session's blocks, shared ones "
        f"counted per session)"
    )
    for name, arch in sorted(stats.get("archives", {}).items()):
        print(
            f"  {name[:22]:<22} archive: {arch.get('blocks')} blocks, "
            f"{arch.get('bytes_on_disk', 0) / MIB:.1f} MiB on disk in "
            f"{arch.get('segments')} segment(s), corrupt records {arch.get('corrupt_records')}"
        )


@dataclass(frozen=True, slots=True)
class _TurnMeasure:
    restored: Restored
    restored_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None  # a copy, as restored
    restore_s: float  # the one real restore: blocks come from the tier they were in
    ttft_memkv_s: float  # restore + the fastest prefill of the uncovered tokens
    ttft_recompute_s: float  # the fastest prefill of the whole prompt
    fast: Generation  # the continuation from the restored cache
    full: Generation  # the continuation from a full recompute


def _measure_turn(
    client: Client, model: Any, prompt: list[int], layout: KVLayout, sid: str,
    settings: DemoSettings,
) -> _TurnMeasure:
    """One turn both ways.

    The restore runs once (a second would find every block promoted to the hot
    tier). Prefills are pure compute on a machine other work shares, so each
    is timed ``settings.repeats`` times and the fastest kept, for both paths alike.
    """
    start = time.perf_counter()
    restored = restore(client, prompt, layout=layout, namespace=NAMESPACE, session_id=sid,
                       config=model.config)
    restore_s = time.perf_counter() - start
    kv = None
    if restored.cache is not None:
        keys, values = cache_to_kv(restored.cache)
        kv = ([k.clone() for k in keys], [v.clone() for v in values])

    def fresh() -> DynamicCache | None:
        return None if kv is None else kv_to_cache(*kv, model.config)

    fast = greedy_decode(model, prompt, cache=restored.cache, max_new_tokens=settings.new_tokens)
    full = greedy_decode(model, prompt, max_new_tokens=settings.new_tokens)
    memkv_prefill = [fast.first_token_s]
    recompute = [full.first_token_s]
    for _ in range(settings.repeats - 1):
        memkv_prefill.append(
            greedy_decode(model, prompt, cache=fresh(), max_new_tokens=1).first_token_s
        )
        recompute.append(greedy_decode(model, prompt, max_new_tokens=1).first_token_s)
    return _TurnMeasure(
        restored, kv, restore_s, restore_s + min(memkv_prefill), min(recompute), fast, full
    )


def _run_turns(
    client: Client,
    model: Any,
    layout: KVLayout,
    settings: DemoSettings,
    checks: _Checks,
    on_turn: Callable[[], None] = lambda: None,
) -> list[float]:
    """All turns of all sessions; returns the TTFT speedups of turns that reused KV.

    ``on_turn`` is called after each turn (the progress bar advances).
    """
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    gen = torch.Generator().manual_seed(settings.seed)
    system = torch.randint(0, vocab, (settings.system_tokens,), generator=gen).tolist()
    sessions = [f"agent-{i}" for i in range(settings.sessions)]
    history = {sid: list(system) for sid in sessions}
    saved = _SavedBlocks(layout, NAMESPACE)
    suspended: str | None = None
    speedups: list[float] = []
    for sid in sessions:
        client.create_session(sid, layout, namespace=NAMESPACE,
                              priority="high" if sid == sessions[0] else "normal")
    _print_header()
    for turn in range(settings.turns):
        for sid in sessions:
            if sid == suspended:
                t0 = time.perf_counter()
                view = client.resume(sid)
                ms = (time.perf_counter() - t0) * MS
                print(
                    f"  resume {sid}: answered in {ms:.1f} ms with {len(view.blocks)} blocks, "
                    f"h/w/c {_tier_counts([b.tier for b in view.blocks])} then; the row below "
                    f"says where each was when read (prefetch may promote them meanwhile)"
                )
                suspended = None
            user = torch.randint(0, vocab, (settings.user_tokens,), generator=gen).tolist()
            prompt = history[sid] + user

            m = _measure_turn(client, model, prompt, layout, sid, settings)
            restored, fast, full = m.restored, m.fast, m.full
            kv_ok = saved.matches(restored, m.restored_kv)
            same = fast.tokens == full.tokens
            checks.turns += 1
            checks.kv_total += restored.cache is not None
            checks.kv_exact += kv_ok and restored.cache is not None
            checks.same_tokens += same
            if not kv_ok:
                checks.failures.append(f"{sid} turn {turn}: restored KV differs from saved")
            if not same:
                checks.failures.append(
                    f"{sid} turn {turn}: restored continuation {fast.tokens} != recompute "
                    f"{full.tokens}"
                )

            covered = prompt + fast.tokens[:-1]  # the last token has no KV yet
            result = save_turn(client, sid, covered, fast.cache)
            saved.add(covered, *cache_to_kv(fast.cache))
            history[sid] = prompt + fast.tokens

            speedup = m.ttft_recompute_s / m.ttft_memkv_s
            if restored.tokens:
                speedups.append(speedup)
            source = {RestoreSource.SESSION: "own", RestoreSource.SHARED: "shared",
                      RestoreSource.NONE: "-"}[restored.source]
            print(
                f"{sid:<9} {turn:>4} {len(prompt):>6} {restored.tokens:>6} {source:<7} "
                f"{_tier_counts(restored.tiers):>7} {m.restore_s * MS:>8.1f} "
                f"{len(prompt) - restored.tokens:>7} {m.ttft_memkv_s * MS:>10.1f} "
                f"{m.ttft_recompute_s * MS:>14.1f} {speedup:>6.2f}x {result.new_blocks:>5}  "
                f"{'exact' if kv_ok else 'DIFF':<5} {'same' if same else 'DIFF':<6}"
            )
            on_turn()
        if turn + 1 < settings.turns:
            # Between turns one session goes away (its blocks go to the cold tier;
            # the shared prompt stays in memory for the others) and comes back next turn.
            suspended = sessions[-1 - turn % len(sessions)]
            view_s = client.suspend(suspended)
            print(f"  suspend {suspended}: state {view_s.state}, {view_s.tokens} tokens archived")
    return speedups


def run(settings: DemoSettings, data_dir: Path) -> bool:
    """Run the demo; True when every check passed."""
    from memkv.api.server import GatewayServer
    from memkv.cluster import connect

    print("memkv demo: agent sessions sharing a system prompt, through the HTTP gateway")
    t0 = time.perf_counter()
    model, model_id = _load_model(settings)
    layout = layout_for(model, model_id=model_id, block_tokens=settings.block_tokens)
    print(
        f"  model: {model_id} ({layout.num_layers} layers, {layout.num_kv_heads} KV heads, "
        f"head_dim {layout.head_dim}, {layout.dtype}), built in {time.perf_counter() - t0:.1f} s; "
        f"block = {layout.block_tokens} tokens = {layout.block_nbytes() / MIB:.2f} MiB; "
        f"torch threads {torch.get_num_threads()}"
    )
    # Timings on a shared machine are only as steady as its load: say what it was.
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start")
    greedy_decode(model, list(range(WARMUP_TOKENS)), max_new_tokens=2)  # not timed

    config = _cluster_config(layout, data_dir)
    t0 = time.perf_counter()
    checks = _Checks()
    with connect(config=config) as cluster, GatewayServer.start(
        cluster, host=config.gateway.host, port=settings.port,
        max_body_bytes=config.gateway.max_body_bytes,
    ) as gateway, Client(gateway.url) as client:
        print(
            f"  embedded cluster + gateway up in {time.perf_counter() - t0:.1f} s at {gateway.url}"
            f"; {ray.get(next(iter(cluster.devices.values())).reserved.remote())} "
            f"(small on purpose), cold in {data_dir}"
        )
        print(
            f"  {settings.sessions} sessions x {settings.turns} turns; system prompt "
            f"{settings.system_tokens} tokens, {settings.user_tokens} new tokens per turn, "
            f"greedy decode of {settings.new_tokens} tokens"
        )
        print(
            "  TTFT memkv = restore over HTTP + prefill of the uncovered tokens + first token; "
            "TTFT recompute = prefill of the whole prompt + first token"
        )
        # A bar on stderr under the table (it goes when done; rows print above it).
        with Progress(TextColumn("[bold]demo: turns"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True),
                      transient=True) as progress:
            task = progress.add_task("turns", total=settings.turns * settings.sessions)
            speedups = _run_turns(client, model, layout, settings, checks,
                                  on_turn=lambda: progress.advance(task))
        _print_tier_stats(client.stats())
        for i in range(settings.sessions):
            client.delete_session(f"agent-{i}")

    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end")
    if speedups:
        print(
            f"TTFT speedup over recomputing, turns that reused KV: median "
            f"{sorted(speedups)[len(speedups) // 2]:.1f}x, min {min(speedups):.1f}x, "
            f"max {max(speedups):.1f}x"
        )
    print(
        f"exactness: {checks.kv_exact}/{checks.kv_total} restores byte-identical to the saved "
        f"KV; {checks.same_tokens}/{checks.turns} greedy continuations from the restored cache "
        f"equal the full recompute's"
    )
    for failure in checks.failures:
        print(f"  FAILED: {failure}")
    print(f"all checks {'passed' if checks.passed else 'FAILED'}; cluster and gateway shut down")
    return checks.passed


def run_demo(settings: DemoSettings, data_dir: Path | None = None) -> bool:
    """Run the demo; True when every check passed.

    Args:
        data_dir: the cold tier's directory (default: a temporary one, removed after).
    """
    if data_dir is not None:
        return run(settings, data_dir)
    with tempfile.TemporaryDirectory(prefix="memkv-demo-") as tmp:
        return run(settings, Path(tmp))


if __name__ == "__main__":
    from memkv.cli import app

    app(["demo"])
