// CPU-side machinery of the gemvz CLI's demo, bench and tune: parsing, random data, the reference
// GEMV and its error bound, tables, JSON and the gnuplot chart (bench_support.h says why each).
#include "tools/gemvz/bench_support.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gemvz/format.h"
#include "nlohmann/json.hpp"
#include "runtime/common/file_util.h"
#include "runtime/common/parallel.h"
#include "runtime/common/status_macros.h"
#include "runtime/common/temp_files.h"

namespace gemvz::cli {
namespace {

// Runs fn(begin, end) over [0, count) in chunks of `grain` on up to `threads` threads.
void ParallelFor(int64_t count, int threads, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn) {
  if (count <= 0) return;
  const int64_t chunks = (count + grain - 1) / grain;
  const int workers = internal::WorkerCount(threads, chunks);
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      fn(c * grain, std::min(count, (c + 1) * grain));
    }
  };
  internal::RunWorkers(workers, [&](int) { work(); });
}

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// xoshiro256**: fast, and good enough for test data (not for anything that must be secret).
class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed) {
    for (uint64_t& w : s_) w = SplitMix64(seed);
  }
  uint64_t Next() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }
  // Uniform in (0, 1): never 0, so log() below is finite.
  double Open01() { return (static_cast<double>(Next() >> 11) + 0.5) * 0x1.0p-53; }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

constexpr int64_t kRandomChunk = int64_t{1} << 16;

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// A gnuplot single-quoted string: '' stands for one quote.
std::string GnuplotQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    out += c;
    if (c == '\'') out += '\'';
  }
  return out + "'";
}

double SafeRatio(double num, double den) { return den > 0 ? num / den : 0; }

nlohmann::json PathToJson(const BenchCase& c, const TimedPath& p, bool checked) {
  nlohmann::json j = {
      {"time_us", p.time_us},
      {"bytes", p.bytes},
      {"tbps", p.TeraBytesPerSecond()},
      {"pct_of_ceiling", c.PercentOfCeiling(p)},
  };
  if (checked) {
    j["max_err_ratio"] = p.max_err_ratio;
    j["check_ok"] = p.check_ok;
  }
  if (!p.kernel.empty()) j["kernel"] = p.kernel;
  return j;
}

}  // namespace

std::string MatrixShape::ToString() const { return absl::StrCat(n, "x", k); }

const std::vector<MatrixShape>& SuiteShapes() {
  static const std::vector<MatrixShape>* suite = new std::vector<MatrixShape>{
      {"pooler", 4096, 8192},
      {"llama3-8b qkv", 6144, 4096},
      {"llama3-8b o", 4096, 4096},
      {"llama3-8b gate_up", 28672, 4096},
      {"llama3-8b down", 4096, 14336},
      {"llama3-70b qkv", 10240, 8192},
      {"llama3-70b down", 8192, 28672},
  };
  return *suite;
}

absl::StatusOr<MatrixShape> ParseShape(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, absl::ByAnyChar("xX"));
  int64_t n = 0, k = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &n) || !absl::SimpleAtoi(parts[1], &k) ||
      n <= 0 || k <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad shape '", text, "': expected NxK, two positive integers (N rows of weights, K "
        "columns), e.g. 4096x8192"));
  }
  // cuBLAS takes int dimensions, and 2^34 weights (32 GiB of BF16) is past any single layer.
  if (n > std::numeric_limits<int32_t>::max() || k > std::numeric_limits<int32_t>::max() ||
      n > (int64_t{1} << 34) / k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad shape '", text, "': too large (each side at most 2^31-1, N*K at most 2^34)"));
  }
  for (const MatrixShape& s : SuiteShapes()) {
    if (s.n == n && s.k == k) return s;
  }
  return MatrixShape{"", n, k};
}

absl::StatusOr<std::vector<int64_t>> ParseMList(const std::string& text) {
  std::vector<int64_t> ms;
  std::set<int64_t> seen;
  if (text.empty()) {
    return absl::InvalidArgumentError("bad --m '': expected a comma-separated list such as 1,8,16");
  }
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    piece = absl::StripAsciiWhitespace(piece);
    int64_t m = 0;
    if (!absl::SimpleAtoi(piece, &m)) {
      return absl::InvalidArgumentError(absl::StrCat("bad --m '", text, "': '", piece,
                                                     "' is not an integer (e.g. 1,8,16)"));
    }
    if (m < 1 || m > kMaxM) {
      return absl::InvalidArgumentError(absl::StrCat("bad --m '", text, "': ", m,
                                                     " is outside 1..", kMaxM));
    }
    if (!seen.insert(m).second) {
      return absl::InvalidArgumentError(absl::StrCat("bad --m '", text, "': ", m,
                                                     " is given twice"));
    }
    ms.push_back(m);
  }
  return ms;
}

