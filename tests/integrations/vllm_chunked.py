"""One vLLM engine run for tests/integrations/test_vllm_chunked.py (runs in the vLLM venv).

    python vllm_chunked.py MODE MODEL_DIR OUT_JSON CONNECTOR_CONFIG_JSON

Every engine has memkv's connector, vLLM's prefix cache on, and a step budget
of ``BUDGET`` tokens (``max_num_batched_tokens``), so each prompt (several
times the budget) is prefilled in chunks, beside the others. Sessions are
made of seeded tokens; turn 2's prompt is turn 1's prompt, its answer and
``NEW_TOKENS`` more.

MODE:
- ``turn1``: the sessions' first turns, all at once, in a KV space too small
  for all of them (vLLM preempts some); writes the answers.
- ``turn2``: the sessions' second turns (the answers read from ``ANSWERS_JSON``
  in the connector config's ``answers`` entry), all at once.
- ``twice``: turn 1, turn 2 and turn 2 again of each session, one request at a
  time: the first turn 2 hits vLLM's own prefix cache for turn 1's blocks, the
  second for all of its own (the reference a fresh engine's load competes with).
- ``fresh``: turn 2 of each session one at a time, on a fresh engine: it loads
  from memkv what ``twice`` saved. For the last session a request for the first
  ``LOCAL_TOKENS`` of its prompt runs first, so that its turn 2 finds part of
  the prefix in vLLM's own cache and the rest in memkv.

Writes, per request, the tokens generated, their logprobs as a float's hex
(bit for bit), the tokens vLLM had cached, and for the engine: vLLM's prompt
tokens by source, its preemptions, and the connector's counters once every
save has landed.
"""

from __future__ import annotations

import json
import random
import sys

from memkv.integrations.vllm.stats_file import saves_settled

BUDGET = 256
BLOCK = 32
SESSIONS = 3
PROMPT_TOKENS = 700
ANSWER_TOKENS = 48
NEW_TOKENS = 60
LOCAL_TOKENS = 160
VOCAB = 500


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(SESSIONS)]


def new_tokens(session: int) -> list[int]:
    rng = random.Random(100 + session)
    return [rng.randrange(1, VOCAB) for _ in range(NEW_TOKENS)]


def main(mode: str, model: str, out_path: str, extra: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    stats_path = out_path + ".connector.json"
    answers = extra.pop("answers", None)
    kv_blocks = extra.pop("kv_blocks", 256)
    transfer = KVTransferConfig(
        kv_connector="MemkvConnector",
        kv_connector_module_path="memkv.integrations.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"stats_path": stats_path, **extra},
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=832,
        block_size=BLOCK,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=SESSIONS,
        num_gpu_blocks_override=kv_blocks,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=transfer,
    )

    def run(batch: list[tuple[list[int], str]], max_tokens: int) -> list[dict]:
        params = [SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False,
                                 logprobs=0, ignore_eos=True,
                                 extra_args={"kv_transfer_params": {"session_id": sid}})
                  for _, sid in batch]
        outs = llm.generate([{"prompt_token_ids": t} for t, _ in batch], params,
                            use_tqdm=False)
        result = []
        for out in outs:
            gen = out.outputs[0]
            logprobs = [float(step[tok].logprob).hex()
                        for tok, step in zip(gen.token_ids, gen.logprobs or [], strict=False)]
            result.append({"tokens": list(gen.token_ids), "logprobs": logprobs,
                           "cached": int(out.num_cached_tokens or 0),
                           "prompt": len(out.prompt_token_ids or [])})
        return result

    def settled() -> None:
        """Saves run behind the engine: wait for those queued, as an agent's next turn would."""
        saves_settled(stats_path, 60)

    first = prompts()
    sids = [f"chunked-{extra.get('model_id', 'm')}-{i}" for i in range(SESSIONS)]
    result: dict = {"mode": mode, "requests": []}
    if mode == "turn1":
        result["requests"] = run(list(zip(first, sids, strict=True)), ANSWER_TOKENS)
    elif mode == "turn2":
        second = [p + a + new_tokens(i) for i, (p, a) in enumerate(zip(first, answers,
                                                                         strict=True))]
        result["requests"] = run(list(zip(second, sids, strict=True)), 8)
    elif mode == "twice":
        for i, (prompt, sid) in enumerate(zip(first, sids, strict=True)):
            one = run([(prompt, sid)], ANSWER_TOKENS)[0]
            settled()
            second = prompt + one["tokens"] + new_tokens(i)
            two = run([(second, sid)], 8)[0]
            settled()
            again = run([(second, sid)], 8)[0]
            result["requests"] += [one, two, again]
    elif mode == "fresh":
        for i, sid in enumerate(sids):
            prompt = first[i] + answers[i] + new_tokens(i)
            if i == SESSIONS - 1:  # part of the prefix in vLLM's own cache first
                result["local"] = run([(prompt[:LOCAL_TOKENS], sid + "-local")], 1)[0]
                settled()
            result["requests"].append(run([(prompt, sid)], 8)[0])
    settled()
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source":
            metrics[metric.labels.get("source", "?")] = int(getattr(metric, "value", 0))
        elif metric.name == "vllm:num_preemptions":
            metrics["preemptions"] = int(getattr(metric, "value", 0))
    result["vllm"] = metrics
    with open(stats_path) as f:
        result["connector"] = json.load(f)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
