// PackedCheckpoint: reads tensors back from packed (or plain) safetensors files, memory-mapped.
#include "gemvz/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/checkpoint/packed_tensor.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/shard_index.h"
#include "runtime/common/file_util.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"

namespace gemvz {
namespace internal {

struct CheckpointState {
  struct Location {
    size_t file = 0;
    bool packed = false;
    PackedTensorMeta meta;                    // packed
    const SafetensorsEntry* entry = nullptr;  // kept as is
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<TensorInfo> tensors;
  std::map<std::string, Location> where;
};

namespace {

// What a checkpoint path holds: the files to open and, for a directory, its indexes.
struct CheckpointLayout {
  std::vector<std::string> files;  // sorted
  std::vector<ShardIndex> indexes;
};

// The first few of `items` (already quoted), and how many more there are.
std::string FirstFew(const std::vector<std::string>& items) {
  constexpr size_t kShown = 3;
  const size_t shown = std::min(items.size(), kShown);
  std::string out = absl::StrJoin(items.begin(), items.begin() + shown, ", ");
  if (items.size() > shown) absl::StrAppend(&out, " and ", items.size() - shown, " more");
  return out;
}

// The weight_map of the index `name` in `dir`, each value checked to be a shard file name.
absl::StatusOr<ShardIndex> ReadShardIndex(const std::string& dir, const std::string& name) {
  const std::string where =
      absl::StrCat("checkpoint directory '", dir, "': its index '", Escaped(name), "'");
  // Small (a name and a file name per tensor); capped like a safetensors header, so that a huge
  // file or a FIFO in its place can neither exhaust nor hang the reader.
  absl::StatusOr<std::string> text =
      ReadRegularFile(absl::StrCat(dir, "/", name), kMaxSafetensorsHeaderBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat(where, " cannot be read: ", text.status().message()));
  }
  absl::StatusOr<ShardIndex> index = ParseShardIndex(*text, name);
  if (!index.ok()) {
    return absl::Status(index.status().code(),
                        absl::StrCat(where, " ", index.status().message(), "; nothing was opened"));
  }
  return index;
}

// Every shard `index` names is among `shards` (the directory's *.safetensors entries).
absl::Status CheckIndexedShardsPresent(const std::string& dir, const ShardIndex& index,
                                       const std::set<std::string>& shards) {
  std::set<std::string> missing;
  for (const auto& [tensor, shard] : index.weight_map) {
    if (shards.count(shard) == 0) missing.insert(shard);
  }
  if (missing.empty()) return absl::OkStatus();
  std::vector<std::string> quoted;
  for (const std::string& shard : missing) quoted.push_back(absl::StrCat("'", Escaped(shard), "'"));
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint directory '", dir, "': its index '", Escaped(index.name), "' names ",
      missing.size(), missing.size() == 1 ? " file" : " files",
      " that the directory lacks: ", FirstFew(quoted),
      " (an unfinished download?); the checkpoint would lack their tensors, so nothing was "
      "opened"));
}

// Reads every *.safetensors.index.json in `dir` (`names`: its entries) and checks that the
// shards each names are there.
absl::StatusOr<std::vector<ShardIndex>> ReadShardIndexes(const std::string& dir,
                                                         const std::vector<std::string>& names) {
  std::set<std::string> shards;
  std::set<std::string> index_names;  // sorted: the same one is at fault on every run
  for (const std::string& name : names) {
    if (absl::EndsWith(name, ".safetensors")) shards.insert(name);
    if (absl::EndsWith(name, kShardIndexSuffix)) index_names.insert(name);
  }
  std::vector<ShardIndex> indexes;
  for (const std::string& name : index_names) {
    ASSIGN_OR_RETURN(ShardIndex index, ReadShardIndex(dir, name));
    RETURN_IF_ERROR(CheckIndexedShardsPresent(dir, index, shards));
    indexes.push_back(std::move(index));
  }
  return indexes;
}

absl::StatusOr<CheckpointLayout> CheckpointFiles(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    const std::string msg = absl::StrCat("cannot open checkpoint '", path, "': ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(msg) : absl::InvalidArgumentError(msg);
  }
  if (!S_ISDIR(st.st_mode)) return CheckpointLayout{{path}, {}};
  const DirectoryListing listing = ListDirectory(path);
  if (listing.open_errno != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot list checkpoint directory '", path,
                                                    "': ", std::strerror(listing.open_errno)));
  }
  // Taken for the end, a failed listing would open the checkpoint without the shards not yet
  // listed.
  if (listing.read_errno != 0) {
    return absl::UnavailableError(absl::StrCat("cannot list checkpoint directory '", path,
                                               "': ", std::strerror(listing.read_errno)));
  }
  // An index names the shards that must be there: one missing is refused before anything is
  // opened, and named (the "no .safetensors file" below would not say which).
  ASSIGN_OR_RETURN(std::vector<ShardIndex> indexes, ReadShardIndexes(path, listing.names));
  std::vector<std::string> files;
  for (const std::string& name : listing.names) {
    if (absl::EndsWith(name, ".safetensors")) files.push_back(absl::StrCat(path, "/", name));
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint directory '", path, "' holds no .safetensors file"));
  }
  // Every *.safetensors entry is a shard: one that is not a file (a directory, a FIFO, a link
  // whose target is gone, as a download left unfinished leaves in a cache of links) is refused,
  // named, before anything is opened. Skipping it would open the checkpoint without its tensors.
  for (const std::string& f : files) {
    if (const std::string kind = NotARegularFile(f); !kind.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint directory '", path, "': its entry '", Escaped(f.substr(path.size() + 1)),
          "' is ", kind,
          ": every *.safetensors entry of a checkpoint directory is read as one of its files, so "
          "remove or rename it (or put the missing file in its place); nothing was opened"));
    }
  }
  return CheckpointLayout{std::move(files), std::move(indexes)};
}

