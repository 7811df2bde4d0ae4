"""Tensors to payloads and back (memkv.protocol.payload: the block as it travels)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from memkv.errors import LayoutMismatchError
from memkv.protocol.payload import BlockPayload

__all__ = ["from_payload", "to_payload"]

# bfloat16 has no numpy dtype: it travels as its 16 raw bits.
_WIRE_DTYPES: dict[torch.dtype, tuple[str, np.dtype]] = {
    torch.float32: ("float32", np.dtype(np.float32)),
    torch.float16: ("float16", np.dtype(np.float16)),
    torch.bfloat16: ("bfloat16", np.dtype(np.uint16)),
}
_BY_NAME = {name: (t, np_dtype) for t, (name, np_dtype) in _WIRE_DTYPES.items()}


def to_payload(
    key: bytes,
    block: torch.Tensor,
    tier: str | None = None,
    exact: bool = True,
    lossy: str = "",
) -> BlockPayload:
    """Wrap a CPU block for transfer (no copy when it is already contiguous)."""
    if block.dtype not in _WIRE_DTYPES:
        raise LayoutMismatchError(
            f"blocks travel as {sorted(n for n, _ in _WIRE_DTYPES.values())}, got {block.dtype}"
        )
    name, np_dtype = _WIRE_DTYPES[block.dtype]
    t = block.detach().cpu().contiguous()
    if block.dtype is torch.bfloat16:
        t = t.view(torch.int16)
    return BlockPayload(bytes(key), name, t.numpy().view(np_dtype), tier, exact, lossy)


def from_payload(payload: BlockPayload, *, copy: bool = False) -> torch.Tensor:
    """The block as a tensor: a zero-copy view of the payload's array unless ``copy``.

    Arrays read from Ray's object store are read-only views of shared memory;
    the view returned for them must not be written to (pass ``copy=True`` to
    get a writable tensor).
    """
    if payload.dtype not in _BY_NAME:
        raise LayoutMismatchError(
            f"unknown block dtype {payload.dtype!r}; expected one of {sorted(_BY_NAME)}"
        )
    dtype, np_dtype = _BY_NAME[payload.dtype]
    arr = np.asarray(payload.data)
    if arr.dtype != np_dtype:
        raise LayoutMismatchError(
            f"a {payload.dtype} block must carry {np_dtype} data, got {arr.dtype}"
        )
    if copy:
        arr = arr.copy()
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; the docstring says so instead.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(dtype) if dtype is torch.bfloat16 else t
