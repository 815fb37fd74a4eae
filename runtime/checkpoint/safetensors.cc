// safetensors reader (mmap, nlohmann_json) and streaming writer; see safetensors.h.
#include "runtime/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "runtime/common/file_util.h"
#include "runtime/common/json_check.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"

namespace gemvz::internal {
namespace {

using Json = nlohmann::json;

struct DtypeInfo {
  const char* name;
  int size;
};
// The dtypes of the safetensors specification with a whole number of bytes per element.
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
    {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8},     {"C64", 8},
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Reads a JSON value that must be an unsigned integer (nlohmann stores non-negative integers as
// number_unsigned; negatives and anything beyond uint64 come out as other types).
bool GetUnsigned(const Json& j, uint64_t* out) {
  if (!j.is_number_unsigned()) return false;
  *out = j.get<uint64_t>();
  return true;
}

}  // namespace

absl::StatusOr<int> SafetensorsDtypeSize(const std::string& dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (dtype == d.name) return d.size;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", Escaped(dtype), "'"));
}

// dtype size * numel of `shape`, false when a dimension is negative or the product overflows
// uint64 (a zero dimension makes it 0 whatever the others are).
bool TensorBytes(uint64_t elem, const std::vector<int64_t>& shape, uint64_t* bytes) {
  for (int64_t d : shape) {
    if (d < 0) return false;
  }
  if (std::count(shape.begin(), shape.end(), 0) > 0) {
    *bytes = 0;
    return true;
  }
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *bytes = n;
  return true;
}

int64_t SafetensorsEntry::numel() const {
  uint64_t n = 0;
  if (!TensorBytes(1, shape, &n) ||
      n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return -1;
  }
  return static_cast<int64_t>(n);
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), file_size_);
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry* SafetensorsFile::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::WillNeed(uint64_t offset, uint64_t size) const {
  if (size == 0) return;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t b = (data_offset_ + offset) / page * page;
  const uint64_t e = std::min(data_offset_ + offset + size, file_size_);
  ::madvise(const_cast<uint8_t*>(base_) + b, e - b, MADV_SEQUENTIAL);
  ::madvise(const_cast<uint8_t*>(base_) + b, e - b, MADV_WILLNEED);
}

void SafetensorsFile::Release(uint64_t offset, uint64_t size) const {
  if (size == 0) return;
  // Whole pages inside the range only: a page shared with a neighbour may still be in use.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t b = (data_offset_ + offset + page - 1) / page * page;
  const uint64_t e = (data_offset_ + offset + size) / page * page;
  if (e > b) ::madvise(const_cast<uint8_t*>(base_) + b, e - b, MADV_DONTNEED);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const std::string where = absl::StrCat("safetensors file '", path, "'");
  auto fail = [&](const std::string& msg) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", msg));
  };
  auto tensor_fail = [&](const std::string& name, const std::string& msg) {
    return absl::InvalidArgumentError(absl::StrCat(where, ", tensor '", Escaped(name), "': ", msg));
  };

  // Looked at before it is opened: a device is not opened at all, and a link that leads nowhere
  // is said to be one (open would only say "No such file or directory").
  if (const std::string kind = NotARegularFile(path); !kind.empty()) {
    return fail(absl::StrCat("not a regular file: ", kind));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  // O_NONBLOCK: a FIFO put in the file's place since must not wait for a writer (fstat refuses
  // it).
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f->fd_ < 0) return ErrnoStatus(absl::StrCat("cannot open ", where));
  struct stat st;
  if (::fstat(f->fd_, &st) != 0) return ErrnoStatus(absl::StrCat("cannot stat ", where));
  if (!S_ISREG(st.st_mode)) return fail("not a regular file");
  f->file_size_ = static_cast<uint64_t>(st.st_size);

