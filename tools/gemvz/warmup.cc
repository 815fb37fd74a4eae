// `gemvz warmup`: precompile kernels with NVRTC into the disk cache, in parallel and without a
// GPU, so that a serving process starts with every kernel it needs already compiled.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gemvz/dispatch.h"
#include "gemvz/runtime.h"
#include "nlohmann/json.hpp"
#include "runtime/common/env.h"
#include "runtime/common/file_util.h"
#include "runtime/cuda/driver.h"
#include "runtime/dispatch/dispatcher.h"
#include "runtime/jit/config_list.h"
#include "runtime/jit/disk_cache.h"
#include "runtime/jit/kernel_cache.h"
#include "tools/gemvz/bench_support.h"
#include "tools/gemvz/command.h"
#include "tools/gemvz/common_flags.h"

ABSL_FLAG(std::string, configs, "",
          "warmup: file of configurations, one per line (z12.nw8.ug2.nb2.pipe3.s1), '#' comments; "
          "'-' reads stdin");
ABSL_FLAG(bool, all_default, false,
          "warmup: the library's default table (gemvz::DefaultWarmupConfigs()) and the tuning "
          "file's kernels");
ABSL_FLAG(bool, tuned, false,
          "warmup: the tuning file's kernels for the target arch (gemvz::TunedWarmupConfigs())");

