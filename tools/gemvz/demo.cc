// `gemvz demo`: the whole story on built-in data. Packs DESIGN.md's layer shapes, proves the round
// trip bit for bit, compiles the kernels, then on a GPU checks and times the GEMV against cuBLAS.
// Without a GPU it does everything that needs none and says plainly what it skipped.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gemvz/config.h"
#include "gemvz/dispatch.h"
#include "gemvz/format.h"
#include "gemvz/runtime.h"
#include "runtime/common/env.h"
#include "runtime/common/status_macros.h"
#include "runtime/dispatch/dispatcher.h"
#include "runtime/gemv/device_state.h"
#include "runtime/jit/kernel_cache.h"
#include "tools/gemvz/bench_flags.h"
#include "tools/gemvz/bench_gpu.h"
#include "tools/gemvz/bench_support.h"
#include "tools/gemvz/command.h"
#include "tools/gemvz/common_flags.h"

ABSL_FLAG(bool, quick, false, "demo: only the suite's first two shapes");

namespace gemvz::cli {
namespace {

const int64_t kDemoMs[] = {1, 8, 16};

const std::string& DemoUsage() {
  static const std::string* usage = new std::string(absl::StrCat(
      "usage: gemvz demo [--quick | --shape=NxK] [--arch=sm_XX] [--seed=N] [--j=N] [--device=N]\n"
      "                  [--replays=N] [--launches=N] [--rotate_mb=MIB] [--pdl]\n"
      "\n"
      "The library's main job on built-in data, start to finish:\n"
      "  1. draws BF16 weights N(0, 1/K) for DESIGN.md's suite (N x K: 4096x8192 pooler,\n"
      "     6144x4096, 4096x4096, 28672x4096, 4096x14336, 10240x8192, 8192x28672);\n"
      "  2. packs each to the 12-bit format with all threads and prints bits per weight, the\n"
      "     exception rate and the pack time, then unpacks it and checks every bit;\n"
      "  3. compiles the kernels the dispatcher picks for m = 1, 8, 16 (gemvz::Precompile),\n"
      "     showing the first request (a compile, or a disk-cache hit) and the second (warm);\n"
      "  4. with a GPU: uploads, runs Gemv at m = 1, 8, 16 on random x, checks it against a\n"
      "     CPU double-precision reference, and prints a speed table against cuBLAS BF16 and\n"
      "     the library's plain BF16 kernel (the machinery of gemvz bench).\n"
      "Without a GPU it does 1-3, prints what it skipped and why, and exits 0.\n"
      "Results go to stdout, progress to stderr.\n"
      "\n"
      "flags:\n"
      "  --quick             only the first two shapes, 4096x8192 and 6144x4096; not with --shape\n"
      "                      (default false)\n"
      "  --shape=NxK         one shape instead of the suite (default: the suite)\n"
      "  --arch=sm_XX        architecture to compile for (default: $GEMVZ_ARCH, else the GPU's,\n"
      "                      else sm_90)\n",
      kMeasureFlagsUsage,
      "\n"
      "Exit status: 0 when everything that ran is right (also without a GPU), 1 when a check or\n"
      "a step fails, 2 for a usage error.\n"
      "\n"
      "examples:\n"
      "  gemvz demo --quick\n"
      "  gemvz demo\n"
      "  GEMVZ_CACHE_DIR=/tmp/cold gemvz demo --quick --arch=sm_90a   # cold compiles\n"));
  return *usage;
}

std::string ShapeName(const MatrixShape& s) { return s.name.empty() ? "-" : s.name; }

struct KernelUse {
  KernelConfig config;
  std::string source;
  std::vector<std::string> used_by;  // "4096x8192 m1"
};

// What the dispatcher will pick for each (shape, m), known without a GPU: GEMVZ_FORCE_CONFIG if
// set (Gemv honours it, and refuses it where Validate does), else the tuning file, the built-in
// table or the heuristic. An error is the environment's (GEMVZ_FORCE_CONFIG, GEMVZ_WEIGHT_ORDER).
absl::StatusOr<std::vector<KernelUse>> KernelsNeeded(const std::vector<MatrixShape>& shapes,
                                                     const std::string& arch,
                                                     const DeviceLimits& limits,
                                                     const std::string& device) {
  std::vector<KernelUse> uses;
  std::map<std::string, size_t> index;  // KernelName -> uses[]
  std::optional<KernelConfig> forced;
  const std::optional<std::string> env_config = internal::GetEnv("GEMVZ_FORCE_CONFIG");
  if (env_config) {
    absl::StatusOr<KernelConfig> parsed = KernelConfig::Parse(*env_config);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GEMVZ_FORCE_CONFIG: ", parsed.status().message()));
    }
    // Gemv applies it only to matrices of its format; the demo's are z12.
    if (parsed->format == WeightFormat::kZ12) forced = *parsed;
  }
  for (const MatrixShape& s : shapes) {
    // In the order the demo's upload will take (UploadOptions' rule), which Gemv gives a forced
    // configuration too.
    ASSIGN_OR_RETURN(const WeightOrder order,
                     internal::ResolveOrder(std::nullopt, arch, s.n, s.k, device));
    for (const int64_t m : kDemoMs) {
      GemvPlan plan;
      if (forced) {
        plan.config = internal::InOrder(*forced, order);
        plan.source = "env";
        // As Gemv and tune check it: one launch of its chunk of m (internal::LaunchShape).
        const GemvShape launch = internal::LaunchShape(GemvShape{m, s.n, s.k}, plan.config);
        if (absl::Status st = Validate(plan.config, launch, limits); !st.ok()) {
          return absl::InvalidArgumentError(absl::StrCat("GEMVZ_FORCE_CONFIG=", *env_config,
                                                         " cannot run ", s.ToString(),
                                                         " at m = ", m, ": ", st.message()));
        }
      } else {
        ASSIGN_OR_RETURN(plan, internal::ChooseConfig(GemvShape{m, s.n, s.k}, WeightFormat::kZ12,
                                                      arch, limits.sm_count, order, device));
      }
      const std::string name = plan.config.KernelName();
      auto [it, fresh] = index.emplace(name, uses.size());
      if (fresh) uses.push_back(KernelUse{plan.config, plan.source, {}});
      uses[it->second].used_by.push_back(absl::StrCat(s.ToString(), " m", m));
    }
  }
  return uses;
}

// Step 2: pack, report, round trip. Returns false when something is wrong.
bool PackAll(const std::vector<MatrixShape>& shapes, uint64_t seed, int threads) {
  std::printf("1. Pack: BF16 weights N(0, 1/K) to 12 bits, losslessly\n\n");
  std::printf("%-18s %-11s %8s %11s %9s %6s %10s %10s %9s %8s  %s\n", "layer", "N x K", "bits/w",
              "exceptions", "entries", "dense", "z12 MiB", "bf16 MiB", "pack ms", "Mw/s",
              "round trip");
  bool ok = true;
  PackOptions options;
  options.threads = threads;
  for (const MatrixShape& s : shapes) {
    Progress(absl::StrFormat("[demo] %s: drawing %d x %d weights", s.ToString(), s.n, s.k));
    const std::vector<uint16_t> w =
        NormalBf16(s.n * s.k, 1.0 / std::sqrt(static_cast<double>(s.k)), WeightSeed(seed, s),
                   threads);
    Progress(absl::StrFormat("[demo] %s: packing", s.ToString()));
    const absl::Time t0 = absl::Now();
    absl::StatusOr<PackedMatrix> packed = Pack(w.data(), s.n, s.k, options);
    const double pack_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (!packed.ok()) {
      std::printf("%-18s %-11s pack FAILED: %s\n", ShapeName(s).c_str(), s.ToString().c_str(),
                  std::string(packed.status().message()).c_str());
      ok = false;
      continue;
    }
    Progress(absl::StrFormat("[demo] %s: unpacking and comparing every bit", s.ToString()));
    std::string round_trip;
    absl::StatusOr<std::vector<uint16_t>> back = Unpack(*packed);
    if (!back.ok()) {
      round_trip = absl::StrCat("FAILED: ", back.status().message());
    } else if (back->size() != w.size()) {
      round_trip = absl::StrFormat("FAILED: %d values back, %d packed", back->size(), w.size());
    } else {
      const auto diff = std::mismatch(w.begin(), w.end(), back->begin());
      if (diff.first == w.end()) {
        round_trip = "bit-exact";
      } else {
        const int64_t i = diff.first - w.begin();
        round_trip = absl::StrFormat("FAILED at (%d, %d): 0x%04x packed, 0x%04x back", i / s.k,
                                     i % s.k, *diff.first, *diff.second);
      }
    }
    ok = ok && round_trip == "bit-exact";
    const PackStats& st = packed->stats;
    std::printf("%-18s %-11s %8.4f %10.4f%% %9lld %6lld %10.1f %10.1f %9.1f %8.0f  %s\n",
                ShapeName(s).c_str(), s.ToString().c_str(), st.bits_per_weight,
                100.0 * st.exception_rate, static_cast<long long>(st.sparse_entries),
                static_cast<long long>(st.dense_rows), st.total_bytes / 1048576.0,
                2.0 * s.n * s.k / 1048576.0, pack_ms,
                pack_ms > 0 ? static_cast<double>(s.n * s.k) / (pack_ms * 1e3) : 0.0,
                round_trip.c_str());
    std::fflush(stdout);
  }
  std::printf("\n(bits/w counts every byte the kernel may read, side tables included; exceptions "
              "are weights outside the 8-value exponent window, corrected exactly; entries are "
              "their FP32 corrections; dense rows are stored whole)\n\n");
  return ok;
}

// Step 3: precompile `uses` (KernelsNeeded), cold then warm.
bool CompileAll(const std::vector<KernelUse>& uses, const std::string& arch, int threads) {
  std::printf(
      "2. Kernels for %s: the dispatcher's choices for m = 1, 8, 16, compiled by NVRTC at "
      "run time\n\n",
      arch.c_str());
  std::vector<KernelConfig> configs;
  for (const KernelUse& u : uses) configs.push_back(u.config);
  ResetJitCounters();
  Progress(absl::StrFormat("[demo] compiling %d kernels for %s", configs.size(), arch));
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::vector<PrecompileResult>> cold = PrecompileAll(
      configs, arch, threads, [](int done, int total, const PrecompileResult& r) {
        Progress(absl::StrFormat("[demo]   %d/%d %s: %.0f ms%s", done, total,
                                 r.config.KernelName(), r.millis,
                                 r.from_disk ? " (disk cache)" : ""));
      });
  const double cold_wall_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
  if (!cold.ok()) {
    std::printf("FAILED to compile: %s\n\n", std::string(cold.status().message()).c_str());
    return false;
  }
  const JitCounters after_cold = GetJitCounters();
  std::printf("%-24s %-12s %13s %12s %5s %7s %6s  %s\n", "kernel", "source", "first ms",
              "again ms", "regs", "spill B", "smem", "used by");
  bool ok = true;
  for (const KernelUse& u : uses) {
    // PrecompileAll may return results in completion order: find this kernel's.
    const PrecompileResult* first = nullptr;
    for (const PrecompileResult& r : *cold) {
      if (r.config.KernelName() == u.config.KernelName()) first = &r;
    }
    absl::StatusOr<PrecompileResult> again = Precompile(u.config, arch);
    if (first == nullptr || !again.ok()) {
      std::printf("%-24s FAILED: %s\n", u.config.KernelName().c_str(),
                  again.ok() ? "no result from PrecompileAll"
                             : std::string(again.status().message()).c_str());
      ok = false;
      continue;
    }
    std::printf("%-24s %-12s %7.1f %-5s %12.3f %5d %7d %6d  %s\n", u.config.KernelName().c_str(),
                u.source.c_str(), first->millis, first->from_disk ? "disk" : "nvrtc", again->millis,
                first->registers, first->spill_bytes, first->shared_bytes,
                absl::StrJoin(u.used_by, ", ").c_str());
  }
  const JitCounters total = GetJitCounters();
  const std::string cache = CacheDirectory();
  std::printf(
      "\n%zu kernels in %.0f ms wall (%s): %lld compiled, %lld from the disk cache; "
      "asked again: %lld in-memory hits. Disk cache: %s\n\n",
      uses.size(), cold_wall_ms,
      threads > 0 ? absl::StrCat(threads, " threads").c_str() : "all cores",
      static_cast<long long>(after_cold.compiles), static_cast<long long>(after_cold.disk_hits),
      static_cast<long long>(total.memory_hits - after_cold.memory_hits),
      cache.empty() ? "disabled (GEMVZ_DISABLE_DISK_CACHE=1)" : cache.c_str());
  return ok;
}

// Step 4 with a GPU: check and time through bench's machinery.
bool RunOnGpu(const std::vector<MatrixShape>& shapes, const TimingOptions& timing,
              const WorkloadOptions& workload) {
  absl::StatusOr<std::unique_ptr<BenchStack>> stack =
      OpenBenchStack(absl::GetFlag(FLAGS_device), timing, workload);
  if (!stack.ok()) {
    std::printf("3. GEMV on the GPU: FAILED to start: %s\n",
                std::string(stack.status().message()).c_str());
    return false;
  }
  const GpuInfo& gpu = (*stack)->session->info();
  std::vector<BenchCase> cases;
  bool ok = true;
  for (const MatrixShape& s : shapes) {
    absl::StatusOr<std::vector<BenchCase>> shape_cases =
        BenchShape((*stack)->tools, s, std::vector<int64_t>(std::begin(kDemoMs), std::end(kDemoMs)));
    if (!shape_cases.ok()) {
      std::printf("%s: FAILED: %s\n", s.ToString().c_str(),
                  std::string(shape_cases.status().message()).c_str());
      ok = false;
      continue;
    }
    for (BenchCase& c : *shape_cases) cases.push_back(std::move(c));
  }
  std::printf("3. GEMV on %s (%s): out[m, N] = x[m, K] W^T, checked against a CPU double-precision "
              "reference\n   (|err| <= 2^-7 |ref| + (K/16 + 64) 2^-23 sum|x w|: one BF16 unit plus "
              "an FP32 accumulation bound; ratio <= 1 passes)\n\n",
              gpu.name.c_str(), gpu.arch.c_str());
  std::printf("%-28s %4s %-26s %-9s %14s %14s %14s  %s\n", "layer", "m", "config", "source",
              "z12 err/tol", "plain err/tol", "cuBLAS err/tol", "result");
  for (const BenchCase& c : cases) {
    const std::string layer = absl::StrCat(ShapeName(c.shape), " ", c.shape.ToString());
    std::printf("%-28s %4lld %-26s %-9s %14.3f %14.3f %14.3f  %s\n", layer.c_str(),
                static_cast<long long>(c.m),
                (c.weight_format == "z12" ? c.config : "plain: " + c.config).c_str(),
                c.config_source.c_str(), c.z12.max_err_ratio, c.plain.max_err_ratio,
                c.cublas.max_err_ratio, c.ok() ? "ok" : "WRONG");
    ok = ok && c.ok();
    if (!c.fallback_reason.empty()) {
      std::printf("    (kept plain BF16: %s)\n", c.fallback_reason.c_str());
    }
  }
  std::printf("\n4. Speed on %s: median of %d CUDA-graph replays, weights rotated through %lld MiB "
              "per path\n\n",
              gpu.name.c_str(), timing.replays, static_cast<long long>(workload.rotate_bytes >> 20));
  std::printf("%s\n", FormatBenchTable(cases).c_str());
  return ok;
}

int RunDemo(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "gemvz demo: unexpected argument '%s' (see gemvz demo --help)\n",
                 args[0].c_str());
    return 2;
  }
  absl::StatusOr<std::vector<MatrixShape>> shapes =
      ShapesFromFlag(absl::GetFlag(FLAGS_shape), absl::GetFlag(FLAGS_quick));
  absl::StatusOr<TimingOptions> timing = TimingFromFlags();
  const uint64_t seed = SeedFromFlag();
  absl::StatusOr<WorkloadOptions> workload = WorkloadFromFlags(seed);
  for (const absl::Status& st : {shapes.status(), timing.status(), workload.status()}) {
    if (!st.ok()) {
      std::fprintf(stderr, "gemvz demo: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  for (const MatrixShape& s : *shapes) {
    if (absl::Status st = CheckPackableShape(s.n, s.k); !st.ok()) {
      std::fprintf(stderr, "gemvz demo: --shape %s: %s\n", s.ToString().c_str(),
                   std::string(st.message()).c_str());
      return 2;
    }
  }
  const int threads = workload->threads;  // --j, checked by WorkloadFromFlags

  absl::StatusOr<std::string> arch_or = ArchFromFlag(absl::GetFlag(FLAGS_device));
  if (!arch_or.ok()) {
    std::fprintf(stderr, "gemvz demo: %s\n", std::string(arch_or.status().message()).c_str());
    return 2;
  }
  const std::string arch = *arch_or;

  const std::string no_gpu = NoGpuReason();
  DeviceLimits limits = DefaultDeviceLimits();
  std::string device_name;  // the tuning file's entries for this GPU, when there is one
  if (no_gpu.empty()) {
    absl::StatusOr<std::unique_ptr<GpuSession>> session =
        GpuSession::Open(absl::GetFlag(FLAGS_device));
    if (session.ok()) {
      limits = (*session)->info().limits;
      device_name = (*session)->info().name;
    }
  }
  // The kernels, chosen before any work: a bad GEMVZ_FORCE_CONFIG or GEMVZ_WEIGHT_ORDER is a
  // usage error, as in tune and bench.
  absl::StatusOr<std::vector<KernelUse>> uses = KernelsNeeded(*shapes, arch, limits, device_name);
  if (!uses.ok()) {
    std::fprintf(stderr, "gemvz demo: %s\n", std::string(uses.status().message()).c_str());
    return 2;
  }

  std::printf("gemvz demo: %zu layer shape%s, BF16 weights N(0, 1/K), seed %llu\n\n",
              shapes->size(), shapes->size() == 1 ? "" : "s", static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  bool ok = PackAll(*shapes, seed, threads);
  std::fflush(stdout);
  ok = CompileAll(*uses, arch, threads) && ok;
  std::fflush(stdout);

  if (!no_gpu.empty()) {
    std::printf(
        "3. GEMV on a GPU: skipped (no GPU: %s).\n"
        "skipped without a GPU:\n"
        "  - uploading the packed weights to a GPU\n"
        "  - running Gemv at m = 1, 8, 16 on random x and checking it against the CPU reference\n"
        "  - the speed table against cuBLAS BF16 and the plain BF16 kernel\n"
        "Everything above ran without a GPU%s. Run gemvz demo on a machine with an NVIDIA GPU and "
        "its driver for the rest.\n",
        no_gpu.c_str(), ok ? " and is right" : "");
    return ok ? 0 : 1;
  }
  ok = RunOnGpu(*shapes, *timing, *workload) && ok;
  std::printf("%s\n", ok ? "demo: everything is right." : "demo: SOMETHING IS WRONG, see above.");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace gemvz::cli

GEMVZ_REGISTER_COMMAND(demo, "demo",
                       "pack, round-trip, compile and (on a GPU) check and time the suite",
                       gemvz::cli::DemoUsage().c_str(), gemvz::cli::RunDemo,
                       "quick shape arch replays launches rotate_mb seed pdl device j");
