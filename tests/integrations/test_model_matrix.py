"""Generation through memkv equals generation without it, for every architecture family we accept.

Each model is built from a small config (random weights, fixed seed) and runs a
three-turn session through the real gateway: every turn restores the previous
turns' KV from memkv, prefills only the new tokens, decodes, and saves.

- fp32: the restored continuation equals a full recompute, token for token.
- bf16: a full recompute may differ from a chunked one by rounding, so the
  restored continuation is compared with the same chunked prefill run without
  memkv (the previous turn's cache kept in memory), and the restored KV with
  that cache, bit for bit.
"""

import itertools

import pytest
import torch
import transformers

from memkv.errors import LayoutMismatchError
from memkv.integrations.transformers import (
    cache_to_kv,
    greedy_decode,
    kv_to_cache,
    layout_for,
    restore,
    save_turn,
)

VOCAB = 101
BLOCK = 8
NEW_TOKENS = 5
_ids = itertools.count()

# name -> (config class, model class, config arguments). The shapes are the
# ones that trip layouts up: multi-query with head_dim 80, fused QKV (Phi3),
# sliding windows shorter than the context (Gemma2/3, Mistral), parallel
# attention (GPT-NeoX, Falcon), learned positions (OPT, GPT-BigCode).
_COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 256}
_LLAMA_LIKE = {
    **_COMMON,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE),
    "mistral-mqa-hd80": (
        "MistralConfig",
        "MistralForCausalLM",
        {**_LLAMA_LIKE, "hidden_size": 160, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 80},
    ),
    "mistral-window": (
        "MistralConfig", "MistralForCausalLM", {**_LLAMA_LIKE, "sliding_window": 12}
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_LLAMA_LIKE, "pad_token_id": 0}),
    "gemma2-window": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 12},
    ),
    "gemma3-window": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 12, "num_hidden_layers": 3,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    ),
    "gpt-neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {**_COMMON, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4},
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {**_COMMON, "hidden_size": 64, "ffn_dim": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "word_embed_proj_dim": 64},
    ),
    "falcon-mqa": (
        "FalconConfig",
        "FalconForCausalLM",
        {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "multi_query": True},
    ),
    "gpt-bigcode-mqa": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256,
         "multi_query": True},
    ),
}


def build(name, dtype):
    config_cls, model_cls, kwargs = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    return model.to(dtype)


def turns(seed):
    """A shared 12-token system prompt and three user messages (context > the windows)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (12, 9, 6, 7)]


def copy_cache(cache):
    keys, values = cache_to_kv(cache)
    return kv_to_cache(keys, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_three_turns_through_memkv_equal_generation_without_it(gateway, name, dtype):
    from memkv.client import Client

    model = build(name, dtype)
    layout = layout_for(model, model_id=f"matrix-{name}", block_tokens=BLOCK)
    assert layout.torch_dtype == dtype
    namespace, sid = f"matrix-{next(_ids)}", f"agent-{next(_ids)}"
    system, *messages = turns(seed=len(name))
    history = list(system)
    kept = None  # the previous turn's cache, as an engine without memkv would keep it
    with Client(gateway.url) as client:
        client.create_session(sid, layout, namespace=namespace)
        for turn, user in enumerate(messages):
            prompt = history + user
            restored = restore(
                client, prompt, layout=layout, namespace=namespace, session_id=sid,
                config=model.config, dtype=dtype,
            )
            assert restored.tokens == (0 if turn == 0 else len(history) - 1)
            if kept is not None:  # before decoding extends the restored cache
                for got, want in zip(cache_to_kv(restored.cache), cache_to_kv(kept), strict=True):
                    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            fast = greedy_decode(model, prompt, cache=restored.cache, max_new_tokens=NEW_TOKENS)
            if dtype == torch.float32:
                full = greedy_decode(model, prompt, max_new_tokens=NEW_TOKENS)
                assert fast.tokens == full.tokens, f"turn {turn}"
            elif kept is not None:
                chunked = greedy_decode(model, prompt, cache=kept, max_new_tokens=NEW_TOKENS)
                assert fast.tokens == chunked.tokens, f"turn {turn}"
            history = prompt + fast.tokens
            save_turn(client, sid, history[:-1], fast.cache, turn=turn + 1)
            kept = copy_cache(fast.cache)
        client.delete_session(sid)


@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window", "gemma3-window"])
def test_sliding_window_models(name):
    """A full cache decodes like the model's own windowed one, and a windowed one is refused.

    The refusal's advice is followed to the letter, and what it yields is every
    token's KV (never the last tokens' KV under the first tokens' ids).
    """
    model = build(name, torch.float32)
    prompt = sum(turns(seed=3), [])
    assert len(prompt) > model.config.sliding_window
    with torch.no_grad():
        own = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt):].tolist()
        windowed = model(torch.tensor([prompt]), use_cache=True).past_key_values
    assert greedy_decode(model, prompt, max_new_tokens=NEW_TOKENS).tokens == own
    with pytest.raises(LayoutMismatchError, match=r"a DynamicCache\(\) with no config"):
        cache_to_kv(windowed)
    # The advice once given (pass only as many token ids as the cache holds)
    # would have stored the last tokens' KV under the first tokens' ids.
    held = min(layer.keys.shape[2] for layer in windowed.layers)
    with pytest.raises(LayoutMismatchError, match="sliding window"):
        save_turn(None, "never-reached", prompt[:held], windowed)
    with torch.no_grad():
        full = model(torch.tensor([prompt]), cache=transformers.DynamicCache(),
                     use_cache=True).past_key_values
    keys, _ = cache_to_kv(full)
    assert all(k.shape[1] == len(prompt) for k in keys)
    # Where the windowed layer kept anything, it is the last tokens' KV.
    for layer, k in zip(windowed.layers, keys, strict=True):
        assert torch.equal(layer.keys[0], k[:, -layer.keys.shape[2]:])
