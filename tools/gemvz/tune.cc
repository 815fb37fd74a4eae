// `gemvz tune`: try any kernel configuration without rebuilding. Compiles it on first use, checks
// it against the CPU reference, times it next to the dispatcher's choice; --sweep ranks a whole
// space; --save writes the winners to the tuning file that the dispatcher reads.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gemvz/config.h"
#include "gemvz/dispatch.h"
#include "gemvz/gemv.h"
#include "gemvz/runtime.h"
#include "nlohmann/json.hpp"
#include "runtime/common/file_util.h"
#include "runtime/dispatch/dispatcher.h"
#include "runtime/gemv/device_state.h"
#include "runtime/jit/config_list.h"
#include "runtime/jit/kernel_cache.h"
#include "tools/gemvz/bench_flags.h"
#include "tools/gemvz/bench_gpu.h"
#include "tools/gemvz/bench_support.h"
#include "tools/gemvz/command.h"
#include "tools/gemvz/common_flags.h"

ABSL_FLAG(bool, sweep, false, "tune: time every configuration of gemvz::SweepSpace for the shape");
ABSL_FLAG(std::string, space, "",
          "tune: sweep the configurations in this file (one per line, # comments) instead");
ABSL_FLAG(std::string, sweep_format, "z12", "tune: the weight format --sweep explores (z12, bf16)");
ABSL_FLAG(bool, save, false, "tune: write the winners to the tuning file the dispatcher reads");
ABSL_FLAG(int, top, 20, "tune: ranking lines printed per (shape, m); 0 prints all");