absl::StatusOr<std::vector<MatrixShape>> ShapesFromFlag(const std::string& shape_flag,
                                                        bool quick) {
  if (!shape_flag.empty()) {
    if (quick) {
      return absl::InvalidArgumentError(
          "--quick and --shape both choose the shapes: give one of them");
    }
    ASSIGN_OR_RETURN(MatrixShape shape, ParseShape(shape_flag));
    return std::vector<MatrixShape>{shape};
  }
  std::vector<MatrixShape> shapes = SuiteShapes();
  if (quick) shapes.resize(2);
  return shapes;
}

absl::StatusOr<std::vector<MatrixShape>> SequenceFromFlag(const std::string& sequence_flag) {
  std::vector<std::string> parts;
  if (sequence_flag == "llama3-8b") {
    parts = {"6144x4096", "4096x4096", "28672x4096", "4096x14336"};
  } else {
    parts = absl::StrSplit(sequence_flag, ',', absl::SkipEmpty());
  }
  if (parts.empty()) {
    return absl::InvalidArgumentError(
        "bad --sequence: expected llama3-8b or a comma-separated list of NxK shapes");
  }
  std::vector<MatrixShape> shapes;
  for (const std::string& part : parts) {
    absl::StatusOr<MatrixShape> shape = ParseShape(part);
    if (!shape.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad --sequence entry '", part, "': ", shape.status().message()));
    }
    shapes.push_back(*shape);
  }
  return shapes;
}

void FillNormalBf16(uint16_t* out, int64_t count, double stddev, uint64_t seed, int threads) {
  const int64_t chunks = (count + kRandomChunk - 1) / kRandomChunk;
  ParallelFor(chunks, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      uint64_t chunk_seed = seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(c + 1));
      Xoshiro256 rng(SplitMix64(chunk_seed));
      const int64_t lo = c * kRandomChunk, hi = std::min(count, lo + kRandomChunk);
      for (int64_t i = lo; i < hi; i += 2) {
        // Box-Muller: two independent normals per pair of uniforms.
        const double r = std::sqrt(-2.0 * std::log(rng.Open01())) * stddev;
        const double phi = 2.0 * M_PI * rng.Open01();
        out[i] = FloatToBf16(static_cast<float>(r * std::cos(phi)));
        if (i + 1 < hi) out[i + 1] = FloatToBf16(static_cast<float>(r * std::sin(phi)));
      }
    }
  });
}

std::vector<uint16_t> NormalBf16(int64_t count, double stddev, uint64_t seed, int threads) {
  std::vector<uint16_t> v(count);
  FillNormalBf16(v.data(), count, stddev, seed, threads);
  return v;
}

std::vector<int64_t> ExceptionColumns(int64_t k, double percent) {
  const int64_t count =
      std::clamp<int64_t>(std::llround(static_cast<double>(k) * percent / 100.0), 1, k);
  std::vector<int64_t> cols(count);
  for (int64_t i = 0; i < count; ++i) cols[i] = i * k / count;
  return cols;
}

uint64_t RandomSeed() {
  std::random_device rd;
  uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return s == 0 ? 1 : s;
}

uint64_t WeightSeed(uint64_t seed, const MatrixShape& shape) {
  uint64_t state = seed ^ (static_cast<uint64_t>(shape.n) * 0x100000001B3ull) ^
                   static_cast<uint64_t>(shape.k);
  return SplitMix64(state);
}

uint64_t InputSeed(uint64_t seed, const MatrixShape& shape) {
  uint64_t state = WeightSeed(seed, shape) ^ 0x5851F42D4C957F2Dull;
  return SplitMix64(state);
}

