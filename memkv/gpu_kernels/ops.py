"""The kernels' Python API: the CUDA kernel for a CUDA tensor where CuPy can run it,
the CPU reference (:mod:`memkv.gpu_kernels.reference`) otherwise — same signatures,
same results (bit for bit for codes, casts and copies; see the tests).

Callers (the precision policy, the codecs, the vLLM connector) use these
functions only, so there is one copy of each piece of math.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from memkv.gpu_kernels import cpu_paged, reference
from memkv.gpu_kernels.loader import backend, cuda_module

__all__ = [
    "INT8_LEVELS",
    "NIBBLE_LEVELS",
    "PAGED_CPU",
    "PAGED_FLASH",
    "cast",
    "gather_blocks",
    "group4_codes",
    "group4_dequantize",
    "group_minmax",
    "int8_dequantize",
    "int8_quantize",
    "int8_scales",
    "pack_nibbles",
    "paged_read",
    "paged_write",
    "scatter_blocks",
    "token_delta",
    "undo_token_delta",
    "unpack_nibbles",
]

INT8_LEVELS = reference.INT8_LEVELS
NIBBLE_LEVELS = reference.NIBBLE_LEVELS
PAGED_CPU, PAGED_FLASH = reference.PAGED_CPU, reference.PAGED_FLASH
_THREADS = 256


def _on_gpu(*tensors: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors) and backend() == "cuda"


def _cp(t: torch.Tensor) -> Any:
    import cupy

    return cupy.from_dlpack(t.contiguous())


def _launch(module: str, name: str, threads: int, *args: Any) -> None:
    import cupy

    kernel = cuda_module(module).get_function(name)
    blocks = max(1, -(-threads // _THREADS))
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        kernel((blocks,), (_THREADS,), args)


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


# -- casts ------------------------------------------------------------------------------------

_CASTS = {
    (torch.float32, torch.float16): "cast_f32_to_f16",
    (torch.float32, torch.bfloat16): "cast_f32_to_bf16",
    (torch.float16, torch.float32): "cast_f16_to_f32",
    (torch.bfloat16, torch.float32): "cast_bf16_to_f32",
}


def cast(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``x`` as ``dtype`` (round to nearest even) and the count of non-finite results."""
    name = _CASTS.get((x.dtype, dtype))
    if name is None or not _on_gpu(x):
        return reference.cast(x, dtype)
    src = x.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    count = torch.zeros(1, dtype=torch.int64, device=src.device)
    _launch("cast", name, src.numel(), _cp(src), _cp(out), _i64(src.numel()), _cp(count))
    return out, int(count.item())


# -- int8 -------------------------------------------------------------------------------------


def int8_scales(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_scale [L, H, D], v_scale [L, H, T])``, fp32: see ``cuda/int8.cu``."""
    if not _on_gpu(block):
        return reference.int8_scales(block)
    x = block.float().contiguous()
    L, _, H, T, D = x.shape
    k = torch.empty((L, H, D), dtype=torch.float32, device=x.device)
    v = torch.empty((L, H, T), dtype=torch.float32, device=x.device)
    dims = (_i32(L), _i32(H), _i32(T), _i32(D))
    _launch("int8", "int8_key_scales", L * H * D, _cp(x), _cp(k), *dims)
    _launch("int8", "int8_value_scales", L * H * T, _cp(x), _cp(v), *dims)
    return k, v


def int8_quantize(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, k_scale, v_scale)`` of a finite block ``[L, 2, H, T, D]``."""
    if not _on_gpu(block):
        return reference.int8_quantize(block)
    k, v = int8_scales(block)
    x = block.float().contiguous()
    L, _, H, T, D = x.shape
    codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    _launch("int8", "int8_quantize", x.numel(), _cp(x), _cp(k), _cp(v), _cp(codes),
            _i32(L), _i32(H), _i32(T), _i32(D))
    return codes, k, v


