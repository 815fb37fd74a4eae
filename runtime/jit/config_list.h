// Configuration lists for warm-up: a text file with one KernelConfig per line ("z12.nw8.ug2.nb2.
// pipe3.s1"), '#' comments and blank lines allowed; errors name the file and the line.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "gemvz/config.h"

namespace gemvz::internal {

// The most bytes a configuration list (warm-up's --configs, tune's --space) may hold: some
// 500 000 lines, far more than any sweep, and a bound on what /dev/zero or an endless pipe given
// as one can take.
inline constexpr int64_t kMaxConfigListBytes = int64_t{16} << 20;

// A line of a configuration list without its comment ('#' to the end) and surrounding
// whitespace; empty for a blank or comment line. The rule of warm-up's --configs and tune's
// --space.
std::string_view ConfigLineText(std::string_view line);

// `text` without the UTF-8 byte order mark (EF BB BF) that some editors put at the start of a
// file; else `text` itself. Configuration lists are read through it, so that their first line
// parses.
std::string_view WithoutUtf8Bom(std::string_view text);

// Parses `text` (a byte order mark at its start skipped); `source_name` (a path, or "<stdin>")
// prefixes error messages as "name:line: ".
absl::StatusOr<std::vector<KernelConfig>> ParseConfigList(std::string_view text,
                                                          std::string_view source_name);

}  // namespace gemvz::internal
