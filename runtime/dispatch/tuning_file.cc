// The tuning file: measured winners persisted as JSON beside the kernel cache. Saves merge under a
// file lock, so that processes saving at once lose nothing, and publish atomically.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gemvz/dispatch.h"
#include "gemvz/runtime.h"
#include "nlohmann/json.hpp"
#include "runtime/common/env.h"
#include "runtime/common/file_util.h"
#include "runtime/common/json_check.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"
#include "runtime/dispatch/dispatcher.h"

namespace gemvz {
namespace {

using Json = nlohmann::ordered_json;

// Version 1: {"version": 1, "entries": [{arch, format, m, n, k, config, time_us}, ...]}.
// Version 2: the same; a config may carry the ".rb2" field (KernelConfig::rb), which a gemvz that
// reads only version 1 cannot parse.
// Version 3: the same; a 12-bit entry's warps may take uneven shares of K (64*S*NW*UG need not
// divide K), which a gemvz that reads only versions 1 and 2 rejects as invalid.
// Version 4: the same; a config may take RB 4, which a gemvz that reads only versions 1 to 3
// rejects as invalid.
// Version 5: the same; a config may carry the ".gm" field (group-major weights,
// KernelConfig::order), which a gemvz that reads only versions 1 to 4 cannot parse.
// Version 6: an entry may name the GPU it was measured on ("device"), which a gemvz that reads
// only versions 1 to 5 would ignore, serving that GPU's winners on every GPU of the arch.
// PIPE came in steps too: the first readers of version 1 took 0..3 and those of version 5 up to
// 8; every reader of version 2 takes up to 8 and of version 6 up to 13 (KernelConfig's MaxPipe).
// A file is written as the oldest version that holds all its entries, so that older gemvz keep
// reading it while they can, and refuse it without overwriting it once they cannot. This gemvz
// reads all six.
constexpr int kTuningFileVersion = 6;
constexpr int kOldestTuningFileVersion = 1;

// The oldest version that holds `c`.
int VersionFor(const TunedChoice& c) {
  if (!c.device.empty() || c.config.pipe >= 9) return 6;
  if (c.config.order == WeightOrder::kGroupMajor) return 5;
  if (c.config.rb == 4) return 4;
  if (c.format == WeightFormat::kZ12 && !internal::EvenShares(c.k / 64, c.config)) return 3;
  return c.config.rb != 1 || c.config.pipe >= 4 ? 2 : 1;
}

using ChoiceKey = std::tuple<std::string, std::string, int, int64_t, int64_t, int64_t>;
ChoiceKey KeyOf(const TunedChoice& c) {
  return {c.arch, c.device, static_cast<int>(c.format), c.m, c.n, c.k};
}

// What a tuned choice must satisfy, in the file and on the way in: a valid launch of its shape.
absl::Status CheckChoice(const TunedChoice& c) {
  if (c.arch.empty()) return absl::InvalidArgumentError("arch is empty");
  for (char ch : c.arch) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '_') {
      return absl::InvalidArgumentError(
          absl::StrCat("arch '", internal::Escaped(c.arch), "' is not like sm_90"));
    }
  }
  // JSON strings are UTF-8: the serializer would throw out of SaveTunedChoices on other bytes.
  if (!internal::JsonCanCarry(c.device)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device '", internal::Escaped(c.device), "' is not valid UTF-8"));
  }
  if (c.config.format != c.format) {
    return absl::InvalidArgumentError(absl::StrCat("config ", c.config.ToString(),
                                                   " is not of the entry's format ",
                                                   std::string(FormatName(c.format))));
  }
  if (!std::isfinite(c.time_us) || c.time_us < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("time_us must be a finite number >= 0 (got ", c.time_us, ")"));
  }
  if (c.m < 1)
    return absl::InvalidArgumentError(absl::StrCat("m must be at least 1 (got ", c.m, ")"));
  // m is the rows of one launch; a configuration with fewer token blocks than m runs in chunks
  // (the heuristic's answer where K admits no larger NB), so it is checked at its chunk.
  return Validate(c.config,
                  GemvShape{std::min<int64_t>(c.m, c.config.tokens_per_launch()), c.n, c.k});
}

