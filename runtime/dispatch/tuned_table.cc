// The tuned table compiled into the library: one configuration per (arch, format, m, n, k) of
// DESIGN.md's benchmark suite on sm_90, at m = 1, 8, 16, and for the 12-bit format in each
// shape's default order also at m = 24 and 32 (a row serves every m from the row below it, so
// these cover 17..32 and the chunks of larger m).
//
// The rows are plain data so that they can be regenerated from a tuning run. On the H200:
//   GEMVZ_TUNING_FILE=/tmp/tuning.json gemvz tune --sweep --save --shape NxK --m 1,8,16
// for each suite shape (both formats), then export the file as rows:
//   jq -r '.entries[] | "    {\"\(.arch)\", \(.m), \(.n), \(.k), \"\(.config)\", \(.time_us)},"'
//   tuning.json
// and paste them over kRows. dispatch_test checks that every row is valid and that the suite is
// covered exactly once per format.
//
// NOTES: measured on one H200 (sm_90, driver 580.159.04) on 2026-11-29 (z12 rows at commit
// 36ec5b7, bf16 rows at 7d1f0de) with `gemvz tune --sweep --replays 5..7 --launches 16` over
// gemvz::SweepSpace, keeping the fastest configuration that does not spill and whose NB is the
// smallest that covers m (a larger NB only adds work; where one measured faster it was within
// noise). time_us is its median there (weights rotated through 512 MiB, CUDA graphs). The
// 12-bit kernel wins with NB 1, 3 to 16 warps, UG 1-4 at m = 1 and 8, and NB 2 at m = 16;
// split-K never won on this suite. ptxas's register allocation moves with small kernel edits
// and decides CTAs per SM, so re-sweep after any change to kernel_sources/.
// PIPE 4..8 (register caps, two accumulator chains; the PIPE 0..3 code unchanged) were timed on
// 2026-11-29 against these rows in the same runs, over every non-spilling NW 2..16, UG 1..4,
// S 1..2: they won by 1.1-4.5 % at m = 16 on five shapes (those rows below) and by under 1 %
// elsewhere, where the older rows stay.
// RB 2 (two row blocks per CTA sharing x's fragments) was timed on 2026-11-29 (session 5) at
// m = 16 against these rows in one run, over NW 4-16, UG 1-2 and PIPE 0, 3..8: it won on
// 28672x4096 (44.83 against 45.71 us; 44.61 for a variant that spills 12 bytes) and 10240x8192
// (32.82 against 33.12); the same run's PIPE 6 beat PIPE 3 on 8192x28672 (82.92 against 83.91).
// Those three m = 16 rows changed; on the smaller shapes RB 2's halved grid lost 3-10 %.
// NW 3 (and 5 and 7; uneven shares of K's 64-wide groups) was timed on 2026-11-30 (session 10)
// over UG 1-4, PIPE 0..8, RB 1-2, S 1 at m = 1, 8, 16 on every suite shape against these rows in
// the same runs, then the winners against the rows in three more rounds on another H200: NW 3
// won by 1.0-1.5 % on six rows (28672x4096 at m = 1, 8, 16: 41.58 against 42.09, 42.39 against
// 42.83, 45.17 against 45.86 us; 10240x8192 at m = 16: 32.96 against 33.28; 8192x28672 at m = 1
// and 8: 79.33 against 80.29, 80.67 against 81.68), which changed, and NW 5 and 7 by under
// 1 % anywhere. The times are that second H200's medians (its 28672x4096 ran 1 % slower).
// RB 4 at NB 2 (four row blocks per CTA from one load of x's fragments; UG 1, S 1) was timed on
// 2026-11-30 (session 11) at m = 16 on every suite shape against these rows: it won on
// 28672x4096 only, z12.nw3.ug1.nb2.pipe3.rb4 (128 registers, 4 CTAs per SM) by 1.1 % in three
// rounds at m = 16 and 0.9 % at m = 12 (44.39, 44.60, 44.65 us against 44.75, 45.14, 45.28); its
// time is the mean of the three medians. The same session's runs timed UG 4 beside the table's
// UG 2 for 8192x28672 at m = 16 (z12.nw4.ug4.nb2.pipe6, 96 registers as UG 2) four times on three
// machine starts: 0.2-0.6 % faster every time (84.47, 82.79, 82.64, 82.93 us against 84.62, 83.25,
// 83.09, 83.21), so that row changed too; its time is the mean of the four medians.
// Group-major weights (".gm": WeightOrder::kGroupMajor, each 64-wide group's row blocks one after
// another in device memory) were timed on 2026-11-30 (session 12) on every suite shape at m = 1,
// 8 and 16: first the sweep spaces of sessions 10-11 at NB 1 (150 configurations) and NB 2 (297)
// in both orders, one round, then the table's row against the best group-major candidates in
// three rounds on one H200 (these times are their means). Group-major won on the five shapes
// whose rows say ".gm": 28672x4096 by 0.0, 0.5 and 2.4 % at m = 1, 8, 16 (43.55 against 44.59
// us at m = 16), 10240x8192 by 2.4, 2.8 and 4.6 %, 8192x28672 by 0.2, 2.5 and 1.3 %, 4096x14336
// by 1.1, 1.1 and 1.9 %, 4096x8192 by 2.0, 1.2 and 0.8 %. On 6144x4096 and 4096x4096 it was
// level (-0.4 to +1.7 %), so they stay block-major. The five keep their block-major rows too
// (the earlier sessions' measurements), for matrices uploaded block-major (UploadOptions,
// GEMVZ_WEIGHT_ORDER, a block-major tuning file); a shape with group-major rows is uploaded
// group-major by default (PreferredOrder). 10240x8192's m = 16 row spills 12 bytes (128 registers,
// the PIPE 5 cap); it ran 2.6 % faster than the fastest kernel without a spill
// (z12.nw4.ug2.nb2.pipe5.rb2.gm: 31.54-31.60 against 32.39-32.50 us in all three rounds and in
// the first run), so it is kept against the usual rule.
// m = 24 and 32 (NB 3 and 4; session 13, 2026-11-30), in each shape's default order: until then
// the heuristic chose there. Swept over gemvz::SweepSpace's S = 1 configurations of the covering
// NB (207-342 a shape), one round; then the best four that spill at most 12 bytes against the
// heuristic's choice in three rounds on the same H200 (group-major shapes; the times are the
// means), or the whole sweep twice (6144x4096, 4096x4096). Against the heuristic: 4096x8192
// 12.4 % faster at m = 24 (15.92 against 17.90 us) and the same kernel at 32; 28672x4096 3.6 %
// (PIPE 3 then) and the same; 4096x14336 8.6 and 6.3 %; 10240x8192 the same and 3.3 %;
// 8192x28672 2.1 % and 14-20 % (98.50 against 112.01 us in the rounds, 89.72 against 107.36 in
// the sweep); 6144x4096 the same and 2.1 %; 4096x4096 12.6 % (9.63 against 10.84) and the same.
// Two rows spill, measured faster than every kernel that does not: 8192x28672 at m = 24 (8 bytes;
// 2.1 % ahead of the heuristic's z12.nw5.ug2.nb3.pipe4.rb2.gm) and 4096x4096 at m = 24 (12 bytes;
// 2.3 % ahead of z12.nw7.ug1.nb3.pipe4). Faster kernels that spill 36-100 bytes were passed over
// (10240x8192 m = 24: z12.nw3.ug4.nb3.pipe7.gm, 44 bytes, 36.49 us in the sweep). Those rounds
// timed each candidate whole, one after another, which favoured the first under the 700 W power cap
// (docs/BENCHMARKS.md, "Timing in turn"); the same lists timed in turn (gemvz tune since 1931295),
// two rounds: the rows held on 12 of 14, 8192x28672 at m = 24 by 5.3 % over the next kernel. Two
// changed: 28672x4096 at m = 24 to PIPE 4 (49.25 and 49.28 against 49.76 and 49.73 us for PIPE 3)
// and 4096x4096 at m = 32 back to the heuristic's PIPE 3 (10.41 and 10.55 against 10.61 and 10.65);
// their times are those rounds' means.
// m = 1, 8, 16 again in turn (session 14, 2026-11-30): the S = 1 space of the covering NB on every
// suite shape (243-522 configurations a case), swept twice in turn with 16 launches a graph (three
// shapes a third time with the graphs shuffled every round, as GraphTimer does since 8baf383), then
// the rows against the candidates that led (by 0.4-3.3 %) in three rounds of 64 launches, shuffled,
// on one H200. Two rows changed, by the same margin in all three rounds (the times are their
// means): 4096x14336 at m = 16 to z12.nw12.ug1.nb2.pipe2.gm (24.14 against 24.45 us, 1.3 %) and
// 4096x8192 at m = 8 to z12.nw8.ug1.nb1.pipe4.gm (13.78 against 13.98, 1.4-1.5 %). 8192x28672 and
// 4096x14336 at m = 1 had kernels 0.5 % ahead in all three (z12.nw8.ug1.nb1.pipe1.gm 80.17 against
// 80.56; z12.nw8.ug1.nb1.pipe4.gm 21.86 against 21.97), within what separates two H200s, so those
// rows stay; the other 17 held.
// The rolling loop (PIPE 9..13, session 19, 2026-11-30): the same kernel as z12.nw3.ug1.nb2.pipe6
// .rb4.gm with the rolling loop, z12.nw3.ug1.nb2.pipe11.rb4.gm (126 registers, 4 CTAs per SM),
// against the table's PIPE 3 row in turn on four H200s: 43.35, 43.40, 43.37 us against 43.63,
// 43.64, 43.64 (three rounds, 0.6 %; its time is their mean), 43.54, 43.60 against 43.82, 44.06,
// 44.01, 43.99 against 44.08, 44.07 and 43.97 twice against 44.02, 44.03 (0.1-1.0 %); at m = 12
// 43.44 against 43.58 and 43.89, 43.88 against 43.97, 43.91. On the other suite shapes at m = 16
// every rolling kernel lost to the rows (their UG 4 rows spill rolled); so only 28672x4096's
// group-major m = 16 row changed.
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
  double time_us;      // the measured median, microseconds
};