GemvReference ReferenceGemv(const uint16_t* w, const uint16_t* x, int64_t m, int64_t n, int64_t k,
                            int threads) {
  GemvReference ref;
  ref.m = m;
  ref.n = n;
  ref.k = k;
  ref.out.assign(m * n, 0.0);
  ref.abs_dot.assign(m * n, 0.0);
  std::vector<float> xf(m * k);
  for (int64_t i = 0; i < m * k; ++i) xf[i] = Bf16ToFloat(x[i]);
  ParallelFor(n, threads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(k);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < k; ++i) wf[i] = Bf16ToFloat(w[r * k + i]);
      for (int64_t t = 0; t < m; ++t) {
        const float* xr = &xf[t * k];
        // A BF16 x BF16 product has at most 16 significant bits, so it is exact in float; the
        // double sums then carry about 2^-53 * K relative error, far below any tolerance.
        double sum = 0, abs_sum = 0;
        for (int64_t i = 0; i < k; ++i) {
          const double p = static_cast<double>(xr[i] * wf[i]);
          sum += p;
          abs_sum += std::fabs(p);
        }
        ref.out[t * n + r] = sum;
        ref.abs_dot[t * n + r] = abs_sum;
      }
    }
  });
  return ref;
}

double GemvTolerance(double ref, double abs_dot, int64_t k) {
  const double chain = static_cast<double>(k) / 16.0 + 64.0;
  return 0x1.0p-7 * std::fabs(ref) + chain * 0x1.0p-23 * abs_dot;
}

std::string ErrorCheck::ToString() const {
  if (checked == 0) return "not checked";
  if (failures == 0) return absl::StrFormat("ok (max |err|/tol %.3f)", max_ratio);
  return absl::StrFormat(
      "WRONG: %d of %d elements over tolerance; worst at token %d, row %d: got %.6g, reference "
      "%.6g, tolerance %.3g (|err|/tol %.3g)",
      failures, checked, worst_token, worst_row, worst_got, worst_ref, worst_tol, max_ratio);
}

namespace {

// Shared by the two checks: `value(t, r)` gives the number compared against `target(t, r)`.
template <typename Fn>
ErrorCheck CheckElements(int64_t m, const GemvReference& ref, double tol_scale, Fn error_of) {
  ErrorCheck check;
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t r = 0; r < ref.n; ++r) {
      const int64_t i = t * ref.n + r;
      double got = 0, target = 0;
      error_of(i, &got, &target);
      const double tol = tol_scale * GemvTolerance(ref.out[i], ref.abs_dot[i], ref.k);
      const double err = std::fabs(got - target);
      double ratio;
      // A non-finite value on either side is the worst there is; as a NaN |err|/tol it would fail
      // the test below but never become the worst element, so the report would name another.
      if (!std::isfinite(got) || !std::isfinite(target)) {
        ratio = std::numeric_limits<double>::infinity();
      } else if (tol > 0) {
        ratio = err / tol;
      } else {
        ratio = err == 0 ? 0 : std::numeric_limits<double>::infinity();
      }
      ++check.checked;
      if (!(ratio <= 1.0)) ++check.failures;
      if (check.worst_token < 0 || ratio > check.max_ratio) {
        check.max_ratio = ratio;
        check.worst_token = t;
        check.worst_row = r;
        check.worst_got = got;
        check.worst_ref = target;
        check.worst_tol = tol;
      }
    }
  }
  return check;
}

}  // namespace

ErrorCheck CheckAgainstReference(const uint16_t* got, int64_t m, const GemvReference& ref) {
  if (m > ref.m) return ErrorCheck{};
  return CheckElements(m, ref, 1.0, [&](int64_t i, double* value, double* target) {
    *value = Bf16ToFloat(got[i]);
    *target = ref.out[i];
  });
}

ErrorCheck CheckPair(const uint16_t* a, const uint16_t* b, int64_t m, const GemvReference& ref) {
  if (m > ref.m) return ErrorCheck{};
  // A NaN or infinity in `b` fails (and is reported) like one in `a`.
  return CheckElements(m, ref, 2.0, [&](int64_t i, double* value, double* target) {
    *value = Bf16ToFloat(a[i]);
    *target = Bf16ToFloat(b[i]);
  });
}

std::string ProbeForm::Name() const {
  return absl::StrFormat("u%d.t%d.b%d", unroll, threads, blocks_per_sm);
}

std::string ProbeForm::NameExpression() const {
  return absl::StrFormat("gemvz_bandwidth_probe<%d, %d>", unroll, threads);
}

