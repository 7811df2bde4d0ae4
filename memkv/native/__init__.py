"""memkv's one native helper: slab copies with non-temporal stores and a fused CRC32.

``kvcopy.c`` is built with the package (``pip install`` compiles it; a machine
without a C compiler installs without it). Where it is missing, or ISA-L's
CRC32 cannot be found to pass to it, :data:`AVAILABLE` is False and the callers
keep their numpy paths: slower, the same bytes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging

import numpy as np

__all__ = ["AVAILABLE", "CRC_CHUNKS", "CRC_NONE", "CRC_SOURCE_SLAB", "copy_slabs"]

logger = logging.getLogger(__name__)

#: how :func:`copy_slabs` continues each slab's CRC32 (see kvcopy.c)
CRC_NONE, CRC_SOURCE_SLAB, CRC_CHUNKS = 0, 1, 2

_U64 = np.dtype(np.uint64)
_I64 = np.dtype(np.int64)
_U32 = np.dtype(np.uint32)


def _load() -> tuple[ctypes._CFuncPtr | None, int]:  # type: ignore[name-defined]
    spec = importlib.util.find_spec("memkv.native._kvcopy")
    if spec is None or spec.origin is None:
        logger.debug("memkv.native: kvcopy not built; numpy copies instead")
        return None, 0
    try:
        from isal import isal_zlib

        crc = ctypes.cast(ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl, ctypes.c_void_p)
        fn = ctypes.CDLL(spec.origin).memkv_copy_slabs
    except (ImportError, OSError, AttributeError) as e:
        logger.debug("memkv.native unusable (%s); numpy copies instead", e)
        return None, 0
    fn.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return fn, int(crc.value or 0)


_copy_slabs, _CRC_FN = _load()
AVAILABLE = _copy_slabs is not None


def copy_slabs(
    src: np.ndarray, dst: np.ndarray, chunk: int, src_off: np.ndarray, dst_off: np.ndarray,
    crcs: np.ndarray | None = None, crc_mode: int = CRC_NONE,
) -> None:
    """Copy chunk ``i`` of every slab ``s`` from ``src[s] + src_off[i]`` to
    ``dst[s] + dst_off[i]`` (addresses; ``chunk`` bytes each), continuing ``crcs[s]``
    as ``crc_mode`` says. The caller guarantees the addresses (views it holds).

    The GIL is let go for the copy (ctypes does), so two threads copy side by side.
    """
    if _copy_slabs is None:
        raise RuntimeError("memkv.native is not built here (memkv.native.AVAILABLE is False)")
    if src.dtype != _U64 or dst.dtype != _U64 or len(src) != len(dst):
        raise ValueError("src and dst must be uint64 address arrays of one length")
    if src_off.dtype != _I64 or dst_off.dtype != _I64 or len(src_off) != len(dst_off):
        raise ValueError("src_off and dst_off must be int64 offset arrays of one length")
    if crc_mode != CRC_NONE and (crcs is None or crcs.dtype != _U32 or len(crcs) != len(src)
                                 or not crcs.flags.c_contiguous):
        raise ValueError("a CRC mode needs crcs: a contiguous uint32 array, one per slab")
    for array in (src, dst, src_off, dst_off):
        if not array.flags.c_contiguous:
            raise ValueError("address and offset arrays must be contiguous")
    _copy_slabs(len(src), src.ctypes.data, dst.ctypes.data,
                crcs.ctypes.data if crcs is not None else None, len(src_off), chunk,
                src_off.ctypes.data, dst_off.ctypes.data, _CRC_FN, crc_mode)