  // Header length, then the header, both against the file size.
  if (f->file_size_ < 8) {
    return fail(
        absl::StrCat("truncated: ", f->file_size_, " bytes, less than the 8-byte header length"));
  }
  uint8_t len_bytes[8];
  if (::pread(f->fd_, len_bytes, 8, 0) != 8) {
    return ErrnoStatus(absl::StrCat("cannot read ", where));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > f->file_size_ - 8) {
    return fail(absl::StrCat("header length ", header_len, " runs past the end of the file (",
                             f->file_size_, " bytes): truncated, or not a safetensors file"));
  }
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return fail(absl::StrCat("header length ", header_len, " is above the ",
                             kMaxSafetensorsHeaderBytes, "-byte limit"));
  }
  if (header_len < 2) return fail(absl::StrCat("header length ", header_len, " is too small"));
  f->data_offset_ = 8 + header_len;
  const uint64_t data_size = f->file_size_ - f->data_offset_;

  void* map = ::mmap(nullptr, f->file_size_, PROT_READ, MAP_PRIVATE, f->fd_, 0);
  if (map == MAP_FAILED) return ErrnoStatus(absl::StrCat("cannot map ", where));
  f->base_ = static_cast<const uint8_t*>(map);
  // The mapping keeps the file: a descriptor held per file would run a checkpoint of more shards
  // than the open file limit (ulimit -n) out of them.
  ::close(f->fd_);
  f->fd_ = -1;

  // The JSON header. First checked without building it (json_check.h): nesting, and no repeated
  // key, which the parser would resolve silently (last one wins). A NUL would end the parser's
  // input early, hiding whatever follows it.
  const char* hb = reinterpret_cast<const char*>(f->base_ + 8);
  if (const void* nul = std::memchr(hb, '\0', header_len); nul != nullptr) {
    return fail(
        absl::StrCat("header holds a NUL byte at offset ", static_cast<const char*>(nul) - hb));
  }
  if (absl::Status st = CheckJsonText(std::string_view(hb, header_len), kMaxJsonDepth,
                                      /*refuse_duplicate_keys=*/true);
      !st.ok()) {
    return fail(absl::StrCat("header is not valid JSON: ", st.message()));
  }
  Json header;
  try {
    header = Json::parse(hb, hb + header_len, nullptr, /*allow_exceptions=*/true);
  } catch (const Json::exception& e) {
    return fail(absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) return fail("header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return fail("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return fail(
              absl::StrCat("__metadata__ value of '", Escaped(m.key()), "' is not a string"));
        }
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return tensor_fail(name, "entry is not an object");
    SafetensorsEntry t;
    t.name = name;
    auto dtype = v.find("dtype");
    if (dtype == v.end() || !dtype->is_string()) return tensor_fail(name, "no string 'dtype'");
    t.dtype = dtype->get<std::string>();
    absl::StatusOr<int> elem = SafetensorsDtypeSize(t.dtype);
    if (!elem.ok()) return tensor_fail(name, std::string(elem.status().message()));
    auto shape = v.find("shape");
    if (shape == v.end() || !shape->is_array()) return tensor_fail(name, "no 'shape' array");
    for (const Json& d : *shape) {
      uint64_t dim;
      if (!GetUnsigned(d, &dim) ||
          dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        // Nesting is bounded (CheckJsonText); length is not.
        return tensor_fail(name, absl::StrCat("shape ", Excerpt(shape->dump(), 200),
                                              " has a dimension that is "
                                              "not a non-negative integer"));
      }
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    // dtype size * numel, refusing overflow (anything above the data size is refused anyway).
    uint64_t bytes = 0;
    const bool too_big = !TensorBytes(static_cast<uint64_t>(*elem), t.shape, &bytes);
    auto offsets = v.find("data_offsets");
    if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 ||
        !GetUnsigned((*offsets)[0], &t.begin) || !GetUnsigned((*offsets)[1], &t.end)) {
      return tensor_fail(name, "no 'data_offsets' pair of non-negative integers");
    }
    if (t.begin > t.end) {
      return tensor_fail(
          name, absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] end before they begin"));
    }
    if (t.end > data_size) {
      return tensor_fail(name, absl::StrCat("data_offsets [", t.begin, ", ", t.end,
                                            "] run past the data section (", data_size,
                                            " bytes): the file is truncated or the header wrong"));
    }
    if (too_big || t.end - t.begin != bytes) {
      return tensor_fail(
          name, absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] hold ", t.end - t.begin,
                             " bytes but ", t.dtype, " ", ShapeString(t.shape), " needs ",
                             too_big ? std::string("more than 2^64") : absl::StrCat(bytes)));
    }
    f->index_[name] = f->tensors_.size();
    f->tensors_.push_back(std::move(t));
  }

  // No two tensors may share bytes (empty tensors share none).
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& t : f->tensors_) {
    if (t.end > t.begin) by_offset.push_back(&t);
  }
  std::sort(
      by_offset.begin(), by_offset.end(),
      [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsEntry* a = by_offset[i - 1];
    const SafetensorsEntry* b = by_offset[i];
    if (b->begin < a->end) {
      return tensor_fail(b->name,
                         absl::StrCat("bytes [", b->begin, ", ", b->end, ") overlap tensor '",
                                      Escaped(a->name), "' at [", a->begin, ", ", a->end, ")"));
    }
  }
  return f;
}