// Of 91 read kernels timed on the suite's 12-bit sizes (25-352 MB, seven runs on two H200s;
// docs/BENCHMARKS.md, "The ceiling"), the fastest of these three was within 0.2 % of the fastest
// of all at every size: fewer loads in flight per thread win at 25-50 MB, more above 170 MB. The
// one form used until then (UNROLL 4, 512 threads, 4 blocks per SM) was 0.1-5 % slower.
const std::vector<ProbeForm>& ProbeForms() {
  static const std::vector<ProbeForm>* forms =
      new std::vector<ProbeForm>{{2, 256, 8}, {4, 256, 8}, {8, 1024, 2}};
  return *forms;
}

int FastestForm(const std::vector<double>& form_times_us) {
  int best = form_times_us.empty() ? -1 : 0;
  for (int form = 1; form < static_cast<int>(form_times_us.size()); ++form) {
    if (form_times_us[form] < form_times_us[best]) best = form;
  }
  return best;
}

double TeraBytesPerSecond(int64_t bytes, double time_us) {
  return time_us > 0 ? static_cast<double>(bytes) / (time_us * 1e-6) / 1e12 : 0;
}

int64_t ActivationBytes(int64_t m, const MatrixShape& shape) {
  return 2 * m * shape.k + 2 * m * shape.n;
}

double BenchCase::PercentOfCeiling(const TimedPath& path) const {
  return 100.0 * SafeRatio(path.TeraBytesPerSecond(), CeilingTbps());
}
double BenchCase::SpeedupVsCublas() const { return SafeRatio(cublas.time_us, z12.time_us); }
double BenchCase::SpeedupVsPlain() const { return SafeRatio(plain.time_us, z12.time_us); }
double BenchCase::BoundVsCublas() const { return SafeRatio(cublas.time_us, probe_z12.time_us); }
double BenchCase::PercentOfBound() const {
  return 100.0 * SafeRatio(probe_z12.time_us, z12.time_us);
}
bool BenchCase::ok() const {
  return z12.check_ok && plain.check_ok && cublas.check_ok && pair_check_ok;
}

GeoMeans ComputeGeoMeans(const std::vector<BenchCase>& cases) {
  GeoMeans g;
  double s_cublas = 0, s_plain = 0, p_z12 = 0, p_plain = 0, p_cublas = 0, b_cublas = 0, b_z12 = 0;
  for (const BenchCase& c : cases) {
    if (c.SpeedupVsCublas() <= 0 || c.SpeedupVsPlain() <= 0 || c.CeilingTbps() <= 0) continue;
    ++g.count;
    if (c.BoundVsCublas() > 0) {
      ++g.bound_count;
      b_cublas += std::log(c.BoundVsCublas());
      b_z12 += std::log(c.PercentOfBound());
    }
    s_cublas += std::log(c.SpeedupVsCublas());
    s_plain += std::log(c.SpeedupVsPlain());
    p_z12 += std::log(c.PercentOfCeiling(c.z12));
    p_plain += std::log(c.PercentOfCeiling(c.plain));
    p_cublas += std::log(c.PercentOfCeiling(c.cublas));
  }
  if (g.count == 0) return g;
  g.speedup_vs_cublas = std::exp(s_cublas / g.count);
  g.speedup_vs_plain = std::exp(s_plain / g.count);
  g.pct_ceiling_z12 = std::exp(p_z12 / g.count);
  g.pct_ceiling_plain = std::exp(p_plain / g.count);
  g.pct_ceiling_cublas = std::exp(p_cublas / g.count);
  if (g.bound_count > 0) {
    g.bound_vs_cublas = std::exp(b_cublas / g.bound_count);
    g.pct_bound_z12 = std::exp(b_z12 / g.bound_count);
  }
  return g;
}

