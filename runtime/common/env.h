// Environment variables, read one way everywhere: unset and empty mean "not given", booleans and
// byte sizes are parsed with one grammar, and a malformed value falls back, with a warning once
// per process for each variable and value (they are read on every compile or call).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace gemvz::internal {

// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string> GetEnv(const char* name);

// 1/true/yes/on and 0/false/no/off (any case). Anything else warns and gives `default_value`.
bool GetEnvBool(const char* name, bool default_value);

// A decimal integer. A malformed value warns and gives `default_value`.
int64_t GetEnvInt64(const char* name, int64_t default_value);

// "1073741824", "512K", "64M", "1G", "2T" (powers of 1024; an optional "B"/"iB" suffix, e.g.
// "64MiB", is accepted). Negative or overflowing sizes are errors.
absl::StatusOr<int64_t> ParseByteSize(std::string_view text);
// A byte size from the environment; a malformed value warns and gives `default_value`.
int64_t GetEnvBytes(const char* name, int64_t default_value);

// $HOME, else the password database's home directory, else "" (then nothing is cached on disk).
std::string HomeDirectory();

}  // namespace gemvz::internal
