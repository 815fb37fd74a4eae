// The compressed GEMV (seed chapter 8): one CTA = RB 16-row blocks x one K slice (blockIdx.y of
// S). NW streaming warps decode 12-bit weights in registers and feed mma.sync m16n8k16, each
// taking its share of the slice's trips of UG groups (as even as whole trips go: k_range.cuh);
// warp NW applies the exact sparse corrections at the same time. With RB 2 (or 4) every streaming
// warp streams its K range of both (all four) row blocks at once and feeds them from one load of
// x's fragments: the same bytes in flight as UG 2 (4) with fewer registers (x's fragments are the
// larger share at NB 2 and above; at NB 4 one load of them serves 64 rows).
// Dense rows (most weights outside the window, e.g. all-zero padded vocabulary rows) get one
// extra CTA each, before the row blocks: it computes the row from its original BF16 values with
// all its threads, in parallel with the rest, and the row block's CTA leaves that row's output to
// it.
// PIPE: 0/3 plain loop (3: minBlocks 1), 1/2 software-pipelined (2: minBlocks 2), 4..8 plain loop
// with minBlocks PIPE - 2 (a register cap that buys more CTAs per SM, so more loads in flight)
// and, with RB 1, two accumulator chains (half the dependent mma latency per trip; RB 2's two
// row blocks are two chains already), 9..13 the same caps (minBlocks PIPE - 7) with the rolling
// loop: each (group, row block)'s registers take the next trip's load as soon as that unit's mma
// are done, so a warp keeps loads in flight through its math with the registers of one trip.
#pragma once

#include "common.cuh"

namespace gemvz_dev {

// One row block's group of 64 K: decode its four A fragments and feed every token block's mma,
// the group's first 32 K into acc and the second into accb (the same array for one chain). Both
// loops use it (session 7, docs/JIT.md: it changed the machine code of 8 of the kernels the table
// and the heuristic picked then, through the accumulators' register names only; timed on the
// H200 against the written-out loops, 0.999x).
template <int NB, int NACC>
__device__ __forceinline__ void decode_mma(const uint4& a0, const uint4& a1, const uint4& b,
                                           unsigned tl, unsigned th, const uint4 (&xa)[NB],
                                           const uint4 (&xb)[NB], float (&acc)[NACC][4],
                                           float (&accb)[NACC][4], int j) {
  const uint4 f0 = decz(a0.x, a0.y, b.x, tl, th);
  const uint4 f1 = decz(a0.z, a0.w, b.y, tl, th);
  const uint4 f2 = decz(a1.x, a1.y, b.z, tl, th);
  const uint4 f3 = decz(a1.z, a1.w, b.w, tl, th);
#pragma unroll
  for (int nb = 0; nb < NB; nb++) {
    mma_bf16(acc[j * NB + nb], f0, xa[nb].x, xa[nb].y);
    mma_bf16(acc[j * NB + nb], f1, xa[nb].z, xa[nb].w);
    mma_bf16(accb[j * NB + nb], f2, xb[nb].x, xb[nb].y);
    mma_bf16(accb[j * NB + nb], f3, xb[nb].z, xb[nb].w);
  }
}

// One (row block, group)'s 96 16-byte units from q, this lane's first: sections 0, 1 and 2.
__device__ __forceinline__ void ld_unit(const uint4* q, uint4& a0, uint4& a1, uint4& b) {
  a0 = ld_stream(q);
  a1 = ld_stream(q + 32);
  b = ld_stream(q + 64);
}

// A zero that ptxas cannot see through, ready only once the unit's mma have written every
// accumulator chain they feed: the rolling loop adds it to the next load's address. Without it
// ptxas hoists that load above the unit's decode and keeps the old and the new words live
// together (session 18: 128 -> 186 registers); with a zero taken from the decoded words instead,
// it decodes every unit first and batches the mma at the end (session 19: 190 registers).
// kz is N >> 31, 0 for every valid shape (N > 0).
template <int NB, int NACC>
__device__ __forceinline__ unsigned after_mma(const float (&acc)[NACC][4],
                                              const float (&accb)[NACC][4], int j, unsigned kz) {
  unsigned z = kz;
#pragma unroll
  for (int nb = 0; nb < NB; nb++) {
    asm("lop3.b32 %0, %1, %2, %3, 0xA8;"  // (a | b) & c
        : "=r"(z)
        : "r"(__float_as_uint(acc[j * NB + nb][3])), "r"(__float_as_uint(accb[j * NB + nb][3])),
          "r"(z));
  }
  return z;
}

// One trip from the weight registers A0, A1, B: each group's x fragments, then each unit's decode
// and mma; with `next` (a constant once inlined; the rolling loop) the unit's registers then take
// the next trip's load, pinned there by after_mma.
template <int NB, int UG, int RB, int NACC, class Unit>
__device__ __forceinline__ void trip(uint4 (&A0)[UG][RB], uint4 (&A1)[UG][RB], uint4 (&B)[UG][RB],
                                     const unsigned short* const (&xr)[NB], int i, unsigned tl,
                                     unsigned th, float (&acc)[NACC][4], float (&accb)[NACC][4],
                                     bool next, const Unit& unit, unsigned kz) {
#pragma unroll
  for (int u = 0; u < UG; u++) {
    uint4 xa[NB], xb[NB];  // k 8t..8t+7 of the group's first / second 32
    x_frags<NB>(xr, i + u, xa, xb);
#pragma unroll
    for (int j = 0; j < RB; j++) {
      decode_mma<NB>(A0[u][j], A1[u][j], B[u][j], tl, th, xa, xb, acc, accb, j);
      if (next) {
        ld_unit(unit(i + UG + u, j) + after_mma<NB>(acc, accb, j, kz), A0[u][j], A1[u][j], B[u][j]);
      }
    }
  }
}

// The dense-row bits of a CTA's RB*16 rows.
template <int RB>
struct DenseMask {
  using T = unsigned;
};
template <>
struct DenseMask<4> {
  using T = unsigned long long;
};

}  // namespace gemvz_dev