std::string FormatBenchTable(const std::vector<BenchCase>& cases) {
  // Column groups: times, achieved bandwidth, share of the probe's ceiling, speedups of z12.
  constexpr const char* kRow =
      "%-28s %4s  %-36s %8s %8s %8s %8s  %6s %6s %6s %6s  %6s %6s %6s  %8s %8s  %s\n";
  // The group labels start where their groups do.
  std::string out = absl::StrFormat("%-71s %-35s  %-27s  %-20s  %s\n", "", "time per call, us",
                                    "achieved TB/s", "% of the probe's TB/s", "z12's speedup");
  absl::StrAppendFormat(&out, kRow, "layer", "m", "z12 config (source)", "z12", "plain",
                        "cuBLAS", "probe", "z12", "plain", "cuBLAS", "probe", "z12", "plain",
                        "cuBLAS", "xcuBLAS", "xplain", "check");
  for (const BenchCase& c : cases) {
    const std::string shape = c.shape.name.empty()
                                  ? c.shape.ToString()
                                  : absl::StrCat(c.shape.name, " ", c.shape.ToString());
    const std::string config =
        c.weight_format == "z12" ? absl::StrCat(c.config, " (", c.config_source, ")")
                                 : absl::StrCat("kept plain: ", c.config);
    absl::StrAppendFormat(
        &out, kRow, shape, absl::StrCat(c.m), config, absl::StrFormat("%.2f", c.z12.time_us),
        absl::StrFormat("%.2f", c.plain.time_us), absl::StrFormat("%.2f", c.cublas.time_us),
        absl::StrFormat("%.2f", c.probe.time_us),
        absl::StrFormat("%.2f", c.z12.TeraBytesPerSecond()),
        absl::StrFormat("%.2f", c.plain.TeraBytesPerSecond()),
        absl::StrFormat("%.2f", c.cublas.TeraBytesPerSecond()),
        absl::StrFormat("%.2f", c.CeilingTbps()),
        absl::StrFormat("%.1f", c.PercentOfCeiling(c.z12)),
        absl::StrFormat("%.1f", c.PercentOfCeiling(c.plain)),
        absl::StrFormat("%.1f", c.PercentOfCeiling(c.cublas)),
        absl::StrFormat("%.3fx", c.SpeedupVsCublas()),
        absl::StrFormat("%.3fx", c.SpeedupVsPlain()), c.ok() ? "ok" : "WRONG");
  }
  const GeoMeans g = ComputeGeoMeans(cases);
  if (g.count > 0) {
    absl::StrAppendFormat(
        &out,
        "geometric mean over %d cases: %.3fx over cuBLAS BF16, %.3fx over plain BF16; of the "
        "read ceiling: z12 %.1f%%, plain %.1f%%, cuBLAS %.1f%%\n",
        g.count, g.speedup_vs_cublas, g.speedup_vs_plain, g.pct_ceiling_z12, g.pct_ceiling_plain,
        g.pct_ceiling_cublas);
  }
  if (g.bound_count > 0) {
    absl::StrAppendFormat(
        &out,
        "streaming bound (the probe over the 12-bit weights' bytes, %d cases): a kernel at its "
        "pace would be %.3fx over cuBLAS BF16; z12 runs at %.1f%% of it\n",
        g.bound_count, g.bound_vs_cublas, g.pct_bound_z12);
  }
  return out;
}

namespace {

// The fields both report kinds share: schema, date, commit, gpu, cublas, settings.
nlohmann::json ReportHead(const char* schema, const BenchEnvironment& e) {
  nlohmann::json doc;
  doc["schema"] = schema;
  doc["date"] = e.date;
  doc["commit"] = e.commit.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.commit);
  doc["gpu"] = {{"name", e.gpu_name},
                {"arch", e.arch},
                {"sm_count", e.sm_count},
                {"memory_bytes", e.memory_bytes},
                {"driver_version", e.driver_version},
                {"cuda_driver_api", e.cuda_driver_api}};
  doc["cublas"] = {{"library", e.cublas_library}, {"version", e.cublas_version}};
  doc["settings"] = {
      {"replays", e.replays}, {"pdl", e.pdl}, {"rotate_bytes", e.rotate_bytes}, {"seed", e.seed}};
  return doc;
}

nlohmann::json ShapeJson(const MatrixShape& s) {
  return {{"name", s.name}, {"n", s.n}, {"k", s.k}};
}

}  // namespace