// CheckChoice, and for a choice to save (not one already in a file, which loads as before) an m
// of one launch: the dispatcher looks up one launch's rows, so an entry for more would never be
// found.
absl::Status CheckSavable(const TunedChoice& c) {
  RETURN_IF_ERROR(CheckChoice(c));
  if (const int64_t rows = internal::LaunchRowsFor(c.m); rows != c.m) {
    return absl::InvalidArgumentError(absl::StrCat(
        "m = ", c.m, " runs as launches of ", rows,
        " rows, which the dispatcher looks up: save the choice for m = ", rows, " instead"));
  }
  return absl::OkStatus();
}

std::string ChoiceName(const TunedChoice& c) {
  // Both escaped: a bad arch or device reaches here, in the message refusing it.
  return absl::StrCat(internal::Escaped(c.arch),
                      c.device.empty() ? "" : absl::StrCat(" (", internal::Escaped(c.device), ")"),
                      " ", std::string(FormatName(c.format)), " ",
                      GemvShape{c.m, c.n, c.k}.ToString());
}

// Parse failures: DataLoss for a corrupt file, FailedPrecondition for a newer schema (which a save
// must not overwrite). Messages are completed with the path by the callers.
absl::StatusOr<std::vector<TunedChoice>> ParseTuningJson(const std::string& text) {
  if (absl::StripAsciiWhitespace(text).empty()) return std::vector<TunedChoice>{};
  // Nesting first, without a DOM: ordered_json copies a deeply nested value recursively.
  if (absl::Status st =
          internal::CheckJsonText(text, internal::kMaxJsonDepth, /*refuse_duplicate_keys=*/false);
      !st.ok()) {
    return absl::DataLossError(absl::StrCat("not valid JSON (", st.message(), ")"));
  }
  Json doc;
  try {
    doc = Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::DataLossError(absl::StrCat("not valid JSON (", e.what(), ")"));
  }
  if (!doc.is_object()) return absl::DataLossError("the top level is not a JSON object");
  const auto version = doc.find("version");
  if (version == doc.end() || !version->is_number_integer()) {
    return absl::DataLossError("no integer \"version\" field");
  }
  // Compared unsigned: a version past int64 is newer too (read as int64 it would wrap to a
  // negative number and set a newer gemvz's file aside as corrupt). JSON's negative integers are
  // the only signed ones.
  if (version->is_number_unsigned() &&
      version->get<uint64_t>() > static_cast<uint64_t>(kTuningFileVersion)) {
    return absl::FailedPreconditionError(absl::StrCat("schema version ", version->get<uint64_t>(),
                                                      " is newer than this gemvz's (",
                                                      kTuningFileVersion, ")"));
  }
  const int64_t v = version->get<int64_t>();
  if (v < kOldestTuningFileVersion) {
    return absl::DataLossError(absl::StrCat("unknown schema version ", v));
  }
  const auto entries = doc.find("entries");
  if (entries == doc.end() || !entries->is_array()) {
    return absl::DataLossError("no \"entries\" array");
  }
  std::vector<TunedChoice> out;
  out.reserve(entries->size());
  for (size_t i = 0; i < entries->size(); ++i) {
    const Json& e = (*entries)[i];
    auto bad = [&](const std::string& why) {
      return absl::DataLossError(absl::StrCat("entry ", i, ": ", why));
    };
    if (!e.is_object()) return bad("not an object");
    auto string_field = [&](const char* name, std::string* value) -> absl::Status {
      const auto it = e.find(name);
      if (it == e.end() || !it->is_string()) return bad(absl::StrCat("no string \"", name, "\""));
      *value = it->get<std::string>();
      return absl::OkStatus();
    };
    auto int_field = [&](const char* name, int64_t* value) -> absl::Status {
      const auto it = e.find(name);
      if (it == e.end() || !it->is_number_integer()) {
        return bad(absl::StrCat("no integer \"", name, "\""));
      }
      if (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t{INT64_MAX}) {
        return bad(absl::StrCat("\"", name, "\" is out of range"));
      }
      *value = it->get<int64_t>();
      return absl::OkStatus();
    };
    TunedChoice c;
    std::string format, config;
    RETURN_IF_ERROR(string_field("arch", &c.arch));
    if (e.contains("device")) RETURN_IF_ERROR(string_field("device", &c.device));
    RETURN_IF_ERROR(string_field("format", &format));
    RETURN_IF_ERROR(int_field("m", &c.m));
    RETURN_IF_ERROR(int_field("n", &c.n));
    RETURN_IF_ERROR(int_field("k", &c.k));
    RETURN_IF_ERROR(string_field("config", &config));
    const auto t = e.find("time_us");
    if (t == e.end() || !t->is_number()) return bad("no number \"time_us\"");
    c.time_us = t->get<double>();
    if (format == "z12") {
      c.format = WeightFormat::kZ12;
    } else if (format == "bf16") {
      c.format = WeightFormat::kBf16;
    } else {
      return bad(absl::StrCat("format '", format, "' is neither z12 nor bf16"));
    }
    absl::StatusOr<KernelConfig> parsed = KernelConfig::Parse(config);
    if (!parsed.ok()) return bad(std::string(parsed.status().message()));
    c.config = *parsed;
    if (absl::Status st = CheckChoice(c); !st.ok()) return bad(std::string(st.message()));
    out.push_back(std::move(c));
  }
  return out;
}

