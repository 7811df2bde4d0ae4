"""The connector's scheduler side: what memkv holds of a prompt, and what to save when.

vLLM makes this side in its scheduler process. Per request it asks how much of
the prompt memkv holds beyond vLLM's own prefix cache (the lookup runs off the
scheduler's loop: :mod:`~memkv.integrations.vllm.lookups`), plans the load of
exactly those blocks into the blocks vLLM allocated for them, and after each
step hands the workers the blocks whose KV became complete in it
(:mod:`~memkv.integrations.vllm.progress`): a prompt's chunks as they are
prefilled, the blocks generated tokens fill, and, when a request finishes,
what is left (its blocks are kept until the workers have copied them).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memkv.integrations.vllm.lookups import Lookups
from memkv.integrations.vllm.pending_saves import PendingSaves
from memkv.integrations.vllm.plan import (
    FAILURES,
    Load,
    MemkvConnectorMetadata,
    Save,
    content_session_id,
    partition_of,
    save_generated,
    save_wait_s,
)
from memkv.integrations.vllm.progress import BlockRange, Progress, RequestProgress
from memkv.integrations.vllm.stats_file import write_part
from memkv.integrations.vllm.transport import KVTransport
from memkv.protocol.layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)

_PARTITION = re.compile(r"[A-Za-z0-9_-]{1,64}")

#: The scheduler's part of the stats file is written at most this often (seconds).
STATS_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class _Match:
    keys: list[bytes]  # memkv's blocks of the prompt's leading tokens
    local_tokens: int  # what vLLM's own prefix cache held when memkv was asked
    partition: str | None  # where they were found (the request's cache_salt's)


class SchedulerSide:
    """Lookups, loads to plan and saves to hand out, for one vLLM scheduler.

    Args:
        layout: the engine's KV layout in memkv's terms.
        extra: ``kv_connector_extra_config``.
        transport: memkv, made on first use (shared with nothing: this process).
    """

    def __init__(self, layout: KVLayout, extra: dict[str, Any],
                 transport: Callable[[], KVTransport]) -> None:
        self.layout = layout
        self._block_size = layout.block_tokens
        self._transport = transport
        self._save_generated = save_generated(extra)
        self._stats_path = extra.get("stats_path")
        self._stats_written = 0.0
        self._stats_lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # live: their tokens grow as they decode
        self._params: dict[str, dict[str, Any]] = {}
        self._matched: dict[str, _Match] = {}
        self._pending_loads: dict[str, Load] = {}
        self._finishing: list[Save] = []  # of finished requests: blocks kept until copied
        self.progress = Progress(self._block_size)
        self.pending_saves = PendingSaves(save_wait_s(extra))
        self.lookups = Lookups(
            lambda tokens, partition: self._transport().scoped(partition).match(tokens))

    # -- vLLM's scheduler calls ---------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own prefix cache) that memkv
        holds, whole blocks; None while the lookup runs (vLLM asks again next step).

        The last prompt token is always left to compute (vLLM needs its logits).
        Any failure answers 0: the engine computes everything itself.
        """
        req_id = request.request_id
        self._requests[req_id] = request
        tokens = list(request.prompt_token_ids or [])
        params = dict(getattr(request, "kv_transfer_params", None) or {})
        self._params[req_id] = params
        self._matched.pop(req_id, None)
        usable = (len(tokens) - 1) // self._block_size * self._block_size
        if usable <= num_computed_tokens:
            self.pending_saves.forget(req_id)
            return 0, False
        if self.pending_saves.too_soon(req_id):
            time.sleep(0.001)  # vLLM asks again next step: not a busy loop meanwhile
            return None, False
        partition = _partition(request, params)
        try:
            found = self.lookups.poll(req_id, tokens[:usable], partition)
        except FAILURES as e:
            logger.warning("memkv lookup failed, computing instead: %s", e)
            self.pending_saves.forget(req_id)
            return 0, False
        if found is None:
            return None, False  # the lookup still runs: vLLM schedules the others
        matched, keys = found
        hit = matched // self._block_size * self._block_size
        if self.pending_saves.should_wait(req_id, _named(params, partition), hit, usable,
                                          local=num_computed_tokens):
            return None, False  # its session's last save has not landed yet
        self._matched[req_id] = _Match(list(keys[: hit // self._block_size]),
                                       num_computed_tokens, partition)
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of exactly the blocks vLLM takes from memkv: those after its
        own prefix cache's (vLLM has not counted them in the request yet)."""
        match = self._matched.get(request.request_id)
        if num_external_tokens <= 0 or match is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = match.local_tokens // self._block_size
        count = num_external_tokens // self._block_size
        keys = match.keys[first : first + count]
        if len(keys) != count or first + count > len(block_ids):
            # vLLM asked for more than memkv offered: load nothing rather than guess.
            logger.warning("memkv: %s asks %d blocks from block %d, memkv offered %d of %d "
                           "blocks; computing them", request.request_id, count, first,
                           len(keys), len(block_ids))
            return
        self._pending_loads[request.request_id] = Load(
            request.request_id, keys, block_ids[first : first + count], match.partition)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MemkvConnectorMetadata:
        """This step's loads, and the blocks whose KV it completes (saves)."""
        meta = MemkvConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens or {}

        def step(req_id: str, computed: int, resumed: bool) -> None:
            load = self._pending_loads.pop(req_id, None)
            if load is not None:
                meta.loads.append(load)
            request = self._requests.get(req_id)
            if request is None:
                return
            span = self.progress.step(req_id, computed, scheduled.get(req_id, 0),
                                      len(drafts.get(req_id, ())), request.all_token_ids,
                                      resumed)
            if span is not None:
                meta.saves.append(self._save(span))

        for new in scheduler_output.scheduled_new_reqs:
            req_id = new.req_id
            resumed = req_id in self.progress  # (vLLM's v2 runner sends resumed ones here)
            if resumed:
                self.progress.blocks_allocated(req_id, new.block_ids[0], replace=True)
            else:
                self._track(req_id, new.num_computed_tokens, list(new.block_ids[0]))
            step(req_id, new.num_computed_tokens, resumed)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                self.progress.blocks_allocated(req_id, new_ids[0], replace=resumed)
            step(req_id, cached.num_computed_tokens[i], resumed)
        meta.saves.extend(self._finishing)
        self._finishing = []
        self._pending_loads.clear()  # loads of requests not scheduled after all
        self._write_stats()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its complete blocks not saved yet are copied out by the
        workers next step, and vLLM keeps them until then (True: free them later)."""
        req_id = request.request_id
        # The last sampled token's KV is never computed.
        computed = min(request.num_computed_tokens, request.num_tokens - 1)
        span = self.progress.finish(req_id, computed, request.all_token_ids)
        if span is not None:
            # (A turn appended by reference has no block to copy, but goes out the same
            # way: vLLM steps again until the workers have handed it to the saver.)
            self._finishing.append(self._save(span, final=True))
        self._params.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self.pending_saves.forget(req_id)
        self.lookups.forget(req_id)
        return span is not None, None

    def close(self) -> None:
        self._write_stats(force=True)
        self.lookups.close()

    # -- internals ----------------------------------------------------------------

    def _track(self, req_id: str, computed: int, block_ids: list[int]) -> None:
        request = self._requests.get(req_id)
        if request is None:
            return
        params = self._params.get(req_id, {})
        named = params.get("session_id")
        prompt = list(request.prompt_token_ids or [])
        match = self._matched.pop(req_id, None)
        progress = RequestProgress(
            req_id=req_id,
            # Without a session, the request's blocks go to one named by its prompt.
            session_id=str(named) if named else content_session_id(self.layout, prompt),
            priority=str(params.get("priority", "normal")),
            prompt_tokens=len(prompt),
            partition=_partition(request, params),
            save_generated=self._save_generated == "all"
            or (self._save_generated == "sessions" and bool(named)),
            block_ids=block_ids,
            named=bool(named),
        )
        self.progress.start(progress, computed, len(match.keys) if match else 0)

    def _save(self, span: BlockRange, final: bool = False) -> Save:
        named = _named(self._params.get(span.req_id, {}), span.partition)
        if named:
            self.pending_saves.issued(named, span.end * self._block_size)
        return Save(span.req_id, span.token_ids, span.block_ids, span.start,
                    span.session_id, span.priority, final=final, partition=span.partition)

    def _write_stats(self, force: bool = False) -> None:
        if not self._stats_path:
            return
        now = time.monotonic()
        if not force and now - self._stats_written < STATS_EVERY_S:
            return
        self._stats_written = now
        with self._stats_lock:
            write_part(self._stats_path, f"scheduler-{os.getpid()}",
                       {"lookups_deferred": self.pending_saves.deferred,
                        "requests_tracked": len(self.progress)})



def _partition(request: Request, params: dict[str, Any]) -> str | None:
    """The partition of the connector's namespace the request's KV lives in: the one its
    ``kv_transfer_params`` name (memkv's front door: None for an engine of one tenant,
    one per tenant for an engine they share), else one per vLLM ``cache_salt``."""
    if "partition" in params:
        named = params["partition"]
        if named is None:
            return None
        if isinstance(named, str) and _PARTITION.fullmatch(named):
            return named
        # Not a partition's name: one of its own all the same (never an error on the
        # scheduler's loop, never another request's partition).
        return partition_of(repr(named))
    return partition_of(getattr(request, "cache_salt", None))


def _named(params: dict[str, Any], partition: str | None) -> str | None:
    """The request's memkv session as its saves are tracked (None: none named): a
    partition's session of a name is not another partition's."""
    named = params.get("session_id")
    if not named:
        return None
    return str(named) if partition is None else f"{named}:{partition}"
