// Kernel arguments, shared by the device code (through NVRTC) and the host launch path (through
// g++): plain C++ with fixed-width builtin types only, so both sides agree on the layout.
#pragma once

// out[M, N] = x[M, K] * W^T for a 12-bit packed W (format.h describes every array).
struct Z12Params {
  const unsigned short* x;                  // [M][ldx] BF16
  const void* w;                            // [N/16][K/64][1536 B], or [K/64][N/16] (GM 1)
  const unsigned int* row_offsets;          // [N + 1] into entries
  const void* entries;                      // {int col, fp32 bits} pairs, per row sorted by col
  const unsigned int* dense_block_offsets;  // [N/16 + 1] into dense_rows
  const unsigned char* dense_rows;          // row within the block
  const unsigned short* dense_values;       // [dense rows][K] original BF16
  const int* dense_global_rows;             // [dense rows] the row each one is
  void* out;                                // [M][ldo] BF16, or FP32 with flags bit 1
  void* ws;                                 // split-K partials: [N/16/RB][S][RB*NB*32] float4
  int* sem;                                 // [N/16/RB] arrival counters, zero between calls
  long long ldx;
  long long ldo;
  int M, N, K, S;  // grid: (n_dense + N/16/RB, S)
  int n_dense;      // dense rows: blockIdx.x < n_dense computes dense row blockIdx.x
  unsigned int tl, th;  // window lookup words
  int flags;            // bit 0: skip the corrections (to measure their cost; wrong results)
                        // bit 1: out is FP32 (partial sums a caller reduces, e.g. tensor parallel)
                        // bit 2: launched with PDL: prefetch the first weights while waiting
};

// The same for a plain row-major BF16 W, padded to [N rounded up to 16][ldw >= K64].
struct Bf16Params {
  const unsigned short* x;  // [M][ldx] BF16, ldx >= K rounded up to 64, zero-padded
  const unsigned short* w;  // [N16][ldw] BF16, zero-padded
  void* out;                // [M][ldo] BF16, or FP32 with flags bit 1
  void* ws;
  int* sem;
  long long ldx;
  long long ldo;
  long long ldw;
  int M, N, K, S;  // N: real rows (stores are guarded); K: padded to a multiple of 64
  int flags;       // bit 1: out is FP32; bit 2: launched with PDL (as Z12Params)
};
