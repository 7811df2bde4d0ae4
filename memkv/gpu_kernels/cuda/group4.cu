// 4-bit asymmetric group codes over a flat fp32 array, in groups of `group`
// consecutive elements (the last group may be short: it is as if padded by
// repeating its last element, which keeps its min and max) - the format of the
// Delta+RL codec (memkv.storage.codecs). The caller turns each group's min and
// max into its stored scale and minimum (rounded in the block's dtype); the codes
// are clamp(rint((x - min) / scale), 0, 15), and dequantisation rounds the
// product before the sum (no fused multiply-add), as the reference does.
#include "memkv_compat.cuh"

#ifdef MEMKV_HOST_BUILD
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
#endif

// One thread per group.
MEMKV_EXTERN __global__ void group_minmax(const float* __restrict__ x, long long n, int group,
                                          float* __restrict__ lo, float* __restrict__ hi) {
  long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long groups = (n + group - 1) / group;
  if (g >= groups) return;
  long long start = g * group, end = start + group < n ? start + group : n;
  float a = x[start], b = x[start];
  for (long long i = start + 1; i < end; ++i) {
    a = fminf(a, x[i]);
    b = fmaxf(b, x[i]);
  }
  lo[g] = a;
  hi[g] = b;
}

MEMKV_EXTERN __global__ void group4_codes(const float* __restrict__ x, long long n, int group,
                                          const float* __restrict__ scale,
                                          const float* __restrict__ minimum,
                                          unsigned char* __restrict__ codes) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  long long g = i / group;
  float s = scale[g] > 0.0f ? scale[g] : 1.0f;  // a constant group: code 0
  float q = rintf((x[i] - minimum[g]) / s);
  codes[i] = (unsigned char)fminf(fmaxf(q, 0.0f), 15.0f);
}

MEMKV_EXTERN __global__ void group4_dequantize(const unsigned char* __restrict__ codes, long long n,
                                               int group, const float* __restrict__ scale,
                                               const float* __restrict__ minimum,
                                               float* __restrict__ out) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  long long g = i / group;
  out[i] = __fadd_rn(__fmul_rn((float)codes[i], scale[g]), minimum[g]);
}

// Two codes to a byte: the first half of the stream in the low nibbles, the second
// half in the high ones (both unpack passes stay contiguous).
MEMKV_EXTERN __global__ void pack_nibbles(const unsigned char* __restrict__ codes, long long n,
                                          unsigned char* __restrict__ packed) {
  long long half = (n + 1) / 2;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= half) return;
  unsigned char hi = i + half < n ? (unsigned char)(codes[i + half] << 4) : 0;
  packed[i] = (unsigned char)(codes[i] | hi);
}

MEMKV_EXTERN __global__ void unpack_nibbles(const unsigned char* __restrict__ packed, long long n,
                                            unsigned char* __restrict__ codes) {
  long long half = (n + 1) / 2;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= half) return;
  codes[i] = packed[i] & 0x0f;
  if (i + half < n) codes[i + half] = packed[i] >> 4;
}

#ifdef MEMKV_HOST_BUILD
static dim3 grid_for(long long n) { return dim3((unsigned)((n + 255) / 256)); }
extern "C" void host_group_minmax(const float* x, long long n, int group, float* lo, float* hi) {
  host_launch(grid_for((n + group - 1) / group), dim3(256), group_minmax, x, n, group, lo, hi);
}
extern "C" void host_group4_codes(const float* x, long long n, int group, const float* s,
                                  const float* m, unsigned char* c) {
  host_launch(grid_for(n), dim3(256), group4_codes, x, n, group, s, m, c);
}
extern "C" void host_group4_dequantize(const unsigned char* c, long long n, int group,
                                       const float* s, const float* m, float* out) {
  host_launch(grid_for(n), dim3(256), group4_dequantize, c, n, group, s, m, out);
}
extern "C" void host_pack_nibbles(const unsigned char* c, long long n, unsigned char* p) {
  host_launch(grid_for((n + 1) / 2), dim3(256), pack_nibbles, c, n, p);
}
extern "C" void host_unpack_nibbles(const unsigned char* p, long long n, unsigned char* c) {
  host_launch(grid_for((n + 1) / 2), dim3(256), unpack_nibbles, p, n, c);
}
#endif
