// Casts between fp32, fp16 and bf16, counting the outputs that are not finite
// (inf from an overflow, or NaN carried through): the precision policy refuses
// a narrowing that produced any.
#include "memkv_compat.cuh"

__device__ __forceinline__ void note_nonfinite(float y, unsigned long long* overflow) {
  if (!isfinite(y)) atomicAdd(overflow, 1ull);
}

MEMKV_EXTERN __global__ void cast_f32_to_f16(const float* __restrict__ x, __half* __restrict__ y,
                                             long long n, unsigned long long* overflow) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  __half h = __float2half_rn(x[i]);
  y[i] = h;
  note_nonfinite(__half2float(h), overflow);
}

MEMKV_EXTERN __global__ void cast_f32_to_bf16(const float* __restrict__ x,
                                              __nv_bfloat16* __restrict__ y, long long n,
                                              unsigned long long* overflow) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
  y[i] = b;
  note_nonfinite(__bfloat162float(b), overflow);
}

MEMKV_EXTERN __global__ void cast_f16_to_f32(const __half* __restrict__ x, float* __restrict__ y,
                                             long long n, unsigned long long* overflow) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = __half2float(x[i]);
  note_nonfinite(y[i], overflow);
}

MEMKV_EXTERN __global__ void cast_bf16_to_f32(const __nv_bfloat16* __restrict__ x,
                                              float* __restrict__ y, long long n,
                                              unsigned long long* overflow) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = __bfloat162float(x[i]);
  note_nonfinite(y[i], overflow);
}

#ifdef MEMKV_HOST_BUILD
#define HOST_CAST(name, tin, tout)                                                    \
  extern "C" void host_##name(const tin* x, tout* y, long long n, unsigned long long* o) { \
    host_launch(dim3((unsigned)((n + 255) / 256)), dim3(256), name, x, y, n, o);       \
  }
HOST_CAST(cast_f32_to_f16, float, __half)
HOST_CAST(cast_f32_to_bf16, float, __nv_bfloat16)
HOST_CAST(cast_f16_to_f32, __half, float)
HOST_CAST(cast_bf16_to_f32, __nv_bfloat16, float)
#endif
