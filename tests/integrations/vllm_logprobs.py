"""One vLLM engine run for tests/integrations/test_vllm_exact.py (runs in the vLLM venv).

    python vllm_logprobs.py MODE MODEL_DIR OUT_JSON [CONNECTOR_CONFIG_JSON]

Every engine has the MemkvConnector and vLLM's own prefix cache on (one
configuration, so every engine computes the same way). MODE ``twice``: the prompt
twice: the first computes it and saves it to memkv, the second hits vLLM's own
prefix cache. MODE ``once``: the prompt once (a fresh engine: its hit comes from
memkv). Writes, per request, the greedy token, its logprob as a float's hex (bit
for bit) and the tokens vLLM had cached.
"""

from __future__ import annotations

import json
import sys

from memkv.integrations.vllm.stats_file import saves_settled

PROMPT = [(7 * i + 3) % 1000 + 1 for i in range(2048)]


def main(mode: str, model: str, out_path: str, extra: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    stats_path = out_path + ".connector.json"
    transfer = KVTransferConfig(
        kv_connector="MemkvConnector",
        kv_connector_module_path="memkv.integrations.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"model_id": "vllm-exact-qwen2", "stats_path": stats_path,
                                   **extra},
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_seqs=1,
        seed=0,
        kv_transfer_config=transfer,
    )
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False, logprobs=1)
    result = []
    for _ in range(2 if mode == "twice" else 1):
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
        token = out.outputs[0].token_ids[0]
        logprob = float(out.outputs[0].logprobs[0][token].logprob)
        result.append([token, logprob.hex(), int(out.num_cached_tokens or 0)])
    saves_settled(stats_path, 60)  # the save runs behind the engine: let it land
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    connector_config = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    main(sys.argv[1], sys.argv[2], sys.argv[3], connector_config)
