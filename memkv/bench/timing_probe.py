"""Cross-tenant timing probes ([2/6] item 6): can one tenant tell, by timing its own
requests, whether another tenant has a prompt cached?

The attack, as published against shared prefix caches (vLLM PR #39082: ROC AUC
0.99 at 8-token prefixes): a victim tenant has prompts cached; the attacker
sends candidates, half of them the victim's prompts (positives), half others
(negatives), and scores each by how fast it is answered (a hit is faster). The
ROC AUC of those scores says how well timing tells them apart: 0.5 is a coin,
1.0 certainty. Measured here through the gateway's own routes (``/v1/match``;
by-key reads of keys the attacker hashed for itself) and through the OpenAI
front door with an engine the tenants share. A public namespace's declared
prefix is the positive control: it must still hit for every reader.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from memkv.client import Client
from memkv.errors import UnknownBlockError
from memkv.protocol.layout import KVLayout

__all__ = ["ProbeResult", "auc", "front_door_probe", "gateway_probe"]

#: The goal ([2/6]): across tenants, timing tells no more than a coin (ROC AUC <= 0.55).
TARGET_AUC = 0.55


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """ROC AUC of scores: the chance a positive scores above a negative (ties count half)."""
    if not positives or not negatives:
        raise ValueError("need positive and negative scores")
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


@dataclass(frozen=True)
class ProbeResult:
    """One probe: its ROC AUC, two-sided (max(a, 1 - a): answered faster or slower, the
    attacker reads either), and what the probes saw."""

    path: str
    auc: float
    probes: int  # of each kind
    positive_ms: float  # median answer time, positives
    negative_ms: float
    hits: int  # positives answered as cached (a hit the attacker could read off)


def _timed(call: Callable[[], object], repeats: int) -> float:
    """The median seconds of ``call`` over ``repeats`` (the probe's best guess)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _result(path: str, pos: list[float], neg: list[float], hits: int) -> ProbeResult:
    # Two-sided: an attacker who found positives slower would use that as well.
    score = auc([-t for t in pos], [-t for t in neg])
    return ProbeResult(path, max(score, 1 - score), len(pos),
                       statistics.median(pos) * 1e3, statistics.median(neg) * 1e3, hits)


def _blocks(layout: KVLayout, tokens: int, rng: random.Random) -> list[np.ndarray]:
    counts = [layout.block_tokens] * (tokens // layout.block_tokens)
    counts += [tokens % layout.block_tokens] if tokens % layout.block_tokens else []
    return [np.full(layout.block_shape(n), rng.random(), dtype=np.float16) for n in counts]


def gateway_probe(url: str, *, victim: str, attacker: str, victim_namespace: str,
                  layout: KVLayout, prompts: int = 40, tokens: int = 64, repeats: int = 5,
                  seed: int = 0) -> list[ProbeResult]:
    """The victim stores ``prompts`` prompts; the attacker times ``/v1/match`` of each of
    them and of as many others, and by-key reads of their keys hashed under the
    victim's namespace (``victim_namespace``: the attacker knows the tenant's name)."""
    rng = random.Random(seed)
    mine = [[rng.randrange(1, 30_000) for _ in range(tokens)] for _ in range(prompts)]
    others = [[rng.randrange(1, 30_000) for _ in range(tokens)] for _ in range(prompts)]
    from memkv.protocol.hashing import chain_hashes

    with Client(url, token=victim) as v, Client(url, token=attacker) as a:
        tenant = victim_namespace
        for i, prompt in enumerate(mine):
            v.create_session(f"probe-{seed}-{i}", layout)
            v.append_turn(f"probe-{seed}-{i}", prompt, blocks=_blocks(layout, tokens, rng),
                          start_block=0)
        match: dict[str, list[float]] = {"pos": [], "neg": []}
        read: dict[str, list[float]] = {"pos": [], "neg": []}
        hits = 0
        # Interleaved, one of each kind after the other: both see the same moments.
        for pair in zip(mine, others, strict=True):
            drawn = list(zip(("pos", "neg"), pair, strict=True))
            rng.shuffle(drawn)  # which goes first is drawn (no order effect)
            for kind, prompt in drawn:
                found = a.match(layout, None, prompt)
                hits += int(kind == "pos" and found.tokens > 0)

                def matched(p: list[int] = prompt) -> None:
                    a.match(layout, None, p)

                match[kind].append(_timed(matched, repeats))
                # The victim's keys, as the attacker can hash them knowing its tenant.
                keys = [bytes(k) for k in chain_hashes(prompt, layout, tenant)]

                def by_key(k: list[bytes] = keys) -> None:
                    try:
                        a.read_blocks_by_key(None, k)
                    except UnknownBlockError:
                        pass

                read[kind].append(_timed(by_key, repeats))
    return [_result("gateway /v1/match", match["pos"], match["neg"], hits),
            _result("gateway /v1/blocks/read", read["pos"], read["neg"], 0)]


def front_door_probe(url: str, model: str, *, victim: str, attacker: str,
                     prompts: int = 12, tokens: int = 512, vocab: int = 500,
                     seed: int = 0, same_tenant: bool = False) -> ProbeResult:
    """The victim sends ``prompts`` prompts through the front door; the attacker (or,
    ``same_tenant``: the victim again, the positive control) times one request per
    candidate (each candidate once: a second would hit the prober's own cache)."""
    rng = random.Random(seed)
    mine = [[rng.randrange(1, vocab) for _ in range(tokens)] for _ in range(prompts)]
    others = [[rng.randrange(1, vocab) for _ in range(tokens)] for _ in range(prompts)]
    prober = victim if same_tenant else attacker

    def complete(token: str, prompt: list[int]) -> float:
        started = time.perf_counter()
        answer = httpx.post(f"{url}/v1/completions", timeout=300,
                            headers={"Authorization": f"Bearer {token}"},
                            json={"model": model, "prompt": prompt, "max_tokens": 1,
                                  "temperature": 0})
        answer.raise_for_status()
        return time.perf_counter() - started

    for prompt in mine:  # the victim's own prompts, cached (engine and memkv)
        complete(victim, prompt)
    pos: list[float] = []
    neg: list[float] = []
    for theirs, fresh in zip(mine, others, strict=True):  # interleaved: the same moments
        question = [rng.randrange(1, vocab) for _ in range(8)]
        # Which of the two goes first is drawn: the second of two requests in a row
        # runs on a warmer engine, an order effect that is no leak.
        if rng.random() < 0.5:
            pos.append(complete(prober, theirs + question))
            neg.append(complete(prober, fresh + question))
        else:
            neg.append(complete(prober, fresh + question))
            pos.append(complete(prober, theirs + question))
    path = "front door, the victim itself (control)" if same_tenant \
        else "front door, engine shared by tenants"
    fast = statistics.median(neg) * 0.5
    return _result(path, pos, neg, sum(t < fast for t in pos))
