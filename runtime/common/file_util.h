// Files that are never half-written: write to a temporary name beside the target, fsync, rename.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gemvz::internal {

absl::StatusOr<std::string> ReadFile(const std::string& path);

// Publishes `data` under `path` atomically: temporary file in the same directory (unique per
// process and thread), write, fsync, rename, fsync of the directory. On any failure the
// temporary file is removed and `path` is untouched.
absl::Status AtomicWriteFile(const std::string& path, std::string_view data);

// The same for content produced in pieces: `write` is called with a sink that appends bytes.
absl::Status AtomicWriteFileStreamed(
    const std::string& path,
    const std::function<absl::Status(const std::function<absl::Status(const void*, size_t)>&)>&
        write);

// A Status for the current errno: "<what>: <strerror>", NotFound / PermissionDenied / Internal.
absl::Status ErrnoStatus(const std::string& what);

// The directory part of `path` ("." when there is none).
std::string DirName(const std::string& path);

// mkdir -p.
absl::Status CreateDirectories(const std::string& path);

}  // namespace gemvz::internal
