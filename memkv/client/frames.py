"""KV on the wire, client side: an append's frames, and block responses parsed straight
off the socket into the arrays they are returned in (docs/wire-format.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memkv import errors
from memkv.client.views import Block
from memkv.protocol.checksum import crc32
from memkv.protocol.dtypes import numpy_view_dtype
from memkv.protocol.frame_headers import (
    BlockHeader,
    EndHeader,
    decode_response_header,
    response_header,
)
from memkv.protocol.hashing import BlockHash, chain_hashes, token_array
from memkv.protocol.layout import KV_AXIS_SIZE, KVLayout

if TYPE_CHECKING:
    from memkv.client.reserved import SlotReservation
    from memkv.shm.staging import PutStaging

from memkv.protocol.services import SessionView
from memkv.protocol.wire import (
    MAGIC,
    MAX_HEADER_BYTES,
    FrameReader,
    WireError,
    block_payload,
    encode_frame,
)

FRAMES_MEDIA_TYPE = "application/x-memkv-frames"
# A block payload larger than this is refused while reading (protects the client).
MAX_BLOCK_BYTES = 1 << 31
FRAME_PREFIX_BYTES = 8


def block_array(layout: KVLayout, block: Any, index: int) -> np.ndarray:
    """A block (numpy array or torch tensor) as a C-contiguous numpy array of its bytes' dtype."""
    if hasattr(block, "detach"):  # a torch tensor: the caller has torch loaded already
        import torch

        t = block.detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") != layout.dtype:
            raise errors.LayoutMismatchError(
                f"block {index} is {t.dtype}, the session's layout is {layout.dtype}"
            )
        array = (t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy()
        array = array.view(numpy_view_dtype(layout.dtype))
    elif isinstance(block, np.ndarray):
        array = np.ascontiguousarray(block)
        if array.dtype != numpy_view_dtype(layout.dtype):
            raise errors.LayoutMismatchError(
                f"block {index} is {array.dtype}; a {layout.dtype} layout takes "
                f"{numpy_view_dtype(layout.dtype)} arrays"
            )
    else:
        raise errors.LayoutMismatchError(
            f"block {index} must be a numpy array or a torch tensor, got {type(block).__name__}"
        )
    shape = tuple(array.shape)
    if (
        len(shape) != 5
        or shape[:3] != (layout.num_layers, KV_AXIS_SIZE, layout.num_kv_heads)
        or shape[4] != layout.head_dim
        or not 0 < shape[3] <= layout.block_tokens
    ):
        raise errors.LayoutMismatchError(
            f"block {index}: expected shape {layout.block_shape()} "
            f"(tokens 1..{layout.block_tokens}), got {shape}"
        )
    return array


def append_body(
    session: SessionView,
    token_ids: Sequence[int] | np.ndarray,
    blocks: Sequence[Any] | None,
    keys: Sequence[Any] | None,
    values: Sequence[Any] | None,
    start_block: int | None,
    turn: int | None,
    staging: PutStaging | None = None,
    checksum_staged: bool = False,
    reserved: SlotReservation | None = None,
) -> tuple[list[bytes | memoryview], list[BlockHash]]:
    """The frames of an append (only blocks from the first one not stored), and the chain.

    ``staging``: blocks that lie in this client staging segment are named
    (segment, offset) rather than sent (a gateway on this host reads them there),
    without a checksum unless ``checksum_staged``: their bytes cross no wire, and
    the device makes each block's CRC32 as it copies it in. ``reserved``: blocks
    that lie in its slots are named with the reservation (the device adopts them).
    """
    tokens = token_array(token_ids)
    layout = session.layout.layout()
    chain = chain_hashes(tokens, layout, session.namespace)
    if blocks is None:
        if keys is None or values is None:
            raise errors.InvalidInputError("append_turn needs keys and values, or blocks")
        from memkv.storage.layout import split_kv  # torch: per-layer tensors came in

        start = 0
        for old, new in zip(session.chain, chain, strict=False):
            if old != new:
                break
            start += 1
        blocks = split_kv(layout, keys, values)[start:]
    else:
        start = start_block or 0
    if len(blocks) != len(chain) - start:
        raise errors.InvalidInputError(
            f"{tokens.size} tokens make {len(chain)} blocks; from block {start} expected "
            f"{len(chain) - start} blocks, got {len(blocks)}"
        )
    head = {
        "kind": "turn",
        "v": 1,
        "turn": session.turn + 1 if turn is None else turn,
        "tokens": tokens.astype("<i8").tobytes(),
        "start_block": start,
        "layout": layout.to_dict(),
        "blocks": len(blocks),
    }
    chunks: list[bytes | memoryview] = list(encode_frame(head))
    for i, block in enumerate(blocks, start=start):
        array = block_array(layout, block, i)
        data = array.data.cast("B")
        header: dict[str, Any] = {
            "kind": "block",
            "index": i,
            "key": bytes(chain[i]),
            "dtype": layout.dtype,
            "shape": list(array.shape),
        }
        ref = reserved.staged_ref(array) if reserved is not None else None
        offset = _staged_at(staging, array) if ref is None else None
        if offset is not None:
            assert staging is not None
            ref = {"segment": staging.segment, "offset": offset}
        if ref is None:
            header["crc32"] = crc32(data)
            chunks.extend(encode_frame(header, data))
        else:
            if checksum_staged:
                header["crc32"] = crc32(data)
            header["staged"] = ref
            chunks.extend(encode_frame(header))
    return chunks, chain


def _staged_at(staging: PutStaging | None, array: np.ndarray) -> int | None:
    """Where ``array`` lies in ``staging`` (None: not there, or not in one piece)."""
    if staging is None or not array.flags.c_contiguous:
        return None
    try:
        return staging.offset_of(array)
    except ValueError:
        return None


def check_block_header(header: BlockHeader, count: int) -> int:
    """The payload size of block frame ``count``, checked against its shape and dtype."""
    if not header.nbytes <= MAX_BLOCK_BYTES:
        raise WireError(f"block frame {count}: bad 'nbytes' {header.nbytes!r}")
    try:
        item = numpy_view_dtype(header.dtype).itemsize
    except errors.LayoutMismatchError as e:
        raise WireError(f"block frame {count}: {e}") from None
    if int(np.prod(header.shape, dtype=np.int64)) * item != header.nbytes:
        raise WireError(f"block frame {count}: shape {header.shape} of {header.dtype} is not "
                        f"{header.nbytes} bytes")
    return header.nbytes


def make_block(header: BlockHeader, buf: np.ndarray, received_crc: int | None = None) -> Block:
    """The block ``buf`` holds, once its CRC32 (``received_crc``: made as it arrived)
    matches its header's."""
    if received_crc is None:
        received_crc = crc32(buf)
    if header.crc32 is None or received_crc != header.crc32:
        raise WireError(f"block {header.index}: payload checksum does not match its header")
    array = buf.view(numpy_view_dtype(header.dtype)).reshape(header.shape)
    return Block(header.index, header.key, array, header.dtype, header.tier_name,
                 header.exact, header.lossy_name)


class BlockStream:
    """Turns streamed response bytes into :class:`Block` objects; checks the end frame."""

    def __init__(self) -> None:
        self._reader = FrameReader(max_payload_bytes=MAX_BLOCK_BYTES)
        self._count = 0
        self._ended = False

    def feed(self, chunk: bytes) -> Iterator[Block]:
        for frame in self._reader.feed(chunk):
            header = response_header(frame.header)
            if isinstance(header, EndHeader):
                if header.count != self._count:
                    raise WireError(f"stream ended after {self._count} blocks, its end frame "
                                    f"says {header.count}")
                self._ended = True
                continue
            key, dtype, array = block_payload(frame)
            self._count += 1
            yield Block(header.index, key, array, dtype, header.tier_name, header.exact,
                        header.lossy_name)

    def close(self) -> None:
        self._reader.close()
        if not self._ended:
            raise WireError(f"the block stream was cut after {self._count} blocks (no end frame)")


def read_exact(response: Any, n: int, what: str) -> bytes:
    data = response.read(n)
    if len(data) != n:
        raise WireError(f"the block stream was cut in the middle of {what}")
    return data


#: A block's CRC32 is continued every this many bytes received: over bytes still in
#: the core's cache, while the sender's next ones are on their way (a pass over the
#: whole block after it arrived cost ~0.16 ms per 4 MiB read from memory). Larger
#: than the block port connection's read buffer (256 KiB), so that each step is read
#: straight into its destination, not through that buffer.
RECEIVE_CRC_STEP = 1 << 20


def read_into(response: Any, buf: np.ndarray) -> int:
    """Fill ``buf`` from ``response``; the CRC32 of its bytes, made as they arrived."""
    view = buf.data.cast("B")
    filled = crc = 0
    while filled < view.nbytes:
        # A step at most per call: a buffered reader would otherwise fill all of it.
        step = view[filled : filled + RECEIVE_CRC_STEP]
        got = 0
        while got < len(step):
            n = response.readinto(step[got:])
            if not n:
                raise WireError("the block stream was cut in the middle of a block")
            got += n
        crc = crc32(step, crc)
        filled += got
    return crc


def destination(out: Sequence[Any] | None, count: int, nbytes: int) -> np.ndarray:
    """Where block ``count`` is read to: the caller's buffer, or a new array."""
    if out is None:
        return np.empty(nbytes, dtype=np.uint8)
    if count >= len(out):
        raise errors.InvalidInputError(f"the response has more blocks than the {len(out)} given")
    dst = out[count]
    if hasattr(dst, "detach"):  # a torch tensor
        import torch

        t = dst.detach()
        if not (t.is_contiguous() and t.device.type == "cpu"):
            raise errors.InvalidInputError("out tensors must be contiguous CPU tensors")
        dst = t.view(torch.uint8).numpy()  # the tensor's own bytes (bf16 included)
    array = np.asarray(dst)
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise errors.InvalidInputError(f"out[{count}] must be a writable C-contiguous buffer")
    flat = array.reshape(-1).view(np.uint8)
    if flat.nbytes != nbytes:
        raise errors.InvalidInputError(
            f"out[{count}] holds {flat.nbytes} bytes, block {count} has {nbytes}"
        )
    return flat


def read_block_frames(
    response: Any, out: Sequence[Any] | None = None, *, body_ends: bool = True
) -> Iterator[Block]:
    """Parse a block response straight off the socket; check the end frame and the length.

    ``response``: an ``http.client`` response, or a block port reply's body
    (anything with ``read(n)`` and ``readinto(view)``). ``body_ends``: the body
    ends with its end frame (checked); False for a block port reply that runs
    to its end frame, after which the connection's next reply follows.
    """
    count = 0
    while True:
        prefix = read_exact(response, FRAME_PREFIX_BYTES, "a frame prefix")
        if prefix[:4] != MAGIC:
            raise WireError(f"bad frame magic {prefix[:4]!r}, expected {MAGIC!r}")
        header_len = int.from_bytes(prefix[4:], "little")
        if header_len > MAX_HEADER_BYTES:
            raise WireError(f"frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
        header = decode_response_header(read_exact(response, header_len, "a header"))
        if isinstance(header, EndHeader):
            if header.count != count:
                raise WireError(
                    f"stream ended after {count} blocks, its end frame says {header.count}"
                )
            if body_ends and response.read(1):
                raise WireError("bytes after the end frame")
            return
        nbytes = check_block_header(header, count)
        buf = destination(out, count, nbytes)
        received_crc = read_into(response, buf)
        count += 1
        yield make_block(header, buf, received_crc)


# -- the sync client ---------------------------------------------------------------------------


def joined(chunks: list[bytes | memoryview]) -> bytes:
    # httpx sends one bytes body with a Content-Length (the gateway checks it
    # against its limit before reading); joining costs one copy of the payload.
    return b"".join(chunks)
