// The measuring flags shared by demo, bench and tune, and their checks.
#include "tools/gemvz/bench_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/common/status_macros.h"
#include "tools/gemvz/common_flags.h"

ABSL_FLAG(int, replays, 20, "timed CUDA-graph replays per measurement; the median is reported");
ABSL_FLAG(int, launches, 64,
          "launches captured in one graph (at least; rounded up to a multiple of the copies)");
ABSL_FLAG(int64_t, rotate_mb, 512,
          "MiB of weight copies each path rotates through (well above the 60 MB L2)");
ABSL_FLAG(uint64_t, seed, 0, "random seed for weights and x (0: a fresh one, printed)");
ABSL_FLAG(bool, pdl, false,
          "launch the library's GEMVs with programmatic dependent launch (Pdl::kAuto)");
ABSL_FLAG(std::string, zero_rows, "",
          "comma-separated rows set to all zeros in the weights (padded-vocabulary rows)");
ABSL_FLAG(std::string, exception_rows, "",
          "comma-separated ROW:PERCENT: that share of the row's weights set outside the 12-bit "
          "window (outlier rows)");

namespace gemvz::cli {

const char kMeasureFlagsUsage[] =
    "  --replays=N         timed CUDA-graph replays; the median is reported (default 20)\n"
    "  --launches=N        launches captured in one graph, at least; rounded up to a multiple of\n"
    "                      the rotated copies (default 64)\n"
    "  --rotate_mb=MIB     each path's weight copies together reach this many MiB, so every\n"
    "                      launch reads HBM, not L2 (default 512)\n"
    "  --seed=N            seed of the random weights N(0, 1/K) and x N(0, 1); 0 picks a fresh\n"
    "                      one and prints it (default 0)\n"
    "  --pdl               launch the library's GEMVs (12-bit and plain) with programmatic\n"
    "                      dependent launch, so each starts while the previous one finishes;\n"
    "                      cuBLAS and the probe are launched as always (default false)\n"
    "  --device=N          GPU ordinal (default 0)\n"
    "  --j=N               host threads for generating, packing, compiling and the reference\n"
    "                      (default 0: all cores)\n";

const char kZeroRowsFlagUsage[] =
    "  --zero_rows=LIST    rows whose weights are all set to zero (padded vocabulary rows), to\n"
    "                      measure what such rows cost; a row outside a shape is an error\n"
    "                      (default: none)\n";

const char kExceptionRowsFlagUsage[] =
    "  --exception_rows=LIST  comma-separated ROW:PERCENT: in each such row PERCENT % of the\n"
    "                      weights (evenly spread columns) are set to the smallest BF16\n"
    "                      subnormal, far below the 12-bit window: each is an exception whose\n"
    "                      correction takes two entries (FP32 cannot hold its difference from\n"
    "                      the decoded weight in one), the most a weight costs; to measure what\n"
    "                      a skewed row costs. A row keeps its list up to 16 entries (8 such\n"
    "                      weights, the row's own outliers included); above, it is a dense\n"
    "                      row, computed by a CTA of its own from its BF16 values (default:\n"
    "                      none)\n";

absl::StatusOr<TimingOptions> TimingFromFlags() {
  TimingOptions t;
  t.replays = absl::GetFlag(FLAGS_replays);
  t.min_launches = absl::GetFlag(FLAGS_launches);
  t.pdl = absl::GetFlag(FLAGS_pdl);
  if (t.replays < 1 || t.replays > 100000) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad --replays=", t.replays, ": expected 1..100000"));
  }
  if (t.min_launches < 1 || t.min_launches > 100000) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad --launches=", t.min_launches, ": expected 1..100000"));
  }
  // Where to measure: an ordinal past the last GPU is found when the GPU is opened.
  if (const int device = absl::GetFlag(FLAGS_device); device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad --device=", device, ": expected a GPU ordinal, 0 or more"));
  }
  return t;
}

absl::StatusOr<WorkloadOptions> WorkloadFromFlags(uint64_t seed) {
  WorkloadOptions w;
  const int64_t mb = absl::GetFlag(FLAGS_rotate_mb);
  if (mb < 1 || mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad --rotate_mb=", mb, ": expected 1..1048576 (MiB)"));
  }
  w.rotate_bytes = mb << 20;
  ASSIGN_OR_RETURN(w.threads, ThreadsFromFlag());
  w.seed = seed;
  return w;
}

absl::Status ZeroRowsFromFlag(const std::vector<MatrixShape>& shapes, WorkloadOptions* workload) {
  const std::string zero_rows = absl::GetFlag(FLAGS_zero_rows);
  if (zero_rows.empty()) return absl::OkStatus();  // the default: none (an empty value is refused)
  // An empty entry ("5,,6", ",") is a mistake, as an empty flag value is: not skipped.
  for (absl::string_view part : absl::StrSplit(zero_rows, ',')) {
    int64_t row = -1;
    if (!absl::SimpleAtoi(part, &row) || row < 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad --zero_rows entry '", part,
                                                     "': expected a row index >= 0"));
    }
    for (const MatrixShape& shape : shapes) {
      if (row >= shape.n) {
        return absl::InvalidArgumentError(absl::StrCat("--zero_rows: row ", row, " is outside ",
                                                       shape.ToString(), " (", shape.n, " rows)"));
      }
    }
    workload->zero_rows.push_back(row);
  }
  return absl::OkStatus();
}

absl::Status ExceptionRowsFromFlag(const std::vector<MatrixShape>& shapes,
                                   WorkloadOptions* workload) {
  const std::string flag = absl::GetFlag(FLAGS_exception_rows);
  if (flag.empty()) return absl::OkStatus();
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    const std::pair<absl::string_view, absl::string_view> row_pct =
        absl::StrSplit(part, absl::MaxSplits(':', 1));
    int64_t row = -1;
    double percent = 0;
    if (!absl::SimpleAtoi(row_pct.first, &row) || row < 0 ||
        !absl::SimpleAtod(row_pct.second, &percent) || !(percent > 0 && percent <= 100)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad --exception_rows entry '", part,
                       "': expected ROW:PERCENT, a row index >= 0 and a share in (0, 100]"));
    }
    for (const MatrixShape& shape : shapes) {
      if (row >= shape.n) {
        return absl::InvalidArgumentError(absl::StrCat("--exception_rows: row ", row,
                                                       " is outside ", shape.ToString(), " (",
                                                       shape.n, " rows)"));
      }
    }
    for (const auto& [earlier, share] : workload->exception_rows) {
      if (earlier == row) {
        return absl::InvalidArgumentError(
            absl::StrCat("--exception_rows: row ", row, " is given twice"));
      }
    }
    for (int64_t zero : workload->zero_rows) {
      if (zero == row) {
        return absl::InvalidArgumentError(absl::StrCat(
            "row ", row, " is in both --zero_rows and --exception_rows: give it to one"));
      }
    }
    workload->exception_rows.emplace_back(row, percent);
  }
  return absl::OkStatus();
}

uint64_t SeedFromFlag() {
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  return seed != 0 ? seed : RandomSeed();
}

}  // namespace gemvz::cli
