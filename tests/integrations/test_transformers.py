"""memkv.integrations.transformers: caches in and out of memkv, and exact restored generation."""

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from memkv.errors import (
    CorruptDataError,
    InvalidInputError,
    LayoutMismatchError,
    PrecisionOverflowError,
)
from memkv.integrations.transformers import (
    RestoreSource,
    cache_to_kv,
    greedy_decode,
    kv_to_cache,
    layout_for,
    restore,
    save_turn,
)
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.services import LayoutSpec
from memkv.storage.layout import KVLayout, block_token_count, split_kv

BLOCK = 4
VOCAB = 97
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).float().eval()


def random_kv(tokens, layout, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    keys = [torch.randn(shape, generator=g) for _ in range(layout.num_layers)]
    values = [torch.randn(shape, generator=g) for _ in range(layout.num_layers)]
    return keys, values


def cache_of(keys, values):
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k[None].clone(), v[None].clone(), i)
    return cache


# -- a tiny in-memory stand-in for memkv.client.Client ------------------------------------


@dataclass
class View:
    session_id: str
    namespace: str
    layout: LayoutSpec  # as the client's SessionView holds it
    tokens: int = 0
    chain: list = field(default_factory=list)


@dataclass(frozen=True)
class FakeBlock:
    index: int
    key: bytes
    tensor: torch.Tensor
    tier: str


@dataclass(frozen=True)
class FakeMatch:
    tokens: int
    blocks: list


class FakeClient:
    """Sessions and blocks in dicts, with the hashing and blocking of the real store."""

    def __init__(self):
        self.sessions = {}
        self.blocks = {}  # key -> tensor
        self.calls = []

    def create_session(self, session_id, layout, *, namespace="default"):
        self.sessions[session_id] = View(session_id, namespace, LayoutSpec.of(layout))

    def session(self, session_id):
        self.calls.append("session")
        return self.sessions[session_id]

    def append_turn(self, session_id, token_ids, keys, values, *, turn=None):
        view = self.sessions[session_id]
        chain = chain_hashes(token_ids, view.layout.layout(), view.namespace)
        blocks = split_kv(view.layout.layout(), keys, values)
        new = [k for k in chain if k not in self.blocks]
        self.blocks.update(zip(chain, blocks, strict=True))
        view.tokens, view.chain = len(token_ids), list(chain)
        return len(new)

    def match(self, layout, namespace, token_ids):
        self.calls.append("match")
        keys, tokens = [], 0
        for key in chain_hashes(token_ids, layout, namespace):
            if key not in self.blocks:
                break
            keys.append(key)
            tokens += int(self.blocks[key].shape[3])
        return FakeMatch(tokens, keys)

    def read_blocks(self, session_id, start=0, end=None):
        self.calls.append("read_blocks")
        chain = self.sessions[session_id].chain
        for i in range(start, len(chain) if end is None else end):
            yield FakeBlock(i, chain[i], self.blocks[chain[i]], "hot")

    def read_blocks_by_key(self, namespace, keys):
        self.calls.append("read_blocks_by_key")
        return [FakeBlock(i, k, self.blocks[k], "warm") for i, k in enumerate(keys)]


LAYOUT = KVLayout(
    "fake", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=BLOCK
)


def stored_session(client, tokens, *, namespace="tenant", seed=0):
    sid = f"s{next(_ids)}"
    client.create_session(sid, LAYOUT, namespace=namespace)
    keys, values = random_kv(len(tokens), LAYOUT, seed)
    save_turn(client, sid, tokens, cache_of(keys, values))
    return sid, keys, values


def restored_kv(restored):
    return cache_to_kv(restored.cache)


# -- layouts and caches --------------------------------------------------------------------