namespace gemvz::cli {
namespace {

const std::string& TuneUsage() {
  static const std::string* usage = new std::string(absl::StrCat(
      "usage: gemvz tune [--shape=NxK] [--m=LIST] --config=CONFIG [--save] [--json=FILE]\n"
      "       gemvz tune [--shape=NxK] [--m=LIST] --sweep [--sweep_format=z12|bf16] [--top=N]\n"
      "                  [--save] [--json=FILE]\n"
      "       gemvz tune [--shape=NxK] [--m=LIST] --space=FILE [--top=N] [--save] [--json=FILE]\n"
      "\n"
      "Tries kernel configurations without rebuilding anything. Each one is checked against the\n"
      "shape first, as one launch of the chunks a Gemv call of m rows runs in (m above 32: equal\n"
      "chunks of at most 32; fewer token blocks than m needs: chunks of 8*nb) (gemvz::Validate;\n"
      "an invalid one is reported with the rule it breaks and skipped), compiled by NVRTC at\n"
      "first use (or found in the disk cache), run once and checked against a CPU\n"
      "double-precision reference, then timed like gemvz bench (CUDA graphs, weights rotated\n"
      "through --rotate_mb, median of --replays) together with the dispatcher's own choice and\n"
      "the other configurations of the same (shape, m), replay by replay in turn, so that none\n"
      "runs in a hotter, power-capped stretch than another.\n"
      "\n"
      "A configuration reads FORMAT.nwW.ugU.nbB.pipeP[.rbR][.gm][.sS], e.g.\n"
      "z12.nw8.ug2.nb1.pipe3.s1: FORMAT z12 or bf16; nw streaming warps per CTA; ug 64-wide K\n"
      "  groups per loop trip; nb 8-row token blocks per launch (covers m <= 8*nb); pipe 0/3\n"
      "  plain loop, 1/2 software pipelined, 4..8 (z12) plain loop capped to pipe-2 CTAs'\n"
      "  registers, 9..13 (z12) rolling loop capped to pipe-7 CTAs' registers; rb (z12, 1,\n"
      "  2 or 4, written only when not 1; 4 with S = 1 only) 16-row blocks per CTA sharing\n"
      "  x's loads; gm (z12) reads group-major weights; s split-K factor (default 1).\n"
      "\n"
      "The 12-bit weights are uploaded in the order a DeviceMatrix upload takes for the shape\n"
      "(GEMVZ_WEIGHT_ORDER=block or group, else the order of the tuned entries for it,\n"
      "gemvz::PreferredOrder), and every 12-bit configuration runs, and is saved, in that order\n"
      "(with .gm or without); tune says so when that changes what was asked.\n"
      "\n"
      "flags:\n"
      "  --shape=NxK         the matrix shape (default: every shape of DESIGN.md's suite)\n"
      "  --m=LIST            comma-separated activation rows (default 1,8,16)\n"
      "  --config=CONFIG     time this one configuration (default: none; give it or --sweep)\n"
      "  --sweep             time every configuration of gemvz::SweepSpace for each (shape, m)\n"
      "                      and print the ranking (default false)\n"
      "  --sweep_format=F    the format --sweep explores: z12 or bf16 (default z12); with --sweep\n"
      "                      only\n"
      "  --space=FILE        sweep the configurations listed in FILE instead, one per line;\n"
      "                      # starts a comment, blank lines and a UTF-8 byte order mark at\n"
      "                      the start are skipped (implies --sweep); one listed twice is timed\n"
      "                      once, where it first comes; more than 16 MiB (/dev/zero) is a\n"
      "                      usage error\n"
      "  --top=N             ranking lines printed per (shape, m); 0 prints all (default 20)\n"
      "  --save              write the winner of each (shape, m, format), the fastest correct\n"
      "                      configuration measured (the dispatcher's own choice included), to\n"
      "                      the tuning file ($GEMVZ_TUNING_FILE, else <cache dir>/tuning.json)\n"
      "                      with gemvz::SaveTunedChoices: later processes use it with no\n"
      "                      rebuild; whether it can be written is checked first (default false)\n"
      "  --json=FILE         write every measurement as JSON (schema gemvz.tune/1, docs/CLI.md)\n"
      "  --arch=sm_XX        compile for this architecture (default: $GEMVZ_ARCH, else the\n"
      "                      GPU's, else sm_90)\n",
      kZeroRowsFlagUsage, kExceptionRowsFlagUsage, kMeasureFlagsUsage,
      "\n"
      "Without a GPU, tune validates and compiles (useful to check that a configuration builds),\n"
      "then exits 1 saying that checking and timing need a GPU. Exit status: 0 when every valid\n"
      "configuration compiled and gave the right result, 1 otherwise, 2 for a usage error\n"
      "(including a --config that is invalid for every shape asked, or a --sweep or --space\n"
      "with no configuration valid for any).\n"
      "\n"
      "examples:\n"
      "  gemvz tune --shape=4096x8192 --m=8 --config=z12.nw8.ug2.nb1.pipe3.s1\n"
      "  gemvz tune --shape=28672x4096 --m=1,8,16 --sweep --top=10\n"
      "  gemvz tune --sweep --save                  # the whole suite; the dispatcher follows\n"
      "  gemvz tune --shape=4096x4096 --m=16 --space=my_configs.txt --json=tune.json\n"));
  return *usage;
}

struct Candidate {
  KernelConfig config;
  std::string invalid;        // the rule Validate says it breaks
  std::string compile_error;  // NVRTC's complaint
  std::optional<PrecompileResult> compiled;
  std::string run_error;
  bool ran = false;
  ErrorCheck check;
  double time_us = 0;
  int64_t bytes = 0;
  bool usable() const { return ran && check.ok() && time_us > 0; }
};

struct TuneCase {
  MatrixShape shape;
  int64_t m = 0;
  WeightFormat format = WeightFormat::kZ12;
  std::vector<Candidate> candidates;
  // The dispatcher's own choice, timed the same way.
  std::string baseline_error;
  Candidate baseline;
  std::string baseline_source;
  std::string fallback_reason;
  // The fastest usable configuration, the baseline included.
  const Candidate* Winner() const {
    const Candidate* best = baseline.usable() ? &baseline : nullptr;
    for (const Candidate& c : candidates) {
      if (c.usable() && (best == nullptr || c.time_us < best->time_us)) best = &c;
    }
    return best;
  }
};

absl::StatusOr<WeightFormat> ParseFormat(const std::string& text) {
  if (text == "z12") return WeightFormat::kZ12;
  if (text == "bf16") return WeightFormat::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("bad --sweep_format '", text, "': expected z12 or bf16"));
}

// The configurations of a --space file; lines that do not parse are reported and skipped.
absl::StatusOr<std::vector<KernelConfig>> ReadSpaceFile(const std::string& path) {
  absl::StatusOr<std::string> content = internal::ReadFile(path, internal::kMaxConfigListBytes);
  if (!content.ok()) {
    return absl::Status(content.status().code(),
                        absl::StrCat("--space: ", content.status().message()));
  }
  std::vector<KernelConfig> configs;
  int number = 0;
  const std::string_view text = internal::WithoutUtf8Bom(*content);
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++number;
    const std::string entry(internal::ConfigLineText(std::string_view(line.data(), line.size())));
    if (entry.empty()) continue;
    absl::StatusOr<KernelConfig> config = KernelConfig::Parse(entry);
    if (!config.ok()) {
      std::fprintf(stderr, "gemvz tune: %s:%d: skipped: %s\n", path.c_str(), number,
                   std::string(config.status().message()).c_str());
      continue;
    }
    configs.push_back(*config);
  }
  if (configs.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--space ", path, ": no valid configuration in the file"));
  }
  return configs;
}

