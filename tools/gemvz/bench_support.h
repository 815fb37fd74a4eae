// CPU-side machinery shared by `gemvz demo`, `bench` and `tune`: the benchmark suite, argument
// parsing, random BF16 data, the double-precision reference GEMV and its error bound, result
// tables, the JSON report and the gnuplot chart. Nothing here needs a GPU (see bench_gpu.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace gemvz::cli {

// One weight matrix shape, N x K (out has N columns, x has K).
struct MatrixShape {
  std::string name;  // "pooler", "llama3-8b qkv"; empty for a shape given on the command line
  int64_t n = 0;
  int64_t k = 0;
  std::string ToString() const;  // "4096x8192"
};

// DESIGN.md's benchmark suite, in its order.
const std::vector<MatrixShape>& SuiteShapes();

// "4096x8192" -> {n 4096, k 8192}, named after the suite entry of that shape if there is one.
absl::StatusOr<MatrixShape> ParseShape(const std::string& text);
// "1,8,16" -> {1, 8, 16}: positive, at most kMaxM, no repeats, kept in the given order.
inline constexpr int64_t kMaxM = 4096;
absl::StatusOr<std::vector<int64_t>> ParseMList(const std::string& text);
// --shape if given (one shape), else the suite; `quick` keeps the suite's first two (with
// --shape as well, a usage error).
absl::StatusOr<std::vector<MatrixShape>> ShapesFromFlag(const std::string& shape_flag, bool quick);

// `gemvz bench --sequence`: "llama3-8b" (one layer's four GEMVs in order: qkv, o, gate_up, down)
// or a comma-separated list of NxK shapes, run one after another.
absl::StatusOr<std::vector<MatrixShape>> SequenceFromFlag(const std::string& sequence_flag);

// Fills `count` BF16 values drawn from N(0, stddev^2), rounded to nearest. Deterministic for a
// seed whatever the thread count: each 64 Ki-element chunk has its own generator.
void FillNormalBf16(uint16_t* out, int64_t count, double stddev, uint64_t seed, int threads);
std::vector<uint16_t> NormalBf16(int64_t count, double stddev, uint64_t seed, int threads);
// --exception_rows's columns of a row of `k` weights for `percent` in (0, 100]: round(k *
// percent / 100) of them (at least one), evenly spread, ascending and distinct: i * k / count.
std::vector<int64_t> ExceptionColumns(int64_t k, double percent);
// A fresh seed from the OS, for runs without --seed.
uint64_t RandomSeed();
// Seeds of a shape's weights and of its x, derived from the run's seed, so that every command
// and every phase of the demo draws the same data for the same shape.
uint64_t WeightSeed(uint64_t seed, const MatrixShape& shape);
uint64_t InputSeed(uint64_t seed, const MatrixShape& shape);

// out[t, r] = sum_k x[t, k] * w[r, k] in double, with the sums of |x[t, k] * w[r, k]| that the
// error bound scales with. Both [m, n], row-major. Rows of w are spread over `threads`.
struct GemvReference {
  int64_t m = 0, n = 0, k = 0;
  std::vector<double> out;
  std::vector<double> abs_dot;
};
GemvReference ReferenceGemv(const uint16_t* w, const uint16_t* x, int64_t m, int64_t n, int64_t k,
                            int threads);

// How far a BF16 output element may be from the exact dot product `ref` and still be right:
//
//   tol = 2^-7 * |ref|  +  (K/16 + 64) * 2^-23 * A,     A = sum_k |x_k * w_k|
//
// The first term is one BF16 unit in the last place at |ref|: the FP32 accumulator is rounded
// to BF16 once (half a unit), and two correct kernels that add in different orders can round to
// neighbouring BF16 values, so any two of them agree within one unit. The second term bounds the
// FP32 accumulation: BF16 x BF16 products are exact in FP32, each addition errs by at most one
// FP32 unit (2^-23 relative, allowing tensor cores that truncate) of a partial sum no larger
// than A, and a K-long dot product is a chain of K/16 mma steps (k16 each) plus at most 64
// reduction adds (warps, split-K slices). That worst case is far above real errors yet small
// (about 1 % of a typical output for N(0, 1/K) weights and N(0, 1) x at K = 8192), so a wrong
// row, token, K group or correction still fails. It also absorbs outputs near zero, where a
// relative bound alone would demand exactness.
double GemvTolerance(double ref, double abs_dot, int64_t k);

