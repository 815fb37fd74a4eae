// The plain BF16 GEMV, the same structure as the 12-bit kernel without the decode and without
// corrections: for matrices that cannot or should not be compressed, and the yardstick the
// compressed kernel is measured against. W is row-major; lane (g, t) reads 16 bytes of rows g and
// g+8 at k = 8t of each 32-wide half of a group, the K relabelling that matches x's 16-byte loads.
#pragma once

#include "common.cuh"

template <int NW, int UG, int NB, int PIPE>
__global__ void __launch_bounds__(NW * 32, (PIPE == 2 ? 2 : PIPE == 3 ? 1 : 0))
    gemvz_bf16_kernel(const Bf16Params p) {
  using namespace gemvz_dev;
  static_assert(NW >= NB, "the first NB warps do the final reduction");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int rb = blockIdx.x, sidx = blockIdx.y;
  const int KG = p.K / 64, KGS = KG / p.S, KGW = KGS / NW;
  const int M = p.M;
  __shared__ float4 red[NW][NB * 32];
  __shared__ int s_last;

  const int g0 = sidx * KGS + warp * KGW;
  const unsigned short* w0 = p.w + static_cast<size_t>(rb * 16 + g) * p.ldw + g0 * 64 + t * 8;
  const unsigned short* w8 = w0 + 8 * p.ldw;  // row g + 8
  // Programmatic dependent launch: let the next kernel start once every CTA has started; when
  // launched with PDL (flags bit 2), pull this warp's first trip of weights (rows g and g + 8,
  // from lanes t = 0) into L2 while the previous kernel finishes; then wait for it before
  // reading x or writing (no-ops without PDL).
  pdl_launch_dependents();
  if ((p.flags & 4) && t == 0) {
    prefetch_l2_bulk(w0, UG * 128);
    prefetch_l2_bulk(w8, UG * 128);
  }
  pdl_wait();
  const unsigned short* xr[NB];
  x_rows<NB>(p.x, p.ldx, M, g0, g, t, xr);
  float acc[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; nb++) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;

  // One group: W rows g / g+8 at k 8t..8t+7 of the first (a, c) and second (b, d) 32.
  auto load = [&](int i, uint4& a, uint4& c, uint4& b, uint4& d) {
    a = ld_stream(reinterpret_cast<const uint4*>(w0 + i * 64));
    c = ld_stream(reinterpret_cast<const uint4*>(w8 + i * 64));
    b = ld_stream(reinterpret_cast<const uint4*>(w0 + i * 64 + 32));
    d = ld_stream(reinterpret_cast<const uint4*>(w8 + i * 64 + 32));
  };
  auto compute = [&](const uint4& a, const uint4& c, const uint4& b, const uint4& d,
                     const uint4 (&xa)[NB], const uint4 (&xb)[NB]) {
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
      mma_bf16(acc[nb], make_uint4(a.x, c.x, a.y, c.y), xa[nb].x, xa[nb].y);
      mma_bf16(acc[nb], make_uint4(a.z, c.z, a.w, c.w), xa[nb].z, xa[nb].w);
      mma_bf16(acc[nb], make_uint4(b.x, d.x, b.y, d.y), xb[nb].x, xb[nb].y);
      mma_bf16(acc[nb], make_uint4(b.z, d.z, b.w, d.w), xb[nb].z, xb[nb].w);
    }
  };

  if constexpr (PIPE == 0 || PIPE == 3) {
    for (int i = 0; i < KGW; i += UG) {
      uint4 A[UG], C[UG], B[UG], D[UG];
#pragma unroll
      for (int u = 0; u < UG; u++) load(i + u, A[u], C[u], B[u], D[u]);
#pragma unroll
      for (int u = 0; u < UG; u++) {
        uint4 xa[NB], xb[NB];
        x_frags<NB>(xr, i + u, xa, xb);
        compute(A[u], C[u], B[u], D[u], xa, xb);
      }
    }
  } else {
    uint4 A[UG], C[UG], B[UG], D[UG];
#pragma unroll
    for (int u = 0; u < UG; u++) load(u, A[u], C[u], B[u], D[u]);
    for (int i = 0; i < KGW; i += UG) {
      uint4 xa[UG][NB], xb[UG][NB];
#pragma unroll
      for (int u = 0; u < UG; u++) x_frags<NB>(xr, i + u, xa[u], xb[u]);
      uint4 nA[UG], nC[UG], nB[UG], nD[UG];
      if (i + UG < KGW) {
#pragma unroll
        for (int u = 0; u < UG; u++) load(i + UG + u, nA[u], nC[u], nB[u], nD[u]);
      }
#pragma unroll
      for (int u = 0; u < UG; u++) compute(A[u], C[u], B[u], D[u], xa[u], xb[u]);
#pragma unroll
      for (int u = 0; u < UG; u++) {
        A[u] = nA[u];
        C[u] = nC[u];
        B[u] = nB[u];
        D[u] = nD[u];
      }
    }
  }
  park_partials<NW, NB>(red, warp, lane, acc);
  __syncthreads();

  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool active = tid < NB * 32;
  const int nbo = tid >> 5;
  if (active) r = sum_warp_partials<NW, NB>(red, tid);
  if (p.S > 1 && !splitk_combine(r, active, static_cast<float4*>(p.ws), p.sem, rb, sidx, p.S,
                                 NB * 32, &s_last)) {
    return;
  }
  if (active) {
    const float rr[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int tok = nbo * 8 + 2 * t + (q & 1);
      const int row = rb * 16 + g + ((q >> 1) << 3);
      if (tok < M && row < p.N) {
        store_out(p.out, static_cast<size_t>(tok) * p.ldo + row, rr[q], p.flags & 2);
      }
    }
  }
}
