#include "runtime/common/log.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace gemvz::internal {

int LogVerbosity() {
  static const int level = [] {
    const char* v = std::getenv("GEMVZ_LOG");
    return (v == nullptr || *v == '\0') ? 0 : std::atoi(v);
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