// --save's tuning file, checked before any work: there must be one, SaveTunedChoices must be able
// to make what is missing of its directories and write beside it (a temporary file and a lock
// file), and a file already there must be one it reads (a corrupt one it replaces).
absl::Status CheckTuningFileForSave() {
  const std::string path = TuningFilePath();
  if (path.empty()) {
    return absl::FailedPreconditionError(
        "--save: no tuning file to write: the disk cache is disabled (GEMVZ_DISABLE_DISK_CACHE) "
        "and GEMVZ_TUNING_FILE is not set");
  }
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--save: cannot write the tuning file '", path, "': ", why));
  };
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return bad("it is a directory");
  // The nearest of its directories that exists; the others are made at the save.
  std::string dir = internal::DirName(path);
  while (::stat(dir.c_str(), &st) != 0) {
    if ((errno != ENOENT && errno != ENOTDIR) || internal::DirName(dir) == dir) {
      return bad(absl::StrCat("'", dir, "': ", std::strerror(errno)));
    }
    dir = internal::DirName(dir);
  }
  if (!S_ISDIR(st.st_mode)) return bad(absl::StrCat("'", dir, "' is not a directory"));
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return bad(absl::StrCat("cannot create files in '", dir, "': ", std::strerror(errno)));
  }
  if (absl::StatusOr<std::vector<TunedChoice>> existing = LoadTunedChoices();
      !existing.ok() && !absl::IsDataLoss(existing.status())) {
    return bad(std::string(existing.status().message()));
  }
  return absl::OkStatus();
}

std::string Label(const TuneCase& c) {
  return absl::StrFormat("%s%s m=%d %s", c.shape.ToString(),
                         c.shape.name.empty() ? "" : absl::StrCat(" (", c.shape.name, ")"), c.m,
                         FormatName(c.format));
}

// Compiles every distinct valid kernel once, in parallel; a failing one is found and marked
// without stopping the others.
void CompileCandidates(std::vector<TuneCase>* cases, const std::string& arch, int threads) {
  std::map<std::string, KernelConfig> kernels;
  for (const TuneCase& c : *cases) {
    for (const Candidate& cand : c.candidates) {
      if (cand.invalid.empty()) kernels.emplace(cand.config.KernelName(), cand.config);
    }
  }
  std::vector<KernelConfig> configs;
  for (const auto& [name, config] : kernels) configs.push_back(config);
  std::map<std::string, PrecompileResult> done;
  std::map<std::string, std::string> failed;
  if (!configs.empty()) {
    Progress(absl::StrFormat("[tune] compiling %d kernels for %s", configs.size(), arch));
    // Every one is tried, --j at a time, whatever fails: a failure is only that kernel's.
    std::vector<absl::StatusOr<PrecompileResult>> each = internal::PrecompileEach(
        configs, arch, threads, /*stop_on_error=*/false,
        [](int n, int total, const PrecompileResult& r) {
          Progress(absl::StrFormat("[tune]   %d/%d %s: %.0f ms%s", n, total, r.config.KernelName(),
                                   r.millis, r.from_disk ? " (disk cache)" : ""));
        });
    for (size_t i = 0; i < configs.size(); ++i) {
      const std::string name = configs[i].KernelName();
      if (each[i].ok()) {
        done.emplace(name, *each[i]);
      } else {
        Progress(absl::StrFormat("[tune]   %s: compile FAILED", name));
        failed.emplace(name, std::string(each[i].status().message()));
      }
    }
  }
  for (TuneCase& c : *cases) {
    for (Candidate& cand : c.candidates) {
      if (!cand.invalid.empty()) continue;
      const std::string name = cand.config.KernelName();
      if (auto it = done.find(name); it != done.end()) cand.compiled = it->second;
      if (auto it = failed.find(name); it != failed.end()) cand.compile_error = it->second;
    }
  }
}