std::string SafetensorsHeaderJson(const std::vector<SafetensorsEntry>& entries,
                                  const std::map<std::string, std::string>& metadata) {
  Json h = Json::object();
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = std::move(m);
  }
  for (const SafetensorsEntry& e : entries) {
    Json shape = Json::array();
    for (int64_t d : e.shape) shape.push_back(static_cast<uint64_t>(d));
    h[e.name] = Json{{"dtype", e.dtype}, {"shape", shape}, {"data_offsets", {e.begin, e.end}}};
  }
  // Names came from valid JSON or from this library, but never let a stray byte throw.
  return h.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// --- Writer ----------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, uint64_t header_reserve) {
  // The data section starts 8-byte aligned, as the reference writer does.
  const uint64_t reserve = (std::max<uint64_t>(header_reserve, 2) + 7) / 8 * 8;
  // The header is padded to the reserve: past the readers' limit (this library's own and the
  // reference implementation's) the file could not be read back. Refused before anything is made.
  if (reserve > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "': its header would take ", reserve, " bytes, over the ",
        kMaxSafetensorsHeaderBytes,
        "-byte limit of safetensors readers (too many tensors or too much metadata for one file)"));
  }
  static std::atomic<uint64_t> counter{0};
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  w->temp_path_ = SiblingPath(path, ".tmp.", absl::StrCat(counter.fetch_add(1)));
  w->temp_registration_ = TempFileRegistration(w->temp_path_);  // before the file exists
  w->fd_ = ::open(w->temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return ErrnoStatus(absl::StrCat("cannot create '", w->temp_path_, "'"));
  w->owns_temp_ = true;
  w->header_reserve_ = reserve;
  w->data_offset_ = 8 + w->header_reserve_;
  if (::lseek(w->fd_, static_cast<off_t>(w->data_offset_), SEEK_SET) < 0) {
    return ErrnoStatus(absl::StrCat("cannot seek in '", w->temp_path_, "'"));
  }
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (owns_temp_ && !published_) ::unlink(temp_path_.c_str());
}