std::string SerializeTuningJson(const std::vector<TunedChoice>& choices) {
  Json entries = Json::array();
  int version = kOldestTuningFileVersion;
  for (const TunedChoice& c : choices) {
    version = std::max(version, VersionFor(c));
    Json e{{"arch", c.arch}};
    if (!c.device.empty()) e["device"] = c.device;
    e["format"] = std::string(FormatName(c.format));
    e["m"] = c.m;
    e["n"] = c.n;
    e["k"] = c.k;
    e["config"] = c.config.ToString();
    e["time_us"] = c.time_us;
    entries.push_back(std::move(e));
  }
  const Json doc{{"version", version}, {"entries", std::move(entries)}};
  return doc.dump(2) + "\n";
}

// Reads and parses `path`; a missing file is empty. Errors name the file.
absl::StatusOr<std::vector<TunedChoice>> ReadTuningFile(const std::string& path) {
  // A FIFO or a device at the path must not hang a serving process, nor a huge file exhaust it.
  constexpr int64_t kMaxTuningFileBytes = int64_t{64} << 20;  // some 400 000 entries
  absl::StatusOr<std::string> text = internal::ReadRegularFile(path, kMaxTuningFileBytes);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) return std::vector<TunedChoice>{};
    return absl::Status(text.status().code(),
                        absl::StrCat("tuning file unreadable: ", text.status().message()));
  }
  absl::StatusOr<std::vector<TunedChoice>> parsed = ParseTuningJson(*text);
  if (!parsed.ok()) {
    return absl::Status(
        parsed.status().code(),
        absl::StrCat("tuning file '", path, "' is ",
                     absl::IsDataLoss(parsed.status()) ? "corrupt" : "unusable", ": ",
                     parsed.status().message(), " (delete it, or fix it by hand)"));
  }
  return parsed;
}

