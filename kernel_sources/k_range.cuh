// Which of K's 64-wide groups a warp of the 12-bit kernel streams: plain C++ that the kernel
// (through NVRTC) and the host's tests (through g++) both compile, so that the dealing is checked
// without a GPU (config_test).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define GEMVZ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GEMVZ_HOST_DEVICE inline
#endif

namespace gemvz_dev {

// K slice s of S takes groups [s*KG/S, (s+1)*KG/S) (Validate: S*UG divides KG), and its NW warps
// share the slice's trips of UG groups as evenly as whole trips go: counts differ by at most one
// trip, and Validate gives every warp at least one. When NW also divides the trips, every warp
// takes KG/(S*NW) groups from s*KG/S + warp*KG/(S*NW).
struct KRange {
  int lo, hi;  // the slice's groups [lo, hi)
  int g0, n;   // this warp's groups [g0, g0 + n), n a multiple of UG
};

// `warp` may be NW (the exception warp, which uses lo and hi only).
template <int NW, int UG>
GEMVZ_HOST_DEVICE KRange k_range(int KG, int S, int sidx, int warp) {
  // The even case is computed as it was before uneven shares existed, the uneven one only when
  // NW does not divide the slice's trips (ts * (NW + 1) < 2^31 since K < 2^31 and NW <= 32).
  // Timed on the H200 against the even-only code, the tuned table's 21 kernels stayed within
  // 1.2 % (geometric mean 0.999).
  const int KGS = KG / S;
  int KGW = KGS / NW, g0 = sidx * KGS + warp * KGW;
  if (KGW * NW != KGS || KGW % UG != 0) {
    const int ts = KGS / UG;
    const int wlo = ts * warp / NW, whi = ts * (warp + 1) / NW;
    g0 = sidx * KGS + wlo * UG;
    KGW = (whi - wlo) * UG;
  }
  return KRange{sidx * KGS, sidx * KGS + KGS, g0, KGW};
}

}  // namespace gemvz_dev