absl::Status SafetensorsWriter::WriteAll(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(size, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StrCat("cannot write '", temp_path_, "'"));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::BeginTensor(const std::string& name, const std::string& dtype,
                                            const std::vector<int64_t>& shape) {
  absl::Status st = StartTensor(name, dtype, shape);
  if (!st.ok()) failed_ = true;
  return st;
}

absl::Status SafetensorsWriter::StartTensor(const std::string& name, const std::string& dtype,
                                            const std::vector<int64_t>& shape) {
  if (in_tensor_ || finished_) {
    return absl::FailedPreconditionError(absl::StrCat("'", path_, "': BeginTensor('", Escaped(name),
                                                      "') while a tensor is open or after Finish"));
  }
  ASSIGN_OR_RETURN(const int elem, SafetensorsDtypeSize(dtype));
  if (name == "__metadata__") {
    return absl::InvalidArgumentError("a tensor cannot be named __metadata__");
  }
  for (const SafetensorsEntry& e : entries_) {
    if (e.name == name) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path_, "': tensor '", Escaped(name), "' written twice"));
    }
  }
  uint64_t expected = 0;
  if (!TensorBytes(static_cast<uint64_t>(elem), shape, &expected)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path_, "': tensor '", Escaped(name), "' has shape ", ShapeString(shape),
                     ": a negative dimension, or more than 2^64 bytes of ", dtype));
  }
  SafetensorsEntry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = shape;
  e.begin = data_size_;
  e.end = data_size_;
  tensor_expected_ = expected;
  entries_.push_back(std::move(e));
  in_tensor_ = true;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Write(const void* data, size_t size) {
  if (!in_tensor_) {
    failed_ = true;
    return absl::FailedPreconditionError("Write outside a tensor");
  }
  if (absl::Status st = WriteAll(data, size); !st.ok()) {
    failed_ = true;
    return st;
  }
  data_size_ += size;
  entries_.back().end = data_size_;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::EndTensor() {
  if (!in_tensor_) {
    failed_ = true;
    return absl::FailedPreconditionError("EndTensor without BeginTensor");
  }
  in_tensor_ = false;
  const SafetensorsEntry& e = entries_.back();
  if (e.end - e.begin != tensor_expected_) {
    failed_ = true;
    return absl::InternalError(absl::StrCat("'", path_, "': tensor '", Escaped(e.name), "' got ",
                                            e.end - e.begin, " bytes, its ", e.dtype, " ",
                                            ShapeString(e.shape), " needs ", tensor_expected_));
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::AddTensor(const std::string& name, const std::string& dtype,
                                          const std::vector<int64_t>& shape, const void* data,
                                          size_t size) {
  RETURN_IF_ERROR(BeginTensor(name, dtype, shape));
  if (size > 0) RETURN_IF_ERROR(Write(data, size));
  return EndTensor();
}

absl::Status SafetensorsWriter::Finish() {
  if (in_tensor_) return absl::FailedPreconditionError("Finish with a tensor still open");
  if (failed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path_, "': not finished, an earlier write failed"));
  }
  if (finished_) return absl::OkStatus();
  std::string header = SafetensorsHeaderJson(entries_, metadata_);
  if (header.size() > header_reserve_) {
    return absl::InternalError(absl::StrCat("'", path_, "': the header needs ", header.size(),
                                            " bytes but only ", header_reserve_, " were reserved"));
  }
  header.resize(header_reserve_, ' ');  // trailing spaces are allowed by the format
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(header_reserve_ >> (8 * i));
  if (::lseek(fd_, 0, SEEK_SET) < 0) {
    return ErrnoStatus(absl::StrCat("cannot seek in '", temp_path_, "'"));
  }
  RETURN_IF_ERROR(WriteAll(len, 8));
  RETURN_IF_ERROR(WriteAll(header.data(), header.size()));
  if (::fsync(fd_) != 0) return ErrnoStatus(absl::StrCat("cannot fsync '", temp_path_, "'"));
  if (::close(fd_) != 0) {
    fd_ = -1;
    return ErrnoStatus(absl::StrCat("cannot close '", temp_path_, "'"));
  }
  fd_ = -1;
  finished_ = true;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Publish() { return PublishTogether({this}); }

absl::Status SafetensorsWriter::PublishTogether(const std::vector<SafetensorsWriter*>& writers,
                                                const std::vector<StagedFile*>& others) {
  std::vector<PendingRename> renames;
  for (StagedFile* f : others) renames.push_back(f->rename());
  for (SafetensorsWriter* w : writers) {
    if (!w->finished_) {
      return absl::FailedPreconditionError(absl::StrCat("'", w->path_, "': Publish before Finish"));
    }
    if (!w->published_) renames.push_back({w->temp_path_, w->path_});
  }
  RETURN_IF_ERROR(RenameAllOrNothing(renames));
  for (StagedFile* f : others) f->Published();
  for (SafetensorsWriter* w : writers) {
    w->published_ = true;
    w->temp_registration_.Release();
  }
  return absl::OkStatus();
}

}  // namespace gemvz::internal