// Every candidate (the dispatcher's choice first) is checked against the reference and captured,
// then all are timed together, replay by replay in turn (GraphTimer), so that none is timed in
// a hotter, power-capped stretch than another.
void TimeCase(ShapeWorkload* work, const TimingOptions& timing, TuneCase* c) {
  const std::string label = Label(*c);
  absl::StatusOr<const std::vector<DeviceMatrix>*> copies = work->ForFormat(c->format);
  if (!copies.ok()) {
    c->baseline_error = std::string(copies.status().message());
    return;
  }
  const DeviceMatrix& first = (**copies)[0];
  c->fallback_reason = first.fallback_reason();
  const int64_t bytes = first.weight_bytes() + ActivationBytes(c->m, c->shape);
  GraphTimer timer(work->stream());
  std::vector<std::pair<Candidate*, int>> captured;  // (candidate, graph)
  auto check_and_capture = [&](Candidate* cand, const GemvOptions& options) {
    cand->bytes = bytes;
    absl::StatusOr<ShapeWorkload::GemvRun> r =
        work->CheckAndCaptureGemv(&timer, **copies, c->m, options, timing);
    if (!r.ok()) {
      cand->run_error = std::string(r.status().message());
      return;
    }
    cand->check = r->check;
    captured.push_back({cand, r->graph});
  };
  absl::StatusOr<GemvPlan> plan = PlanGemv(first, c->m);
  if (!plan.ok()) {
    c->baseline_error = std::string(plan.status().message());
  } else {
    c->baseline.config = plan->config;
    c->baseline_source = plan->source;
    Progress(absl::StrFormat("[tune] %s: the dispatcher's %s (%s)", label,
                             plan->config.ToString(), plan->source));
    check_and_capture(&c->baseline, GemvOptions{});
    if (!c->baseline.run_error.empty()) c->baseline_error = c->baseline.run_error;
  }
  for (Candidate& cand : c->candidates) {
    if (!cand.invalid.empty() || !cand.compile_error.empty()) continue;
    Progress(absl::StrFormat("[tune] %s: %s", label, cand.config.ToString()));
    GemvOptions options;
    options.config = cand.config;
    check_and_capture(&cand, options);
  }
  if (captured.empty()) return;
  Progress(absl::StrFormat("[tune] %s: timing %d configurations in turn", label,
                           static_cast<int>(captured.size())));
  // A round of a few hundred candidates takes seconds: say how far it is every few seconds.
  const absl::Time start = absl::Now();
  absl::Time last = start;
  absl::StatusOr<std::vector<double>> us = timer.MedianMicros(timing, [&](int done, int total) {
    const absl::Time now = absl::Now();
    if (done == total || now - last < absl::Seconds(3)) return;
    last = now;
    Progress(absl::StrFormat("[tune] %s:   round %d/%d of every configuration, %.0f s", label, done,
                             total, absl::ToDoubleSeconds(now - start)));
  });
  for (const auto& [cand, graph] : captured) {
    if (!us.ok()) {
      cand->run_error = std::string(us.status().message());
      if (cand == &c->baseline) c->baseline_error = cand->run_error;
      continue;
    }
    cand->ran = true;
    cand->time_us = (*us)[graph];
  }
}

void PrintCase(const TuneCase& c, int top) {
  std::printf("%s\n", Label(c).c_str());
  if (!c.fallback_reason.empty()) {
    std::printf("  note: the weights stayed plain BF16: %s\n", c.fallback_reason.c_str());
  }
  if (!c.baseline_error.empty()) {
    std::printf("  dispatcher's choice: FAILED: %s\n", c.baseline_error.c_str());
  } else if (c.baseline.ran) {
    std::printf("  dispatcher's choice: %s (%s): %.2f us, %s\n",
                c.baseline.config.ToString().c_str(), c.baseline_source.c_str(),
                c.baseline.time_us, c.baseline.check.ToString().c_str());
  }
  std::vector<const Candidate*> ranked;
  for (const Candidate& cand : c.candidates) {
    if (cand.usable()) ranked.push_back(&cand);
  }
  std::sort(ranked.begin(), ranked.end(),
            [](const Candidate* a, const Candidate* b) { return a->time_us < b->time_us; });
  if (!ranked.empty()) {
    std::printf("  %4s  %-28s %9s %7s %10s %5s %7s  %s\n", "rank", "config", "time us", "TB/s",
                "vs disp.", "regs", "spill B", "check |err|/tol");
  }
  const double base_us = c.baseline.usable() ? c.baseline.time_us : 0;
  for (size_t i = 0; i < ranked.size(); ++i) {
    if (top > 0 && static_cast<int>(i) >= top) {
      std::printf("  ... %zu more (--top=0 prints all)\n", ranked.size() - i);
      break;
    }
    const Candidate& r = *ranked[i];
    const double tbps = TeraBytesPerSecond(r.bytes, r.time_us);
    std::printf("  %4zu  %-28s %9.2f %7.2f %9.3fx %5d %7d  %.3f%s\n", i + 1,
                r.config.ToString().c_str(), r.time_us, tbps,
                base_us > 0 ? base_us / r.time_us : 0.0, r.compiled ? r.compiled->registers : -1,
                r.compiled ? r.compiled->spill_bytes : -1, r.check.max_ratio,
                r.config == c.baseline.config ? "  (the dispatcher's)" : "");
  }
  for (const Candidate& cand : c.candidates) {
    if (!cand.invalid.empty()) {
      std::printf("  skipped: %s\n", cand.invalid.c_str());  // names the config and rule
    } else if (!cand.compile_error.empty()) {
      std::printf("  compile FAILED  %s: %s\n", cand.config.ToString().c_str(),
                  cand.compile_error.c_str());
    } else if (!cand.run_error.empty()) {
      std::printf("  run FAILED  %s: %s\n", cand.config.ToString().c_str(),
                  cand.run_error.c_str());
    } else if (cand.ran && !cand.check.ok()) {
      std::printf("  WRONG  %s: %s\n", cand.config.ToString().c_str(),
                  cand.check.ToString().c_str());
    }
  }
  if (const Candidate* w = c.Winner()) {
    std::printf("  winner: %s, %.2f us%s\n", w->config.ToString().c_str(), w->time_us,
                w == &c.baseline ? " (the dispatcher's choice stands)" : "");
  }
  std::printf("\n");
}

