// `gemvz cache`: look into the kernel cache and manage it: list entries, verify every one,
// prune to the size cap, clear, or print where it is.
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gemvz/runtime.h"
#include "nlohmann/json.hpp"
#include "runtime/common/env.h"
#include "runtime/common/file_util.h"
#include "runtime/common/log.h"
#include "runtime/jit/disk_cache.h"
#include "tools/gemvz/bench_support.h"
#include "tools/gemvz/command.h"
#include "tools/gemvz/common_flags.h"

ABSL_FLAG(std::string, cache_max_bytes, "",
          "cache prune: the size to prune to, e.g. 512M (default: GEMVZ_CACHE_MAX_BYTES or 1G)");
ABSL_FLAG(bool, cache_remove_bad, false, "cache verify: also remove the invalid entries");

namespace gemvz::cli {
namespace {

constexpr char kCacheUsage[] =
    "gemvz cache: inspect and manage the kernel cache that the JIT and 'gemvz warmup' fill.\n"
    "\n"
    "usage: gemvz cache list   [--json=FILE]\n"
    "       gemvz cache verify [--cache_remove_bad]\n"
    "       gemvz cache prune  [--cache_max_bytes=SIZE]\n"
    "       gemvz cache clear\n"
    "       gemvz cache dir\n"
    "\n"
    "The cache lives in GEMVZ_CACHE_DIR, else $XDG_CACHE_HOME/gemvz, else ~/.cache/gemvz, one "
    "file\n"
    "per compiled kernel under kernels/ (<sha256 key>.gemvzk: cubin, PTX, lowered name, ptxas\n"
    "statistics, checksum). Every subcommand is safe while other processes use the cache.\n"
    "\n"
    "subcommands:\n"
    "  list     one line per entry, least recently used first: key (first 16 hex digits),\n"
    "           kernel, architecture, size, time since last use, registers, spill bytes; then\n"
    "           the total. Invalid entries are shown with the reason.\n"
    "  verify   reads and checks every entry (size, magic, version, checksum, the key inside);\n"
    "           exit status 1 when any is invalid. Invalid entries are harmless: the JIT\n"
    "           removes and recompiles them on use.\n"
    "  prune    removes least recently used entries until the cache fits the cap, and sweeps\n"
    "           temporary and lock files that crashed writers left behind\n"
    "  clear    removes every kernel entry (the tuning file, tuning.json, is kept)\n"
    "  dir      prints the cache directory in use\n"
    "\n"
    "flags:\n"
    "  --json=FILE              list: also write the entries as JSON\n"
    "  --cache_remove_bad       verify: remove the invalid entries it finds; one it cannot\n"
    "                           remove is named on stderr with the reason (exit status 1)\n"
    "  --cache_max_bytes=SIZE   prune: the cap (bytes, or with K/M/G/T: 512M, 2G); default\n"
    "                           GEMVZ_CACHE_MAX_BYTES, else 1G\n"
    "Each flag is its subcommand's; given to another, it is a usage error (exit 2).\n"
    "\n"
    "examples:\n"
    "  gemvz cache list\n"
    "  gemvz cache verify --cache_remove_bad\n"
    "  gemvz cache prune --cache_max_bytes=256M\n"
    "  GEMVZ_CACHE_DIR=/srv/gemvz-cache gemvz cache clear\n";

std::string HumanBytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  if (bytes < (int64_t{1} << 20)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  if (bytes < (int64_t{1} << 30)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
}

std::string HumanAge(int64_t seconds) {
  if (seconds < 0) seconds = 0;
  if (seconds < 120) return absl::StrCat(seconds, "s");
  if (seconds < 7200) return absl::StrCat(seconds / 60, "m");
  if (seconds < 2 * 86400) return absl::StrCat(seconds / 3600, "h");
  return absl::StrCat(seconds / 86400, "d");
}

int Fail(const std::string& message, int code = 1) {
  std::fprintf(stderr, "gemvz cache: %s\n", message.c_str());
  return code;
}

// What the table shows of a file's name or of what an entry holds: escaped, since anyone who can
// write to a shared cache directory chooses the names (a terminal escape would act on the screen
// of whoever lists it). The JSON report keeps the raw values.
std::string Shown(const std::string& s) { return internal::Escaped(s, std::string::npos); }

int List(internal::DiskCache& cache) {
  if (absl::Status st = CheckOutputFile("json", absl::GetFlag(FLAGS_json)); !st.ok()) {
    return Fail(std::string(st.message()), 2);
  }
  absl::StatusOr<std::vector<internal::DiskEntryInfo>> entries = cache.List(/*verify=*/true);
  if (!entries.ok()) return Fail(std::string(entries.status().message()));
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  int64_t total = 0;
  int bad = 0;
  std::printf("%-16s  %-24s %-7s %10s %6s %5s %6s\n", "key", "kernel", "arch", "size", "used",
              "regs", "spill");
  nlohmann::json j = nlohmann::json::array();
  for (const internal::DiskEntryInfo& e : *entries) {
    total += e.size_bytes;
    const std::string age = HumanAge(now - e.last_used_unix_ns / 1000000000);
    if (!e.status.ok()) {
      ++bad;
      std::printf("%-16s  (invalid: %s) %s\n", Shown(e.key.substr(0, 16)).c_str(),
                  Shown(std::string(e.status.message())).c_str(), HumanBytes(e.size_bytes).c_str());
    } else {
      std::printf("%-16s  %-24s %-7s %10s %6s %5d %6d\n", Shown(e.key.substr(0, 16)).c_str(),
                  Shown(e.kernel_name).c_str(), Shown(e.arch).c_str(),
                  HumanBytes(e.size_bytes).c_str(), age.c_str(), e.registers, e.spill_bytes);
    }
    j.push_back({{"key", e.key},
                 {"valid", e.status.ok()},
                 {"error", std::string(e.status.message())},
                 {"kernel", e.kernel_name},
                 {"name_expression", e.name_expression},
                 {"arch", e.arch},
                 {"bytes", e.size_bytes},
                 {"last_used_unix", e.last_used_unix_ns / 1000000000},
                 {"created_unix", e.meta.created_unix},
                 {"nvrtc", e.meta.nvrtc_version},
                 {"library", e.meta.library_version},
                 {"registers", e.registers},
                 {"spill_bytes", e.spill_bytes},
                 {"shared_bytes", e.shared_bytes}});
  }
  std::printf("%zu entries, %s in %s%s\n", entries->size(), HumanBytes(total).c_str(),
              cache.directory().c_str(),
              bad > 0 ? absl::StrCat(", ", bad, " invalid").c_str() : "");
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    if (!WriteJsonReport("cache", path, j)) return 1;  // "wrote PATH", as the other --json do
  }
  return 0;
}

int Verify(internal::DiskCache& cache) {
  absl::StatusOr<std::vector<internal::DiskEntryInfo>> entries = cache.List(/*verify=*/true);
  if (!entries.ok()) return Fail(std::string(entries.status().message()));
  const bool remove = absl::GetFlag(FLAGS_cache_remove_bad);
  int bad = 0, removed = 0, unremoved = 0;
  for (const internal::DiskEntryInfo& e : *entries) {
    if (e.status.ok()) {
      std::printf("ok   %s  %s %s\n", Shown(e.key).c_str(), Shown(e.kernel_name).c_str(),
                  Shown(e.arch).c_str());
      continue;
    }
    ++bad;
    std::printf("BAD  %s  %s\n", Shown(e.key).c_str(),
                Shown(std::string(e.status.message())).c_str());
    if (remove) {
      // Under the key's lock and after a second look, as the library does: a process may have
      // put a good entry in its place since the list was made. Read directly, not through the
      // JIT's lookup, whose warnings speak of compiling.
      const std::unique_ptr<internal::DiskCache::KeyLock> lock = cache.LockKey(e.key);
      const absl::StatusOr<internal::CompiledKernel> again = internal::ReadEntryFile(e.path, e.key);
      // NotFound is a file pruned meanwhile, unless something is still there: a link that leads
      // nowhere reads as NotFound too, and is bad.
      struct stat there;
      const bool still_bad = !again.ok() && (!absl::IsNotFound(again.status()) ||
                                             ::lstat(e.path.c_str(), &there) == 0);
      if (!still_bad) continue;
      // One that cannot be removed (no permission, a non-empty directory under an entry's name) is
      // named with the reason, and the summary counts it apart: never taken for removed.
      const int err = std::remove(e.path.c_str()) == 0 ? 0 : errno;
      if (err == 0 || err == ENOENT) {
        ++removed;
      } else {
        ++unremoved;
        std::fflush(stdout);  // after its BAD line
        std::fprintf(stderr, "gemvz cache: could not remove '%s': %s\n", Shown(e.path).c_str(),
                     std::strerror(err));
      }
    }
  }
  std::printf("%zu entries checked in %s: %zu valid, %d invalid%s%s\n", entries->size(),
              cache.directory().c_str(), entries->size() - bad, bad,
              remove ? absl::StrCat(", ", removed, " removed").c_str() : "",
              unremoved > 0 ? absl::StrCat(", ", unremoved, " could not be removed").c_str() : "");
  return bad > 0 || unremoved > 0 ? 1 : 0;
}

int Prune(internal::DiskCache& cache) {
  int64_t cap = internal::DiskCacheMaxBytes();
  if (const std::string flag = absl::GetFlag(FLAGS_cache_max_bytes); !flag.empty()) {
    absl::StatusOr<int64_t> parsed = internal::ParseByteSize(flag);
    if (!parsed.ok())
      return Fail(absl::StrCat("--cache_max_bytes: ", parsed.status().message()), 2);
    cap = *parsed;
  }
  absl::StatusOr<internal::PruneResult> r = cache.Prune(cap);
  if (!r.ok()) return Fail(std::string(r.status().message()));
  std::printf("pruned %s to %s: removed %d entries (%s), kept %d (%s)\n", cache.directory().c_str(),
              HumanBytes(cap).c_str(), r->removed, HumanBytes(r->removed_bytes).c_str(), r->kept,
              HumanBytes(r->kept_bytes).c_str());
  return 0;
}

int Clear(internal::DiskCache& cache) {
  absl::StatusOr<int> removed = cache.Clear();
  if (!removed.ok()) return Fail(std::string(removed.status().message()));
  std::printf("removed %d entries from %s\n", *removed, cache.directory().c_str());
  return 0;
}

int RunCache(const std::vector<std::string>& args) {
  if (args.size() != 1) {
    return Fail("expected one subcommand: list, verify, prune, clear or dir (see --help)", 2);
  }
  const std::string& sub = args[0];
  if (sub != "list" && sub != "verify" && sub != "prune" && sub != "clear" && sub != "dir") {
    return Fail(
        absl::StrCat("unknown subcommand '", sub, "': expected list, verify, prune, clear or dir"),
        2);
  }
  // Each flag is one subcommand's (the usage lines): given to another, it would be ignored.
  const struct {
    const char* flag;
    const char* owner;
    bool given;
  } owned[] = {{"json", "list", FlagGiven("json")},
               {"cache_remove_bad", "verify", FlagGiven("cache_remove_bad")},
               {"cache_max_bytes", "prune", FlagGiven("cache_max_bytes")}};
  for (const auto& o : owned) {
    if (o.given && sub != o.owner) {
      return Fail(absl::StrCat("--", o.flag, " is for 'gemvz cache ", o.owner, "', not '", sub,
                               "' (see --help)"),
                  2);
    }
  }
  const std::string dir = CacheDirectory();
  if (sub == "dir") {
    if (dir.empty()) {
      return Fail("the disk cache is disabled (GEMVZ_DISABLE_DISK_CACHE=1, or no home directory)");
    }
    // Where it is to be made is fine; something else in its place is not a cache directory, and
    // a path that cannot be looked up (a symlink loop, a file as a parent, no permission) is no
    // place for one either.
    struct stat st;
    if (::stat(dir.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) {
        return Fail(absl::StrCat("the cache directory '", dir, "' is not a directory"));
      }
    } else if (errno != ENOENT) {
      return Fail(absl::StrCat("the cache directory '", dir,
                               "' cannot be looked up: ", std::strerror(errno)));
    }
    std::printf("%s\n", dir.c_str());
    return 0;
  }
  if (dir.empty()) {
    return Fail("the disk cache is disabled (GEMVZ_DISABLE_DISK_CACHE=1, or no home directory)");
  }
  internal::DiskCache cache(dir);
  if (sub == "list") return List(cache);
  if (sub == "verify") return Verify(cache);
  if (sub == "prune") return Prune(cache);
  return Clear(cache);
}

}  // namespace
}  // namespace gemvz::cli

GEMVZ_REGISTER_COMMAND(cache, "cache", "list, verify, prune, clear or locate the kernel cache",
                       gemvz::cli::kCacheUsage, gemvz::cli::RunCache,
                       "json cache_remove_bad cache_max_bytes");
