// `gemvz bench`: the compressed GEMV, the library's plain BF16 GEMV, cuBLAS BF16 and the read
// bandwidth ceiling, side by side in one run on one GPU, per (shape, m).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tools/gemvz/bench_flags.h"
#include "tools/gemvz/bench_gpu.h"
#include "tools/gemvz/bench_support.h"
#include "tools/gemvz/command.h"
#include "tools/gemvz/common_flags.h"

ABSL_FLAG(std::string, plot, "", "draw the speedups per shape and m into this PNG (needs gnuplot)");
ABSL_FLAG(std::string, commit, "", "the commit measured, for --json (default: $GEMVZ_COMMIT)");
ABSL_FLAG(std::string, sequence, "",
          "time these shapes' GEMVs one after another (llama3-8b or a list of NxK) instead");

namespace gemvz::cli {
namespace {

const std::string& BenchUsage() {
  static const std::string* usage = new std::string(absl::StrCat(
      "usage: gemvz bench [--shape=NxK] [--m=1,8,16] [--json=FILE] [--plot=FILE.png]\n"
      "                   [--commit=SHA] [--replays=N] [--launches=N] [--rotate_mb=MIB]\n"
      "                   [--seed=N] [--pdl] [--device=N] [--j=N]\n"
      "       gemvz bench --sequence=llama3-8b|NxK,NxK,... [--m=1,8,16] [--json=FILE] ...\n"
      "\n"
      "Measures, side by side in one run on one GPU, for each shape and each m:\n"
      "  z12     the dispatcher's compressed choice: DeviceMatrix::FromBf16 + Gemv (the config\n"
      "          and where it came from are printed; FromBf16 may keep a matrix plain and says\n"
      "          why)\n"
      "  plain   the library's plain BF16 kernel: DeviceMatrix::UploadPlain + Gemv\n"
      "  cuBLAS  cublasGemmEx, BF16 in and out, FP32 compute (libcublas opened at run time)\n"
      "  probe   a read-only kernel streaming the same BF16 copies cuBLAS reads, the fastest of\n"
      "          three forms of it: the ceiling; and the same over as many bytes as the 12-bit\n"
      "          weights take, whose time bounds a 12-bit kernel that streams no faster (its\n"
      "          launch, ramp and tail included): the summary's 'streaming bound'\n"
      "All three GEMVs are checked against a CPU double-precision reference and against each\n"
      "other (see docs/CLI.md for the tolerance). Weights are N(0, 1/K), x is N(0, 1), BF16.\n"
      "Each path rotates through copies of its weights totalling --rotate_mb, so launches read\n"
      "HBM, not the 60 MB L2; each measurement is the median over --replays replays of a CUDA\n"
      "graph of --launches launches, after warm-up.\n"
      "\n"
      "Bytes are counted honestly: z12 = packed weights + side tables + x + out; bf16 = 2*N*K +\n"
      "x + out. TB/s is bytes / time; '% of ceiling' divides by the probe's TB/s.\n"
      "\n"
      "flags:\n"
      "  --shape=NxK         one matrix shape (default: DESIGN.md's suite of 7 shapes)\n"
      "  --m=LIST            comma-separated activation rows (default 1,8,16)\n"
      "  --json=FILE         also write every number as JSON (schema gemvz.bench/1, docs/CLI.md)\n"
      "  --plot=FILE.png     draw speedup over cuBLAS and over plain per (shape, m) with gnuplot,\n"
      "                      if it is installed (default: no chart)\n"
      "  --commit=SHA        the commit measured, recorded in --json (default: $GEMVZ_COMMIT)\n"
      "  --sequence=LIST     instead of timing each shape alone, time the shapes' GEMVs one\n"
      "                      after another in one CUDA graph, as in a decode step: llama3-8b\n"
      "                      (one layer: qkv, o, gate_up, down) or comma-separated NxK shapes.\n"
      "                      Per m it prints the time of one pass for z12 and plain BF16, each\n"
      "                      launched plainly and with programmatic dependent launch, and for\n"
      "                      cuBLAS; --json writes schema gemvz.sequence/1 (default: off)\n",
      kZeroRowsFlagUsage, kExceptionRowsFlagUsage, kMeasureFlagsUsage,
      "\n"
      "Needs a GPU; without one it exits 1 and writes nothing. Exit status: 0 when every result\n"
      "is right, 1 when a check fails or something cannot run, 2 for a usage error.\n"
      "\n"
      "examples:\n"
      "  gemvz bench\n"
      "  gemvz bench --shape=4096x8192 --m=1,8,16\n"
      "  gemvz bench --json=bench.json --plot=bench.png --commit=$(git rev-parse HEAD)\n"
      "  gemvz bench --sequence=llama3-8b --json=layer.json\n"));
  return *usage;
}

int RunSequence(const BenchTools& tools, const std::vector<MatrixShape>& shapes,
                const std::vector<int64_t>& ms, const BenchEnvironment& env,
                const std::string& json_path) {
  std::vector<std::string> names;
  for (const MatrixShape& s : shapes) {
    names.push_back(s.name.empty() ? s.ToString() : absl::StrCat(s.name, " ", s.ToString()));
  }
  std::printf("sequence of %zu GEMVs: %s\n\n", shapes.size(), absl::StrJoin(names, ", ").c_str());
  absl::StatusOr<std::vector<SequenceCase>> cases = BenchSequence(tools, shapes, ms);
  if (!cases.ok()) {
    std::fprintf(stderr, "gemvz bench: %s\n", std::string(cases.status().message()).c_str());
    return 1;
  }
  std::printf("%s", FormatSequenceTable(*cases).c_str());
  bool ok = true;
  for (const SequenceCase& c : *cases) ok = ok && c.ok;
  if (!ok) std::printf("\nSOME RESULTS ARE WRONG: see stderr.\n");
  if (!json_path.empty()) {
    ok = WriteJsonReport("bench", json_path, SequenceReportToJson(env, shapes, *cases)) && ok;
  }
  return ok ? 0 : 1;
}

int RunBench(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "gemvz bench: unexpected argument '%s' (see gemvz bench --help)\n",
                 args[0].c_str());
    return 2;
  }
  // Everything the command line says is checked before anything long starts.
  absl::StatusOr<std::vector<MatrixShape>> shapes =
      ShapesFromFlag(absl::GetFlag(FLAGS_shape), /*quick=*/false);
  absl::StatusOr<std::vector<int64_t>> ms = ParseMList(absl::GetFlag(FLAGS_m));
  absl::StatusOr<TimingOptions> timing = TimingFromFlags();
  absl::StatusOr<WorkloadOptions> workload = WorkloadFromFlags(0);
  for (const absl::Status& st :
       {shapes.status(), ms.status(), timing.status(), workload.status()}) {
    if (!st.ok()) {
      std::fprintf(stderr, "gemvz bench: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  const std::string json_path = absl::GetFlag(FLAGS_json);
  const std::string plot_path = absl::GetFlag(FLAGS_plot);
  const std::string sequence_flag = absl::GetFlag(FLAGS_sequence);
  absl::StatusOr<std::vector<MatrixShape>> sequence = std::vector<MatrixShape>{};
  if (!sequence_flag.empty()) {
    sequence = SequenceFromFlag(sequence_flag);
    if (!sequence.ok()) {
      std::fprintf(stderr, "gemvz bench: %s\n", std::string(sequence.status().message()).c_str());
      return 2;
    }
    if (!absl::GetFlag(FLAGS_shape).empty() || !plot_path.empty() || absl::GetFlag(FLAGS_pdl)) {
      std::fprintf(stderr,
                   "gemvz bench: --sequence takes its shapes from its own list, draws no chart and "
                   "measures with and without PDL itself: drop --shape, --plot and --pdl\n");
      return 2;
    }
  }
  for (const absl::Status& st :
       {ZeroRowsFromFlag(sequence->empty() ? *shapes : *sequence, &*workload),
        ExceptionRowsFromFlag(sequence->empty() ? *shapes : *sequence, &*workload),
        CheckOutputFile("json", json_path), CheckOutputFile("plot", plot_path),
        CheckOutputIsNoneOf("plot", plot_path, {{"the --json file", json_path}})}) {
    if (!st.ok()) {
      std::fprintf(stderr, "gemvz bench: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  if (!plot_path.empty() && FindOnPath("gnuplot").empty()) {
    std::fprintf(stderr,
                 "gemvz bench: note: --plot needs gnuplot, which is not installed (Debian/Ubuntu: "
                 "apt-get install gnuplot-nox); the benchmark runs, the chart will not be drawn\n");
  }

  const std::string no_gpu = NoGpuReason();
  if (!no_gpu.empty()) {
    std::fprintf(stderr,
                 "gemvz bench: a GPU is needed to benchmark, and none can be used here (%s).\n"
                 "Nothing was measured%s.\n",
                 no_gpu.c_str(), json_path.empty() ? "" : " and no JSON was written");
    return 1;
  }

  workload->seed = SeedFromFlag();
  absl::StatusOr<std::unique_ptr<BenchStack>> stack =
      OpenBenchStack(absl::GetFlag(FLAGS_device), *timing, *workload);
  if (!stack.ok()) {
    std::fprintf(stderr, "gemvz bench: %s\n", std::string(stack.status().message()).c_str());
    return 1;
  }
  const BenchTools& tools = (*stack)->tools;
  BenchReport report;
  report.env = DescribeEnvironment(tools, CommitFrom(absl::GetFlag(FLAGS_commit)));
  const BenchEnvironment& env = report.env;
  std::printf("gemvz bench on %s (%s, %d SMs), driver %s (CUDA %s), %s\n", env.gpu_name.c_str(),
              env.arch.c_str(), env.sm_count,
              env.driver_version.empty() ? "?" : env.driver_version.c_str(),
              env.cuda_driver_api.c_str(), env.cublas_library.c_str());
  std::printf("seed %llu, %d replays of >= %d launches, weights rotated through %lld MiB per path%s\n\n",
              static_cast<unsigned long long>(env.seed), tools.timing.replays,
              tools.timing.min_launches, static_cast<long long>(env.rotate_bytes >> 20),
              env.pdl ? ", z12 and plain with programmatic dependent launch (--pdl)" : "");
  std::fflush(stdout);
  if (!sequence->empty()) return RunSequence(tools, *sequence, *ms, env, json_path);

  std::vector<std::string> errors;
  for (const MatrixShape& shape : *shapes) {
    absl::StatusOr<std::vector<BenchCase>> cases = BenchShape(tools, shape, *ms);
    if (!cases.ok()) {
      const std::string line = absl::StrCat(shape.ToString(), ": ", cases.status().message());
      Progress(absl::StrCat("[bench] FAILED ", line));
      errors.push_back(line);
      continue;
    }
    for (BenchCase& c : *cases) {
      Progress(absl::StrFormat(
          "[bench] %s m=%d: z12 %.2f us, plain %.2f us, cuBLAS %.2f us, probe %.2f us: %.3fx over "
          "cuBLAS, %.1f%% of ceiling%s",
          shape.ToString(), c.m, c.z12.time_us, c.plain.time_us, c.cublas.time_us,
          c.probe.time_us, c.SpeedupVsCublas(), c.PercentOfCeiling(c.z12),
          c.ok() ? "" : "  (WRONG RESULT)"));
      report.cases.push_back(std::move(c));
    }
  }

  std::printf("%s", FormatBenchTable(report.cases).c_str());
  bool ok = errors.empty();
  for (const BenchCase& c : report.cases) ok = ok && c.ok();
  for (const std::string& e : errors) std::printf("error: %s\n", e.c_str());
  if (!ok) std::printf("\nSOME RESULTS ARE WRONG OR MISSING: see the lines above and stderr.\n");

  if (!json_path.empty()) {
    nlohmann::json doc = BenchReportToJson(report);
    doc["errors"] = errors;
    doc["ok"] = ok;
    ok = WriteJsonReport("bench", json_path, doc) && ok;
  }
  if (!plot_path.empty()) {
    const std::string title = absl::StrFormat("gemvz z12 GEMV speedup, %s, %s", env.gpu_name,
                                              env.date);
    if (absl::Status st = PlotSpeedups(report.cases, title, plot_path); !st.ok()) {
      // The chart is optional: its absence does not fail the run.
      std::fprintf(stderr, "gemvz bench: %s\n", std::string(st.message()).c_str());
    } else {
      std::printf("wrote %s\n", plot_path.c_str());
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace gemvz::cli

GEMVZ_REGISTER_COMMAND(
    bench, "bench", "time z12 vs plain BF16 vs cuBLAS vs the bandwidth ceiling on the GPU",
    gemvz::cli::BenchUsage().c_str(), gemvz::cli::RunBench,
    "shape m json plot commit sequence zero_rows exception_rows replays launches "
    "rotate_mb "
    "seed pdl device j");