namespace gemvz::cli {
namespace {

constexpr char kWarmupUsage[] =
    "gemvz warmup: precompile kernels into the disk cache, so a serving process starts warm.\n"
    "\n"
    "usage: gemvz warmup [--arch=ARCH] [--configs=FILE | --all_default | --tuned] [--j=N]\n"
    "                    [--json=FILE]\n"
    "       gemvz warmup [--arch=ARCH] [--j=N] CONFIG [CONFIG ...]\n"
    "\n"
    "Compiles each configuration with NVRTC for one target architecture, several at a time, and\n"
    "publishes every result into the kernel cache (see 'gemvz cache'). Needs no GPU and no\n"
    "driver. A configuration already in the cache is a hit and costs no compile, so running the\n"
    "same warm-up twice reports all hits the second time. The split count S of a configuration\n"
    "is a run-time argument: z12.nw8.ug2.nb2.pipe3.s1 and .s4 are one kernel, compiled once.\n"
    "\n"
    "flags:\n"
    "  --arch=ARCH      target architecture: sm_90, sm_90a, sm_80, ... (default: $GEMVZ_ARCH,\n"
    "                   else GPU 0's, else sm_90 on a machine without a GPU)\n"
    "  --configs=FILE   configurations, one per line, in the text form z12.nw8.ug2.nb2.pipe3.s1\n"
    "                   (format.nwN.ugN.nbN.pipeN[.rbN][.gm][.sN]); '#' starts a comment,\n"
    "                   blank lines and a UTF-8 byte order mark at the start are skipped\n"
    "                   (as in tune's --space); an invalid line stops the run before\n"
    "                   anything is compiled and is named as FILE:LINE. '-' reads standard\n"
    "                   input. More than 16 MiB (/dev/zero) is a usage error.\n"
    "  --all_default    those of --tuned first, when the tuning file can be read (else a\n"
    "                   warning says why not); then every distinct kernel of the built-in\n"
    "                   tuned table, of the heuristic over the benchmark suite, and every\n"
    "                   kernel the heuristic's shaped rule can pick for other shapes, in both\n"
    "                   weight orders (gemvz::DefaultWarmupConfigs()); this is what runs\n"
    "                   when no configuration is given at all\n"
    "  --tuned          the kernels of the tuning file's entries for ARCH\n"
    "                   (gemvz::TunedWarmupConfigs(): GEMVZ_TUNING_FILE, else\n"
    "                   <cache dir>/tuning.json), e.g. a file 'gemvz tune --save' wrote on\n"
    "                   another machine; no file, no entry for ARCH, or a file that cannot be\n"
    "                   read is an error (exit 1)\n"
    "  --j=N            compiles in parallel (default 0: one per core)\n"
    "  --json=FILE      also write the results as JSON: {arch, threads, seconds, compiled, hits,\n"
    "                   failed, cache_dir, tuning_file, tuning_file_kernels, results:\n"
    "                   [{config, from_disk, ms, registers, spill_bytes, shared_bytes}, or\n"
    "                   {config, error} for one that failed]}\n"
    "\n"
    "output: progress on stderr, one line per finished kernel; then on stdout one line per kernel\n"
    "(kernel, arch, compiled or hit, milliseconds, registers, spill bytes, static shared bytes;\n"
    "FAILED and the error's first line for one that did not compile, its whole log on stderr)\n"
    "and a summary. A failed compile stops no other kernel. Kernels that spill registers are\n"
    "flagged. Exit status: 0 when every kernel compiled and is in the cache (with the disk cache\n"
    "disabled: compiled), 1 on a failed compile, an unwritable cache or one whose size cap cannot\n"
    "hold them all, or --tuned with nothing to warm, 2 on bad usage (--json may not name the\n"
    "--configs file, nor the tuning file when the run reads it).\n"
    "\n"
    "environment:\n"
    "  GEMVZ_CACHE_DIR           cache directory (else $XDG_CACHE_HOME/gemvz, else "
    "~/.cache/gemvz)\n"
    "  GEMVZ_TUNING_FILE         the tuning file (else <cache dir>/tuning.json)\n"
    "  GEMVZ_DISABLE_DISK_CACHE  1: compile only, persist nothing\n"
    "  GEMVZ_CACHE_MAX_BYTES     size cap of the cache (default 1G; least recently used go first)\n"
    "  GEMVZ_NVRTC_OPTIONS       extra NVRTC options (part of the cache key)\n"
    "  GEMVZ_DUMP_DIR            write each compile's source, PTX and ptxas report there\n"
    "  GEMVZ_LOG=1               log hits, misses, compile and load times\n"
    "\n"
    "examples:\n"
    "  gemvz warmup --all_default --arch=sm_90 --j=2\n"
    "  gemvz warmup --configs=serving_configs.txt\n"
    "  GEMVZ_TUNING_FILE=tuning.json gemvz warmup --tuned --arch=sm_90\n"
    "  gemvz warmup z12.nw8.ug2.nb2.pipe3 bf16.nw4.ug2.nb1.pipe3 --arch=sm_90a\n"
    "  GEMVZ_CACHE_DIR=/srv/gemvz-cache gemvz warmup --all_default\n";

absl::StatusOr<std::vector<KernelConfig>> GatherConfigs(const std::vector<std::string>& args) {
  const std::string file = absl::GetFlag(FLAGS_configs);
  const bool all_default = absl::GetFlag(FLAGS_all_default);
  const bool tuned = absl::GetFlag(FLAGS_tuned);
  const int sources =
      (file.empty() ? 0 : 1) + (all_default ? 1 : 0) + (tuned ? 1 : 0) + (args.empty() ? 0 : 1);
  if (sources > 1) {
    return absl::InvalidArgumentError(
        "give configurations one way only: --configs=FILE, --all_default, --tuned, or on the "
        "command line");
  }
  std::vector<KernelConfig> configs;
  if (!file.empty()) {
    const bool from_stdin = file == "-";
    const std::string where = from_stdin ? "<stdin>" : file;
    absl::StatusOr<std::string> text =
        from_stdin ? internal::ReadDescriptor(STDIN_FILENO, where, internal::kMaxConfigListBytes)
                   : internal::ReadFile(file, internal::kMaxConfigListBytes);
    if (!text.ok()) return text.status();
    absl::StatusOr<std::vector<KernelConfig>> parsed = internal::ParseConfigList(*text, where);
    if (!parsed.ok()) return parsed.status();
    configs = *std::move(parsed);
    if (configs.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": no configurations in it"));
    }
  } else if (!args.empty()) {
    for (size_t i = 0; i < args.size(); ++i) {
      absl::StatusOr<KernelConfig> c = KernelConfig::Parse(args[i]);
      if (!c.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("argument ", i + 1, ": ", c.status().message()));
      }
      configs.push_back(*c);
    }
  } else if (!tuned) {
    configs = DefaultWarmupConfigs();
  }
  return internal::DistinctKernels(configs);  // --tuned's come once the arch is known
}