std::string FormatSequenceTable(const std::vector<SequenceCase>& cases) {
  constexpr const char* kRow = "%4s  %9s %9s %9s %9s %9s  %9s %9s %9s  %s\n";
  std::string out = absl::StrFormat("%-4s  %-49s  %s\n", "", "time of one pass over the sequence, us",
                                    "z12's speedup over cuBLAS");
  absl::StrAppendFormat(&out, kRow, "m", "z12", "z12 PDL", "plain", "plain PDL", "cuBLAS", "z12",
                        "z12 PDL", "PDL gain", "check");
  for (const SequenceCase& c : cases) {
    absl::StrAppendFormat(&out, kRow, absl::StrCat(c.m), absl::StrFormat("%.2f", c.z12_us),
                          absl::StrFormat("%.2f", c.z12_pdl_us), absl::StrFormat("%.2f", c.plain_us),
                          absl::StrFormat("%.2f", c.plain_pdl_us),
                          absl::StrFormat("%.2f", c.cublas_us),
                          absl::StrFormat("%.3fx", c.cublas_us / c.z12_us),
                          absl::StrFormat("%.3fx", c.cublas_us / c.z12_pdl_us),
                          absl::StrFormat("%.3fx", c.z12_us / c.z12_pdl_us), c.ok ? "ok" : "WRONG");
  }
  return out;
}

nlohmann::json SequenceReportToJson(const BenchEnvironment& env,
                                    const std::vector<MatrixShape>& shapes,
                                    const std::vector<SequenceCase>& cases) {
  nlohmann::json doc = ReportHead(kSequenceSchema, env);
  nlohmann::json seq = nlohmann::json::array();
  for (const MatrixShape& s : shapes) seq.push_back(ShapeJson(s));
  doc["sequence"] = seq;
  nlohmann::json out = nlohmann::json::array();
  bool all_ok = !cases.empty();
  for (const SequenceCase& c : cases) {
    all_ok = all_ok && c.ok;
    out.push_back({{"m", c.m},
                   {"launches", c.launches},
                   {"time_us",
                    {{"z12", c.z12_us},
                     {"z12_pdl", c.z12_pdl_us},
                     {"plain", c.plain_us},
                     {"plain_pdl", c.plain_pdl_us},
                     {"cublas", c.cublas_us}}},
                   {"speedup_vs_cublas",
                    {{"z12", c.cublas_us / c.z12_us}, {"z12_pdl", c.cublas_us / c.z12_pdl_us}}},
                   {"ok", c.ok}});
  }
  doc["cases"] = out;
  doc["ok"] = all_ok;
  return doc;
}

nlohmann::json BenchReportToJson(const BenchReport& report) {
  nlohmann::json doc = ReportHead(kBenchSchema, report.env);
  nlohmann::json cases = nlohmann::json::array();
  bool all_ok = true;
  for (const BenchCase& c : report.cases) {
    all_ok = all_ok && c.ok();
    cases.push_back({
        {"shape", ShapeJson(c.shape)},
        {"m", c.m},
        {"dispatch",
         {{"config", c.config},
          {"source", c.config_source},
          {"weight_format", c.weight_format},
          {"fallback_reason", c.fallback_reason},
          {"plain_config", c.plain_config}}},
        {"rotation",
         {{"copies_z12", c.copies_z12},
          {"copies_bf16", c.copies_bf16},
          {"launches_z12", c.launches_z12},
          {"launches_bf16", c.launches_bf16}}},
        {"paths",
         {{"z12", PathToJson(c, c.z12, true)},
          {"plain", PathToJson(c, c.plain, true)},
          {"cublas", PathToJson(c, c.cublas, true)},
          {"probe", PathToJson(c, c.probe, false)},
          {"probe_z12", PathToJson(c, c.probe_z12, false)}}},
        {"ceiling_tbps", c.CeilingTbps()},
        {"speedup_vs_cublas", c.SpeedupVsCublas()},
        {"speedup_vs_plain", c.SpeedupVsPlain()},
        {"bound_vs_cublas", c.BoundVsCublas()},
        {"pct_of_bound", c.PercentOfBound()},
        {"pair_check_ok", c.pair_check_ok},
        {"ok", c.ok()},
    });
  }
  doc["cases"] = std::move(cases);
  const GeoMeans g = ComputeGeoMeans(report.cases);
  doc["geomean"] = {{"count", g.count},
                    {"speedup_vs_cublas", g.speedup_vs_cublas},
                    {"speedup_vs_plain", g.speedup_vs_plain},
                    {"pct_ceiling_z12", g.pct_ceiling_z12},
                    {"pct_ceiling_plain", g.pct_ceiling_plain},
                    {"pct_ceiling_cublas", g.pct_ceiling_cublas},
                    {"bound_count", g.bound_count},
                    {"bound_vs_cublas", g.bound_vs_cublas},
                    {"pct_bound_z12", g.pct_bound_z12}};
  doc["ok"] = all_ok;
  return doc;
}