def int8_dequantize(
    codes: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``codes * scale`` into ``out`` (fp32 product, rounded once to out's dtype)."""
    if not _on_gpu(codes, k_scale, v_scale, out):
        return reference.int8_dequantize(codes, k_scale, v_scale, out)
    L, _, H, T, D = codes.shape
    wide = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _launch("int8", "int8_dequantize", codes.numel(), _cp(codes), _cp(k_scale), _cp(v_scale),
            _cp(wide), _i32(L), _i32(H), _i32(T), _i32(D))
    out.copy_(wide if out.dtype == torch.float32 else cast(wide, out.dtype)[0])
    return out


# -- 4-bit groups, nibbles, the token delta (the codecs run these on host arrays) --------------

group_minmax = reference.group_minmax
group4_codes = reference.group4_codes
group4_dequantize = reference.group4_dequantize
pack_nibbles = reference.pack_nibbles
unpack_nibbles = reference.unpack_nibbles
token_delta = reference.token_delta
undo_token_delta = reference.undo_token_delta


# -- block copies -----------------------------------------------------------------------------


def gather_blocks(arena: torch.Tensor, offsets: list[int], block_bytes: int) -> torch.Tensor:
    """Blocks at byte ``offsets`` of a uint8 ``arena``, as one contiguous uint8 tensor."""
    if not _on_gpu(arena) or block_bytes % 4 or any(o % 4 for o in offsets):
        return reference.gather_blocks(arena, offsets, block_bytes)
    offs = torch.tensor(offsets, dtype=torch.int64, device=arena.device)
    out = torch.empty(len(offsets) * block_bytes, dtype=torch.uint8, device=arena.device)
    _launch("gather", "gather_blocks", len(offsets) * block_bytes // 4,
            _cp(arena.view(torch.int32)), _cp(offs), _i64(len(offsets)), _i64(block_bytes),
            _cp(out.view(torch.int32)))
    return out


def scatter_blocks(
    src: torch.Tensor, offsets: list[int], block_bytes: int, arena: torch.Tensor
) -> None:
    """Block ``i`` of ``src`` to ``arena[offsets[i]:]`` (the inverse of :func:`gather_blocks`)."""
    if not _on_gpu(src, arena) or block_bytes % 4 or any(o % 4 for o in offsets):
        reference.scatter_blocks(src, offsets, block_bytes, arena)
        return
    offs = torch.tensor(offsets, dtype=torch.int64, device=arena.device)
    _launch("gather", "scatter_blocks", len(offsets) * block_bytes // 4,
            _cp(src.view(torch.int32)), _cp(offs), _i64(len(offsets)), _i64(block_bytes),
            _cp(arena.view(torch.int32)))


def _paged(kind: str, blocks: torch.Tensor, block_ids: list[int], layer: int,
           cache: torch.Tensor, layout: int) -> None:
    n, L, _, H, N, D = blocks.shape
    num_blocks = cache.shape[0] if layout == PAGED_CPU else cache.shape[1]
    word = {2: torch.int16, 4: torch.int32}[blocks.element_size()]
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    suffix = "u16" if word is torch.int16 else "u32"
    first, second = (blocks, cache) if kind == "write" else (cache, blocks)
    _launch("gather", f"paged_{kind}_{suffix}", n * 2 * H * N * D,
            _cp(first.view(word)), _cp(ids), _i64(n), _i32(L), _i32(layer), _i32(H), _i32(N),
            _i32(D), _i64(num_blocks), _i32(layout), _cp(second.view(word)))


def paged_write(
    blocks: torch.Tensor, block_ids: list[int], layer: int, cache: torch.Tensor, layout: int
) -> None:
    """Layer ``layer`` of memkv blocks ``[n, L, 2, H, N, D]`` into a layer's paged cache."""
    if not _on_gpu(blocks, cache) or not blocks.is_contiguous() or not cache.is_contiguous():
        if not cpu_paged.paged_copy("write", blocks, block_ids, layer, cache, layout):
            reference.paged_write(blocks, block_ids, layer, cache, layout)
        return
    _paged("write", blocks, block_ids, layer, cache, layout)


def paged_read(
    cache: torch.Tensor, block_ids: list[int], layer: int,
    blocks: torch.Tensor | list[torch.Tensor], layout: int,
) -> None:
    """Layer ``layer`` of a paged cache's ``block_ids`` into memkv blocks (one tensor, or
    one per block where they do not lie back to back)."""
    if isinstance(blocks, list) or not _on_gpu(blocks, cache) or not blocks.is_contiguous() \
            or not cache.is_contiguous():
        if not cpu_paged.paged_copy("read", blocks, block_ids, layer, cache, layout):
            reference.paged_read(cache, block_ids, layer, blocks, layout)
        return
    _paged("read", blocks, block_ids, layer, cache, layout)