// Adds one file's logical tensors to `state`.
absl::Status AddFile(CheckpointState& state, std::unique_ptr<SafetensorsFile> file) {
  const size_t index = state.files.size();
  const SafetensorsFile& f = *file;
  const std::string where = absl::StrCat("safetensors file '", f.path(), "'");
  state.files.push_back(std::move(file));

  auto version = f.metadata().find(kMetaVersionKey);
  if (version != f.metadata().end()) {
    int v = 0;
    if (!absl::SimpleAtoi(version->second, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": metadata ", kMetaVersionKey, " = '",
                                                     Escaped(version->second),
                                                     "' is not a version number"));
    }
    if (v > kCheckpointFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": packed-checkpoint version ", v, " is newer than this build of gemvz reads (",
          kCheckpointFormatVersion, "); upgrade gemvz"));
    }
  }

  auto add = [&](TensorInfo info, CheckpointState::Location loc) -> absl::Status {
    auto [it, inserted] = state.where.emplace(info.name, loc);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", internal::Escaped(info.name), "' appears twice: in '",
                       state.files[it->second.file]->path(), "' and in '", f.path(), "'"));
    }
    state.tensors.push_back(std::move(info));
    return absl::OkStatus();
  };

  std::map<std::string, bool> is_part;
  const std::string prefix = kMetaTensorPrefix;
  for (const auto& [key, value] : f.metadata()) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name = key.substr(prefix.size());
    absl::StatusOr<PackedTensorMeta> meta = DecodePackedTensorMeta(value);
    if (!meta.ok()) {
      return absl::Status(meta.status().code(),
                          absl::StrCat(where, ", packed tensor '", internal::Escaped(name),
                                       "': ", meta.status().message()));
    }
    RETURN_IF_ERROR(CheckPackedParts(f, name, *meta));
    TensorInfo info;
    info.name = name;
    info.file = f.path();
    info.dtype = "BF16";
    info.shape = {meta->rows, meta->cols};
    info.packed = true;
    for (int i = 0; i < kPackedParts; ++i) {
      const SafetensorsEntry* e = f.Find(PackedPartName(name, i));
      info.stored_bytes += static_cast<int64_t>(e->end - e->begin);
      is_part[e->name] = true;
    }
    CheckpointState::Location loc;
    loc.file = index;
    loc.packed = true;
    loc.meta = *meta;
    RETURN_IF_ERROR(add(std::move(info), loc));
  }
  for (const SafetensorsEntry& e : f.tensors()) {
    if (is_part.count(e.name)) continue;
    TensorInfo info;
    info.name = e.name;
    info.file = f.path();
    info.dtype = e.dtype;
    info.shape = e.shape;
    info.stored_bytes = static_cast<int64_t>(e.end - e.begin);
    CheckpointState::Location loc;
    loc.file = index;
    loc.entry = &e;
    RETURN_IF_ERROR(add(std::move(info), loc));
  }
  return absl::OkStatus();
}