absl::Status CheckOutputFile(const char* flag, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": ", why));
  };
  struct stat info;
  if (::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) return bad("is a directory");
  if (internal::IsSpecialFile(path)) {
    return bad(
        "is not a regular file (a device, FIFO or socket): the report replaces its file by a "
        "rename; give a file's path");
  }
  const std::string dir = internal::DirName(path);
  if (::stat(dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    return bad(absl::StrCat("its directory '", dir, "' does not exist"));
  }
  // Named like the writer's own temporary files and registered like them, so that a signal
  // removes it; a name already taken (left by a killed run with this pid) is passed over.
  static std::atomic<uint64_t> counter{0};
  int e = EEXIST;
  for (int attempt = 0; attempt < 100 && e == EEXIST; ++attempt) {
    const std::string probe =
        internal::SiblingPath(path, ".tmp.", absl::StrCat("probe", counter++));
    internal::TempFileRegistration registration(probe);
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::close(fd);
      ::unlink(probe.c_str());
      return absl::OkStatus();
    }
    e = errno;
  }
  return bad(absl::StrCat("cannot create a file beside it: ", std::strerror(e)));
}

absl::Status CheckOutputIsNoneOf(const char* flag, const std::string& path,
                                 const std::vector<NamedFile>& others) {
  if (path.empty()) return absl::OkStatus();
  for (const NamedFile& other : others) {
    if (!other.path.empty() && internal::SameFile(path, other.path)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, "=", path, " is ", other.what, ": choose another file"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteJsonFile(const std::string& path, const nlohmann::json& doc) {
  // Strings such as file paths need not be UTF-8; a strict dump would throw out of the command.
  const absl::Status st = internal::AtomicWriteFile(
      path, doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  if (!st.ok()) {
    return absl::Status(st.code(), absl::StrCat("writing JSON to ", path, ": ", st.message()));
  }
  return absl::OkStatus();
}

bool WriteJsonReport(const char* command, const std::string& path, const nlohmann::json& doc) {
  if (absl::Status st = WriteJsonFile(path, doc); !st.ok()) {
    std::fprintf(stderr, "gemvz %s: %s\n", command, std::string(st.message()).c_str());
    return false;
  }
  std::printf("wrote %s\n", path.c_str());
  return true;
}

std::string UtcTimestamp() {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
}

std::string CommitFrom(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  const char* env = std::getenv("GEMVZ_COMMIT");
  return env == nullptr ? "" : env;
}

std::string NvidiaDriverVersion() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.82.07  Wed ...": the first token made
  // of digits and dots with at least one dot.
  std::istringstream words(line);
  for (std::string w; words >> w;) {
    if (w.find('.') != std::string::npos &&
        w.find_first_not_of("0123456789.") == std::string::npos && std::isdigit(w[0])) {
      return w;
    }
  }
  return "";
}

std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(dir, "/", name);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

absl::Status PlotSpeedups(const std::vector<BenchCase>& cases, const std::string& title,
                          const std::string& png_path) {
  if (cases.empty()) return absl::InvalidArgumentError("--plot: no results to draw");
  const std::string gnuplot = FindOnPath("gnuplot");
  if (gnuplot.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--plot ", png_path, " needs gnuplot, which is not on PATH. Install it (Debian/Ubuntu: "
        "apt-get install gnuplot-nox) or leave out --plot; the table and --json hold the same "
        "numbers"));
  }
  const char* tmp_env = std::getenv("TMPDIR");
  std::string dir_template =
      absl::StrCat(tmp_env != nullptr && *tmp_env != '\0' ? tmp_env : "/tmp", "/gemvz-plot-XXXXXX");
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("--plot: cannot create a temporary directory ", dir_template, ": ",
                     std::strerror(errno)));
  }
  // gnuplot draws into the scratch directory and the chart is then published whole, so that a
  // failed or interrupted run never leaves a half-drawn PNG at the user's path. The directory and
  // every file in it are registered for removal on a signal, and removed on every return.
  const std::string dir = dir_template;
  const std::string data_path = dir + "/speedups.dat";
  const std::string script_path = dir + "/speedups.gp";
  const std::string log_path = dir + "/gnuplot.log";
  const std::string scratch_png = dir + "/speedups.png";
  const std::string* const scratch_files[] = {&data_path, &script_path, &log_path, &scratch_png};
  internal::TempFileRegistration dir_registration(dir);
  std::vector<internal::TempFileRegistration> file_registrations;
  for (const std::string* p : scratch_files) file_registrations.emplace_back(*p);
  absl::Cleanup remove_scratch = [&] {
    for (const std::string* p : scratch_files) std::remove(p->c_str());
    rmdir(dir.c_str());
  };
  {
    std::ofstream data(data_path);
    data << "# label speedup_vs_cublas speedup_vs_plain\n";
    for (const BenchCase& c : cases) {
      std::string label = absl::StrCat(c.shape.name.empty() ? c.shape.ToString() : c.shape.name,
                                       " m=", c.m);
      std::replace(label.begin(), label.end(), '"', '\'');
      data << '"' << label << "\" " << c.SpeedupVsCublas() << ' ' << c.SpeedupVsPlain() << '\n';
    }
    if (!data) return absl::InternalError(absl::StrCat("--plot: cannot write ", data_path));
  }
  // Room above the tallest bar, and the 1.333x line (the byte ratio's bound) always in view.
  double y_max = 4.0 / 3.0;
  for (const BenchCase& c : cases) {
    y_max = std::max({y_max, c.SpeedupVsCublas(), c.SpeedupVsPlain()});
  }
  y_max *= 1.15;
  absl::Status result = absl::OkStatus();
  // pngcairo draws better; builds without cairo only have png.
  for (const char* terminal : {"pngcairo size 1400,700 noenhanced", "png size 1400,700 noenhanced"}) {
    std::remove(scratch_png.c_str());
    std::ofstream script(script_path, std::ios::trunc);
    script << "set terminal " << terminal << "\n"
           << "set output " << GnuplotQuote(scratch_png) << "\n"
           << "set title " << GnuplotQuote(title) << "\n"
           << "set style data histograms\n"
           << "set style histogram clustered gap 1\n"
           << "set style fill solid 0.85 border -1\n"
           << "set boxwidth 0.9\n"
           << "set ylabel 'speedup (x)'\n"
           << "set yrange [0:" << y_max << "]\n"
           << "set grid ytics\n"
           << "set xtics rotate by -45 scale 0\n"
           << "set bmargin 10\n"
           << "set rmargin 8\n"
           << "set key outside top center horizontal\n"
           << "set arrow from graph 0, first 1 to graph 1, first 1 nohead dt 2 lc rgb 'black'\n"
           << "set arrow from graph 0, first 1.3333 to graph 1, first 1.3333 nohead dt 3 "
              "lc rgb 'gray40'\n"
           << "plot " << GnuplotQuote(data_path)
           << " using 2:xtic(1) title 'z12 over cuBLAS BF16', '' using 3 title 'z12 over plain "
              "BF16'\n";
    script.close();
    const std::string cmd = absl::StrCat(ShellQuote(gnuplot), " ", ShellQuote(script_path),
                                         " > ", ShellQuote(log_path), " 2>&1");
    const int rc = std::system(cmd.c_str());
    // std::system ignores SIGINT and SIGQUIT in this process while gnuplot runs, so a Ctrl-C
    // reaches only the shell and gnuplot: take it here, after the scratch directory has gone.
    if (rc != -1 && WIFSIGNALED(rc) && (WTERMSIG(rc) == SIGINT || WTERMSIG(rc) == SIGQUIT)) {
      std::move(remove_scratch).Invoke();
      std::raise(WTERMSIG(rc));
      return absl::CancelledError("--plot: interrupted");  // only if the signal is ignored
    }
    if (rc == 0 && access(scratch_png.c_str(), F_OK) == 0) {
      absl::StatusOr<std::string> png = internal::ReadFile(scratch_png);
      result = png.ok() ? internal::AtomicWriteFile(png_path, *png) : png.status();
      if (!result.ok()) result = absl::InternalError(absl::StrCat("--plot: ", result.message()));
      break;
    }
    std::ifstream log(log_path);
    std::stringstream text;
    text << log.rdbuf();
    result = absl::InternalError(absl::StrCat("--plot: gnuplot failed (", gnuplot, ", exit ",
                                              WIFEXITED(rc) ? WEXITSTATUS(rc) : rc,
                                              "): ", text.str()));
  }
  return result;
}

}  // namespace gemvz::cli
