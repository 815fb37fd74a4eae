// A tiny logger behind GEMVZ_LOG (0 = warnings only, 1 = info, 2 = debug). Debian's Abseil has no
// ABSL_LOG, and the library must stay quiet unless asked.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"

namespace gemvz::internal {

enum class LogLevel { kWarning = 0, kInfo = 1, kDebug = 2 };

// The level from GEMVZ_LOG, read once.
int LogVerbosity();
void LogLine(LogLevel level, const std::string& message);

// What a message quotes of `s`, which may be as long as the file it came from: at most `max`
// bytes, "..." after a cut.
std::string Excerpt(std::string_view s, size_t max);

// What a message shows of text from outside (a tensor's name from a file's header, a
// configuration line): Excerpt(s, max) with every byte outside printable ASCII, quotes and
// backslashes escaped (\x1b, \x00, \xc2\x9b for U+009B, \', \\), so that a NUL or a terminal
// escape (C0 or C1) in a file cannot cut the message or rewrite the screen where it is printed.
std::string Escaped(std::string_view s, size_t max = 200);

template <typename... Args>
void Log(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
  if (static_cast<int>(level) > LogVerbosity()) return;
  LogLine(level, absl::StrFormat(format, args...));
}

}  // namespace gemvz::internal

#define GEMVZ_LOG_INFO(...) ::gemvz::internal::Log(::gemvz::internal::LogLevel::kInfo, __VA_ARGS__)
#define GEMVZ_LOG_DEBUG(...) ::gemvz::internal::Log(::gemvz::internal::LogLevel::kDebug, __VA_ARGS__)
#define GEMVZ_LOG_WARNING(...) \
  ::gemvz::internal::Log(::gemvz::internal::LogLevel::kWarning, __VA_ARGS__)