def test_layout_for_reads_sizes_and_dtype_from_model_or_config(model):
    layout = layout_for(model, model_id="tiny", block_tokens=16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert layout.dtype == "float32" and layout.block_tokens == 16
    assert layout_for(model.config, model_id="tiny", dtype=torch.float16).dtype == "float16"
    bf16 = LlamaConfig(**TINY, dtype="bfloat16", head_dim=32)
    assert layout_for(bf16, model_id="x").head_dim == 32
    assert layout_for(bf16, model_id="x").dtype == "bfloat16"
    with pytest.raises(LayoutMismatchError, match="does not say its dtype"):
        layout_for(LlamaConfig(**TINY), model_id="x")
    with pytest.raises(LayoutMismatchError, match="must be one of"):
        layout_for(model, model_id="x", dtype=torch.int8)
    with pytest.raises(InvalidInputError, match="num_attention_heads"):
        layout_for(object(), model_id="x", dtype="float32")


def test_cache_round_trips_through_kv(model):
    with torch.no_grad():
        cache = model(torch.arange(11)[None], use_cache=True).cache
    keys, values = cache_to_kv(cache)
    assert len(keys) == 2 and keys[0].shape == (2, 11, 16)
    back = kv_to_cache(keys, values, model.config)
    for a, b in zip(cache.layers, back.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert back.get_seq_length() == 11
    half = kv_to_cache(keys, values, dtype=torch.float16)
    assert half.layers[0].keys.dtype == torch.float16


def test_cache_shape_errors_are_named():
    keys, values = random_kv(5, LAYOUT, 0)
    batched = DynamicCache()
    batched.update(torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8), 0)
    with pytest.raises(LayoutMismatchError, match="one sequence"):
        cache_to_kv(batched)
    with pytest.raises(InvalidInputError, match="no layers"):
        cache_to_kv(object())
    with pytest.raises(LayoutMismatchError, match="as many key as value"):
        kv_to_cache(keys, values[:1])
    with pytest.raises(LayoutMismatchError, match="config has 2 layers"):
        kv_to_cache(keys[:1], values[:1], LlamaConfig(**TINY))
    with pytest.raises(PrecisionOverflowError):
        kv_to_cache([k * 1e6 for k in keys], values, dtype=torch.float16)


# -- save and restore with the fake client -------------------------------------------------


def test_save_turn_checks_the_token_count():
    client = FakeClient()
    client.create_session("s", LAYOUT, namespace="tenant")
    keys, values = random_kv(6, LAYOUT, 1)
    with pytest.raises(InvalidInputError, match=r"KV for 6 tokens but 7"):
        save_turn(client, "s", list(range(7)), cache_of(keys, values))
    assert save_turn(client, "s", torch.arange(6)[None], cache_of(keys, values)) == 2


def test_restore_uses_the_partial_tail_of_the_session():
    client = FakeClient()
    tokens = list(range(10))  # blocks of 4, 4, 2
    sid, keys, values = stored_session(client, tokens)
    restored = restore(client, tokens + [50, 51], layout=LAYOUT, namespace="tenant", session_id=sid)
    assert restored.tokens == 10 and restored.source is RestoreSource.SESSION
    assert restored.tiers == ["hot", "hot", "hot"]
    got_k, got_v = restored_kv(restored)
    assert all(torch.equal(a, b) for a, b in zip(got_k, keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_v, values, strict=True))
    assert "match" not in client.calls  # no whole block of the input is missing


def test_restore_leaves_one_token_to_prefill():
    client = FakeClient()
    tokens = list(range(9))
    sid, keys, _ = stored_session(client, tokens)
    restored = restore(client, tokens, layout=LAYOUT, namespace="tenant", session_id=sid)
    assert restored.tokens == 8 and len(restored.tiers) == 2  # the 1-token tail is not needed
    assert torch.equal(restored_kv(restored)[0][0], keys[0][:, :8])
    one = restore(client, [0], layout=LAYOUT, namespace="tenant", session_id=sid)
    assert one.cache is None and one.tokens == 0
    cropped = restore(client, tokens[:7], layout=LAYOUT, namespace="tenant", session_id=sid)
    # The input ends inside block 1 (tokens 4..6 of its 4..7): that block is not
    # the input's, so only block 0 is usable.
    assert cropped.tokens == 4


def test_restore_stops_where_the_input_diverges():
    client = FakeClient()
    tokens = list(range(12))
    sid, _, _ = stored_session(client, tokens)
    edited = tokens[:6] + [90] + tokens[7:]
    restored = restore(client, edited, layout=LAYOUT, namespace="tenant", session_id=sid)
    assert restored.tokens == 4 and len(restored.tiers) == 1


def test_a_new_session_gets_the_shared_prefix_of_its_namespace():
    client = FakeClient()
    system = list(range(9))
    stored_session(client, system + [60, 61, 62])
    client.create_session("new", LAYOUT, namespace="tenant")
    restored = restore(
        client, system + [70, 71], layout=LAYOUT, namespace="tenant", session_id="new"
    )
    assert restored.tokens == 8 and restored.source is RestoreSource.SHARED
    assert restored.tiers == ["warm", "warm"]
    no_session = restore(client, system + [70], layout=LAYOUT, namespace="tenant")
    assert no_session.tokens == 8
    other_tenant = restore(client, system + [70], layout=LAYOUT, namespace="someone-else")
    assert other_tenant.cache is None and other_tenant.tokens == 0


def test_restore_refuses_other_layouts_namespaces_and_foreign_blocks():
    client = FakeClient()
    sid, _, _ = stored_session(client, list(range(8)))
    fp16 = KVLayout("fake", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=BLOCK)
    with pytest.raises(LayoutMismatchError, match="stores layout"):
        restore(client, list(range(9)), layout=fp16, namespace="tenant", session_id=sid)
    with pytest.raises(InvalidInputError, match="belongs to namespace 'tenant'"):
        restore(client, list(range(9)), layout=LAYOUT, namespace="other", session_id=sid)
    original = client.read_blocks

    def swapped(session_id, start=0, end=None):  # a server answering with other blocks
        return list(original(session_id, start, end))[::-1]

    client.read_blocks = swapped
    with pytest.raises(CorruptDataError, match="differ"):
        restore(client, list(range(9)), layout=LAYOUT, namespace="tenant", session_id=sid)


@settings(max_examples=40, deadline=None)
@given(
    stored=st.integers(1, 14),
    common=st.integers(0, 14),
    extra=st.integers(0, 6),
)
def test_restore_covers_the_longest_usable_prefix(stored, common, extra):
    client = FakeClient()
    tokens = list(range(stored))
    sid, keys, _ = stored_session(client, tokens)
    common = min(common, stored)
    query = tokens[:common] + [80 + i for i in range(extra)]
    restored = restore(client, query, layout=LAYOUT, namespace="tenant", session_id=sid)
    limit = max(len(query) - 1, 0)
    if common == stored:
        expected = stored  # every stored block matches, the partial tail too
    else:
        counts = block_token_count(LAYOUT, min(len(query), stored))
        expected, pos = 0, 0
        for n in counts:  # a block matches when all its tokens are shared
            if pos + n > common or (n < BLOCK and pos + n != stored):
                break
            pos += n
            expected = pos
    assert restored.tokens == min(expected, limit)
    if restored.tokens:
        assert torch.equal(restored_kv(restored)[0][1], keys[1][:, : restored.tokens])
    else:
        assert restored.cache is None


def test_greedy_decode_from_a_restored_cache_equals_recompute(model):
    client = FakeClient()
    layout = layout_for(model, model_id="tiny", block_tokens=BLOCK)
    client.create_session("chat", layout, namespace="tenant")
    prompt = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    first = greedy_decode(model, prompt, max_new_tokens=5)
    save_turn(client, "chat", prompt + first.tokens[:-1], first.cache)
    follow = prompt + first.tokens + [5, 6, 7]
    restored = restore(
        client, follow, layout=layout, namespace="tenant", session_id="chat", config=model.config
    )
    assert restored.tokens == len(prompt) + 4
    fast = greedy_decode(model, follow, cache=restored.cache, max_new_tokens=6)
    full = greedy_decode(model, follow, max_new_tokens=6)
    assert fast.tokens == full.tokens
    assert restored.keys == tuple(client.sessions["chat"].chain)
    with pytest.raises(InvalidInputError, match="at least one token"):
        greedy_decode(model, follow[:3], cache=fast.cache, max_new_tokens=1)
    half = restore(
        client, follow, layout=layout, namespace="tenant", session_id="chat", dtype=torch.float16
    )
    with pytest.raises(LayoutMismatchError, match="restore it with dtype=torch.float32"):
        greedy_decode(model, follow, cache=half.cache, max_new_tokens=1)


# -- through the real gateway --------------------------------------------------------------


def test_generation_restored_through_the_gateway_equals_full_recompute(gateway, model):
    """Three turns of two sessions sharing a system prompt, one suspended in between.

    The KV is stored in the model's dtype (fp32) and the shared test cluster keeps
    later rounds in fp32 (``device.precision.later_dtype``), so what comes back is
    exactly what was saved: a restored continuation must equal a full recompute's.
    """
    from memkv.client import Client

    layout = layout_for(model, model_id="tiny-llama-test", block_tokens=8)
    g = torch.Generator().manual_seed(11)
    system = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    namespace = f"tenant-{next(_ids)}"
    sessions = [f"agent-{next(_ids)}" for _ in range(2)]
    history = {sid: list(system) for sid in sessions}
    saved = {}
    seen_tiers = set()
    with Client(gateway.url) as client:
        for sid in sessions:
            client.create_session(sid, layout, namespace=namespace)
        for turn in range(3):
            for n, sid in enumerate(sessions):
                if turn == 2 and n == 1:
                    client.suspend(sid)
                    client.resume(sid)
                user = torch.randint(0, VOCAB, (6,), generator=g).tolist()
                prompt = history[sid] + user
                restored = restore(
                    client,
                    prompt,
                    layout=layout,
                    namespace=namespace,
                    session_id=sid,
                    config=model.config,
                )
                if turn == 0 and n == 0:
                    assert restored.tokens == 0
                elif turn == 0:
                    assert restored.source is RestoreSource.SHARED and restored.tokens == 16
                else:
                    assert restored.source is RestoreSource.SESSION
                    assert restored.tokens == len(history[sid]) - 1
                    # Byte-identical to the KV that was saved last turn.
                    got = cache_to_kv(restored.cache)[0][0]
                    assert torch.equal(got, saved[sid][0][0][:, : restored.tokens])
                seen_tiers.update(restored.tiers)
                if turn == 2 and n == 1:
                    # Suspended: its own blocks came back from the archive, and exactly.
                    assert "cold" in restored.tiers
                fast = greedy_decode(model, prompt, cache=restored.cache, max_new_tokens=6)
                full = greedy_decode(model, prompt, max_new_tokens=6)
                assert fast.tokens == full.tokens, f"{sid} turn {turn}"
                history[sid] = prompt + fast.tokens
                covered = history[sid][:-1]
                save_turn(client, sid, covered, fast.cache, turn=turn + 1)
                saved[sid] = tuple([t.clone() for t in kv] for kv in cache_to_kv(fast.cache))
                # A retried save of the same turn changes nothing.
                assert client.session(sid).tokens == len(covered)
                save_turn(client, sid, covered, fast.cache, turn=turn + 1)
                assert client.session(sid).tokens == len(covered)
        for sid in sessions:
            client.delete_session(sid)
    assert seen_tiers <= {"hot", "warm", "cold"}


def test_continuations_from_a_fork_and_a_rewind_equal_the_recompute(gateway, model):
    """An agent branches from the middle of a turn and backs up in another: both end
    inside a block (of 8), and each continuation, restored from memkv, must equal a
    full recompute (fp32 all the way: the cut is the saved KV, byte for byte)."""
    from memkv.client import Client

    layout = layout_for(model, model_id="tiny-llama-test", block_tokens=8)
    g = torch.Generator().manual_seed(12)
    namespace = f"tenant-{next(_ids)}"
    trunk, branch = f"trunk-{next(_ids)}", f"branch-{next(_ids)}"
    with Client(gateway.url) as client:
        client.create_session(trunk, layout, namespace=namespace)
        prompt = torch.randint(0, VOCAB, (27,), generator=g).tolist()
        first = greedy_decode(model, prompt, max_new_tokens=6)
        history = prompt + first.tokens
        save_turn(client, trunk, history[:-1], first.cache, turn=1)  # 32 tokens: 4 blocks
        client.fork_session(trunk, branch, at_tokens=13, token_ids=history)
        client.rewind_session(trunk, 21, token_ids=history)
        for sid, kept in ((branch, 13), (trunk, 21)):
            assert client.session(sid).tokens == kept
            asked = history[:kept] + torch.randint(0, VOCAB, (5,), generator=g).tolist()
            restored = restore(client, asked, layout=layout, namespace=namespace,
                               session_id=sid, config=model.config)
            assert restored.source is RestoreSource.SESSION and restored.tokens == kept
            fast = greedy_decode(model, asked, cache=restored.cache, max_new_tokens=6)
            assert fast.tokens == greedy_decode(model, asked, max_new_tokens=6).tokens, sid
        for sid in (trunk, branch):
            client.delete_session(sid)


def test_kv_to_cache_adopts_fresh_tensors_only_when_asked(model):
    from memkv.integrations.transformers import kv_to_cache

    n = model.config.num_hidden_layers
    keys = [torch.randn(2, 5, 8) for _ in range(n)]
    values = [torch.randn(2, 5, 8) for _ in range(n)]
    before = [k.clone() for k in keys]
    copied = kv_to_cache(keys, values, model.config)
    adopted = kv_to_cache(keys, values, model.config, adopt=True)
    for i in range(n):
        assert copied.layers[i].keys.data_ptr() != keys[i].data_ptr()
        assert adopted.layers[i].keys.data_ptr() == keys[i].data_ptr()  # no copy
        assert torch.equal(adopted.layers[i].values[0], values[i])
    # A later step (a prefill) makes new tensors: what was handed over stays as it was.
    adopted.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8), 0)
    assert adopted.get_seq_length() == 8
    assert all(torch.equal(k, b) for k, b in zip(keys, before, strict=True))


