"""Where a fork or a rewind ends: the blocks it keeps whole, and the one it cuts.

A session's first ``at`` tokens are its first blocks, the last of them whole
when ``at`` ends where the session's own block ends (a block boundary, or the
session's end), otherwise cut: the first tokens of that block, made once on
the device (:class:`~memkv.protocol.services.BlockCut`).

A cut block is stored under the hash of its own tokens, as every block is, so
a reader that hashes its tokens (a prefix match, ``restore`` of the
transformers integration) finds it. Only the caller knows those tokens: it
sends the tokens of the block the end falls in (``tail_tokens``), and they are
taken only if they hash to that block's key, so nothing is ever stored under
tokens it was not computed from.
"""

from __future__ import annotations

from collections.abc import Sequence

from memkv.errors import ConflictError, InvalidInputError, OutOfRangeError
from memkv.protocol.hashing import ROOT_HASH, BlockHash, hash_block, token_array
from memkv.protocol.layout import KVLayout, block_token_count
from memkv.protocol.services import BlockCut, CreateSession, ForkSession, Quota, SessionView

__all__ = ["fork_request", "prefix_of", "tail_of"]


def prefix_of(
    layout: KVLayout,
    namespace: str,
    chain: Sequence[bytes],
    tokens: int,
    at: int,
    what: str,
    tail_tokens: Sequence[int] | None = None,
) -> tuple[tuple[bytes, ...], BlockCut | None]:
    """The chain of a session's first ``at`` tokens, and the cut that makes its last
    block (None: every block is the session's own).

    Args:
        chain, tokens, namespace: the session's blocks, token count and namespace.
        what: "fork" or "rewind", for the errors.
        tail_tokens: the token ids of the session's block that ``at`` ends inside
            (needed only then).

    Raises:
        OutOfRangeError: ``at`` is not in ``[1, tokens]``.
        InvalidInputError: it ends inside a
            block and ``tail_tokens`` are missing or not that block's tokens.
    """
    if isinstance(at, bool) or not isinstance(at, int) or not 1 <= at <= tokens:
        raise OutOfRangeError(
            f"a {what} keeps between 1 and the session's {tokens} tokens, got {at!r}"
            + (" (delete the session to drop all of it)" if at == 0 else "")
        )
    kept = block_token_count(layout, at)
    own = block_token_count(layout, tokens)
    n = len(kept)
    if kept[-1] == own[n - 1]:
        return tuple(bytes(k) for k in chain[:n]), None
    source = bytes(chain[n - 1])
    first = (n - 1) * layout.block_tokens
    if tail_tokens is None:
        raise InvalidInputError(
            f"a {what} at {at} tokens ends inside block {n - 1} (tokens {first}.."
            f"{first + own[n - 1] - 1}): send that block's {own[n - 1]} token ids as "
            f"tail_tokens, or end at a multiple of {layout.block_tokens}")
    tail = token_array(tail_tokens)
    parent = BlockHash(bytes(chain[n - 2])) if n > 1 else ROOT_HASH
    if len(tail) != own[n - 1] or hash_block(
            parent, tail, layout.fingerprint, namespace) != source:
        raise InvalidInputError(
            f"tail_tokens are not the tokens of block {n - 1} of the session (tokens "
            f"{first}..{first + own[n - 1] - 1}, {own[n - 1]} of them)")
    key = hash_block(parent, tail[: kept[-1]], layout.fingerprint, namespace)
    return tuple(bytes(k) for k in chain[: n - 1]) + (bytes(key),), BlockCut(source, kept[-1])


def tail_of(layout: KVLayout, tokens: int, at: int,
            token_ids: Sequence[int] | None) -> tuple[int, ...] | None:
    """The ``tail_tokens`` a fork or rewind at ``at`` needs, taken from the session's
    ``token_ids`` (its first ``tokens`` at least as far as that block): None where
    ``at`` ends where a block of the session ends, or no ``token_ids`` are given.

    Raises:
        InvalidInputError: ``token_ids`` stop before the end of that block.
    """
    if token_ids is None or not 1 <= at < tokens or at % layout.block_tokens == 0:
        return None
    first = (at - 1) // layout.block_tokens * layout.block_tokens
    end = min(first + layout.block_tokens, tokens)
    if len(token_ids) < end:
        raise InvalidInputError(
            f"token_ids has {len(token_ids)} tokens; cutting at {at} needs the session's "
            f"first {end}")
    return tuple(int(t) for t in token_ids[first:end])


def fork_request(parent: SessionView, new_id: str, at_tokens: int | None = None, *,
                 tail_tokens: Sequence[int] | None = None,
                 quota: Quota | None = None) -> ForkSession:
    """The fork of ``parent`` (its view, as its router shard answered it) into a new
    session ``new_id`` of the same tenant, layout and options, holding its first
    ``at_tokens`` tokens (None: all of them); ``tail_tokens`` as :func:`prefix_of`.

    Raises:
        ConflictError: the parent has no blocks yet.
        InvalidInputError: as :func:`prefix_of`.
    """
    if parent.device_id is None or not parent.chain:
        raise ConflictError(f"session {parent.session_id!r} has no blocks yet: nothing to fork")
    at = parent.tokens if at_tokens is None else at_tokens
    chain, cut = prefix_of(parent.layout.layout(), parent.namespace, parent.chain,
                           parent.tokens, at, "fork", tail_tokens)
    return ForkSession(
        session=CreateSession(
            session_id=new_id, layout=parent.layout, namespace=parent.namespace,
            priority=parent.priority, ack=parent.ack, quota=quota,
            exact_only=parent.exact_only, finite_only=parent.finite_only,
        ),
        chain=chain, tokens=at, device_id=parent.device_id, cut=cut,
        parent=parent.session_id,
    )