// The tuning file's share of a warm-up (--tuned, or the defaults).
struct TunedPart {
  std::string file;    // the file whose kernels were taken ("" when none were)
  size_t kernels = 0;  // its kernels for the arch
  size_t added = 0;    // of them, not among the other configurations
};

// The archs that the tuning file's entries are for (it was just read: it reads again).
std::string ArchsInTheTuningFile() {
  std::set<std::string> archs;
  for (const TunedChoice& c : LoadTunedChoices().value_or(std::vector<TunedChoice>{})) {
    archs.insert(c.arch);
  }
  return absl::StrJoin(archs, ", ");
}

// Puts the tuning file's kernels for `arch` first in `configs`: the dispatcher prefers its
// entries, so those are the kernels that a warm-up cut short should have done. `required`
// (--tuned): a file that cannot be read, or nothing to warm, is an error (false: stop); else
// it is a warning, or nothing when there is no file, as the dispatcher takes it.
bool AddTunedConfigs(const std::string& arch, bool required, std::vector<KernelConfig>& configs,
                     TunedPart& part) {
  part = TunedPart{};
  const std::string path = TuningFilePath();
  absl::StatusOr<std::vector<KernelConfig>> tuned = TunedWarmupConfigs(arch);
  if (!tuned.ok()) {
    const std::string why(tuned.status().message());
    if (required) {
      std::fprintf(stderr, "gemvz warmup: %s\n", why.c_str());
      return false;
    }
    std::fprintf(stderr,
                 "gemvz warmup: warning: %s; its kernels are not warmed (the dispatcher runs "
                 "without the file too)\n",
                 why.c_str());
    return true;
  }
  if (tuned->empty()) {
    struct stat st;
    const bool exists = !path.empty() && ::stat(path.c_str(), &st) == 0;
    const std::string archs = exists ? ArchsInTheTuningFile() : "";
    if (required && path.empty()) {
      std::fprintf(stderr, "gemvz warmup: --tuned: there is no tuning file (%s)\n",
                   internal::GetEnvBool("GEMVZ_DISABLE_DISK_CACHE", false)
                       ? "the disk cache is disabled and GEMVZ_TUNING_FILE is not set"
                       : "no cache directory: set GEMVZ_CACHE_DIR, or GEMVZ_TUNING_FILE");
    } else if (required && !exists) {
      std::fprintf(stderr,
                   "gemvz warmup: --tuned: there is no tuning file at %s ('gemvz tune --save' "
                   "writes one; GEMVZ_TUNING_FILE names another)\n",
                   path.c_str());
    } else if (exists && (required || !archs.empty())) {
      std::fprintf(stderr, "gemvz warmup: %s the tuning file %s has no entries for %s%s\n",
                   required ? "--tuned:" : "note:", path.c_str(), arch.c_str(),
                   archs.empty()
                       ? " (it has none at all)"
                       : absl::StrCat(" (it has entries for ", archs, "; --arch chooses)").c_str());
    }
    return !required;
  }
  std::vector<KernelConfig> all = *tuned;
  all.insert(all.end(), configs.begin(), configs.end());
  const size_t others = configs.size();
  configs = internal::DistinctKernels(all);
  part.file = path;
  part.kernels = tuned->size();
  part.added = configs.size() - others;
  return true;
}

// How many of `results` have no entry in the disk cache at `cache_dir`.
int NotInCache(const std::string& cache_dir, const std::vector<PrecompileResult>& results) {
  const internal::DiskCache disk(cache_dir);
  int missing = 0;
  for (const PrecompileResult& r : results) {
    struct stat st;
    if (::stat(disk.EntryPath(r.cache_key).c_str(), &st) != 0) ++missing;
  }
  return missing;
}