// An exclusive flock on `<tuning file>.lock`, held for one read-merge-write. flock locks belong to
// the open file description, so two threads of one process exclude each other as well. The lock
// file is never removed: removing it would let two savers lock different inodes.
class FileLock {
 public:
  static absl::StatusOr<FileLock> Acquire(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot open the tuning file's lock '", path, "': ", std::strerror(errno)));
    }
    while (::flock(fd, LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("cannot lock '", path, "': ", std::strerror(e)));
    }
    return FileLock(fd);
  }
  FileLock(FileLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  FileLock& operator=(FileLock&&) = delete;
  ~FileLock() {
    if (fd_ >= 0) {
      ::flock(fd_, LOCK_UN);
      ::close(fd_);
    }
  }

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace

std::string TuningFilePath() {
  if (std::optional<std::string> path = internal::GetEnv("GEMVZ_TUNING_FILE")) return *path;
  // Beside the kernel cache; none when that is disabled (GEMVZ_DISABLE_DISK_CACHE=1).
  const std::string dir = CacheDirectory();
  if (dir.empty()) return "";
  return absl::StrCat(dir, "/tuning.json");
}

absl::StatusOr<std::vector<TunedChoice>> LoadTunedChoices() {
  const std::string path = TuningFilePath();
  if (path.empty()) return std::vector<TunedChoice>{};  // no disk cache and no explicit file
  return ReadTuningFile(path);
}

absl::Status SaveTunedChoices(const std::vector<TunedChoice>& choices) {
  // Check every choice before anything is touched: a bad one saves nothing.
  for (size_t i = 0; i < choices.size(); ++i) {
    if (absl::Status st = CheckSavable(choices[i]); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot save tuned choice ", i, " (",
                                                     ChoiceName(choices[i]), "): ", st.message()));
    }
  }
  const std::string path = TuningFilePath();
  if (path.empty()) {
    return absl::FailedPreconditionError(
        "no tuning file: the disk cache is disabled (GEMVZ_DISABLE_DISK_CACHE) and "
        "GEMVZ_TUNING_FILE is not set");
  }
  RETURN_IF_ERROR(internal::CreateDirectories(internal::DirName(path)));

  // Threads of this process queue here rather than each opening the lock file.
  static absl::Mutex* const save_mu = new absl::Mutex();
  absl::MutexLock process_lock(save_mu);
  ASSIGN_OR_RETURN(FileLock file_lock, FileLock::Acquire(path + ".lock"));

  std::map<ChoiceKey, TunedChoice> merged;
  absl::StatusOr<std::vector<TunedChoice>> existing = ReadTuningFile(path);
  if (existing.ok()) {
    for (TunedChoice& c : *existing) merged[KeyOf(c)] = std::move(c);
  } else if (absl::IsDataLoss(existing.status())) {
    // Unusable anyway; keep a copy for whoever wants to look, and start over.
    const std::string aside = path + ".corrupt";
    GEMVZ_LOG_WARNING("%s; replacing it (the old content is kept in '%s')",
                      existing.status().message(), aside);
    if (std::rename(path.c_str(), aside.c_str()) != 0) {
      GEMVZ_LOG_WARNING("cannot keep '%s' as '%s': %s", path, aside, std::strerror(errno));
    }
  } else {
    // Unreadable, or written by a newer gemvz: overwriting would lose what we cannot see.
    return absl::Status(existing.status().code(),
                        absl::StrCat("cannot save tuned choices: ", existing.status().message()));
  }
  for (const TunedChoice& c : choices) {
    // A shape's 12-bit entries share one weight order (its uploads take it, PreferredOrder): a
    // choice of the other order replaces them all, so no m is left with an entry its matrices
    // can never run.
    int dropped = 0;
    for (auto it = merged.begin(); it != merged.end();) {
      const TunedChoice& e = it->second;
      if (e.format == WeightFormat::kZ12 && c.format == WeightFormat::kZ12 && e.arch == c.arch &&
          e.device == c.device && e.n == c.n && e.k == c.k && e.config.order != c.config.order) {
        it = merged.erase(it);
        ++dropped;
      } else {
        ++it;
      }
    }
    if (dropped > 0) {
      const bool group = c.config.order == WeightOrder::kGroupMajor;
      GEMVZ_LOG_WARNING(
          "tuning file: %d %s-major entr%s for %dx%d on %s replaced by %s-major "
          "ones (a shape's entries share one weight order)",
          dropped, group ? "block" : "group", dropped == 1 ? "y" : "ies", c.n, c.k, c.arch,
          group ? "group" : "block");
    }
    merged[KeyOf(c)] = c;
  }

  std::vector<TunedChoice> all;
  all.reserve(merged.size());
  for (auto& [key, c] : merged) all.push_back(std::move(c));
  RETURN_IF_ERROR(internal::AtomicWriteFile(path, SerializeTuningJson(all)));
  internal::InvalidateTuningFileCache();
  GEMVZ_LOG_INFO("saved %d tuned choice(s) to '%s' (%d in the file)",
                 static_cast<int>(choices.size()), path, static_cast<int>(all.size()));
  return absl::OkStatus();
}

}  // namespace gemvz
