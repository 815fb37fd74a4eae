// The tuned table compiled into the library: one configuration per (arch, format, m, n, k) of
// DESIGN.md's benchmark suite on sm_90, at m = 1, 8, 16.
//
// The rows are plain data so that they can be regenerated from a tuning run. On the H200:
//   GEMVZ_TUNING_FILE=/tmp/tuning.json gemvz tune --sweep --save --shape NxK --m 1,8,16
// for each suite shape (both formats), then export the file as rows:
//   jq -r '.entries[] | "    {\"\(.arch)\", \(.m), \(.n), \(.k), \"\(.config)\", \(.time_us)},"'
//   tuning.json
// and paste them over kRows. dispatch_test checks that every row is valid and that the suite is
// covered exactly once per format.
//
// NOTES: the seed rows (time_us 0: not measured yet) follow chapter 8's tuner and the grid
// arithmetic of 132 SMs: NB = ceil(m/8); 16 warps with PIPE 2 (two CTAs per SM) for the 12-bit
// kernel where N/16 alone gives about two waves of CTAs or more; elsewhere 8 or 4 warps and
// split-K until N/16 * S reaches about two waves, keeping at least two loop trips per warp;
// PIPE 1 at m = 16 for the largest K per CTA. No row spills registers (ptxas, NVRTC 13.0,
// sm_90): the plain kernel with 16 warps and PIPE 2 does (56 bytes and more), so it takes 8.
#include <string>
#include <vector>

#include "gemvz/dispatch.h"
#include "runtime/common/log.h"

namespace gemvz {
namespace {

struct Row {
  const char* arch;
  int64_t m, n, k;
  const char* config;  // KernelConfig text; its format is the entry's format
  double time_us;      // 0: seeded by reasoning, not measured
};

// clang-format off
constexpr Row kRows[] = {
    // pooler, 4096 x 8192
    {"sm_90", 1, 4096, 8192, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 8, 4096, 8192, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 16, 4096, 8192, "z12.nw8.ug2.nb2.pipe3.s2", 0},
    {"sm_90", 1, 4096, 8192, "bf16.nw8.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 8, 4096, 8192, "bf16.nw8.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 16, 4096, 8192, "bf16.nw8.ug2.nb2.pipe3.s2", 0},
    // llama3-8b qkv, 6144 x 4096
    {"sm_90", 1, 6144, 4096, "z12.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 8, 6144, 4096, "z12.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 16, 6144, 4096, "z12.nw4.ug2.nb2.pipe3.s2", 0},
    {"sm_90", 1, 6144, 4096, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 8, 6144, 4096, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 16, 6144, 4096, "bf16.nw4.ug2.nb2.pipe3.s2", 0},
    // llama3-8b o, 4096 x 4096
    {"sm_90", 1, 4096, 4096, "z12.nw4.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 8, 4096, 4096, "z12.nw4.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 16, 4096, 4096, "z12.nw4.ug2.nb2.pipe3.s2", 0},
    {"sm_90", 1, 4096, 4096, "bf16.nw4.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 8, 4096, 4096, "bf16.nw4.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 16, 4096, 4096, "bf16.nw4.ug2.nb2.pipe3.s2", 0},
    // llama3-8b gate_up, 28672 x 4096
    {"sm_90", 1, 28672, 4096, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 8, 28672, 4096, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 16, 28672, 4096, "z12.nw8.ug1.nb2.pipe1.s1", 0},
    {"sm_90", 1, 28672, 4096, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 8, 28672, 4096, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 16, 28672, 4096, "bf16.nw8.ug1.nb2.pipe1.s1", 0},
    // llama3-8b down, 4096 x 14336
    {"sm_90", 1, 4096, 14336, "z12.nw8.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 8, 4096, 14336, "z12.nw8.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 16, 4096, 14336, "z12.nw8.ug2.nb2.pipe3.s2", 0},
    {"sm_90", 1, 4096, 14336, "bf16.nw8.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 8, 4096, 14336, "bf16.nw8.ug2.nb1.pipe3.s2", 0},
    {"sm_90", 16, 4096, 14336, "bf16.nw8.ug2.nb2.pipe3.s2", 0},
    // llama3-70b qkv, 10240 x 8192
    {"sm_90", 1, 10240, 8192, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 8, 10240, 8192, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 16, 10240, 8192, "z12.nw8.ug2.nb2.pipe3.s1", 0},
    {"sm_90", 1, 10240, 8192, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 8, 10240, 8192, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 16, 10240, 8192, "bf16.nw8.ug2.nb2.pipe3.s1", 0},
    // llama3-70b down, 8192 x 28672
    {"sm_90", 1, 8192, 28672, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 8, 8192, 28672, "z12.nw16.ug1.nb1.pipe2.s1", 0},
    {"sm_90", 16, 8192, 28672, "z12.nw8.ug2.nb2.pipe1.s1", 0},
    {"sm_90", 1, 8192, 28672, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 8, 8192, 28672, "bf16.nw8.ug2.nb1.pipe3.s1", 0},
    {"sm_90", 16, 8192, 28672, "bf16.nw8.ug2.nb2.pipe1.s1", 0},
};
// clang-format on

std::vector<TunedChoice> BuildTable() {
  std::vector<TunedChoice> table;
  table.reserve(sizeof(kRows) / sizeof(kRows[0]));
  for (const Row& row : kRows) {
    absl::StatusOr<KernelConfig> config = KernelConfig::Parse(row.config);
    if (!config.ok()) {
      // dispatch_test fails on this; a release build skips the row rather than crash.
      GEMVZ_LOG_WARNING("built-in tuned table: row %s m%d n%d k%d skipped: %s", row.arch, row.m,
                        row.n, row.k, config.status().message());
      continue;
    }
    TunedChoice c;
    c.arch = row.arch;
    c.format = config->format;
    c.m = row.m;
    c.n = row.n;
    c.k = row.k;
    c.config = *config;
    c.time_us = row.time_us;
    table.push_back(std::move(c));
  }
  return table;
}

}  // namespace

const std::vector<TunedChoice>& BuiltinTunedTable() {
  static const std::vector<TunedChoice>* const table = new std::vector<TunedChoice>(BuildTable());
  return *table;
}

}  // namespace gemvz
