"""`make demo`: the storage engine doing its job on a real model's KV cache.

Several agent sessions share one system prompt and run several turns each with
the reference Llama-architecture model (built offline from a config). After
every turn the session's KV cache is parked in a :class:`TieredStore` whose hot
and warm tiers are deliberately small, so blocks are evicted and demoted; then
sessions are suspended to the cold tier (one of them "offline", i.e. with the
lossy Delta+RL codec), the store is closed and reopened from disk, the sessions
are resumed lazily and their caches read back and checked against the KV the
model computed. Every figure printed is measured in this run.

(The gateway and the Ray cluster arrive with later issues; this demo drives the
engine they wrap.)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from memkv.integrations.reference_model import build_reference_model, cache_kv, reference_layout
from memkv.storage.config import MIB, AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import join_blocks, split_kv
from memkv.storage.precision import measure_error
from memkv.storage.store import TieredStore
from memkv.storage.tiers import Tier

SYSTEM_PROMPT_TOKENS = 512
TURN_TOKENS = (384, 320, 448)  # user message + assistant reply per turn


def _fmt_bytes(n: float) -> str:
    return f"{n / MIB:8.2f} MiB"


def _print_stats(store: TieredStore, title: str) -> None:
    st = store.stats()
    print(f"\n{title}")
    print(f"  {'tier':<5} {'blocks':>7} {'used':>12} {'capacity':>12} {'hits':>6} {'evictions':>9}")
    for tier, ts in st.tiers.items():
        cap = _fmt_bytes(ts.capacity_bytes) if ts.capacity_bytes else "        disk"
        print(
            f"  {tier.value:<5} {ts.blocks:>7} {_fmt_bytes(ts.used_bytes):>12} {cap:>12} "
            f"{ts.hits:>6} {ts.evictions:>9}"
        )
    print(
        f"  sessions {st.sessions}, distinct blocks {st.blocks}; logical KV "
        f"{_fmt_bytes(st.logical_bytes).strip()} stored once as "
        f"{_fmt_bytes(st.unique_bytes).strip()} "
        f"(dedup saved {_fmt_bytes(st.dedup_bytes_saved).strip()} over {st.dedup_hits} blocks); "
        f"promotions {st.promotions}, demotions {st.demotions}, prefetched {st.prefetched} "
        f"({st.prefetch_used} used)"
    )


def run(sessions: int, data_dir: Path, seed: int) -> bool:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("memkv storage-engine demo")
    print(f"  data dir: {data_dir}")
    model = build_reference_model(seed)
    layout = reference_layout(model, dtype="float16", block_tokens=256)
    print(
        f"  model: reference Llama ({layout.num_layers} layers, {layout.num_kv_heads} KV heads, "
        f"head_dim {layout.head_dim}); block = {layout.block_tokens} tokens = "
        f"{layout.block_nbytes() / MIB:.2f} MiB in fp16"
    )
    config = StoreConfig(
        hot_capacity_bytes=8 * MIB,
        warm_capacity_bytes=12 * MIB,
        allocator=AllocatorConfig.for_profile("edge"),
        archive=ArchiveConfig(directory=data_dir / "cold", fsync="batch"),
        debug_refcounts=True,
    )
    gen = torch.Generator().manual_seed(seed)
    system_prompt = torch.randint(
        0, model.config.vocab_size, (SYSTEM_PROMPT_TOKENS,), generator=gen
    )
    history: dict[str, torch.Tensor] = {}
    reference: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    store = TieredStore(config)
    print(
        f"\n{'session':<10} {'turn':>4} {'tokens':>7} {'prefill s':>10} {'new blk':>8} "
        f"{'dedup':>6} {'put ms':>8}"
    )
    for turn, turn_tokens in enumerate(TURN_TOKENS):
        for i in range(sessions):
            sid = f"agent-{i}"
            if turn == 0:
                store.create_session(
                    sid, layout, namespace="demo-tenant", priority="high" if i == 0 else "normal"
                )
                history[sid] = system_prompt
            new = torch.randint(0, model.config.vocab_size, (turn_tokens,), generator=gen)
            history[sid] = torch.cat([history[sid], new])
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(history[sid][None], use_cache=True)
            prefill = time.perf_counter() - t0
            keys, values = cache_kv(out.past_key_values, torch.float16)
            reference[sid] = (keys, values)
            t0 = time.perf_counter()
            result = store.put_kv(sid, history[sid].tolist(), keys, values)
            put_ms = (time.perf_counter() - t0) * 1e3
            print(
                f"{sid:<10} {turn:>4} {len(history[sid]):>7} {prefill:>10.2f} "
                f"{result.new_blocks:>8} {result.deduplicated_blocks:>6} {put_ms:>8.1f}"
            )
    _print_stats(store, "after all turns (small hot/warm tiers: blocks were demoted)")

    offline = f"agent-{sessions - 1}"
    for i in range(1, sessions):
        sid = f"agent-{i}"
        store.suspend(sid, offline=(sid == offline))
    print(
        f"\nsuspended agent-1..agent-{sessions - 1} ({offline} offline → lossy Delta+RL "
        f"for its unshared blocks); agent-0 (high priority) stays active"
    )
    _print_stats(store, "after suspend")
    store.suspend("agent-0")
    store.close()

    print("\nreopening the store from disk (suspended sessions come back from their manifests)")
    store = TieredStore(config)
    ok = True
    print(
        f"\n{'session':<10} {'state':<9} {'blocks':>6} {'found in (first read)':<28} "
        f"{'read ms':>8} {'max abs err':>12}  check"
    )
    for i in range(sessions):
        sid = f"agent-{i}"
        info = store.session(sid)
        t0 = time.perf_counter()
        handle = store.resume(sid)
        tiers = [loc.tier.value for loc in handle.blocks]
        blocks = [block for _, block in store.read_session(sid)]
        read_ms = (time.perf_counter() - t0) * 1e3
        keys, values = join_blocks(layout, blocks)
        ref = torch.stack([torch.stack([k, v]) for k, v in zip(*reference[sid], strict=True)])
        got = torch.stack([torch.stack([k, v]) for k, v in zip(keys, values, strict=True)])
        err = measure_error(ref.float(), got.float())
        counts = {t.value: tiers.count(t.value) for t in Tier if tiers.count(t.value)}
        if sid == offline:
            verdict = "lossy (Delta+RL), within bound" if err.rel_rms < 0.1 else "ERROR TOO LARGE"
            ok &= err.rel_rms < 0.1
        else:
            exact = torch.equal(ref, got)
            verdict = "byte-identical" if exact else "MISMATCH"
            ok &= exact
        print(
            f"{sid:<10} {info.state.value:<9} {len(blocks):>6} {str(counts):<28} "
            f"{read_ms:>8.1f} {err.max_abs:>12.5f}  {verdict}"
        )
    for i in range(sessions):
        store.delete_session(f"agent-{i}")
    store.check_invariants()
    _print_stats(store, "after deleting every session (nothing may be left)")
    empty = store.stats().blocks == 0
    ok &= empty
    store.close()
    # Each block once: the shared system prompt is stored once, not per session.
    split = split_kv(layout, *reference["agent-0"])
    print(
        f"\nall checks {'passed' if ok else 'FAILED'}: lossless sessions byte-identical, "
        f"lossy within bound, refcounts back to zero ({len(split)} blocks in agent-0's cache)"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="cold-tier directory (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    if args.sessions < 2:
        parser.error("--sessions must be at least 2")
    if args.data_dir is not None:
        return 0 if run(args.sessions, args.data_dir, args.seed) else 1
    with tempfile.TemporaryDirectory(prefix="memkv-demo-") as tmp:
        return 0 if run(args.sessions, Path(tmp), args.seed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
