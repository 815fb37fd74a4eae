// The read-bandwidth ceiling that `gemvz bench` compares the GEMVs with: streams a buffer once
// through the same non-allocating read-only path the GEMV kernels use, and nothing else. The
// bench times a few (UNROLL, THREADS, blocks) forms of it and takes the fastest (ProbeForms in
// tools/gemvz/bench_support.cc).
#pragma once

#include "common.cuh"

namespace gemvz_probe {

// 16 bytes through the non-coherent path, not allocated in L1: the GEMVs' own weight load.
using gemvz_dev::ld_stream;

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

}  // namespace gemvz_probe

// Grid-stride over n 16-byte units in blocks of THREADS threads: thread i reads units i,
// i + stride, ... with UNROLL loads in flight. Every thread folds what it read into one word and
// each block stores the XOR of its threads to sink[blockIdx.x], so no load is dead and no two
// blocks contend for one address.
template <int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) gemvz_bandwidth_probe(const uint4* __restrict__ src,
                                                             long long n,
                                                             unsigned* __restrict__ sink) {
  using namespace gemvz_probe;
  const long long stride = static_cast<long long>(gridDim.x) * THREADS;
  long long i = static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x;
  unsigned acc = 0;
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) v[u] = ld_stream(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; u++) acc ^= fold(v[u]);
  }
  for (; i < n; i += stride) acc ^= fold(ld_stream(src + i));  // the last partial sweep

  // Block XOR: warps by shuffle, then the warps' words through shared memory.
  __shared__ unsigned warp_acc[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned b = 0;
    for (int w = 0; w < THREADS / 32; w++) b ^= warp_acc[w];
    sink[blockIdx.x] = b;
  }
}