int RunWarmup(const std::vector<std::string>& args) {
  absl::StatusOr<std::vector<KernelConfig>> configs = GatherConfigs(args);
  if (!configs.ok()) {
    std::fprintf(stderr, "gemvz warmup: %s\n", std::string(configs.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<std::string> arch = ArchFromFlag(0);
  if (!arch.ok()) {
    std::fprintf(stderr, "gemvz warmup: %s\n", std::string(arch.status().message()).c_str());
    return 2;
  }
  const bool tuned_only = absl::GetFlag(FLAGS_tuned);
  // The defaults (--all_default, or nothing given) take the tuning file's kernels too.
  const bool defaults = !tuned_only && absl::GetFlag(FLAGS_configs).empty() && args.empty();
  const bool reads_tuning_file = tuned_only || defaults;
  const std::string json_path = absl::GetFlag(FLAGS_json);
  for (const absl::Status& st :
       {CheckOutputFile("json", json_path),
        CheckOutputIsNoneOf(
            "json", json_path,
            {{"the --configs file", absl::GetFlag(FLAGS_configs)},
             {"the tuning file", reads_tuning_file ? TuningFilePath() : std::string()}})}) {
    if (!st.ok()) {
      std::fprintf(stderr, "gemvz warmup: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  const absl::StatusOr<int> threads_or = ThreadsFromFlag();
  if (!threads_or.ok()) {
    std::fprintf(stderr, "gemvz warmup: %s\n", std::string(threads_or.status().message()).c_str());
    return 2;
  }
  int threads = *threads_or;
  if (threads <= 0) threads = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  TunedPart tuned;
  if (reads_tuning_file && !AddTunedConfigs(*arch, tuned_only, *configs, tuned)) return 1;
  const std::string cache_dir = CacheDirectory();
  std::string from_file;
  if (tuned_only) {
    from_file = absl::StrCat(" (the tuning file ", tuned.file, "'s)");
  } else if (!tuned.file.empty()) {
    from_file = absl::StrCat(" (the tuning file ", tuned.file, "'s ", tuned.kernels, " first, ",
                             tuned.added, " of them not among the defaults)");
  }
  std::fprintf(stderr, "gemvz warmup: %zu kernels%s for %s on %d threads into %s\n",
               configs->size(), from_file.c_str(), arch->c_str(), threads,
               cache_dir.empty() ? "memory only (disk cache disabled)" : cache_dir.c_str());

  const JitCounters before = GetJitCounters();
  const auto start = std::chrono::steady_clock::now();
  // Every kernel is tried, whatever fails: one that does not compile costs only itself.
  const std::vector<absl::StatusOr<PrecompileResult>> each = internal::PrecompileEach(
      *configs, *arch, threads, /*stop_on_error=*/false,
      [](int done, int total, const PrecompileResult& r) {
        std::fprintf(stderr, "[%*d/%d] %-24s %-8s %8.1f ms\n", total >= 10 ? 2 : 1, done, total,
                     r.config.KernelName().c_str(), r.from_disk ? "hit" : "compiled", r.millis);
      });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const JitCounters after = GetJitCounters();
  std::vector<PrecompileResult> results;  // the kernels that compiled or were hits
  int failed = 0;
  for (size_t i = 0; i < each.size(); ++i) {
    if (each[i].ok()) {
      results.push_back(*each[i]);
    } else {
      ++failed;
      std::fprintf(stderr, "gemvz warmup: %s: %s\n", (*configs)[i].KernelName().c_str(),
                   std::string(each[i].status().message()).c_str());
    }
  }

  int compiled = 0, hits = 0, spilling = 0;
  std::printf("%-24s %-7s %-8s %9s %5s %6s %6s\n", "kernel", "arch", "result", "ms", "regs",
              "spill", "smem");
  for (size_t i = 0; i < each.size(); ++i) {
    if (!each[i].ok()) {
      const std::string message(each[i].status().message());
      std::printf("%-24s %-7s %-8s %s\n", (*configs)[i].KernelName().c_str(), arch->c_str(),
                  "FAILED", message.substr(0, message.find('\n')).c_str());
      continue;
    }
    const PrecompileResult& r = *each[i];
    (r.from_disk ? hits : compiled)++;
    if (r.spill_bytes > 0) ++spilling;
    std::printf("%-24s %-7s %-8s %9.1f %5d %6d %6d%s\n", r.config.KernelName().c_str(),
                r.arch.c_str(), r.from_disk ? "hit" : "compiled", r.millis, r.registers,
                r.spill_bytes, r.shared_bytes, r.spill_bytes > 0 ? "  SPILLS" : "");
  }
  std::printf("%zu kernels for %s on %d threads in %.2f s: %d compiled, %d hits%s%s\n", each.size(),
              arch->c_str(), threads, seconds, compiled, hits,
              failed > 0 ? absl::StrCat(", ", failed, " FAILED").c_str() : "",
              compiled == 0 && failed == 0 ? " (all hits)" : "");
  if (spilling > 0) {
    std::printf("warning: %d kernel(s) spill registers to local memory (see the SPILLS lines)\n",
                spilling);
  }
  const int64_t written = after.disk_writes - before.disk_writes;
  const int64_t new_compiles = after.compiles - before.compiles;
  int status = 0;
  if (cache_dir.empty()) {
    std::printf("note: the disk cache is disabled (GEMVZ_DISABLE_DISK_CACHE); nothing was kept\n");
  } else if (written < new_compiles) {
    std::printf("error: %lld of %lld compiled kernels could not be written to %s\n",
                static_cast<long long>(new_compiles - written),
                static_cast<long long>(new_compiles), cache_dir.c_str());
    status = 1;
  } else if (const int evicted = NotInCache(cache_dir, results); evicted > 0) {
    // Each write prunes the cache to its cap, least recently used first: a cap smaller than this
    // warm-up's kernels evicts some of them. Another process may also have pruned or cleared it.
    std::printf(
        "error: %d of %zu kernels are no longer in %s: evicted by its size cap, %s bytes "
        "(GEMVZ_CACHE_MAX_BYTES, default 1G), too small to hold them all, or removed by another "
        "process (gemvz cache prune or clear)\n",
        evicted, results.size(), cache_dir.c_str(),
        absl::StrCat(internal::DiskCacheMaxBytes()).c_str());
    status = 1;
  } else {
    std::printf("cache: %s\n", cache_dir.c_str());
  }
  if (failed > 0) {
    std::printf(
        "error: %d of %zu kernels failed to compile (the FAILED lines; NVRTC's log on "
        "stderr)\n",
        failed, each.size());
    status = 1;
  }

  if (const std::string json_path = absl::GetFlag(FLAGS_json); !json_path.empty()) {
    nlohmann::json j;
    j["arch"] = *arch;
    j["threads"] = threads;
    j["seconds"] = seconds;
    j["compiled"] = compiled;
    j["hits"] = hits;
    j["cache_dir"] = cache_dir;
    j["failed"] = failed;
    j["tuning_file"] = tuned.file;
    j["tuning_file_kernels"] = tuned.kernels;
    for (size_t i = 0; i < each.size(); ++i) {
      if (!each[i].ok()) {
        j["results"].push_back({{"config", (*configs)[i].KernelName()},
                                {"error", std::string(each[i].status().message())}});
        continue;
      }
      const PrecompileResult& r = *each[i];
      j["results"].push_back({{"config", r.config.KernelName()},
                              {"from_disk", r.from_disk},
                              {"ms", r.millis},
                              {"registers", r.registers},
                              {"spill_bytes", r.spill_bytes},
                              {"shared_bytes", r.shared_bytes}});
    }
    if (!WriteJsonReport("warmup", json_path, j)) return 1;
  }
  return status;
}

}  // namespace
}  // namespace gemvz::cli

GEMVZ_REGISTER_COMMAND(warmup, "warmup", "precompile kernels into the disk cache (no GPU needed)",
                       gemvz::cli::kWarmupUsage, gemvz::cli::RunWarmup,
                       "arch configs all_default tuned j json");
