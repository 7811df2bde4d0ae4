"""The connector's save progress (memkv.integrations.vllm.progress): which blocks each
step completes, as vLLM's scheduler reports a request's steps."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.integrations.vllm.progress import Progress, RequestProgress

BS = 4


def _request(prompt: int, generated: bool = True, blocks: int = 64) -> RequestProgress:
    return RequestProgress("r", "s", "normal", prompt_tokens=prompt, save_generated=generated,
                           block_ids=list(range(100, 100 + blocks)))


def test_a_chunked_prefill_is_saved_chunk_by_chunk():
    progress = Progress(BS)
    tokens = list(range(30))  # 7 full blocks and 2 tokens
    progress.start(_request(30), computed=0, memkv_blocks=0)
    first = progress.step("r", 0, 10, 0, tokens)  # 10 tokens: blocks 0, 1
    assert first is not None and (first.start, first.end) == (0, 2)
    assert first.block_ids == [100, 101] and first.token_ids == tokens[:8]
    second = progress.step("r", 10, 10, 0, tokens)  # up to 20: blocks 2, 3, 4
    assert second is not None and (second.start, second.end) == (2, 5)
    assert second.token_ids == tokens[:20]
    third = progress.step("r", 20, 10, 0, tokens)  # up to 30: blocks 5, 6
    assert third is not None and (third.start, third.end) == (5, 7)
    assert progress.step("r", 30, 1, 0, tokens) is None  # the prompt's tail is not full


def test_generated_tokens_fill_blocks_that_are_saved_and_a_finish_saves_the_rest():
    progress = Progress(BS)
    progress.start(_request(6), computed=0, memkv_blocks=0)
    tokens = list(range(6))
    assert progress.step("r", 0, 6, 0, tokens).end == 1
    tokens.append(6)  # sampled, fed next step
    assert progress.step("r", 6, 1, 0, tokens) is None  # positions 0..6
    tokens.append(7)
    saved = progress.step("r", 7, 1, 0, tokens)  # position 7 completes block 1
    assert saved is not None and (saved.start, saved.end) == (1, 2)
    tokens += [8, 9, 10, 11, 12]
    # Async scheduling: the last tokens are not known yet when the step is planned.
    assert progress.step("r", 8, 1, 0, tokens[:9]) is None
    last = progress.finish("r", computed=12, tokens=tokens)
    assert last is not None and (last.start, last.end) == (2, 3)
    assert "r" not in progress


def test_prompt_only_requests_do_not_save_generated_blocks():
    progress = Progress(BS)
    progress.start(_request(6, generated=False), computed=0, memkv_blocks=0)
    tokens = list(range(12))
    assert progress.step("r", 0, 6, 0, tokens[:6]).end == 1
    assert progress.step("r", 6, 5, 0, tokens) is None
    assert progress.finish("r", 11, tokens) is None


def test_blocks_memkv_or_vllm_hold_are_not_sent_again():
    progress = Progress(BS)
    tokens = list(range(20))
    progress.start(_request(20), computed=8, memkv_blocks=3)  # vLLM had 2, memkv 3
    saved = progress.step("r", 12, 8, 0, tokens)
    assert saved is not None and (saved.start, saved.end) == (3, 5)


def test_speculative_drafts_are_not_saved_until_verified():
    progress = Progress(BS)
    tokens = list(range(8))
    progress.start(_request(4), computed=0, memkv_blocks=0)
    assert progress.step("r", 0, 4, 0, tokens[:4]).end == 1
    # 1 verified token and 3 drafts: positions 4..7, only 4 is certain.
    assert progress.step("r", 4, 4, 3, tokens) is None
    saved = progress.step("r", 8, 1, 0, tokens + [8])
    assert saved is not None and (saved.start, saved.end) == (1, 2)


def test_a_failed_load_rewinds_to_where_vllm_recomputes():
    progress = Progress(BS)
    tokens = list(range(24))
    progress.start(_request(24), computed=12, memkv_blocks=3)  # 3 blocks loaded
    saved = progress.step("r", 12, 4, 0, tokens)  # block 3, its save dropped (load failed)
    assert saved is not None and (saved.start, saved.end) == (3, 4)
    # vLLM recomputes from the first failed block (block 1).
    again = progress.step("r", 4, 12, 0, tokens)
    assert again is not None and (again.start, again.end) == (1, 4)


def test_a_preempted_request_neither_loses_nor_repeats_its_saves():
    progress = Progress(BS)
    tokens = list(range(24))
    progress.start(_request(24), computed=0, memkv_blocks=0)
    assert progress.step("r", 0, 16, 0, tokens).end == 4
    # Preempted: its blocks are freed; it resumes with 2 blocks from memkv and new blocks.
    progress.blocks_allocated("r", list(range(200, 206)), replace=True)
    resumed = progress.step("r", 8, 16, 0, tokens, resumed=True)
    assert resumed is not None and (resumed.start, resumed.end) == (4, 6)
    assert resumed.block_ids == [204, 205]


def test_blocks_not_allocated_yet_are_not_saved():
    progress = Progress(BS)
    progress.start(_request(16, blocks=2), computed=0, memkv_blocks=0)
    saved = progress.step("r", 0, 16, 0, list(range(16)))
    assert saved is not None and saved.end == 2
    progress.blocks_allocated("r", [102, 103], replace=False)
    later = progress.step("r", 16, 0, 0, list(range(16)))
    assert later is not None and (later.start, later.end, later.block_ids) == (2, 4, [102, 103])


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(1, 80), chunks=st.lists(st.integers(1, 17), min_size=1, max_size=30),
       decode=st.integers(0, 20))
def test_every_complete_block_is_saved_exactly_once(prompt, chunks, decode):
    """However the prompt is chunked and however long the decode, each complete block is
    handed out once, in order, with the tokens of its position."""
    progress = Progress(BS)
    tokens = list(range(1000, 1000 + prompt))
    progress.start(_request(prompt, blocks=64), computed=0, memkv_blocks=0)
    ranges = []
    computed = 0
    for chunk in chunks:
        step = min(chunk, prompt - computed)
        if step <= 0:
            break
        ranges.append(progress.step("r", computed, step, 0, tokens))
        computed += step
    for i in range(decode if computed == prompt else 0):
        tokens.append(5000 + i)  # sampled by the last step, fed by the next
        ranges.append(progress.step("r", computed, 1, 0, tokens))
        computed += 1
    tokens.append(9999)  # the last sampled token: never fed, its KV never computed
    ranges.append(progress.finish("r", computed, tokens))
    saved = [r for r in ranges if r is not None]
    covered = [b for r in saved for b in range(r.start, r.end)]
    assert covered == list(range(computed // BS))
    for r in saved:
        assert r.token_ids == tokens[: r.end * BS]
        assert r.block_ids == list(range(100 + r.start, 100 + r.end))


def _named(req_id: str, session: str = "s", partition: str | None = None) -> RequestProgress:
    return RequestProgress(req_id, session, "normal", prompt_tokens=10, partition=partition,
                           block_ids=list(range(100, 104)), named=True)


def test_a_named_turn_held_by_vllms_cache_is_appended_to_its_session_by_reference():
    """Every full block in vLLM's prefix cache (computed for another session): nothing to
    send, but the session must still grow by the turn, else another engine resuming it
    computes everything again."""
    progress = Progress(BS)
    tokens = list(range(11))  # 2 full blocks and 3 tokens
    progress.start(_named("r1"), computed=8, memkv_blocks=0)
    assert progress.step("r1", 8, 2, 0, tokens) is None  # the tail is not full
    ref = progress.finish("r1", computed=10, tokens=tokens)
    assert ref is not None and ref.by_reference and (ref.start, ref.end) == (2, 2)
    assert ref.block_ids == [] and ref.token_ids == tokens[:8] and ref.session_id == "s"
    # The same turn again: this engine took the session that far already.
    progress.start(_named("r2"), computed=8, memkv_blocks=2)
    assert progress.finish("r2", computed=10, tokens=tokens) is None
    # Another partition's session of that name is another session.
    progress.start(_named("r3", partition="p1"), computed=8, memkv_blocks=0)
    assert progress.finish("r3", computed=10, tokens=tokens).by_reference
    # A request with no session of its own names none: nothing by reference.
    anonymous = _request(10, blocks=4)
    progress.start(anonymous, computed=8, memkv_blocks=0)
    assert progress.finish("r", computed=10, tokens=tokens) is None


def test_a_named_turn_that_sends_blocks_is_not_also_appended_by_reference():
    progress = Progress(BS)
    tokens = list(range(13))
    progress.start(_named("r1"), computed=8, memkv_blocks=0)
    sent = progress.step("r1", 8, 5, 0, tokens)  # completes block 2: sent from block 2
    assert sent is not None and not sent.by_reference and (sent.start, sent.end) == (2, 3)
    assert progress.finish("r1", computed=12, tokens=tokens) is None
