#include "runtime/checkpoint/shard_index.h"

#include <cctype>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "runtime/common/json_check.h"
#include "runtime/common/log.h"

namespace gemvz::internal {

bool IsShardFileName(const std::string& shard) {
  return absl::EndsWith(shard, ".safetensors") && shard.find('/') == std::string::npos &&
         shard.find('\0') == std::string::npos;
}

absl::StatusOr<ShardIndex> ParseShardIndex(const std::string& text, const std::string& name) {
  if (absl::Status st = CheckJsonText(text, kMaxJsonDepth, /*refuse_duplicate_keys=*/true);
      !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("is not valid JSON: ", st.message()));
  }
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto map = doc.is_object() ? doc.find("weight_map") : doc.end();
  if (!doc.is_object() || map == doc.end() || !map->is_object()) {
    return absl::InvalidArgumentError("has no \"weight_map\" object");
  }
  ShardIndex index;
  index.name = name;
  for (auto it = map->begin(); it != map->end(); ++it) {
    if (!it.value().is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("maps tensor '", Escaped(it.key()),
                                                     "' to a value of type ",
                                                     it.value().type_name(), ", not a file name"));
    }
    const std::string& shard = it.value().get_ref<const std::string&>();
    if (!IsShardFileName(shard)) {
      return absl::InvalidArgumentError(
          absl::StrCat("maps tensor '", Escaped(it.key()), "' to '", Escaped(shard),
                       "', which is not the name of a *.safetensors file of the directory"));
    }
    index.weight_map.emplace(it.key(), shard);
  }
  return index;
}

namespace {

// The prefix of "<prefix>-NNNNN-of-NNNNN.safetensors", or "" when `name` is not one.
std::string HuggingFaceShardPrefix(const std::string& name) {
  constexpr char kExt[] = ".safetensors";
  if (!absl::EndsWith(name, kExt)) return "";
  const size_t end = name.size() - (sizeof(kExt) - 1);
  // Walks back over "-NNNNN" (five digits or more); returns where its '-' is, or npos.
  auto number_before = [&](size_t e) -> size_t {
    size_t b = e;
    while (b > 0 && std::isdigit(static_cast<unsigned char>(name[b - 1]))) --b;
    if (e - b < 5 || b == 0 || name[b - 1] != '-') return std::string::npos;
    return b - 1;
  };
  const size_t total = number_before(end);
  if (total == std::string::npos || total < 3 || name.compare(total - 3, 3, "-of") != 0) {
    return "";
  }
  const size_t index = number_before(total - 3);
  if (index == std::string::npos || index == 0) return "";
  return name.substr(0, index);
}

}  // namespace

std::string ShardIndexNameFor(const std::vector<std::string>& shard_names, std::string* why_none) {
  if (why_none != nullptr) why_none->clear();
  if (shard_names.size() < 2) return "";
  std::string prefix;
  bool one_prefix = true;
  for (const std::string& n : shard_names) {
    if (!IsShardFileName(n) || !JsonCanCarry(n)) {
      if (why_none != nullptr) {
        *why_none = absl::StrCat("'", Escaped(n),
                                 "' is not a *.safetensors file name that an index can hold "
                                 "(UTF-8, no '/')");
      }
      return "";
    }
    const std::string p = HuggingFaceShardPrefix(n);
    if (p.empty() || (!prefix.empty() && p != prefix)) one_prefix = false;
    prefix = p;
  }
  return absl::StrCat(one_prefix ? prefix : "model", kShardIndexSuffix);
}

std::string ShardIndexJson(const std::map<std::string, std::string>& weight_map,
                           uint64_t total_size,
                           const std::map<std::string, std::string>& metadata) {
  nlohmann::json meta = nlohmann::json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta["total_size"] = total_size;
  // nlohmann::json keeps object keys sorted: the bytes depend on the content only. Names came
  // from valid JSON and file names were checked (ShardIndexNameFor), but never let a byte throw.
  const nlohmann::json doc = {{"metadata", std::move(meta)}, {"weight_map", weight_map}};
  return doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace gemvz::internal
