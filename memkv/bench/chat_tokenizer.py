"""A byte-level tokenizer with a chat template, for the models built from a config.

The engines of the benches and tests run models built from a config (nothing is
downloaded), started with ``--skip-tokenizer-init``: they take token ids. Chat
completions and the Responses API take text, so an engine serving them needs a
tokenizer and a chat template. This one is made here, offline: the 256 bytes
(GPT-2's byte-level alphabet, no merges), then added tokens ``<|t256|>`` ... up
to the model's vocabulary, so every id a model samples decodes to text that
encodes back to the same id (a chain's history is sent again as text). The
template writes each message as ``<|role|>content`` (tool calls and tool
answers as text too) and ends with ``<|assistant|>``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "with_chat_tokenizer"]

END = "<|end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}<for>{{ m.tool_call_id }}{% endif %}" + END +
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def with_chat_tokenizer(model_dir: Path, vocab_size: int) -> Path:
    """``model_dir``'s model beside a chat tokenizer of ``vocab_size`` ids (a sibling
    directory, made once: the model's files linked, the tokenizer's written)."""
    out = model_dir.with_name(model_dir.name + "-chat")
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.iterdir():
        (tmp / f.name).symlink_to(f.resolve())
    alphabet = sorted(ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END])
    tokenizer.add_tokens([f"<|t{i}|>" for i in range(len(alphabet) + 1, vocab_size)])
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END,
        "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE}))
    tmp.rename(out)
    return out
