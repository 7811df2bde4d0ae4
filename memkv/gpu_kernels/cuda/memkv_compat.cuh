// One source, two builds.
//
// Under nvcc (or NVRTC through CuPy's RawModule) this pulls in CUDA's fp16/bf16
// types and nothing else. With MEMKV_HOST_BUILD (g++ -x c++) it defines the CUDA
// built-ins the kernels use, so each kernel also compiles as plain C++ and runs on
// the CPU: a launch becomes a loop over the grid, one (block, thread) at a time.
// Kernels here therefore use no shared memory, no __syncthreads and no warp
// intrinsics: each thread owns its outputs (a reduction is a loop in one thread).
#pragma once

#ifndef MEMKV_HOST_BUILD
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define MEMKV_EXTERN extern "C"
#else
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__ inline
#define __forceinline__
#define MEMKV_EXTERN static

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned int x_, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
static dim3 threadIdx, blockIdx, blockDim, gridDim;

// The grid as a loop (serial: the host build is for checking results, not speed).
template <typename Kernel, typename... Args>
static void host_launch(dim3 grid, dim3 block, Kernel kernel, Args... args) {
  gridDim = grid;
  blockDim = block;
  for (blockIdx.z = 0; blockIdx.z < grid.z; ++blockIdx.z)
    for (blockIdx.y = 0; blockIdx.y < grid.y; ++blockIdx.y)
      for (blockIdx.x = 0; blockIdx.x < grid.x; ++blockIdx.x)
        for (threadIdx.z = 0; threadIdx.z < block.z; ++threadIdx.z)
          for (threadIdx.y = 0; threadIdx.y < block.y; ++threadIdx.y)
            for (threadIdx.x = 0; threadIdx.x < block.x; ++threadIdx.x) kernel(args...);
}

static inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long v) {
  unsigned long long old = *address;
  *address = old + v;
  return old;
}

// IEEE half and bfloat16 as their bits, with CUDA's round-to-nearest-even conversions.
struct __half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };

static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static inline float __half2float(__half h) {
  _Float16 f; std::memcpy(&f, &h.bits, 2); return static_cast<float>(f);
}
static inline __half __float2half_rn(float x) {
  _Float16 f = static_cast<_Float16>(x);  // round to nearest even, as CUDA's _rn
  __half h; std::memcpy(&h.bits, &f, 2); return h;
}
static inline float __bfloat162float(__nv_bfloat16 b) { return bits_f32(uint32_t(b.bits) << 16); }
static inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u = f32_bits(x);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) { b.bits = uint16_t((u >> 16) | 0x40u); return b; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  b.bits = uint16_t(u >> 16);
  return b;
}
using std::isfinite;
#endif