// The worst element of one output against the reference.
struct ErrorCheck {
  int64_t checked = 0;
  int64_t failures = 0;      // elements over tolerance, or not finite
  double max_ratio = 0;      // max |got - ref| / tol (<= 1 passes; 0 with tol 0 and exact)
  int64_t worst_token = -1;  // where max_ratio (or the first non-finite value) is
  int64_t worst_row = -1;
  double worst_got = 0, worst_ref = 0, worst_tol = 0;
  bool ok() const { return checked > 0 && failures == 0; }
  std::string ToString() const;  // "ok, max |err|/tol 0.031" or where it fails
};
// `got` is BF16 [m, n] with m <= ref.m: the first m tokens of the reference.
ErrorCheck CheckAgainstReference(const uint16_t* got, int64_t m, const GemvReference& ref);
// Two kernels' outputs against each other: each may be off by its tolerance, so 2 * tol.
ErrorCheck CheckPair(const uint16_t* a, const uint16_t* b, int64_t m, const GemvReference& ref);

// --- Bench results ----------------------------------------------------------------------------

// Bytes per second in units of 10^12; 0 when untimed.
double TeraBytesPerSecond(int64_t bytes, double time_us);
// Bytes a GEMV moves besides its weights: x [m, K] read and out [m, N] written, BF16.
int64_t ActivationBytes(int64_t m, const MatrixShape& shape);

// A form of the bandwidth probe's read kernel (kernel_sources/bandwidth_probe.cuh): UNROLL loads
// in flight per thread, threads per block, blocks per SM in the grid.
struct ProbeForm {
  int unroll = 0;
  int threads = 0;
  int blocks_per_sm = 0;
  std::string Name() const;            // "u4.t256.b8"
  std::string NameExpression() const;  // "gemvz_bandwidth_probe<4, 256>"
};
// The forms `gemvz bench` times; the fastest is the ceiling (and the streaming bound).
const std::vector<ProbeForm>& ProbeForms();
// Which of the forms was fastest: the index into `form_times_us` (one median time per form, in
// ProbeForms() order) of the least; the first of equals. -1 when there are none.
int FastestForm(const std::vector<double>& form_times_us);

// One timed path of one (shape, m).
struct TimedPath {
  double time_us = 0;     // median time of one call
  int64_t bytes = 0;      // bytes one call must move: weights (and side tables) + x + out
  double max_err_ratio = -1;  // worst |err| / tol against the CPU reference; -1 unchecked
  bool check_ok = false;
  std::string kernel;  // the probes: the fastest form of the read kernel ("u4.t256.b8")
  double TeraBytesPerSecond() const { return cli::TeraBytesPerSecond(bytes, time_us); }
};

struct BenchCase {
  MatrixShape shape;
  int64_t m = 0;
  std::string config;         // the dispatcher's choice for the compressed path
  std::string config_source;  // "tuned", "heuristic", ...
  std::string weight_format;  // "z12", or "bf16" when FromBf16 kept the matrix plain
  std::string fallback_reason;
  std::string plain_config;   // the dispatcher's choice for the plain BF16 path
  int copies_z12 = 0;         // rotated copies of each kind
  int copies_bf16 = 0;
  int launches_z12 = 0;       // launches per timed replay: a multiple of the path's copies
  int launches_bf16 = 0;
  TimedPath z12, plain, cublas, probe;  // probe.bytes: the buffer it streams (2 N K)
  // The streaming bound: the probe over as many bytes as the 12-bit weights take (a prefix of
  // the same copies), so with its own launch, ramp and tail. A 12-bit kernel that streams no
  // faster than the probe takes at least this long. Untimed (0) when the matrix was kept plain.
  // Both probes are the fastest of the probe's forms at their size.
  TimedPath probe_z12;
  bool pair_check_ok = false;  // the three GEMVs agree with each other (2 * tol)

  double CeilingTbps() const { return probe.TeraBytesPerSecond(); }
  double PercentOfCeiling(const TimedPath& path) const;
  double SpeedupVsCublas() const;  // cublas time / z12 time
  double SpeedupVsPlain() const;   // plain time / z12 time
  double BoundVsCublas() const;    // cublas time / probe_z12 time: the most z12 could gain
  double PercentOfBound() const;   // 100 * probe_z12 time / z12 time
  bool ok() const;                 // every check passed
};

