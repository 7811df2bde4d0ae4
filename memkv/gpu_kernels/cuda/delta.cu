// The token-axis delta of Delta+RL over uint8 codes viewed as [outer, T, inner]:
// d[o, 0, i] = c[o, 0, i] & mask; d[o, t, i] = (c[o, t, i] - c[o, t - 1, i]) & mask, so the
// inverse (a running sum per (o, i) column, modulo 256, & mask) is exact.
#include "memkv_compat.cuh"

MEMKV_EXTERN __global__ void token_delta(const unsigned char* __restrict__ codes,
                                         unsigned char* __restrict__ out, long long outer, int T,
                                         long long inner, int mask) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= outer * T * inner) return;
  int t = (int)((i / inner) % T);
  unsigned char v = t == 0 ? codes[i] : (unsigned char)(codes[i] - codes[i - inner]);
  out[i] = (unsigned char)(v & mask);
}

// One thread per column: the running sum is sequential along the tokens.
MEMKV_EXTERN __global__ void undo_token_delta(const unsigned char* __restrict__ deltas,
                                              unsigned char* __restrict__ out, long long outer,
                                              int T, long long inner, int mask) {
  long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= outer * inner) return;
  long long o = c / inner, i = c % inner;
  const unsigned char* d = deltas + o * T * inner + i;
  unsigned char* y = out + o * T * inner + i;
  unsigned char sum = 0;
  for (int t = 0; t < T; ++t) {
    sum = (unsigned char)(sum + d[(long long)t * inner]);
    y[(long long)t * inner] = (unsigned char)(sum & mask);
  }
}

#ifdef MEMKV_HOST_BUILD
static dim3 grid_for(long long n) { return dim3((unsigned)((n + 255) / 256)); }
extern "C" void host_token_delta(const unsigned char* c, unsigned char* out, long long outer,
                                 int T, long long inner, int mask) {
  host_launch(grid_for(outer * T * inner), dim3(256), token_delta, c, out, outer, T, inner, mask);
}
extern "C" void host_undo_token_delta(const unsigned char* d, unsigned char* out,
                                      long long outer, int T, long long inner, int mask) {
  host_launch(grid_for(outer * inner), dim3(256), undo_token_delta, d, out, outer, T, inner,
              mask);
}
#endif