def test_layouts_of_multi_query_and_latent_attention_models():
    from transformers import DeepseekV3Config, FalconConfig, GPTBigCodeConfig

    from memkv.errors import LayoutMismatchError
    from memkv.integrations.transformers import layout_for

    mqa = layout_for(FalconConfig(multi_query=True), model_id="f", dtype="float32")
    assert mqa.num_kv_heads == 1 and mqa.head_dim == 64
    # Item 11 of [1/5]: the new decoder architecture cached every attention head in
    # transformers up to 5.2x (it repeated the KV heads first), num_kv_heads since 5.25;
    # layout_for said num_kv_heads and the first save failed. Checked against a real
    # model's cache, whichever transformers is installed.
    from transformers import FalconForCausalLM

    falcon = FalconConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True)
    gqa = layout_for(falcon, model_id="f", dtype="float32")
    cache = FalconForCausalLM(falcon).eval()(torch.arange(5)[None], use_cache=True)
    keys, _ = cache_to_kv(cache.past_key_values)
    assert (gqa.num_kv_heads, gqa.head_dim) == tuple(keys[0].shape[::2])
    assert gqa.num_kv_heads in (2, 8) and gqa.head_dim == 8
    assert (
        layout_for(GPTBigCodeConfig(multi_query=True), model_id="g", dtype="float32").num_kv_heads
        == 1
    )
    with pytest.raises(LayoutMismatchError, match="keys are 192 wide and its values 128"):
        layout_for(DeepseekV3Config(), model_id="d", dtype="bfloat16")
    # Equal K and V widths passed, and the first save failed with a misleading message.
    equal = DeepseekV3Config(qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
    with pytest.raises(LayoutMismatchError, match="multi-head latent attention"):
        layout_for(equal, model_id="d", dtype="bfloat16")


class _SlidingLayer:
    """A cache layer as transformers' sliding-window layers look: K, V and the count of
    tokens it has seen (``cumulative_length``)."""

    def __init__(self, kept, seen, heads=2, head_dim=8):
        self.keys = torch.randn(1, heads, kept, head_dim)
        self.values = torch.randn(1, heads, kept, head_dim)
        self.cumulative_length = seen


class _Cache:
    def __init__(self, *layers):
        self.layers = list(layers)


def test_sliding_checks_read_the_token_axis_not_the_heads():
    """Item 12 of [1/5]: the check read the KV-head axis as the token count, so a
    sliding layer that dropped nothing was refused, with wrong numbers."""
    keys, _ = cache_to_kv(_Cache(_SlidingLayer(kept=10, seen=10)))  # dropped nothing
    assert keys[0].shape == (2, 10, 8)
    with pytest.raises(LayoutMismatchError, match="only its last 10 of 12 tokens"):
        cache_to_kv(_Cache(_SlidingLayer(kept=10, seen=12)))


def test_restored_says_which_blocks_are_lossy():
    """Item 13 of [1/5]: restore() dropped the per-block exactness flags."""
    import numpy as np

    from memkv.client import Block, Match
    from memkv.integrations.transformers import restore

    layout = KVLayout("m", 2, 2, 8, dtype="float32", block_tokens=4)
    ids = list(range(13))
    keys = [bytes(k) for k in chain_hashes(ids[:12], layout, "ns")]
    arrays = [np.zeros(layout.block_shape(), dtype=np.float32) for _ in keys]

    class _Client:
        def match(self, layout_, namespace, token_ids):
            return Match(12, keys)

        def read_blocks_by_key(self, namespace, wanted):
            steps = ["", "int8", ""]
            return [Block(i, k, a, "float32", "warm", exact=not steps[i], lossy=steps[i])
                    for i, (k, a) in enumerate(zip(wanted, arrays, strict=True))]

    restored = restore(_Client(), ids, layout=layout, namespace="ns")
    assert restored.tokens == 12
    assert restored.lossy == ("", "int8", "") and not restored.exact
