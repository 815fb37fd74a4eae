// A pass over JSON text before it is parsed into a DOM: nlohmann's DOM copes badly with what a
// corrupt or hostile file can hold (ordered_json copies a deeply nested value recursively, dump()
// recurses, and a parser callback that watches keys rescans every parent object, quadratic in its
// size), so the files gemvz reads (safetensors headers, the tuning file, packed-tensor metadata)
// are first checked here with the SAX parser, which keeps no DOM and does not recurse.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace gemvz::internal {

// The deepest nesting of objects and arrays gemvz's own files need is 4; 64 leaves room.
inline constexpr int kMaxJsonDepth = 64;

// OK when `text` is one JSON value nested at most `max_depth` deep and, with
// `refuse_duplicate_keys`, no object repeats a key (a DOM parse would keep the last silently).
// Otherwise InvalidArgument saying what: the nesting, the repeated key (cut to 200 characters), or
// the parser's own syntax error.
absl::Status CheckJsonText(std::string_view text, int max_depth, bool refuse_duplicate_keys);

// Whether a JSON string can hold `s` as it is: valid UTF-8, which nlohmann's strict dump needs (it
// throws on other bytes). For names from outside (file names, device names) before they are
// written into JSON.
bool JsonCanCarry(std::string_view s);

}  // namespace gemvz::internal
