// safetensors files: a memory-mapped reader that checks every header field against the file
// before anything is read, and a writer that streams tensors into a temporary file and publishes
// it atomically. Format: u64 header length, JSON header, raw little-endian tensor bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/common/file_util.h"
#include "runtime/common/temp_files.h"

namespace gemvz::internal {

// Bytes per element of a safetensors dtype ("BF16" -> 2); an error for dtypes this reader does not
// know (sub-byte types included).
absl::StatusOr<int> SafetensorsDtypeSize(const std::string& dtype);

// The reader refuses headers above this size, like the reference implementation.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets into the data section (after the header)
  uint64_t end = 0;
  int64_t numel() const;  // -1 when a dimension is negative or the product overflows int64
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and checks its header: sizes, JSON, dtypes, shapes, offsets inside the
  // data section and matching dtype * shape, no two tensors overlapping, no duplicate names.
  // Errors name the file and, where one is at fault, the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  uint64_t data_offset() const { return data_offset_; }  // 8 + header length
  // In header order.
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  const SafetensorsEntry* Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's bytes inside the mapping (valid while this object lives).
  const uint8_t* data(const SafetensorsEntry& t) const { return base_ + data_offset_ + t.begin; }
  // Asks the kernel to read [offset, offset + size) of the data section ahead, sequentially.
  void WillNeed(uint64_t offset, uint64_t size) const;
  // Drops those mapped pages from this process's resident set once they have been consumed; the
  // page cache keeps them. Keeps a large file's packing from holding the whole file resident.
  void Release(uint64_t offset, uint64_t size) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  int fd_ = -1;
  const uint8_t* base_ = nullptr;
  uint64_t file_size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// The JSON header for `entries` (with their offsets) and `metadata`, unpadded. Numbers are written
// in decimal, so a header built from placeholder values of maximal length (kMaxHeaderNumber) is an
// upper bound on the real one: that is how the writer reserves room for a header it writes last.
std::string SafetensorsHeaderJson(const std::vector<SafetensorsEntry>& entries,
                                  const std::map<std::string, std::string>& metadata);
inline constexpr uint64_t kMaxHeaderNumber = ~uint64_t{0};  // 20 digits

// Writes a safetensors file whose tensors are appended one by one, in any number of pieces, after
// a header area reserved up front and filled at Finish. Nothing exists under the final name until
// Publish; destroying an unpublished writer removes its temporary file.
class SafetensorsWriter {
 public:
  // `header_reserve`: an upper bound on the header's JSON length (see SafetensorsHeaderJson);
  // refused above kMaxSafetensorsHeaderBytes, since the header is padded to it.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(const std::string& path,
                                                                   uint64_t header_reserve);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // A tensor in pieces: BeginTensor, Write..., EndTensor (which checks the byte count). After any
  // error the writer refuses to Finish.
  absl::Status BeginTensor(const std::string& name, const std::string& dtype,
                           const std::vector<int64_t>& shape);
  absl::Status Write(const void* data, size_t size);
  absl::Status EndTensor();
  // The same in one call.
  absl::Status AddTensor(const std::string& name, const std::string& dtype,
                         const std::vector<int64_t>& shape, const void* data, size_t size);
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  // Writes the header (padded with spaces to the reserve) and fsyncs: the temporary file is then
  // complete and can be opened with SafetensorsFile.
  absl::Status Finish();
  // Renames the finished file to its final name and makes the rename durable.
  absl::Status Publish();
  // The same for several finished writers, all or none (RenameAllOrNothing): on error no final
  // name has changed and each writer still removes its temporary file when destroyed. `others`
  // (whole files staged beside them, such as a checkpoint's index) join the same publish and are
  // renamed first, so that an index is in place before the files it names; on error each still
  // removes its temporary file when destroyed too.
  static absl::Status PublishTogether(const std::vector<SafetensorsWriter*>& writers,
                                      const std::vector<StagedFile*>& others = {});

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return data_offset_ + data_size_; }
  uint64_t data_bytes() const { return data_size_; }  // the tensors' bytes, without the header

 private:
  SafetensorsWriter() = default;
  absl::Status StartTensor(const std::string& name, const std::string& dtype,
                           const std::vector<int64_t>& shape);
  absl::Status WriteAll(const void* data, size_t size);
  std::string path_;
  std::string temp_path_;
  bool owns_temp_ = false;  // created by this writer (not someone else's file of that name)
  // Lets a signal handler remove the temporary file if the process is interrupted.
  TempFileRegistration temp_registration_;
  int fd_ = -1;
  uint64_t header_reserve_ = 0;
  uint64_t data_offset_ = 0;
  uint64_t data_size_ = 0;
  bool in_tensor_ = false;
  uint64_t tensor_expected_ = 0;
  bool failed_ = false;  // a write or a tensor went wrong: the file must not be finished
  bool finished_ = false;
  bool published_ = false;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace gemvz::internal