// clang-format off
constexpr Row kRows[] = {
    // pooler, 4096 x 8192
    {"sm_90", 1, 4096, 8192, "z12.nw16.ug1.nb1.pipe2.gm.s1", 13.60},
    {"sm_90", 8, 4096, 8192, "z12.nw8.ug1.nb1.pipe4.gm.s1", 13.78},
    {"sm_90", 16, 4096, 8192, "z12.nw8.ug4.nb2.pipe4.gm.s1", 14.59},
    {"sm_90", 24, 4096, 8192, "z12.nw7.ug4.nb3.pipe4.gm.s1", 15.92},
    {"sm_90", 32, 4096, 8192, "z12.nw8.ug1.nb4.pipe3.gm.s1", 18.20},
    // (block-major: the rows before session 12, with their times)
    {"sm_90", 1, 4096, 8192, "z12.nw16.ug1.nb1.pipe2.s1", 13.49},
    {"sm_90", 8, 4096, 8192, "z12.nw16.ug1.nb1.pipe2.s1", 13.92},
    {"sm_90", 16, 4096, 8192, "z12.nw8.ug4.nb2.pipe4.s1", 14.58},
    {"sm_90", 1, 4096, 8192, "bf16.nw8.ug2.nb1.pipe1.s1", 18.69},
    {"sm_90", 8, 4096, 8192, "bf16.nw8.ug2.nb1.pipe2.s1", 18.98},
    {"sm_90", 16, 4096, 8192, "bf16.nw8.ug2.nb2.pipe1.s1", 20.07},
    // llama3-8b qkv, 6144 x 4096
    {"sm_90", 1, 6144, 4096, "z12.nw8.ug2.nb1.pipe3.s1", 10.62},
    {"sm_90", 8, 6144, 4096, "z12.nw8.ug2.nb1.pipe3.s1", 10.86},
    {"sm_90", 16, 6144, 4096, "z12.nw8.ug1.nb2.pipe5.s1", 11.41},
    {"sm_90", 24, 6144, 4096, "z12.nw4.ug4.nb3.pipe5.s1", 12.39},
    {"sm_90", 32, 6144, 4096, "z12.nw5.ug1.nb4.pipe3.s1", 14.91},
    {"sm_90", 1, 6144, 4096, "bf16.nw8.ug1.nb1.pipe1.s1", 14.51},
    {"sm_90", 8, 6144, 4096, "bf16.nw8.ug1.nb1.pipe1.s1", 14.85},
    {"sm_90", 16, 6144, 4096, "bf16.nw4.ug2.nb2.pipe1.s1", 15.94},
    // llama3-8b o, 4096 x 4096
    {"sm_90", 1, 4096, 4096, "z12.nw16.ug1.nb1.pipe2.s1", 7.92},
    {"sm_90", 8, 4096, 4096, "z12.nw16.ug1.nb1.pipe2.s1", 8.13},
    {"sm_90", 16, 4096, 4096, "z12.nw8.ug4.nb2.pipe4.s1", 8.62},
    {"sm_90", 24, 4096, 4096, "z12.nw8.ug2.nb3.pipe4.s1", 9.63},
    {"sm_90", 32, 4096, 4096, "z12.nw8.ug1.nb4.pipe3.s1", 10.48},
    {"sm_90", 1, 4096, 4096, "bf16.nw8.ug2.nb1.pipe2.s1", 10.38},
    {"sm_90", 8, 4096, 4096, "bf16.nw8.ug2.nb1.pipe2.s1", 10.83},
    {"sm_90", 16, 4096, 4096, "bf16.nw8.ug2.nb2.pipe2.s1", 11.72},
    // llama3-8b gate_up, 28672 x 4096
    {"sm_90", 1, 28672, 4096, "z12.nw3.ug2.nb1.pipe3.gm.s1", 42.10},
    {"sm_90", 8, 28672, 4096, "z12.nw3.ug1.nb1.pipe3.gm.s1", 42.11},
    {"sm_90", 16, 28672, 4096, "z12.nw3.ug1.nb2.pipe11.rb4.gm.s1", 43.37},
    {"sm_90", 24, 28672, 4096, "z12.nw5.ug1.nb3.pipe4.rb4.gm.s1", 49.27},
    {"sm_90", 32, 28672, 4096, "z12.nw4.ug1.nb4.pipe0.rb4.gm.s1", 53.01},
    // (block-major: the rows before session 12, with their times)
    {"sm_90", 1, 28672, 4096, "z12.nw3.ug2.nb1.pipe3.s1", 41.58},
    {"sm_90", 8, 28672, 4096, "z12.nw3.ug2.nb1.pipe3.s1", 42.39},
    {"sm_90", 16, 28672, 4096, "z12.nw3.ug1.nb2.pipe3.rb4.s1", 44.55},
    {"sm_90", 1, 28672, 4096, "bf16.nw8.ug4.nb1.pipe3.s1", 57.40},
    {"sm_90", 8, 28672, 4096, "bf16.nw8.ug4.nb1.pipe3.s1", 58.97},
    {"sm_90", 16, 28672, 4096, "bf16.nw2.ug2.nb2.pipe1.s1", 63.25},
    // llama3-8b down, 4096 x 14336
    {"sm_90", 1, 4096, 14336, "z12.nw16.ug1.nb1.pipe2.gm.s1", 22.18},
    {"sm_90", 8, 4096, 14336, "z12.nw16.ug1.nb1.pipe2.gm.s1", 22.51},
    {"sm_90", 16, 4096, 14336, "z12.nw12.ug1.nb2.pipe2.gm.s1", 24.14},
    {"sm_90", 24, 4096, 14336, "z12.nw7.ug4.nb3.pipe4.gm.s1", 26.25},
    {"sm_90", 32, 4096, 14336, "z12.nw7.ug2.nb4.pipe4.gm.s1", 31.76},
    // (block-major: the rows before session 12, with their times)
    {"sm_90", 1, 4096, 14336, "z12.nw16.ug1.nb1.pipe2.s1", 22.03},
    {"sm_90", 8, 4096, 14336, "z12.nw16.ug1.nb1.pipe2.s1", 22.35},
    {"sm_90", 16, 4096, 14336, "z12.nw16.ug2.nb2.pipe0.s1", 24.18},
    {"sm_90", 1, 4096, 14336, "bf16.nw4.ug4.nb1.pipe2.s1", 31.17},
    {"sm_90", 8, 4096, 14336, "bf16.nw8.ug2.nb1.pipe1.s1", 31.80},
    {"sm_90", 16, 4096, 14336, "bf16.nw8.ug2.nb2.pipe2.s1", 33.52},
    // llama3-70b qkv, 10240 x 8192
    {"sm_90", 1, 10240, 8192, "z12.nw4.ug2.nb1.pipe7.gm.s1", 30.37},
    {"sm_90", 8, 10240, 8192, "z12.nw7.ug2.nb1.pipe0.gm.s1", 30.56},
    {"sm_90", 16, 10240, 8192, "z12.nw4.ug4.nb2.pipe5.rb2.gm.s1", 31.57},
    {"sm_90", 24, 10240, 8192, "z12.nw4.ug4.nb3.pipe5.gm.s1", 39.40},
    {"sm_90", 32, 10240, 8192, "z12.nw4.ug1.nb4.pipe0.rb4.gm.s1", 48.26},
    // (block-major: the rows before session 12, with their times)
    {"sm_90", 1, 10240, 8192, "z12.nw4.ug2.nb1.pipe3.s1", 30.43},
    {"sm_90", 8, 10240, 8192, "z12.nw4.ug2.nb1.pipe3.s1", 30.75},
    {"sm_90", 16, 10240, 8192, "z12.nw3.ug4.nb2.pipe7.s1", 32.96},
    {"sm_90", 1, 10240, 8192, "bf16.nw2.ug2.nb1.pipe1.s1", 43.09},
    {"sm_90", 8, 10240, 8192, "bf16.nw4.ug2.nb1.pipe1.s1", 43.22},
    {"sm_90", 16, 10240, 8192, "bf16.nw2.ug2.nb2.pipe1.s1", 47.08},
    // llama3-70b down, 8192 x 28672
    {"sm_90", 1, 8192, 28672, "z12.nw7.ug2.nb1.pipe0.gm.s1", 80.63},
    {"sm_90", 8, 8192, 28672, "z12.nw7.ug2.nb1.pipe0.gm.s1", 79.95},
    {"sm_90", 16, 8192, 28672, "z12.nw4.ug4.nb2.pipe3.rb2.gm.s1", 83.00},
    {"sm_90", 24, 8192, 28672, "z12.nw7.ug2.nb3.pipe4.rb2.gm.s1", 88.62},
    {"sm_90", 32, 8192, 28672, "z12.nw7.ug2.nb4.pipe0.rb2.gm.s1", 98.50},
    // (block-major: the rows before session 12, with their times)
    {"sm_90", 1, 8192, 28672, "z12.nw3.ug4.nb1.pipe1.s1", 79.33},
    {"sm_90", 8, 8192, 28672, "z12.nw3.ug4.nb1.pipe5.s1", 80.67},
    {"sm_90", 16, 8192, 28672, "z12.nw4.ug4.nb2.pipe6.s1", 83.21},
    {"sm_90", 1, 8192, 28672, "bf16.nw2.ug2.nb1.pipe2.s1", 118.33},
    {"sm_90", 8, 8192, 28672, "bf16.nw8.ug2.nb1.pipe2.s1", 116.14},
    {"sm_90", 16, 8192, 28672, "bf16.nw4.ug2.nb2.pipe1.s1", 117.56},
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
