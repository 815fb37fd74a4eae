// Configuration lists (see config_list.h).
#include "runtime/jit/config_list.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace gemvz::internal {

std::string_view ConfigLineText(std::string_view line_in) {
  absl::string_view line(line_in.data(), line_in.size());
  if (const size_t hash = line.find('#'); hash != absl::string_view::npos) {
    line = line.substr(0, hash);
  }
  line = absl::StripAsciiWhitespace(line);
  return std::string_view(line.data(), line.size());
}

std::string_view WithoutUtf8Bom(std::string_view text) {
  constexpr std::string_view kBom = "\xEF\xBB\xBF";
  if (text.substr(0, kBom.size()) == kBom) text.remove_prefix(kBom.size());
  return text;
}

absl::StatusOr<std::vector<KernelConfig>> ParseConfigList(std::string_view text,
                                                          std::string_view source_name) {
  std::vector<KernelConfig> out;
  int line_number = 0;
  const std::string all(WithoutUtf8Bom(text));
  for (absl::string_view line : absl::StrSplit(all, '\n')) {
    ++line_number;
    const std::string entry(ConfigLineText(std::string_view(line.data(), line.size())));
    if (entry.empty()) continue;
    absl::StatusOr<KernelConfig> c = KernelConfig::Parse(entry);
    if (!c.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(source_name), ":", line_number, ": ", c.status().message()));
    }
    out.push_back(*c);
  }
  return out;
}

}  // namespace gemvz::internal
