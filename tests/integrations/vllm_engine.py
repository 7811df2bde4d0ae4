"""One vLLM engine run for tests/integrations/test_vllm.py (runs in the vLLM venv).

    python vllm_engine.py MODE MODEL_DIR OUT_JSON [CONNECTOR_CONFIG_JSON]

MODE: ``baseline`` (no connector), ``memkv`` (MemkvConnector with the given
``kv_connector_extra_config``) or ``outage`` (the same, against a memkv that is
not there). vLLM's own prefix cache is off, so every reused prefix comes from
memkv. Writes the greedy outputs of one prompt and of a three-turn agent
session, what vLLM says it had cached for each request, and the connector's
counters.
"""

from __future__ import annotations

import json
import os
import sys

from memkv.integrations.vllm.stats_file import saves_settled

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(150)]
TURN_INPUTS = [
    [(11 * i + 5) % 500 + 1 for i in range(90)],
    [(13 * i + 2) % 500 + 1 for i in range(40)],
    [(17 * i + 9) % 500 + 1 for i in range(40)],
]
NEW_TOKENS = 12


def main(mode: str, model: str, out_path: str, extra: dict) -> None:
    from vllm import LLM, SamplingParams

    kwargs = {}
    stats_path = out_path + ".connector.json"
    if mode != "baseline":
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MemkvConnector",
            kv_connector_module_path="memkv.integrations.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "model_id": "vllm-test-llama", "stats_path": stats_path, **extra
            },
        )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=2,
        seed=0,
        **kwargs,
    )

    def run(tokens, session_id=None):
        extra = {"kv_transfer_params": {"session_id": session_id}} if session_id else None
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0, detokenize=False, extra_args=extra
        )
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    def settled() -> None:
        """Saves run behind the engine: wait for those queued, as an agent's next turn would."""
        if mode != "baseline":
            saves_settled(stats_path, 60)

    result = {"mode": mode, "prompt": None, "turns": []}
    result["prompt"] = run(PROMPT)
    settled()
    # A session holds one model's KV: a run under another model id has its own.
    session_id = "agent-1" if "model_id" not in extra else f"agent-1-{extra['model_id']}"
    history: list[int] = []
    for user in TURN_INPUTS:
        history = history + user
        generated, cached = run(history, session_id=session_id)
        result["turns"].append([generated, cached])
        history = history + generated
        settled()
    if mode != "baseline" and os.path.exists(stats_path):
        with open(stats_path) as f:
            result["connector"] = json.load(f)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    connector_config = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    main(sys.argv[1], sys.argv[2], sys.argv[3], connector_config)
