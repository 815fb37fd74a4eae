#include "runtime/common/log.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace gemvz::internal {

std::string Excerpt(std::string_view s, size_t max) {
  if (s.size() <= max) return std::string(s);
  return std::string(s.substr(0, max)) + "...";
}

std::string Escaped(std::string_view s, size_t max) { return absl::CHexEscape(Excerpt(s, max)); }

int LogVerbosity() {
  static const int level = [] {
    const char* v = std::getenv("GEMVZ_LOG");
    if (v == nullptr || *v == '\0') return 0;
    // A whole number >= 0, above 2 taken as 2. Anything else would silence the warnings (atoi
    // made "debug" 0, and "-1" hid them all): it is said once, and warnings stay on.
    int64_t n = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &n) || n < 0) {
      LogLine(LogLevel::kWarning,
              absl::StrCat("GEMVZ_LOG='", v,
                           "' is not a level: 0 (warnings), 1 (info) or 2 (debug); using 0"));
      return 0;
    }
    return static_cast<int>(std::min<int64_t>(n, 2));
  }();
  return level;
}

void LogLine(LogLevel level, const std::string& message) {
  static std::mutex mu;  // one line at a time, even from many threads
  static const char* const kTags[] = {"warning", "info", "debug"};
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "[gemvz %s] %s\n", kTags[static_cast<int>(level)], message.c_str());
}

}  // namespace gemvz::internal
