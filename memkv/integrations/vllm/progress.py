"""What each running request has computed, and which of its blocks memkv still lacks.

vLLM computes a request's KV over many steps: a prompt longer than the
scheduler's step budget (2,048 tokens on CPU and most GPUs, several requests
sharing it) is prefilled in chunks, then each decode step adds a token. A
block is worth saving once every one of its tokens has KV in the paged cache;
this table says, step by step, which blocks became so (vLLM's
``OffloadingConnector`` and LMCache's connector track a request the same way).

A block's KV is complete after a step when all its positions are below

- the tokens computed once the step has run (``num_computed_tokens`` before it
  plus the tokens it schedules, less speculative drafts, which may be
  rejected), and
- the tokens the scheduler knows (with async scheduling the token a step feeds
  may still be a placeholder: its block is saved a step later, its KV is still
  in the cache then).

Blocks memkv already has (its hit, or what vLLM's own prefix cache held: this
engine computed or loaded those, and saved them then) are not sent again; a
request that is preempted and resumes keeps its count (memkv has its saves,
it neither loses nor repeats them); a request whose load failed goes back to
where vLLM recomputes from. Plain logic: no vLLM import, tested on its own.

A named session's turn must still reach the session when it sends nothing: when
vLLM's prefix cache held every full block of it (this engine computed or loaded
them for another request or session), the request finishes with a *reference*
range (no blocks, ``start == end``), which appends the turn's tokens to the
session with every block named by its key; memkv holds the blocks already.
Without it the session silently never grew (or was never made) and another
engine resuming it would compute everything again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["MAX_SESSION_EXTENTS", "BlockRange", "Progress", "RequestProgress"]

#: Named sessions whose saved extent the scheduler remembers (the oldest forgotten).
MAX_SESSION_EXTENTS = 65536


@dataclass(frozen=True, slots=True)
class BlockRange:
    """Blocks ``start .. end`` of a request, to copy out of vLLM blocks ``block_ids``."""

    req_id: str
    session_id: str
    priority: str
    partition: str | None  # of the connector's namespace (vLLM's cache_salt)
    token_ids: list[int]  # the request's tokens up to the end of block ``end - 1``
    block_ids: list[int]  # one vLLM block per block start .. end
    start: int
    end: int

    @property
    def by_reference(self) -> bool:
        """No block to send: the session's blocks up to ``end`` are memkv's already."""
        return self.start == self.end


@dataclass(slots=True)
class RequestProgress:
    """One request's blocks, and how many leading ones memkv has or was handed."""

    req_id: str
    session_id: str
    priority: str
    prompt_tokens: int
    partition: str | None = None
    save_generated: bool = True  # blocks filled by generated tokens too
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks memkv has, or whose save is under way
    named: bool = False  # the request named its session (not one made of its prompt)
    sent: bool = False  # a range of it was handed out to save

    @property
    def session_key(self) -> tuple[str, str | None]:
        return self.session_id, self.partition


class Progress:
    """The running requests' progress, keyed by request id.

    Args:
        block_size: tokens per block (vLLM's and memkv's).
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._requests: dict[str, RequestProgress] = {}
        # Named session -> leading blocks of it this engine has saved or referenced:
        # a turn sending nothing appends by reference only when the session may lack it.
        self._extents: OrderedDict[tuple[str, str | None], int] = OrderedDict()

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, req_id: str) -> RequestProgress | None:
        return self._requests.get(req_id)

    def start(self, progress: RequestProgress, computed: int, memkv_blocks: int) -> None:
        """A request scheduled for the first time: ``computed`` tokens already in its
        blocks (vLLM's prefix cache and what memkv loads), ``memkv_blocks`` leading
        blocks memkv holds (its lookup; 0 when none was made)."""
        progress.saved = max(memkv_blocks, computed // self.block_size)
        self._requests[progress.req_id] = progress

    def blocks_allocated(self, req_id: str, new_block_ids: Sequence[int],
                         replace: bool) -> None:
        """vLLM gave the request blocks: more of them, or (resumed after a
        preemption) a new list for all of them."""
        progress = self._requests.get(req_id)
        if progress is None:
            return
        if replace:
            progress.block_ids = list(new_block_ids)
        else:
            progress.block_ids.extend(new_block_ids)

    def step(self, req_id: str, computed_before: int, scheduled: int, drafts: int,
             tokens: Sequence[int], resumed: bool = False) -> BlockRange | None:
        """The blocks whose KV this step completes (None: none).

        Args:
            computed_before: the request's ``num_computed_tokens`` before this step.
            scheduled: tokens this step computes for it.
            drafts: of those, speculative tokens (their KV may be rejected).
            tokens: every token of the request the scheduler knows.
            resumed: the request's first step after a preemption.
        """
        progress = self._requests.get(req_id)
        if progress is None:
            return None
        if not resumed:
            # Fewer tokens computed than were saved: a load failed and vLLM computes
            # again from its first missing block, and the step's save was dropped
            # (its KV was made over blocks that never arrived). A resumed request
            # recomputes what memkv did not give back, which memkv has: not sent again.
            progress.saved = min(progress.saved, computed_before // self.block_size)
        return self._take(progress, computed_before + scheduled - drafts, tokens)

    def finish(self, req_id: str, computed: int, tokens: Sequence[int]) -> BlockRange | None:
        """The request is done: its complete blocks not saved yet (None: none), and it
        is forgotten. ``computed``: tokens whose KV is in the cache (vLLM never
        computes the last sampled token's)."""
        progress = self._requests.pop(req_id, None)
        if progress is None:
            return None
        taken = self._take(progress, computed, tokens)
        if taken is not None or not progress.named or progress.sent or progress.saved <= 0:
            return taken
        if self._extents.get(progress.session_key, 0) >= progress.saved:
            return None  # this engine's own saves took the session this far
        self._note_extent(progress, progress.saved)
        return BlockRange(
            req_id=progress.req_id, session_id=progress.session_id,
            priority=progress.priority, partition=progress.partition,
            token_ids=list(tokens[: progress.saved * self.block_size]), block_ids=[],
            start=progress.saved, end=progress.saved,
        )

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def _take(self, progress: RequestProgress, computed: int,
              tokens: Sequence[int]) -> BlockRange | None:
        bs = self.block_size
        end_tokens = min(computed, len(tokens))
        if not progress.save_generated:
            end_tokens = min(end_tokens, progress.prompt_tokens)
        end = min(end_tokens // bs, len(progress.block_ids))
        start = progress.saved
        if end <= start:
            return None
        progress.saved = end
        progress.sent = True
        self._note_extent(progress, end)
        return BlockRange(
            req_id=progress.req_id,
            session_id=progress.session_id,
            priority=progress.priority,
            partition=progress.partition,
            token_ids=list(tokens[: end * bs]),
            block_ids=list(progress.block_ids[start:end]),
            start=start,
            end=end,
        )

    def _note_extent(self, progress: RequestProgress, end: int) -> None:
        if not progress.named:
            return
        self._extents.pop(progress.session_key, None)
        self._extents[progress.session_key] = end
        while len(self._extents) > MAX_SESSION_EXTENTS:
            self._extents.popitem(last=False)
