// Symmetric int8 quantisation of a KV block [L, 2, H, T, D] (fp32 in): keys per
// channel (one scale per (l, h, d), over the tokens), values per token (one scale
// per (l, h, t), over the channels) - the format of memkv.storage.precision.
// scale = absmax / 127, rounded down where needed so that 127 * scale <= absmax;
// code = clamp(rint(x / scale), -127, 127) (a zero scale gives code 0).
#include "memkv_compat.cuh"

__device__ __forceinline__ float scale_down(float absmax) {
  float s = absmax / 127.0f;
  if ((double)s * 127.0 > (double)absmax) s = nextafterf(s, 0.0f);
  return s;
}

// One thread per (l, h, d): the max over tokens of |K|.
MEMKV_EXTERN __global__ void int8_key_scales(const float* __restrict__ x, float* __restrict__ scale,
                                             int L, int H, int T, int D) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)L * H * D) return;
  int d = (int)(i % D), h = (int)((i / D) % H), l = (int)(i / ((long long)D * H));
  const float* k = x + (((long long)l * 2 + 0) * H + h) * (long long)T * D + d;
  float m = 0.0f;
  for (int t = 0; t < T; ++t) m = fmaxf(m, fabsf(k[(long long)t * D]));
  scale[i] = scale_down(m);
}

// One thread per (l, h, t): the max over channels of |V|.
MEMKV_EXTERN __global__ void int8_value_scales(const float* __restrict__ x,
                                               float* __restrict__ scale, int L, int H, int T,
                                               int D) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)L * H * T) return;
  int t = (int)(i % T), h = (int)((i / T) % H), l = (int)(i / ((long long)T * H));
  const float* v = x + ((((long long)l * 2 + 1) * H + h) * T + t) * (long long)D;
  float m = 0.0f;
  for (int d = 0; d < D; ++d) m = fmaxf(m, fabsf(v[d]));
  scale[i] = scale_down(m);
}

__device__ __forceinline__ float element_scale(long long i, const float* k_scale,
                                               const float* v_scale, int H, int T, int D) {
  int d = (int)(i % D);
  int t = (int)((i / D) % T);
  int h = (int)((i / ((long long)D * T)) % H);
  int kv = (int)((i / ((long long)D * T * H)) % 2);
  long long l = i / ((long long)D * T * H * 2);
  return kv == 0 ? k_scale[(l * H + h) * D + d] : v_scale[(l * H + h) * T + t];
}

MEMKV_EXTERN __global__ void int8_quantize(const float* __restrict__ x,
                                           const float* __restrict__ k_scale,
                                           const float* __restrict__ v_scale,
                                           signed char* __restrict__ codes, int L, int H, int T,
                                           int D) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)L * 2 * H * T * D) return;
  float s = element_scale(i, k_scale, v_scale, H, T, D);
  float q = rintf(x[i] / (s > 0.0f ? s : 1.0f));
  codes[i] = (signed char)fminf(fmaxf(q, -127.0f), 127.0f);
}

MEMKV_EXTERN __global__ void int8_dequantize(const signed char* __restrict__ codes,
                                             const float* __restrict__ k_scale,
                                             const float* __restrict__ v_scale,
                                             float* __restrict__ out, int L, int H, int T, int D) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)L * 2 * H * T * D) return;
  out[i] = (float)codes[i] * element_scale(i, k_scale, v_scale, H, T, D);
}

#ifdef MEMKV_HOST_BUILD
static dim3 grid_for(long long n) { return dim3((unsigned)((n + 255) / 256)); }
extern "C" void host_int8_scales(const float* x, float* k, float* v, int L, int H, int T, int D) {
  host_launch(grid_for((long long)L * H * D), dim3(256), int8_key_scales, x, k, L, H, T, D);
  host_launch(grid_for((long long)L * H * T), dim3(256), int8_value_scales, x, v, L, H, T, D);
}
extern "C" void host_int8_quantize(const float* x, const float* k, const float* v,
                                   signed char* c, int L, int H, int T, int D) {
  host_launch(grid_for((long long)L * 2 * H * T * D), dim3(256), int8_quantize, x, k, v, c, L, H,
              T, D);
}
extern "C" void host_int8_dequantize(const signed char* c, const float* k, const float* v,
                                     float* out, int L, int H, int T, int D) {
  host_launch(grid_for((long long)L * 2 * H * T * D), dim3(256), int8_dequantize, c, k, v, out, L,
              H, T, D);
}
#endif