// Every tensor `index` names is in the shard it names (a packed tensor under its logical name).
// Tensors that no index names are accepted, as Hugging Face's loaders accept them.
absl::Status CheckIndexedTensors(const std::string& dir, const ShardIndex& index,
                                 const CheckpointState& state) {
  std::vector<std::string> misplaced;
  for (const auto& [tensor, shard] : index.weight_map) {
    auto it = state.where.find(tensor);
    const std::string found =
        it == state.where.end() ? "" : BaseName(state.files[it->second.file]->path());
    if (found == shard) continue;
    misplaced.push_back(
        absl::StrCat("'", Escaped(tensor), "' (not in '", Escaped(shard), "'",
                     found.empty() ? "" : absl::StrCat("; in '", Escaped(found), "'"), ")"));
  }
  if (misplaced.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoint directory '", dir, "': its index '", Escaped(index.name), "' names ",
                   misplaced.size(), misplaced.size() == 1 ? " tensor" : " tensors",
                   " that the file it gives does not hold: ", FirstFew(misplaced),
                   " (a file cut short or replaced, or an index of another checkpoint)"));
}

}  // namespace
}  // namespace internal

absl::StatusOr<PackedCheckpoint> PackedCheckpoint::Open(const std::string& path) {
  ASSIGN_OR_RETURN(const internal::CheckpointLayout layout, internal::CheckpointFiles(path));
  auto state = std::make_shared<internal::CheckpointState>();
  for (const std::string& p : layout.files) {
    ASSIGN_OR_RETURN(std::unique_ptr<internal::SafetensorsFile> f,
                     internal::SafetensorsFile::Open(p));
    RETURN_IF_ERROR(internal::AddFile(*state, std::move(f)));
  }
  for (const internal::ShardIndex& index : layout.indexes) {
    RETURN_IF_ERROR(internal::CheckIndexedTensors(path, index, *state));
  }
  std::sort(state->tensors.begin(), state->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  PackedCheckpoint c;
  c.state_ = std::move(state);
  return c;
}

const std::vector<TensorInfo>& PackedCheckpoint::tensors() const {
  static const std::vector<TensorInfo>* const kNone = new std::vector<TensorInfo>();
  return state_ ? state_->tensors : *kNone;
}

absl::StatusOr<TensorInfo> PackedCheckpoint::Info(const std::string& name) const {
  if (!state_) return absl::FailedPreconditionError("checkpoint not open");
  auto it = std::lower_bound(state_->tensors.begin(), state_->tensors.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  if (it == state_->tensors.end() || it->name != name) {
    return absl::NotFoundError(
        absl::StrCat("no tensor '", internal::Escaped(name), "' in the checkpoint"));
  }
  return *it;
}

absl::StatusOr<PackedMatrix> PackedCheckpoint::GetPacked(const std::string& name) const {
  if (!state_) return absl::FailedPreconditionError("checkpoint not open");
  auto it = state_->where.find(name);
  if (it == state_->where.end()) {
    return absl::NotFoundError(
        absl::StrCat("no tensor '", internal::Escaped(name), "' in the checkpoint"));
  }
  const internal::SafetensorsFile& f = *state_->files[it->second.file];
  if (!it->second.packed) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor '", internal::Escaped(name), "' in '", f.path(), "' is not packed (",
                     it->second.entry->dtype, "); read it with GetRaw or GetBf16"));
  }
  return internal::ReadPackedTensor(f, name, it->second.meta);
}

absl::StatusOr<TensorView> PackedCheckpoint::GetRaw(const std::string& name) const {
  if (!state_) return absl::FailedPreconditionError("checkpoint not open");
  auto it = state_->where.find(name);
  if (it == state_->where.end()) {
    return absl::NotFoundError(
        absl::StrCat("no tensor '", internal::Escaped(name), "' in the checkpoint"));
  }
  const internal::SafetensorsFile& f = *state_->files[it->second.file];
  if (it->second.packed) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor '", internal::Escaped(name), "' in '", f.path(),
                     "' is packed; read it with GetPacked or GetBf16"));
  }
  const internal::SafetensorsEntry& e = *it->second.entry;
  TensorView v;
  v.dtype = e.dtype;
  v.shape = e.shape;
  v.data = f.data(e);
  v.size = e.end - e.begin;
  return v;
}

absl::StatusOr<std::vector<uint16_t>> PackedCheckpoint::GetBf16(const std::string& name) const {
  if (!state_) return absl::FailedPreconditionError("checkpoint not open");
  auto it = state_->where.find(name);
  if (it != state_->where.end() && it->second.packed) {
    ASSIGN_OR_RETURN(const PackedMatrix p, GetPacked(name));
    return Unpack(p);
  }
  ASSIGN_OR_RETURN(const TensorView v, GetRaw(name));
  if (v.dtype != "BF16") {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", internal::Escaped(name), "' is ", v.dtype, ", not BF16"));
  }
  std::vector<uint16_t> out(v.size / 2);
  if (v.size > 0) std::memcpy(out.data(), v.data, v.size);
  return out;
}

}  // namespace gemvz