nlohmann::json CandidateJson(const Candidate& c) {
  nlohmann::json j = {{"config", c.config.ToString()}};
  if (!c.invalid.empty()) j["invalid"] = c.invalid;
  if (!c.compile_error.empty()) j["compile_error"] = c.compile_error;
  if (!c.run_error.empty()) j["run_error"] = c.run_error;
  if (c.compiled) {
    j["compile"] = {{"from_disk", c.compiled->from_disk},
                    {"millis", c.compiled->millis},
                    {"registers", c.compiled->registers},
                    {"spill_bytes", c.compiled->spill_bytes},
                    {"shared_bytes", c.compiled->shared_bytes}};
  }
  if (c.ran) {
    j["time_us"] = c.time_us;
    j["bytes"] = c.bytes;
    j["tbps"] = TeraBytesPerSecond(c.bytes, c.time_us);
    j["max_err_ratio"] = c.check.max_ratio;
    j["check_ok"] = c.check.ok();
  }
  return j;
}

int RunTune(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "gemvz tune: unexpected argument '%s' (see gemvz tune --help)\n",
                 args[0].c_str());
    return 2;
  }
  auto usage_error = [](const std::string& message) {
    std::fprintf(stderr, "gemvz tune: %s\n", message.c_str());
    return 2;
  };
  absl::StatusOr<std::vector<MatrixShape>> shapes =
      ShapesFromFlag(absl::GetFlag(FLAGS_shape), /*quick=*/false);
  absl::StatusOr<std::vector<int64_t>> ms = ParseMList(absl::GetFlag(FLAGS_m));
  absl::StatusOr<TimingOptions> timing = TimingFromFlags();
  absl::StatusOr<WorkloadOptions> workload = WorkloadFromFlags(0);
  absl::StatusOr<WeightFormat> sweep_format = ParseFormat(absl::GetFlag(FLAGS_sweep_format));
  for (const absl::Status& st : {shapes.status(), ms.status(), timing.status(), workload.status(),
                                 sweep_format.status()}) {
    if (!st.ok()) return usage_error(std::string(st.message()));
  }
  for (const absl::Status& st :
       {ZeroRowsFromFlag(*shapes, &*workload), ExceptionRowsFromFlag(*shapes, &*workload)}) {
    if (!st.ok()) return usage_error(std::string(st.message()));
  }
  for (const absl::Status& st :
       {CheckOutputFile("json", absl::GetFlag(FLAGS_json)),
        CheckOutputIsNoneOf("json", absl::GetFlag(FLAGS_json),
                            {{"the --space file", absl::GetFlag(FLAGS_space)},
                             {"the tuning file that --save writes",
                              absl::GetFlag(FLAGS_save) ? TuningFilePath() : std::string()}})}) {
    if (!st.ok()) return usage_error(std::string(st.message()));
  }
  if (absl::GetFlag(FLAGS_save)) {
    if (absl::Status st = CheckTuningFileForSave(); !st.ok()) {
      return usage_error(std::string(st.message()));
    }
  }
  if (absl::GetFlag(FLAGS_top) < 0) {
    return usage_error(absl::StrCat("bad --top=", absl::GetFlag(FLAGS_top),
                                    ": expected 0 (every line) or more"));
  }
  const std::string config_text = absl::GetFlag(FLAGS_config);
  const std::string space_path = absl::GetFlag(FLAGS_space);
  const bool sweep = absl::GetFlag(FLAGS_sweep) || !space_path.empty();
  if (config_text.empty() == !sweep) {
    return usage_error(config_text.empty()
                           ? "give --config=CONFIG, or --sweep / --space=FILE (see --help)"
                           : "--config and --sweep/--space exclude each other");
  }
  // Only --sweep's space is chosen by format; a value given anyway would be ignored in silence.
  if (FlagGiven("sweep_format") && (!absl::GetFlag(FLAGS_sweep) || !space_path.empty())) {
    return usage_error(
        "--sweep_format chooses what --sweep explores; --config and --space name their "
        "configurations themselves");
  }
  std::optional<KernelConfig> single;
  if (!config_text.empty()) {
    absl::StatusOr<KernelConfig> parsed = KernelConfig::Parse(config_text);
    if (!parsed.ok()) return usage_error(absl::StrCat("--config: ", parsed.status().message()));
    single = *parsed;
  }
  std::optional<std::vector<KernelConfig>> space;
  if (!space_path.empty()) {
    absl::StatusOr<std::vector<KernelConfig>> read = ReadSpaceFile(space_path);
    if (!read.ok()) return usage_error(std::string(read.status().message()));
    space = *read;
  }
  absl::StatusOr<std::string> arch_or = ArchFromFlag(absl::GetFlag(FLAGS_device));
  if (!arch_or.ok()) return usage_error(std::string(arch_or.status().message()));
  const std::string arch = *arch_or;
  if (absl::GetFlag(FLAGS_save)) {
    // The tuning file keys one launch's rows. A winner timed over several launches (m above 32)
    // is not that launch's winner: a configuration with fewer token blocks runs more launches at
    // this m than at the key's. So such an m is timed and ranked, not saved; said before the work.
    std::vector<std::string> unsaved;
    for (const int64_t m : *ms) {
      if (const int64_t rows = internal::LaunchRowsFor(m); rows != m) {
        unsaved.push_back(absl::StrFormat(
            "m = %d is not saved: it runs as launches of %d rows; tune --m=%d to choose their "
            "configuration",
            m, rows, rows));
      }
    }
    const bool none = unsaved.size() == ms->size();
    for (const std::string& line : unsaved) {
      std::fprintf(stderr, "gemvz tune: %s--save: %s\n", none ? "" : "note: ", line.c_str());
    }
    if (none) {
      return usage_error(
          "--save: no m asked can be saved (the tuning file keys one launch's rows, 32 at most)");
    }
  }

  // The GPU, when there is one, sets the limits, the architecture and the timing.
  const std::string no_gpu = NoGpuReason();
  std::unique_ptr<GpuSession> session;
  if (no_gpu.empty()) {
    absl::StatusOr<std::unique_ptr<GpuSession>> opened = GpuSession::Open(absl::GetFlag(FLAGS_device));
    if (!opened.ok()) {
      std::fprintf(stderr, "gemvz tune: %s\n", std::string(opened.status().message()).c_str());
      return 1;
    }
    session = std::move(*opened);
  }
  const DeviceLimits limits = session ? session->info().limits : DefaultDeviceLimits();
  if (session && arch != session->info().arch) {
    std::fprintf(stderr,
                 "gemvz tune: note: compiling for --arch=%s too, but the GPU runs %s kernels: "
                 "those are the ones timed and saved\n",
                 arch.c_str(), session->info().arch.c_str());
  }

  // One case per (shape, m, format); each candidate checked against the rules first.
  std::vector<TuneCase> cases;
  int invalid_single = 0;
  const std::string run_arch = session ? session->info().arch : arch;
  for (const MatrixShape& shape : *shapes) {
    // The 12-bit weights are uploaded in the order DeviceMatrix::Upload picks for the shape
    // (GEMVZ_WEIGHT_ORDER, else the dispatcher's PreferredOrder), and every 12-bit candidate runs
    // in that order: a kernel reads one order only.
    absl::StatusOr<WeightOrder> order =
        internal::ResolveOrder(std::nullopt, run_arch, shape.n, shape.k,
                               session ? session->info().name : std::string());
    if (!order.ok()) {
      std::fprintf(stderr, "gemvz tune: %s\n", std::string(order.status().message()).c_str());
      return 2;
    }
    bool reordered = false;
    for (const int64_t m : *ms) {
      const GemvShape gshape{m, shape.n, shape.k};
      std::vector<KernelConfig> configs;
      if (single) {
        configs = {*single};
      } else if (space) {
        configs = *space;
      } else {
        configs = SweepSpace(gshape, *sweep_format);
      }
      // Each configuration once, where it first comes: a space may list one twice, spelt alike
      // or not (.s1 is the default), or twice once in the weight order (with .gm and without).
      std::vector<KernelConfig> distinct;
      std::set<std::string> seen;
      for (const KernelConfig& config : configs) {
        const KernelConfig in_order = internal::InOrder(config, *order);
        reordered = reordered || in_order != config;
        if (seen.insert(in_order.ToString()).second) distinct.push_back(in_order);
      }
      configs = std::move(distinct);
      std::map<WeightFormat, TuneCase> by_format;
      for (const KernelConfig& config : configs) {
        TuneCase& c = by_format[config.format];
        c.shape = shape;
        c.m = m;
        c.format = config.format;
        Candidate cand;
        cand.config = config;
        // Checked as the call runs it: one launch of its chunk of m (internal::LaunchShape).
        if (absl::Status st = Validate(config, internal::LaunchShape(gshape, config), limits);
            !st.ok()) {
          cand.invalid = std::string(st.message());
          if (single) {
            ++invalid_single;
            std::fprintf(stderr, "gemvz tune: %s\n", cand.invalid.c_str());
          }
        }
        c.candidates.push_back(std::move(cand));
      }
      if (configs.empty()) {
        std::fprintf(stderr, "gemvz tune: no configuration to try for %s\n",
                     gshape.ToString().c_str());
      }
      for (auto& [format, c] : by_format) cases.push_back(std::move(c));
    }
    if (reordered) {
      std::fprintf(stderr,
                   "gemvz tune: note: %s's 12-bit weights are uploaded %s-major here, so its "
                   "configurations run as %s-major ones (GEMVZ_WEIGHT_ORDER=block or group "
                   "chooses)\n",
                   shape.ToString().c_str(), std::string(OrderName(*order)).c_str(),
                   std::string(OrderName(*order)).c_str());
    }
  }
  if (single && invalid_single == static_cast<int>(cases.size())) {
    std::fprintf(stderr, "gemvz tune: nothing to try: %s breaks a rule for every shape asked\n",
                 single->ToString().c_str());
    return 2;
  }
  // So is a sweep with no configuration valid for any (shape, m) asked: it would time only the
  // dispatcher's choices and rank nothing, and a GPU run would end with status 0.
  if (!single) {
    int valid = 0;
    for (const TuneCase& c : cases) {
      for (const Candidate& cand : c.candidates) valid += cand.invalid.empty() ? 1 : 0;
    }
    if (valid == 0) {
      for (const TuneCase& c : cases) {
        for (const Candidate& cand : c.candidates) {
          std::fprintf(stderr, "gemvz tune: %s\n", cand.invalid.c_str());
        }
      }
      const std::string what =
          space ? absl::StrCat("--space ", space_path)
                : absl::StrCat("--sweep (--sweep_format=", std::string(FormatName(*sweep_format)),
                               ")");
      std::fprintf(stderr,
                   "gemvz tune: nothing to try: %s has no configuration valid for any shape and m "
                   "asked\n",
                   what.c_str());
      return 2;
    }
  }

  const int threads = workload->threads;  // --j, checked by WorkloadFromFlags
  // With a GPU whose architecture differs from --arch, both are compiled; the statistics shown
  // are those of the GPU's, which is what gets timed.
  if (session && arch != session->info().arch) CompileCandidates(&cases, arch, threads);
  CompileCandidates(&cases, session ? session->info().arch : arch, threads);

  if (!session) {
    int compiled = 0, failed = 0, invalid = 0;
    for (const TuneCase& c : cases) {
      for (const Candidate& cand : c.candidates) {
        if (!cand.invalid.empty()) {
          ++invalid;
          if (!single) std::printf("skipped: %s\n", cand.invalid.c_str());
        } else if (!cand.compile_error.empty()) {
          ++failed;
          std::printf("compile FAILED %s: %s\n", cand.config.ToString().c_str(),
                      cand.compile_error.c_str());
        } else if (cand.compiled) {
          ++compiled;
          if (single) {
            std::printf("%s for %s m=%lld: valid; %s for %s in %.0f ms (%d registers, %d spill "
                        "bytes, %d B shared)\n",
                        cand.config.ToString().c_str(), c.shape.ToString().c_str(),
                        static_cast<long long>(c.m),
                        cand.compiled->from_disk ? "found in the disk cache" : "compiled",
                        arch.c_str(), cand.compiled->millis, cand.compiled->registers,
                        cand.compiled->spill_bytes, cand.compiled->shared_bytes);
          }
        }
      }
    }
    std::printf("%d valid configuration(s) compiled or found in the cache for %s, %d failed to "
                "compile, %d invalid.\n",
                compiled, arch.c_str(), failed, invalid);
    std::fprintf(stderr,
                 "gemvz tune: checking and timing need a GPU, and none can be used here (%s); "
                 "nothing was timed%s%s.\n",
                 no_gpu.c_str(), absl::GetFlag(FLAGS_save) ? ", nothing was saved" : "",
                 absl::GetFlag(FLAGS_json).empty() ? "" : ", no JSON was written");
    return 1;
  }

  // Time on the GPU, one shape's weights at a time.
  workload->seed = SeedFromFlag();
  const int64_t max_m = *std::max_element(ms->begin(), ms->end());
  std::printf("gemvz tune on %s (%s), seed %llu, %d replays of >= %d launches, %lld MiB rotated%s\n\n",
              session->info().name.c_str(), session->info().arch.c_str(),
              static_cast<unsigned long long>(workload->seed), timing->replays,
              timing->min_launches, static_cast<long long>(workload->rotate_bytes >> 20),
              timing->pdl ? ", programmatic dependent launch" : "");
  bool ok = true;
  for (const MatrixShape& shape : *shapes) {
    Progress(absl::StrFormat("[tune] %s: weights, x and the CPU reference", shape.ToString()));
    absl::StatusOr<std::unique_ptr<ShapeWorkload>> work =
        ShapeWorkload::Create(session.get(), shape, max_m, *workload);
    for (TuneCase& c : cases) {
      if (c.shape.n != shape.n || c.shape.k != shape.k) continue;
      if (!work.ok()) {
        c.baseline_error = std::string(work.status().message());
      } else {
        TimeCase(work->get(), *timing, &c);
      }
      PrintCase(c, absl::GetFlag(FLAGS_top));
      std::fflush(stdout);
    }
  }

  std::vector<TunedChoice> winners;
  for (const TuneCase& c : cases) {
    if (!c.baseline_error.empty()) ok = false;
    for (const Candidate& cand : c.candidates) {
      if (!cand.invalid.empty()) {
        ok = ok && !single;  // in a sweep, an invalid configuration is just skipped
      } else if (!cand.usable()) {
        ok = false;
      }
    }
    if (const Candidate* w = c.Winner()) {
      // Several launches' winner: reported, not saved (--save said so before the work).
      if (internal::LaunchRowsFor(c.m) != c.m) continue;
      TunedChoice choice;
      choice.arch = session->info().arch;
      choice.device = session->info().name;
      choice.format = c.format;
      choice.m = c.m;
      choice.n = c.shape.n;
      choice.k = c.shape.k;
      choice.config = w->config;
      choice.time_us = w->time_us;
      winners.push_back(choice);
    }
  }

  std::string saved_to;
  if (absl::GetFlag(FLAGS_save)) {
    if (winners.empty()) {
      std::printf("--save: no winner to save\n");
      ok = false;
    } else if (absl::Status st = SaveTunedChoices(winners); !st.ok()) {
      std::fprintf(stderr, "gemvz tune: --save: %s\n", std::string(st.message()).c_str());
      ok = false;
    } else {
      saved_to = TuningFilePath();
      std::printf("saved %zu winner(s) to %s; the dispatcher uses them from now on, no rebuild\n",
                  winners.size(), saved_to.c_str());
    }
  }

  const std::string json_path = absl::GetFlag(FLAGS_json);
  if (!json_path.empty()) {
    nlohmann::json doc;
    doc["schema"] = "gemvz.tune/1";
    doc["date"] = UtcTimestamp();
    doc["gpu"] = {{"name", session->info().name}, {"arch", session->info().arch}};
    doc["settings"] = {{"replays", timing->replays},
                       {"pdl", timing->pdl},
                       {"rotate_bytes", workload->rotate_bytes},
                       {"seed", workload->seed}};
    nlohmann::json results = nlohmann::json::array();
    for (const TuneCase& c : cases) {
      nlohmann::json candidates = nlohmann::json::array();
      for (const Candidate& cand : c.candidates) candidates.push_back(CandidateJson(cand));
      nlohmann::json r = {
          {"shape", {{"name", c.shape.name}, {"n", c.shape.n}, {"k", c.shape.k}}},
          {"m", c.m},
          {"format", std::string(FormatName(c.format))},
          {"dispatcher", CandidateJson(c.baseline)},
          {"candidates", std::move(candidates)},
      };
      r["dispatcher"]["source"] = c.baseline_source;
      if (!c.baseline_error.empty()) r["dispatcher"]["error"] = c.baseline_error;
      const Candidate* w = c.Winner();
      r["winner"] = w == nullptr ? nlohmann::json(nullptr)
                                 : nlohmann::json{{"config", w->config.ToString()},
                                                  {"time_us", w->time_us}};
      results.push_back(std::move(r));
    }
    doc["results"] = std::move(results);
    doc["saved_to"] = saved_to.empty() ? nlohmann::json(nullptr) : nlohmann::json(saved_to);
    doc["ok"] = ok;
    ok = WriteJsonReport("tune", json_path, doc) && ok;
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace gemvz::cli

GEMVZ_REGISTER_COMMAND(tune, "tune",
                       "try any kernel configuration, or sweep and rank them; --save for the "
                       "dispatcher",
                       gemvz::cli::TuneUsage().c_str(), gemvz::cli::RunTune,
                       "shape m config sweep sweep_format space top save json arch zero_rows "
                       "exception_rows "
                       "replays launches rotate_mb seed pdl device j");
