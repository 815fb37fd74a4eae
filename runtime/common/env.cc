// Environment variable helpers (see env.h).
#include "runtime/common/env.h"

#include <pwd.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "runtime/common/log.h"

namespace gemvz::internal {

namespace {

// True the first time (name, value) is malformed in this process: the variables are read on
// every compile or every call, and one warning says it.
bool FirstWarning(const char* name, const std::string& value) {
  static std::mutex mu;
  static auto* warned = new std::set<std::pair<std::string, std::string>>();
  std::lock_guard<std::mutex> lock(mu);
  return warned->emplace(name, value).second;
}

}  // namespace

std::optional<std::string> GetEnv(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool GetEnvBool(const char* name, bool default_value) {
  const std::optional<std::string> v = GetEnv(name);
  if (!v) return default_value;
  const std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(*v));
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  if (FirstWarning(name, *v)) {
    GEMVZ_LOG_WARNING("%s='%s' is not a boolean (1/0, true/false, yes/no, on/off); using %s", name,
                      *v, default_value ? "1" : "0");
  }
  return default_value;
}

int64_t GetEnvInt64(const char* name, int64_t default_value) {
  const std::optional<std::string> v = GetEnv(name);
  if (!v) return default_value;
  int64_t out = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*v), &out)) {
    if (FirstWarning(name, *v)) {
      GEMVZ_LOG_WARNING("%s='%s' is not an integer; using %d", name, *v, default_value);
    }
    return default_value;
  }
  return out;
}

absl::StatusOr<int64_t> ParseByteSize(std::string_view text) {
  // Debian's Abseil has its own string_view type, distinct from std::string_view.
  const std::string original(text);
  absl::string_view s = absl::StripAsciiWhitespace(original);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("bad byte size '", original, "': ", why,
                                                   " (examples: 1073741824, 512M, 1G, 64MiB)"));
  };
  if (s.empty()) return bad("empty");
  // Split the digits from the unit.
  size_t digits = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) ++digits;
  if (digits == 0) return bad("it must start with a non-negative whole number");
  uint64_t value = 0;
  if (!absl::SimpleAtoi(s.substr(0, digits), &value)) return bad("number too large");
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(digits)));
  if (absl::EndsWith(unit, "ib")) {
    unit.resize(unit.size() - 2);
    if (unit.empty()) return bad("'iB' needs a prefix, e.g. MiB");
  } else if (absl::EndsWith(unit, "b")) {
    unit.resize(unit.size() - 1);
  }
  int shift = 0;
  if (unit.empty()) {
    shift = 0;
  } else if (unit == "k") {
    shift = 10;
  } else if (unit == "m") {
    shift = 20;
  } else if (unit == "g") {
    shift = 30;
  } else if (unit == "t") {
    shift = 40;
  } else {
    return bad("unknown unit; use K, M, G or T");
  }
  const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) >> shift;
  if (value > limit) return bad("too large");
  return static_cast<int64_t>(value << shift);
}

int64_t GetEnvBytes(const char* name, int64_t default_value) {
  const std::optional<std::string> v = GetEnv(name);
  if (!v) return default_value;
  absl::StatusOr<int64_t> parsed = ParseByteSize(*v);
  if (!parsed.ok()) {
    if (FirstWarning(name, *v)) {
      GEMVZ_LOG_WARNING("%s: %s; using %d bytes", name, parsed.status().message(), default_value);
    }
    return default_value;
  }
  return *parsed;
}

std::string HomeDirectory() {
  if (std::optional<std::string> home = GetEnv("HOME")) return *home;
  // getpwuid_r: the reentrant form, since any thread may ask. sysconf's size is a hint (1024 on
  // glibc): an entry past it (a long GECOS field, a directory service's) answers ERANGE, and the
  // buffer doubles, up to 1 MiB, rather than the disk cache going off for want of a home.
  const long hint = ::sysconf(_SC_GETPW_R_SIZE_MAX);
  std::vector<char> buf(hint > 0 ? static_cast<size_t>(hint) : 16384);
  struct passwd pw;
  struct passwd* result = nullptr;
  int err;
  while ((err = ::getpwuid_r(::getuid(), &pw, buf.data(), buf.size(), &result)) == ERANGE &&
         buf.size() < (size_t{1} << 20)) {
    buf.resize(buf.size() * 2);
  }
  if (err == 0 && result != nullptr && result->pw_dir != nullptr && result->pw_dir[0] != '\0') {
    return result->pw_dir;
  }
  return "";
}

}  // namespace gemvz::internal
