// Files that are never half-written: write to a temporary name beside the target, fsync, rename.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/common/temp_files.h"

namespace gemvz::internal {

// The whole of `path` (a regular file, a pipe, a device: whatever the caller named). With
// `max_bytes` (not negative), more than that is refused (FailedPrecondition) once read, so that
// /dev/zero or an endless pipe cannot exhaust the reader.
absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes = -1);

// The same from an open descriptor (standard input), to its end, named `name` in errors; `fd` is
// left open. A non-blocking descriptor with nothing to read yet is waited on (poll), not an error.
absl::StatusOr<std::string> ReadDescriptor(int fd, const std::string& name, int64_t max_bytes);

// The same for files that gemvz itself keeps (cache entries, the tuning file), where anything
// else found at the path must not hang or exhaust the reader: FailedPrecondition without
// blocking for what is not a regular file (a FIFO, a device, a directory) and for one of more
// than `max_bytes`; NotFound when there is nothing.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, int64_t max_bytes);

// Whether `path` is a device, FIFO or socket, or a link to one (followed): what a publish by
// rename must not replace. False for a regular file, a directory, nothing, or a dangling link.
bool IsSpecialFile(const std::string& path);

// What `path` is when it is not a regular file, following links: "a directory", "a FIFO", "a
// socket", "a character device", "a block device", or "a symbolic link to 'T', which does not
// exist"; "" for a regular file, or one that cannot be looked up otherwise (opening it says why).
// Looked up without opening anything: a FIFO does not wait for a writer, a device is not opened.
std::string NotARegularFile(const std::string& path);

// Publishes `data` under `path` atomically: temporary file in the same directory (unique per
// process and thread), write, fsync, rename, fsync of the directory. On any failure the
// temporary file is removed and `path` is untouched. A `path` that is a device, FIFO or socket,
// or a link to one, is refused (FailedPrecondition) before anything is written: the rename would
// replace it.
absl::Status AtomicWriteFile(const std::string& path, std::string_view data);

// Content produced in pieces: called with a sink that appends bytes.
using StreamedContent =
    std::function<absl::Status(const std::function<absl::Status(const void*, size_t)>&)>;

// The same for content produced in pieces.
absl::Status AtomicWriteFileStreamed(const std::string& path, const StreamedContent& write);

// A finished temporary file and the name it is to be published under.
struct PendingRename {
  std::string from;  // the temporary file
  std::string to;    // its final name; a file already there is replaced
};

// A whole file written under a temporary name beside `path` (SiblingPath ".tmp.", registered
// for a signal handler to remove), fsynced and closed: the first half of AtomicWriteFile, for a
// file published together with others (RenameAllOrNothing of rename()). Destroying it removes
// the temporary file unless Published() was called.
class StagedFile {
 public:
  // On any failure (an exception from `write` included) nothing is left behind.
  static absl::StatusOr<std::unique_ptr<StagedFile>> Write(const std::string& path,
                                                           const StreamedContent& write);
  ~StagedFile();
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t size() const { return size_; }  // bytes written
  PendingRename rename() const { return {temp_path_, path_}; }
  // The temporary file was renamed to `path`: no longer this object's to remove.
  void Published();

 private:
  StagedFile() = default;
  std::string path_;
  std::string temp_path_;
  int fd_ = -1;  // open while it is written
  uint64_t size_ = 0;
  bool owns_temp_ = false;  // created by this object (not someone else's file of that name)
  bool published_ = false;
  TempFileRegistration registration_;
};

// Publishes several files together: on success every `from` is under its `to`; on error every
// `to` is as it was before the call (a replaced file restored, a new one removed) and the `from`s
// not yet renamed are left to the caller to remove. A directory in the way fails before anything
// is touched, and so does a device, FIFO or socket, or a link to one (the rename would replace
// it). Signals that a handler defers (temp_files.h) wait until it returns. Not atomic against a
// crash or SIGKILL: see the comment in file_util.cc.
absl::Status RenameAllOrNothing(const std::vector<PendingRename>& renames);

// A Status for the current errno: "<what>: <strerror>", NotFound / PermissionDenied / Internal.
absl::Status ErrnoStatus(const std::string& what);

// The directory part of `path` ("." when there is none).
std::string DirName(const std::string& path);
// The file name part of `path`: what follows its last '/'.
std::string BaseName(const std::string& path);

// Whether `a` and `b` name one file: the same inode where both exist (links followed); else
// whether they lead to one place once the directories missing on them are made (each resolved
// from its nearest ancestor that exists: "/abs/out/r.json", "out/x/../r.json" and "out/r.json"
// are one file when out is still to be made). Links are followed, so a link to a file is that
// file: a command checks with it that an output it is asked for is none of its inputs or other
// outputs, and refuses a name that leads to one.
bool SameFile(const std::string& a, const std::string& b);

// A name beside `path` for this process's temporary or backup file:
// "<file name><kind><pid>.<unique>" (kind ".tmp." or ".old."), with the file name shortened
// where the whole would pass NAME_MAX (255 bytes) though `path`'s own name does not.
std::string SiblingPath(const std::string& path, std::string_view kind, std::string_view unique);

// mkdir -p. With `created`, appends the directories it made, outermost first (so that a caller
// that fails later can take them back: RemoveCreatedDirectories).
absl::Status CreateDirectories(const std::string& path,
                               std::vector<std::string>* created = nullptr);

// Removes `created` (from CreateDirectories), innermost first, each only if it is empty.
void RemoveCreatedDirectories(const std::vector<std::string>& created);

// The names in a directory but "." and "..", in the order readdir gives them, and what stopped the
// listing: open_errno when opendir failed (no names), read_errno when readdir failed part way
// (EIO on a network or FUSE file system; names then holds the entries read before). readdir ends
// a failed listing as it ends a whole one, with errno the only difference: a caller that skips
// read_errno takes part of a directory for all of it.
struct DirectoryListing {
  std::vector<std::string> names;
  int open_errno = 0;
  int read_errno = 0;
};
DirectoryListing ListDirectory(const std::string& dir);

}  // namespace gemvz::internal
