// The on-disk kernel cache: one self-checking file per key, published atomically, evicted least
// recently used first under a size cap, with a per-key file lock around the miss path so that
// processes cold-starting together compile once where they can and never see a partial entry.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz::internal {

// What an entry records beside the kernel itself.
struct DiskEntryMeta {
  std::string nvrtc_version;
  std::string library_version;
  int64_t created_unix = 0;  // seconds
};

// Entry layout: 24-byte header ("GEMVZJIT", u32 format version, u32 CRC-32C of the payload,
// u64 payload size) then the payload (length-prefixed fields, the key first). A new layout bumps
// kJitSchemaVersion too (cache_key.h): two builds sharing a directory then key their entries
// apart, where they would otherwise take each other's for invalid and remove them in turn.
inline constexpr int kDiskEntryVersion = 1;
std::string SerializeEntry(const CompiledKernel& kernel);
// Checks everything (size, magic, version, checksum, fields, the key echoed inside against
// `expected_key` unless it is empty) and says what is wrong.
absl::StatusOr<CompiledKernel> ParseEntry(std::string_view bytes, std::string_view expected_key,
                                          DiskEntryMeta* meta = nullptr);
// The entry file at `path`, read and checked as ParseEntry does (NotFound when it is gone).
absl::StatusOr<CompiledKernel> ReadEntryFile(const std::string& path, std::string_view expected_key,
                                             DiskEntryMeta* meta = nullptr);

// One file of the cache, as `List` sees it.
struct DiskEntryInfo {
  std::string key;
  std::string path;
  int64_t size_bytes = 0;
  int64_t last_used_unix_ns = 0;  // the file's mtime: touched on every hit
  absl::Status status;            // why the entry is invalid; OK when it parsed (or unchecked)
  // From the entry, when it parsed:
  std::string kernel_name;
  std::string arch;
  std::string name_expression;
  int registers = -1;
  int spill_bytes = -1;
  int shared_bytes = -1;
  DiskEntryMeta meta;
};

struct PruneResult {
  int removed = 0;
  int64_t removed_bytes = 0;
  int kept = 0;
  int64_t kept_bytes = 0;
};

class DiskCache {
 public:
  static constexpr int64_t kDefaultMaxBytes = int64_t{1} << 30;  // 1 GiB

  // `directory` is the cache root (CacheDirectory()); entries live in <root>/kernels.
  explicit DiskCache(std::string directory);
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  const std::string& directory() const { return root_; }
  std::string EntryPath(std::string_view key) const;

  enum class Lookup { kHit, kMissing, kRejected };
  // Reads the entry of `key` into *out. kRejected: the file exists but is invalid (*reason says
  // why); with `remove_bad` it is then deleted with one warning. A hit refreshes the entry's
  // last-use time for the LRU order.
  Lookup Read(const std::string& key, CompiledKernel* out, std::string* reason, bool remove_bad);

  // Publishes `kernel` under its key (atomic). The first failure switches this cache to
  // read-only with one warning; later calls return FailedPrecondition at once.
  absl::Status Write(const CompiledKernel& kernel);
  bool read_only() const;

  // Cross-process exclusive lock on one key (flock on <root>/locks/<key>.lock), held while the
  // object lives. Null when the lock file cannot be made, or when another process has held it
  // for `max_wait` (stopped or hung: one warning names the file); the miss path then runs
  // unlocked, which is still correct: publishing is atomic.
  class KeyLock {
   public:
    explicit KeyLock(int fd) : fd_(fd) {}
    KeyLock(const KeyLock&) = delete;
    KeyLock& operator=(const KeyLock&) = delete;
    ~KeyLock();

   private:
    int fd_;
  };
  static constexpr absl::Duration kDefaultLockWait = absl::Seconds(60);
  std::unique_ptr<KeyLock> LockKey(const std::string& key,
                                   absl::Duration max_wait = kDefaultLockWait);

  // Every entry, oldest use first; with `verify` each is parsed and checked.
  absl::StatusOr<std::vector<DiskEntryInfo>> List(bool verify) const;
  // Removes least recently used entries until the total is at most `max_bytes`, never `keep_key`;
  // also sweeps stale temporary and lock files left by crashed writers.
  absl::StatusOr<PruneResult> Prune(int64_t max_bytes, std::string_view keep_key = "");
  // Removes every entry (and lock and stale temporary files). Returns how many entries went; one
  // that cannot be removed does not stop the rest, and PermissionDenied then names the first.
  absl::StatusOr<int> Clear();

 private:
  std::string root_;
  std::string kernels_dir_;
  std::string locks_dir_;
  mutable absl::Mutex mu_;
  bool read_only_ ABSL_GUARDED_BY(mu_) = false;
  bool dirs_ready_ ABSL_GUARDED_BY(mu_) = false;
};

// The size cap: GEMVZ_CACHE_MAX_BYTES ("1G", "512M", bytes), else DiskCache::kDefaultMaxBytes.
int64_t DiskCacheMaxBytes();

}  // namespace gemvz::internal
