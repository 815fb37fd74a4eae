// Flags that demo, bench and tune share for measuring: replays, launches per graph, rotation size
// and the random seed. Defined once in bench_flags.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "tools/gemvz/bench_gpu.h"

ABSL_DECLARE_FLAG(int, replays);
ABSL_DECLARE_FLAG(int, launches);
ABSL_DECLARE_FLAG(int64_t, rotate_mb);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(bool, pdl);

namespace gemvz::cli {

// The flags' values, checked (--device's sign too): a bad value names the flag.
absl::StatusOr<TimingOptions> TimingFromFlags();
// `seed` is the value to use: --seed, or a fresh one when it is 0 (the caller prints it).
absl::StatusOr<WorkloadOptions> WorkloadFromFlags(uint64_t seed);
// --seed, or a fresh random seed when it is 0.
uint64_t SeedFromFlag();

// The flag lines each measuring command's usage text includes.
extern const char kMeasureFlagsUsage[];
// --zero_rows's lines, for bench and tune. demo does not take the flag: its steps without a GPU
// pack the suite's random weights as they are, and its GPU part runs the same weights.
extern const char kZeroRowsFlagUsage[];

// --zero_rows into `workload`, each row checked against every shape before anything long starts.
absl::Status ZeroRowsFromFlag(const std::vector<MatrixShape>& shapes, WorkloadOptions* workload);

// --exception_rows's lines, for bench and tune.
extern const char kExceptionRowsFlagUsage[];

// --exception_rows into `workload`, checked as --zero_rows is; a row may not be in both (call
// after ZeroRowsFromFlag) nor twice.
absl::Status ExceptionRowsFromFlag(const std::vector<MatrixShape>& shapes,
                                   WorkloadOptions* workload);

}  // namespace gemvz::cli
