// Hugging Face's index of a sharded checkpoint, `<prefix>.safetensors.index.json`:
// {"metadata": {"total_size": N, ...}, "weight_map": {"tensor": "shard.safetensors", ...}}.
// Read by PackedCheckpoint::Open to check a directory against it, written by PackCheckpoint
// beside two or more outputs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gemvz::internal {

inline constexpr char kShardIndexSuffix[] = ".safetensors.index.json";

// One index: its weight_map.
struct ShardIndex {
  std::string name;                               // its file name in the directory
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name
};

// Whether an index may name `shard`: a plain file name of a *.safetensors file, so that it can
// only mean an entry of the directory itself.
bool IsShardFileName(const std::string& shard);

// The weight_map of index text, each value checked to be a shard file name (`name` is only
// copied into the result). Errors are InvalidArgument, their message a phrase to follow the
// index's name: "is not valid JSON: ...", "has no \"weight_map\" object", "maps tensor 'w' to
// ...".
absl::StatusOr<ShardIndex> ParseShardIndex(const std::string& text, const std::string& name);

// The name of the index to write beside shards named `shard_names` (file names), or "" for none,
// with `why_none` (when given) saying why where there is a reason to say: one shard needs no
// index (Hugging Face writes none for one file; `why_none` stays empty), and an index can name
// only *.safetensors files whose names JSON carries unchanged (UTF-8). The name is
// "<prefix>.safetensors.index.json" when every shard is "<prefix>-NNNNN-of-NNNNN.safetensors"
// with one prefix (five digits or more, as Hugging Face numbers them), else
// "model.safetensors.index.json".
std::string ShardIndexNameFor(const std::vector<std::string>& shard_names,
                              std::string* why_none = nullptr);

// The text of an index: `weight_map`, and "metadata" holding "total_size" and `metadata`'s
// strings. Keys sorted, two-space indentation and a final newline, as Hugging Face writes it:
// the same arguments give the same bytes.
std::string ShardIndexJson(const std::map<std::string, std::string>& weight_map,
                           uint64_t total_size, const std::map<std::string, std::string>& metadata);

}  // namespace gemvz::internal