template <int NW, int UG, int NB, int PIPE, int RB = 1, int GM = 0>
__global__ void __launch_bounds__((NW + 1) * 32, (PIPE == 2   ? 2
                                                  : PIPE == 3 ? 1
                                                  : PIPE >= 9 ? PIPE - 7
                                                  : PIPE >= 4 ? PIPE - 2
                                                              : 0))
    gemvz_z12_kernel(const Z12Params p) {
  using namespace gemvz_dev;
  static_assert(NW >= NB, "the first NB warps do the final reduction");
  static_assert(RB == 1 || RB == 2 || RB == 4, "RB 1, 2 or 4 row blocks per CTA");
  static_assert(GM == 0 || GM == 1, "GM 0 (block-major) or 1 (group-major)");
  using Mask = typename DenseMask<RB>::T;
  // The combine takes RB*NB*32 C fragments: one a thread when there are enough threads, else in
  // turns (RB 4, S = 1 only).
  constexpr bool kOneFragmentPerThread = NW + 1 >= RB * NB;
  static_assert(RB == 4 || kOneFragmentPerThread, "the first RB*NB*32 threads do the combine");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  // cb: this CTA's RB row blocks (its pair at RB 2); negative for a dense row's CTA.
  // Dense rows' CTAs come first, so they start in the first wave and end long before the last
  // row block (last, they waited for a free slot and then ran alone: +50 % measured at m = 16).
  const int cb = static_cast<int>(blockIdx.x) - p.n_dense, sidx = blockIdx.y;
  const int KG = p.K / 64;
  const int M = p.M;
  __shared__ float4 red[NW][RB * NB * 32];
  __shared__ float ecorr[RB * 16][NB * 8 + 1];  // +1: 16 lanes writing 16 rows hit 16 banks
  __shared__ Mask s_dense;  // bit j*16 + r: row r of block j is dense (its CTA stores it)
  __shared__ int s_last;
  // Programmatic dependent launch: let the next kernel start once every CTA has started; when
  // launched with PDL (flags bit 2), pull this warp's first trip of weights into L2 while the
  // previous kernel finishes; then wait for it before anything reads x or writes (no-ops when
  // launched without PDL).
  pdl_launch_dependents();
  if ((p.flags & 4) && cb >= 0 && warp < NW && lane == 0) {
    if constexpr (GM == 0) {  // each row block's UG groups are contiguous
#pragma unroll
      for (int j = 0; j < RB; j++) {
        const size_t first =
            (static_cast<size_t>(cb * RB + j) * KG + k_range<NW, UG>(KG, p.S, sidx, warp).g0) * 96;
        prefetch_l2_bulk(static_cast<const uint4*>(p.w) + first, UG * 96 * 16);
      }
    } else {  // each group's RB row blocks are: the first group's (a loop over the trip's UG
              // groups cost the capped NB 2 kernels a 20-byte spill)
      const int g0 = k_range<NW, UG>(KG, p.S, sidx, warp).g0;
      const size_t first = (static_cast<size_t>(g0) * (p.N / 16) + cb * RB) * 96;
      prefetch_l2_bulk(static_cast<const uint4*>(p.w) + first, RB * 96 * 16);
    }
  }
  pdl_wait();

  if (cb < 0) {
    // ---- A dense row's CTA: out[tok][row] = sum_k orig[k] * x[tok][k], all threads over K in
    // 16-byte chunks (every load independent: one memory round trip), then a fixed-order sum.
    if (sidx != 0 || (p.flags & 1)) return;  // once per row, not per K slice
    const int d = static_cast<int>(blockIdx.x);
    const int row = __ldg(p.dense_global_rows + d);
    const unsigned short* vals = p.dense_values + static_cast<size_t>(d) * p.K;
    float* part = reinterpret_cast<float*>(&red[0][0]);  // [warps][NB*8]; red is large enough
    const int nwarps = NW + 1;
    // TF tokens' loads in flight at a time, four at every NB: one at a time at NB 1 made a
    // dense CTA at m = 8 take eight passes over K (some 7 us at K = 14336), which a row-block CTA
    // waiting for its slot pays in full. Four leaves every default kernel's registers and spills
    // as they were; eight did not (at NB 1 or NB 2).
    constexpr int TF = 4;
    for (int tok0 = 0; tok0 < M; tok0 += TF) {
      float acc[TF];
#pragma unroll
      for (int j = 0; j < TF; j++) acc[j] = 0.f;
#pragma unroll 1
      for (int c = tid; c < p.K / 8; c += nwarps * 32) {
        const uint4 wv = __ldg(reinterpret_cast<const uint4*>(vals + c * 8));
#pragma unroll
        for (int j = 0; j < TF; j++) {
          {  // unconditional (clamped row) so the TF loads issue together; extras are not stored
            const uint4 xv = __ldg(reinterpret_cast<const uint4*>(
                p.x + static_cast<size_t>(min(tok0 + j, M - 1)) * p.ldx + c * 8));
            float a = acc[j];
            a += __uint_as_float(wv.x << 16) * __uint_as_float(xv.x << 16);
            a += __uint_as_float(wv.x & 0xFFFF0000u) * __uint_as_float(xv.x & 0xFFFF0000u);
            a += __uint_as_float(wv.y << 16) * __uint_as_float(xv.y << 16);
            a += __uint_as_float(wv.y & 0xFFFF0000u) * __uint_as_float(xv.y & 0xFFFF0000u);
            a += __uint_as_float(wv.z << 16) * __uint_as_float(xv.z << 16);
            a += __uint_as_float(wv.z & 0xFFFF0000u) * __uint_as_float(xv.z & 0xFFFF0000u);
            a += __uint_as_float(wv.w << 16) * __uint_as_float(xv.w << 16);
            a += __uint_as_float(wv.w & 0xFFFF0000u) * __uint_as_float(xv.w & 0xFFFF0000u);
            acc[j] = a;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < TF; j++) {
        float a = acc[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xFFFFFFFFu, a, o);
        if (lane == 0 && tok0 + j < M) part[warp * (NB * 8) + tok0 + j] = a;
      }
    }
    __syncthreads();
    if (tid < M) {
      float r = 0.f;
      for (int wi = 0; wi < nwarps; wi++) r += part[wi * (NB * 8) + tid];
      store_out(p.out, static_cast<size_t>(tid) * p.ldo + row, r, p.flags & 2);
    }
    return;
  }

  if (warp == NW) {
    // ---- Exception warp: lane -> (row r, tokens p, p+2, ...) for each row block in turn; fixed
    // order, so deterministic.
    const int r = lane & 15, par = lane >> 4;
    const KRange kr = k_range<NW, UG>(KG, p.S, sidx, warp);  // the slice's [lo, hi)
    const int klo = kr.lo * 64, khi = kr.hi * 64;
    const bool corrections = !(p.flags & 1);
    Mask dense_mask = 0;  // rows whose own CTA stores them
#pragma unroll
    for (int j = 0; j < RB; j++) {
      const int rb = cb * RB + j;
      float ea[NB * 4];
#pragma unroll
      for (int q = 0; q < NB * 4; q++) ea[q] = 0.f;
      if (corrections) {
        const int row = rb * 16 + r;
        const int2* ep = static_cast<const int2*>(p.entries);
        const unsigned e1 = __ldg(p.row_offsets + row + 1);
#pragma unroll 2
        for (unsigned e = __ldg(p.row_offsets + row); e < e1; e++) {
          const int2 en = __ldg(ep + e);
          if (en.x >= klo && en.x < khi) {  // each correction belongs to exactly one K slice
            const float d = __int_as_float(en.y);
#pragma unroll
            for (int q = 0; q < NB * 4; q++) {
              const int tok = par + 2 * q;
              if (tok < M) ea[q] += d * bf16_to_float(p.x[static_cast<size_t>(tok) * p.ldx + en.x]);
            }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < NB * 4; q++) ecorr[j * 16 + r][par + 2 * q] = ea[q];
      if (corrections && lane == 0) {
        const unsigned d1 = __ldg(p.dense_block_offsets + rb + 1);
        for (unsigned d = __ldg(p.dense_block_offsets + rb); d < d1; d++) {
          dense_mask |= Mask{1} << (j * 16 + __ldg(p.dense_rows + d));
        }
      }
    }
    if (lane == 0) s_dense = dense_mask;
  } else {
    // ---- Streaming warps: RB row blocks at once, each group's x fragments shared by all.
    const KRange kr = k_range<NW, UG>(KG, p.S, sidx, warp);
    const int g0 = kr.g0, KGW = kr.n;  // this warp's groups [g0, g0 + KGW)
    // One (row block, group) is 96 16-byte units: sections 0, 1, 2 of 32 lanes each. Row block j
    // of this CTA's group i lies 96 * j (group-major; KG * 96 * j block-major) + SG * i units on
    // from wp, this warp's first unit.
    const size_t NRB = static_cast<size_t>(p.N / 16);
    const uint4* wp =
        static_cast<const uint4*>(p.w) +
        (GM ? static_cast<size_t>(g0) * NRB + cb * RB : static_cast<size_t>(cb * RB) * KG + g0) *
            96 +
        lane;
    const size_t SG = GM ? NRB * 96 : 96;  // (block-major spelt as before GM: same machine code)
    const unsigned short* xr[NB];
    x_rows<NB>(p.x, p.ldx, M, g0, g, t, xr);
    float acc[RB * NB][4];  // [j * NB + nb]: row block j, token block nb
#pragma unroll
    for (int b = 0; b < RB * NB; b++) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0.f;
    const unsigned TL = p.tl, TH = p.th;
    // Row block j's group gi: this lane's first unit of it.
    auto unit = [&](int gi, int j) {
      return wp + (GM ? static_cast<size_t>(j) * 96 : static_cast<size_t>(j) * KG * 96) +
             static_cast<size_t>(gi) * SG;
    };

    if constexpr (PIPE == 0 || PIPE >= 3) {
      // PIPE >= 4: the second half of each group's mma go to a second accumulator, so a trip's
      // chain of dependent mma is half as long (PIPE 0/3, and RB 2, whose two row blocks are
      // two chains already: accb is acc itself).
      constexpr bool kTwoChains = PIPE >= 4 && RB == 1;
      float acc2[RB * NB][4];
#pragma unroll
      for (int b = 0; b < RB * NB; b++) acc2[b][0] = acc2[b][1] = acc2[b][2] = acc2[b][3] = 0.f;
      float(&accb)[RB * NB][4] = kTwoChains ? acc2 : acc;
      const unsigned kz = static_cast<unsigned>(p.N) >> 31;
      if constexpr (PIPE >= 9) {
        // The rolling loop (PIPE 9..13): PIPE 4..8's caps and chains. Each unit (group u, row
        // block j) is decoded, fed to its mma, and then its registers take the next trip's
        // load, pinned there by after_mma. ptxas still sinks a loop body's last loads to its end
        // (their consumers are in the next iteration), so the body holds two trips: the first
        // trip's loads, consumed by the second, stay among its math (session 19: gate_up at
        // m = 16 0.1-1.0 % faster than PIPE 3 and 6 on four H200s, with the same 126-128
        // registers).
        uint4 A0[UG][RB], A1[UG][RB], B[UG][RB];
        if (KGW > 0) {
#pragma unroll
          for (int u = 0; u < UG; u++)
#pragma unroll
            for (int j = 0; j < RB; j++) ld_unit(unit(u, j), A0[u][j], A1[u][j], B[u][j]);
        }
        int i = 0;
        for (; i + 2 * UG < KGW; i += 2 * UG) {
          trip<NB>(A0, A1, B, xr, i, TL, TH, acc, accb, true, unit, kz);
          trip<NB>(A0, A1, B, xr, i + UG, TL, TH, acc, accb, true, unit, kz);
        }
        for (; i + UG < KGW; i += UG) trip<NB>(A0, A1, B, xr, i, TL, TH, acc, accb, true, unit, kz);
        if (KGW > 0) trip<NB>(A0, A1, B, xr, i, TL, TH, acc, accb, false, unit, kz);
      } else {
        for (int i = 0; i < KGW; i += UG) {
          uint4 A0[UG][RB], A1[UG][RB], B[UG][RB];
#pragma unroll
          for (int u = 0; u < UG; u++)  // all loads first: 3 x 16 bytes per group per lane
#pragma unroll
            for (int j = 0; j < RB; j++) ld_unit(unit(i + u, j), A0[u][j], A1[u][j], B[u][j]);
          trip<NB>(A0, A1, B, xr, i, TL, TH, acc, accb, false, unit, kz);
        }
      }
      if constexpr (kTwoChains) {
#pragma unroll
        for (int b = 0; b < RB * NB; b++)
#pragma unroll
          for (int q = 0; q < 4; q++) acc[b][q] += acc2[b][q];
      }
    } else {
      uint4 A0[UG][RB], A1[UG][RB], B[UG][RB];
#pragma unroll
      for (int u = 0; u < UG; u++)  // prologue: the first UG groups
#pragma unroll
        for (int j = 0; j < RB; j++) ld_unit(unit(u, j), A0[u][j], A1[u][j], B[u][j]);
      for (int i = 0; i < KGW; i += UG) {
        uint4 xa[UG][NB], xb[UG][NB];
#pragma unroll
        for (int u = 0; u < UG; u++) x_frags<NB>(xr, i + u, xa[u], xb[u]);
        uint4 nA0[UG][RB], nA1[UG][RB], nB[UG][RB];
        if (i + UG < KGW) {  // next groups' weights in flight while these decode
#pragma unroll
          for (int u = 0; u < UG; u++)
#pragma unroll
            for (int j = 0; j < RB; j++)
              ld_unit(unit(i + UG + u, j), nA0[u][j], nA1[u][j], nB[u][j]);
        }
#pragma unroll
        for (int u = 0; u < UG; u++)
#pragma unroll
          for (int j = 0; j < RB; j++)
            decode_mma<NB>(A0[u][j], A1[u][j], B[u][j], TL, TH, xa[u], xb[u], acc, acc, j);
#pragma unroll
        for (int u = 0; u < UG; u++)
#pragma unroll
          for (int j = 0; j < RB; j++) {
            A0[u][j] = nA0[u][j];
            A1[u][j] = nA1[u][j];
            B[u][j] = nB[u][j];
          }
      }
    }
    park_partials<NW, RB * NB>(red, warp, lane, acc);
  }
  __syncthreads();  // red, ecorr and s_dense complete

  // C fragment (jb, nbo) of this thread's lane: rows g, g+8 of row block jb, tokens nbo*8 + 2t,
  // +1. Its exact corrections, then its stores but for tokens past M and the rows that their own
  // dense-row CTA stores.
  auto add_corrections = [&](float4& r, int jb, int nbo) {
    r.x += ecorr[jb * 16 + g][nbo * 8 + 2 * t];
    r.y += ecorr[jb * 16 + g][nbo * 8 + 2 * t + 1];
    r.z += ecorr[jb * 16 + g + 8][nbo * 8 + 2 * t];
    r.w += ecorr[jb * 16 + g + 8][nbo * 8 + 2 * t + 1];
  };
  auto store_fragment = [&](const float4& r, int jb, int nbo) {
    const float rr[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int tok = nbo * 8 + 2 * t + (q & 1);
      const int row = (cb * RB + jb) * 16 + g + ((q >> 1) << 3);
      const bool dense_row = (s_dense >> (jb * 16 + (row & 15))) & 1u;
      if (tok < M && !dense_row) {
        store_out(p.out, static_cast<size_t>(tok) * p.ldo + row, rr[q], p.flags & 2);
      }
    }
  };

  if constexpr (!kOneFragmentPerThread) {
    // ---- Combine in turns (RB 4): fragment f = tid, tid + (NW+1)*32, ... (its lane is tid's, so
    // g and t are this thread's). No split-K here: Validate allows RB 4 with S = 1 only, and a
    // launch that bypassed it stops rather than store one slice's partial sums.
    if (p.S != 1) __trap();
    for (int f = tid; f < RB * NB * 32; f += (NW + 1) * 32) {
      const int jb = f / (NB * 32), nbo = (f >> 5) % NB;
      float4 r = sum_warp_partials<NW, RB * NB>(red, f);
      add_corrections(r, jb, nbo);
      store_fragment(r, jb, nbo);
    }
    return;
  }
  // ---- Combine: thread tid < RB*NB*32 owns C fragment (jb, nbo).
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool active = tid < RB * NB * 32;
  const int jb = RB == 1 ? 0 : tid / (NB * 32), nbo = RB == 1 ? tid >> 5 : (tid >> 5) % NB;
  if (active) {
    r = sum_warp_partials<NW, RB * NB>(red, tid);
    add_corrections(r, jb, nbo);
  }
  if (p.S > 1 && !splitk_combine(r, active, static_cast<float4*>(p.ws), p.sem, cb, sidx, p.S,
                                 RB * NB * 32, &s_last)) {
    return;
  }
  if (active) store_fragment(r, jb, nbo);
}
