// Block copies between an arena and contiguous buffers, and between memkv blocks
// and an engine's paged KV cache.
//
// gather/scatter: n blocks of `block_bytes` at byte offsets of an arena, to or from
// one contiguous buffer (a session's scattered blocks as one tensor and back); one
// thread per 4-byte word (block_bytes and offsets are multiples of 4: memkv's
// blocks are whole elements of 2 or 4 bytes and arena units are aligned).
//
// paged: one layer of n memkv blocks [n, L, 2, H, N, D] into (or out of) vLLM's
// paged cache of that layer, at the given block ids, for its two layouts:
//   layout 0 (CPU backend)        [num_blocks, H, 2N, D]: per head, N K rows then N V rows
//   layout 1 (flash attention)    [2, num_blocks, N, H, D]
// Elements are moved as 16-bit words (fp16/bf16) or 32-bit ones (fp32).
#include "memkv_compat.cuh"

MEMKV_EXTERN __global__ void gather_blocks(const unsigned int* __restrict__ arena,
                                           const long long* __restrict__ offsets, long long n,
                                           long long block_bytes, unsigned int* __restrict__ out) {
  long long words = block_bytes / 4;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * words) return;
  long long b = i / words, w = i % words;
  out[i] = arena[offsets[b] / 4 + w];
}

MEMKV_EXTERN __global__ void scatter_blocks(const unsigned int* __restrict__ src,
                                            const long long* __restrict__ offsets, long long n,
                                            long long block_bytes, unsigned int* __restrict__ arena) {
  long long words = block_bytes / 4;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * words) return;
  long long b = i / words, w = i % words;
  arena[offsets[b] / 4 + w] = src[i];
}

__device__ __forceinline__ long long paged_index(int layout, long long block_id, int kv, int h,
                                                 int t, int d, int H, int N, int D,
                                                 long long num_blocks) {
  if (layout == 0) return ((block_id * H + h) * 2LL * N + (long long)kv * N + t) * D + d;
  return ((((long long)kv * num_blocks + block_id) * N + t) * H + h) * D + d;
}

// The two ends of element i of a paged copy: where it sits in the memkv blocks and in
// the cache. False past the last element.
__device__ __forceinline__ bool paged_pair(long long i, const long long* __restrict__ block_ids,
                                           long long n, int L, int layer, int H, int N, int D,
                                           long long num_blocks, int layout,
                                           long long* block_at, long long* cache_at) {
  long long per = 2LL * H * N * D;
  if (i >= n * per) return false;
  long long b = i / per, r = i % per;
  int d = (int)(r % D), t = (int)((r / D) % N), h = (int)((r / ((long long)D * N)) % H);
  int kv = (int)(r / ((long long)D * N * H));
  *block_at = (b * L + layer) * per + r;
  *cache_at = paged_index(layout, block_ids[b], kv, h, t, d, H, N, D, num_blocks);
  return true;
}

#define PAGED_KERNELS(suffix, T_)                                                              \
  MEMKV_EXTERN __global__ void paged_write_##suffix(                                           \
      const T_* __restrict__ blocks, const long long* __restrict__ block_ids, long long n,      \
      int L, int layer, int H, int N, int D, long long num_blocks, int layout,                 \
      T_* __restrict__ cache) {                                                                \
    long long at, c;                                                                           \
    if (paged_pair((long long)blockIdx.x * blockDim.x + threadIdx.x, block_ids, n, L, layer,   \
                   H, N, D, num_blocks, layout, &at, &c))                                      \
      cache[c] = blocks[at];                                                                   \
  }                                                                                            \
  MEMKV_EXTERN __global__ void paged_read_##suffix(                                            \
      const T_* __restrict__ cache, const long long* __restrict__ block_ids, long long n,       \
      int L, int layer, int H, int N, int D, long long num_blocks, int layout,                 \
      T_* __restrict__ blocks) {                                                               \
    long long at, c;                                                                           \
    if (paged_pair((long long)blockIdx.x * blockDim.x + threadIdx.x, block_ids, n, L, layer,   \
                   H, N, D, num_blocks, layout, &at, &c))                                      \
      blocks[at] = cache[c];                                                                   \
  }

PAGED_KERNELS(u16, unsigned short)
PAGED_KERNELS(u32, unsigned int)

#ifdef MEMKV_HOST_BUILD
static dim3 grid_for(long long n) { return dim3((unsigned)((n + 255) / 256)); }
extern "C" void host_gather_blocks(const unsigned int* a, const long long* o, long long n,
                                   long long bb, unsigned int* out) {
  host_launch(grid_for(n * (bb / 4)), dim3(256), gather_blocks, a, o, n, bb, out);
}
extern "C" void host_scatter_blocks(const unsigned int* s, const long long* o, long long n,
                                    long long bb, unsigned int* a) {
  host_launch(grid_for(n * (bb / 4)), dim3(256), scatter_blocks, s, o, n, bb, a);
}
#define HOST_PAGED(suffix, T_)                                                                 \
  extern "C" void host_paged_write_##suffix(const T_* b, const long long* ids, long long n,    \
                                            int L, int layer, int H, int N, int D,             \
                                            long long nb, int layout, T_* c) {                 \
    host_launch(grid_for(n * 2LL * H * N * D), dim3(256), paged_write_##suffix, b, ids, n, L,   \
                layer, H, N, D, nb, layout, c);                                                \
  }                                                                                            \
  extern "C" void host_paged_read_##suffix(const T_* c, const long long* ids, long long n,     \
                                           int L, int layer, int H, int N, int D,              \
                                           long long nb, int layout, T_* b) {                  \
    host_launch(grid_for(n * 2LL * H * N * D), dim3(256), paged_read_##suffix, c, ids, n, L,    \
                layer, H, N, D, nb, layout, b);                                                \
  }
HOST_PAGED(u16, unsigned short)
HOST_PAGED(u32, unsigned int)
#endif
