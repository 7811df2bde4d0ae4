"""Park and restore a transformers ``DynamicCache`` in memkv, turn by turn.

An inference worker that serves a multi-turn session does, each turn::

    restored = restore(client, input_ids, layout=layout, namespace=tenant, session_id=sid)
    gen = greedy_decode(model, input_ids, cache=restored.cache, max_new_tokens=64)
    # prefilled only input_ids[restored.tokens:]
    save_turn(client, sid, input_ids + gen.tokens[:-1], gen.cache)

:func:`restore` returns the cache of the longest cached prefix of the input —
the session's own chain first (its partial last block included), else a prefix
that other sessions of the namespace stored (a shared system prompt) — and how
many tokens it covers. It always leaves at least one input token to prefill,
since the model needs that token's logits to produce the next one.

Works for causal LMs with one K and one V of equal width per layer and token
(Llama, Qwen2, Mistral, Phi3, Gemma2/3, GPT-NeoX, OPT, Falcon and GPT-BigCode
multi-query …; tested in ``tests/integrations/test_model_matrix.py``): sizes
come from the model's config, never from constants here. Sliding-window layers
are kept whole (every token's KV), since KV is only ever stored under the
tokens it was computed from; the model's attention mask applies the window.

Precision (the deployment's ``device.precision``, by default): blocks of a
session's first turn stay in the model's dtype wherever they go; blocks of
later turns are stored as float16 once demoted from the hot tier
(``later_dtype``), and long-idle unshared blocks as int8. An fp32 session
that must stay exact is created with ``exact_only=True``; every restored
block says whether it is exact (``Block.exact``, ``Block.lossy``).

The client is anything with the methods of :class:`KVClient` (the HTTP
:class:`memkv.client.Client` has them), so this module needs no server to test.
"""

from memkv.integrations.transformers.caches import (
    DEFAULT_BLOCK_TOKENS,
    cache_to_kv,
    kv_to_cache,
    layout_for,
)
from memkv.integrations.transformers.clients import BlockLike, KVClient, MatchLike, SessionLike
from memkv.integrations.transformers.decoding import Generation, greedy_decode
from memkv.integrations.transformers.turns import (
    Restored,
    RestoreSource,
    layers_from_blocks,
    restore,
    save_turn,
)

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "BlockLike",
    "Generation",
    "KVClient",
    "MatchLike",
    "Restored",
    "RestoreSource",
    "SessionLike",
    "cache_to_kv",
    "greedy_decode",
    "kv_to_cache",
    "layers_from_blocks",
    "layout_for",
    "restore",
    "save_turn",
]
