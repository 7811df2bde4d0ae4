"""The one table of KV dtypes memkv stores, by name.

Import-light on purpose (numpy only): the HTTP client and the wire format use
it without loading torch. ``torch_dtype`` imports torch only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from memkv.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "DTypeInfo",
    "StorageDType",
    "dtype_info",
    "non_finite_count",
    "numpy_view_dtype",
    "torch_dtype",
]

StorageDType = Literal["float32", "float16", "bfloat16"]


@dataclass(frozen=True, slots=True)
class DTypeInfo:
    """How one stored dtype is sized and viewed.

    ``numpy_view`` is the numpy dtype its raw bytes are viewed as: bfloat16 has
    none, so its payloads travel and are viewed as their 16 raw bits (uint16).
    """

    name: StorageDType
    itemsize: int
    numpy_view: np.dtype[Any]


DTYPES: dict[str, DTypeInfo] = {
    "float32": DTypeInfo("float32", 4, np.dtype(np.float32)),
    "float16": DTypeInfo("float16", 2, np.dtype(np.float16)),
    "bfloat16": DTypeInfo("bfloat16", 2, np.dtype(np.uint16)),
}


def dtype_info(name: object) -> DTypeInfo:
    """The table entry of ``name``.

    Raises:
        InvalidInputError: ``name`` is not one of :data:`DTYPES`.
    """
    info = DTYPES.get(name) if isinstance(name, str) else None
    if info is None:
        raise InvalidInputError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return info


def numpy_view_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a payload of ``name`` is viewed as (bfloat16 as uint16 bits)."""
    return dtype_info(name).numpy_view


#: bfloat16's exponent bits: all ones is an infinity or a NaN.
_BF16_EXPONENT = np.uint16(0x7F80)


def non_finite_count(array: np.ndarray, name: str) -> int:
    """How many values of a payload (viewed as :func:`numpy_view_dtype`) are NaN or inf."""
    if dtype_info(name).name == "bfloat16":
        return int(np.count_nonzero((array & _BF16_EXPONENT) == _BF16_EXPONENT))
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``name`` (imports torch)."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        dtype_info(name).name
    ]