struct GeoMeans {
  int count = 0;
  double speedup_vs_cublas = 0;
  double speedup_vs_plain = 0;
  double pct_ceiling_z12 = 0;
  double pct_ceiling_plain = 0;
  double pct_ceiling_cublas = 0;
  int bound_count = 0;         // the cases with a streaming bound (probe_z12 timed)
  double bound_vs_cublas = 0;  // over those cases
  double pct_bound_z12 = 0;
};
GeoMeans ComputeGeoMeans(const std::vector<BenchCase>& cases);

// Where and how a report was made.
struct BenchEnvironment {
  std::string gpu_name;
  std::string arch;            // "sm_90"
  int sm_count = 0;
  int64_t memory_bytes = 0;
  std::string driver_version;  // the kernel module's, e.g. "580.82.07"; empty if unknown
  std::string cuda_driver_api; // what cuDriverGetVersion says, e.g. "13.0"
  std::string cublas_library;  // the file that was loaded
  int cublas_version = 0;
  std::string date;            // ISO 8601, UTC
  std::string commit;          // --commit or GEMVZ_COMMIT; empty if unknown
  int replays = 0;
  bool pdl = false;            // the library's GEMVs used programmatic dependent launch
  int64_t rotate_bytes = 0;
  uint64_t seed = 0;
};

struct BenchReport {
  BenchEnvironment env;
  std::vector<BenchCase> cases;
};

// One m of `gemvz bench --sequence`: the time of one pass over the sequence of GEMVs, for the
// 12-bit path launched plainly and with programmatic dependent launch (GemvOptions::pdl), the
// plain BF16 path likewise, and cuBLAS; `ok`: every GEMV of every path was right.
struct SequenceCase {
  int64_t m = 0;
  double z12_us = 0, z12_pdl_us = 0, plain_us = 0, plain_pdl_us = 0, cublas_us = 0;
  int launches = 0;  // GEMVs captured in one timed graph
  bool ok = false;
};
// Its table (one line per m) and its JSON document (schema gemvz.sequence/1, docs/CLI.md).
std::string FormatSequenceTable(const std::vector<SequenceCase>& cases);
nlohmann::json SequenceReportToJson(const BenchEnvironment& env,
                                    const std::vector<MatrixShape>& shapes,
                                    const std::vector<SequenceCase>& cases);

// The table `gemvz bench` prints: one line per (shape, m) and the geometric means.
std::string FormatBenchTable(const std::vector<BenchCase>& cases);

// The JSON document of `gemvz bench --json` (schema "gemvz.bench/1", documented in docs/CLI.md).
inline constexpr const char* kBenchSchema = "gemvz.bench/1";
inline constexpr const char* kSequenceSchema = "gemvz.sequence/1";
nlohmann::json BenchReportToJson(const BenchReport& report);

// Whether the file `flag` names (--json=PATH, --plot=PATH) can be written, checked before a
// command's work so that a bad path does not throw a long run away: not a directory, nor a
// device, FIFO or socket (/dev/null: the rename that publishes the file would replace it), and a
// file can be created beside it (a probe file, removed at once). An empty path is fine (not asked
// for).
absl::Status CheckOutputFile(const char* flag, const std::string& path);

// Whether the file `flag` names is none of a command's other files, each given with what it is
// ("the input 'a.safetensors'"): writing it would replace that one (internal::SameFile). An
// empty path is fine. The error names the first file it would replace.
struct NamedFile {
  std::string what;
  std::string path;
};
absl::Status CheckOutputIsNoneOf(const char* flag, const std::string& path,
                                 const std::vector<NamedFile>& others);

// Writes JSON text to `path` atomically (temporary file, fsync, rename).
absl::Status WriteJsonFile(const std::string& path, const nlohmann::json& doc);
// WriteJsonFile for a command's --json: prints "wrote PATH" on stdout, or the error on stderr as
// "gemvz COMMAND: ..."; returns whether the file was written.
bool WriteJsonReport(const char* command, const std::string& path, const nlohmann::json& doc);

// The current time as "2025-11-29T10:42:00Z".
std::string UtcTimestamp();
// --commit if given, else GEMVZ_COMMIT, else "".
std::string CommitFrom(const std::string& flag_value);
// The NVIDIA kernel module's version from /proc/driver/nvidia/version, or "".
std::string NvidiaDriverVersion();

// The full path of an executable found on PATH, or "".
std::string FindOnPath(const std::string& name);
// Draws speedup over cuBLAS and over plain BF16 per (shape, m) into a PNG with gnuplot. Fails
// with a clear message when gnuplot is not installed; never needed to build.
absl::Status PlotSpeedups(const std::vector<BenchCase>& cases, const std::string& title,
                          const std::string& png_path);

}  // namespace gemvz::cli
