// PackedCheckpoint: reads tensors back from packed (or plain) safetensors files, memory-mapped.
#include "gemvz/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "runtime/checkpoint/packed_tensor.h"
#include "runtime/checkpoint/safetensors.h"
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

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

absl::StatusOr<std::vector<std::string>> CheckpointFiles(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    const std::string msg = absl::StrCat("cannot open checkpoint '", path, "': ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(msg) : absl::InvalidArgumentError(msg);
  }
  if (!S_ISDIR(st.st_mode)) return std::vector<std::string>{path};
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
  std::vector<std::string> files;
  for (const std::string& name : listing.names) {
    if (EndsWith(name, ".safetensors")) files.push_back(absl::StrCat(path, "/", name));
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
  return files;
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

}  // namespace
}  // namespace internal

absl::StatusOr<PackedCheckpoint> PackedCheckpoint::Open(const std::string& path) {
  ASSIGN_OR_RETURN(const std::vector<std::string> paths, internal::CheckpointFiles(path));
  auto state = std::make_shared<internal::CheckpointState>();
  for (const std::string& p : paths) {
    ASSIGN_OR_RETURN(std::unique_ptr<internal::SafetensorsFile> f,
                     internal::SafetensorsFile::Open(p));
    RETURN_IF_ERROR(internal::AddFile(*state, std::move(f)));
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
