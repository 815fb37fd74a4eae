// Device helpers shared by the GEMV kernels: streaming loads, the BF16 tensor-core mma, the
// byte-permute and three-input logic instructions the 12-bit decoder is built from.
#pragma once

#include "gemv_params.cuh"
#include "k_range.cuh"

namespace gemvz_dev {

// 16 bytes through the non-coherent path without allocating in L1: weights are read once.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// d += A (16x16 BF16, row) * B (16x8 BF16, col), FP32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint4 a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// a | (b & c) in one instruction: the truth table of f(0xF0, 0xCC, 0xAA) is 0xF8.
__device__ __forceinline__ unsigned or_and(unsigned a, unsigned b, unsigned c) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xF8;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// S0/S1: low bytes of values 0-3 / 4-7 of one A fragment; Q: their 3-bit codes (bits 4i..4i+2)
// and signs (bits 7,15,23,31 for values 0-3; 3,11,19,27 for 4-7). Returns the four fragment
// registers, each two BF16 values (lower index in the low half).
__device__ __forceinline__ uint4 decz(unsigned s0, unsigned s1, unsigned q, unsigned tl,
                                      unsigned th) {
  const unsigned h0 = or_and(prmt(tl, th, q & 0x7777u), q, 0x80808080u);          // values 0-3
  const unsigned h1 = or_and(prmt(tl, th, (q >> 16) & 0x7777u), q << 4, 0x80808080u);  // 4-7
  uint4 a;
  a.x = prmt(s0, h0, 0x5140u);  // [low0, high0, low1, high1]
  a.y = prmt(s0, h0, 0x7362u);
  a.z = prmt(s1, h1, 0x5140u);
  a.w = prmt(s1, h1, 0x7362u);
  return a;
}

// Programmatic dependent launch (sm_90+; no-ops below, and no-ops on sm_90 when the grid was
// launched without the attribute). launch_dependents lets the next kernel in the stream start once
// every CTA of this grid has started; pdl_wait blocks until the previous grid has finished and its
// writes are visible. Launched with PDL, the GEMVs start their first weights (which no earlier
// kernel writes) towards L2 before pdl_wait; they read x or write anything only after it.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Starts pulling `bytes` (a multiple of 16, from a 16-byte aligned `p`) into L2 with the bulk-copy
// engine: one instruction, no registers held, nothing returned (sm_90+; a no-op below).
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_float(unsigned short h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}

__device__ __forceinline__ unsigned short float_to_bf16(float v) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

// Stores one result as BF16 (round to nearest even) or, with `fp32`, as the FP32 sum itself.
__device__ __forceinline__ void store_out(void* out, size_t idx, float v, bool fp32) {
  if (fp32) {
    static_cast<float*>(out)[idx] = v;
  } else {
    static_cast<unsigned short*>(out)[idx] = float_to_bf16(v);
  }
}

__device__ __forceinline__ void add4(float4& r, const float4 v) {
  r.x += v.x;
  r.y += v.y;
  r.z += v.z;
  r.w += v.w;
}

// Lane (g, t)'s x rows for token blocks 0..NB-1, at the warp's first group g0 and k = 8t: token
// nb*8 + g, clamped to M - 1 (rows past M compute garbage that is never stored).
template <int NB>
__device__ __forceinline__ void x_rows(const unsigned short* x, long long ldx, int M, int g0,
                                       int g, int t, const unsigned short* (&xr)[NB]) {
#pragma unroll
  for (int nb = 0; nb < NB; nb++) {
    const int tok = min(nb * 8 + g, M - 1);
    xr[nb] = x + static_cast<size_t>(tok) * ldx + g0 * 64 + t * 8;
  }
}

// Group gi's x fragments for every token block: k 8t..8t+7 of its first 32 K (xa) and of its
// second (xb). Every loop of both kernels loads them through this (session 19: the same cubins
// as written out, for all 777 configurations checked; docs/JIT.md).
template <int NB>
__device__ __forceinline__ void x_frags(const unsigned short* const (&xr)[NB], int gi,
                                        uint4 (&xa)[NB], uint4 (&xb)[NB]) {
#pragma unroll
  for (int nb = 0; nb < NB; nb++) {
    xa[nb] = __ldg(reinterpret_cast<const uint4*>(xr[nb] + gi * 64));
    xb[nb] = __ldg(reinterpret_cast<const uint4*>(xr[nb] + gi * 64 + 32));
  }
}

// A streaming warp parks its C fragments (one float4 per lane and token block) for the sum.
template <int NW, int NB>
__device__ __forceinline__ void park_partials(float4 (&red)[NW][NB * 32], int warp, int lane,
                                              const float (&acc)[NB][4]) {
#pragma unroll
  for (int nb = 0; nb < NB; nb++)
    red[warp][nb * 32 + lane] = make_float4(acc[nb][0], acc[nb][1], acc[nb][2], acc[nb][3]);
}

// Thread tid < NB*32 adds the NW warps' partial C fragments in warp order (deterministic).
template <int NW, int NB>
__device__ __forceinline__ float4 sum_warp_partials(const float4 (&red)[NW][NB * 32], int tid) {
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int wi = 0; wi < NW; wi++) add4(r, red[wi][tid]);
  return r;
}

// Split-K across CTAs: each CTA parks its partial sums, the last to arrive adds all S of them in
// slice order (deterministic) and resets the counter for the next call. Returns false in the CTAs
// that are not last; they must exit without storing.
__device__ __forceinline__ bool splitk_combine(float4& r, bool active, float4* ws, int* sem,
                                               int rb, int sidx, int S, int width, int* s_last) {
  const int tid = threadIdx.x;
  if (active) ws[(static_cast<size_t>(rb) * S + sidx) * width + tid] = r;
  __threadfence();
  __syncthreads();
  if (tid == 0) *s_last = (atomicAdd(&sem[rb], 1) == S - 1);
  __syncthreads();
  if (!*s_last) return false;
  __threadfence();
  if (active) {
    r = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < S; s++) add4(r, __ldcg(ws + (static_cast<size_t>(rb) * S + s) * width + tid));
  }
  if (tid == 0) sem[rb] = 0;
  return true;
}

}  // namespace gemvz_dev
