// The on-disk kernel cache (see disk_cache.h).
#include "runtime/jit/disk_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <initializer_list>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/common/env.h"
#include "runtime/common/file_util.h"
#include "runtime/common/hash.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"
#include "runtime/jit/cache_key.h"
#include "runtime/jit/cubin_info.h"
#include "runtime/jit/nvrtc_compiler.h"

namespace gemvz::internal {
namespace {

constexpr char kMagic[8] = {'G', 'E', 'M', 'V', 'Z', 'J', 'I', 'T'};
constexpr size_t kHeaderBytes = 24;
constexpr char kEntrySuffix[] = ".gemvzk";
// The largest entry a reader takes (a cubin with its PTX is a few MB); anything else found under
// an entry's name (a FIFO, a link to a device, a huge file) is a bad entry, never a hang.
constexpr int64_t kMaxEntryBytes = int64_t{256} << 20;
constexpr char kLockSuffix[] = ".lock";
// Temporary files and lock files younger than this may belong to a live writer.
constexpr int64_t kStaleTempSeconds = 3600;
constexpr int64_t kStaleLockSeconds = 60;

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
void PutString(std::string* out, std::string_view s) {
  PutU64(out, s.size());
  out->append(s.data(), s.size());
}
uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

// Reads length-prefixed fields with bounds checks; the first failure sticks and names the field.
class FieldReader {
 public:
  explicit FieldReader(std::string_view data) : data_(data) {}
  bool U64(const char* field, uint64_t* v) {
    if (!error_.empty()) return false;
    if (data_.size() - pos_ < 8) {
      error_ = absl::StrCat("payload ends inside field '", field, "'");
      return false;
    }
    *v = GetLe(data_.data() + pos_, 8);
    pos_ += 8;
    return true;
  }
  bool I64(const char* field, int64_t* v) {
    uint64_t u;
    if (!U64(field, &u)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
  bool Int(const char* field, int* v) {
    int64_t x;
    if (!I64(field, &x)) return false;
    if (x < -1 || x > (int64_t{1} << 30)) {
      error_ = absl::StrCat("field '", field, "' out of range (", x, ")");
      return false;
    }
    *v = static_cast<int>(x);
    return true;
  }
  bool String(const char* field, std::string* s) {
    uint64_t n;
    if (!U64(field, &n)) return false;
    if (n > data_.size() - pos_) {
      error_ = absl::StrCat("field '", field, "' claims ", n, " bytes but only ",
                            data_.size() - pos_, " remain");
      return false;
    }
    s->assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool AtEnd() const { return pos_ == data_.size(); }
  const std::string& error() const { return error_; }

 private:
  std::string_view data_;
  size_t pos_ = 0;
  std::string error_;
};

bool IsHexKey(std::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// Names in `dir`, without "." and "..". A missing directory is an empty one.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DirectoryListing listing = ListDirectory(dir);
  if (listing.open_errno == ENOENT) return std::vector<std::string>{};
  if (listing.open_errno != 0) {
    return absl::InternalError(
        absl::StrCat("cannot list '", dir, "': ", std::strerror(listing.open_errno)));
  }
  // Taken for the end, a failed listing would let `cache clear` report success with entries
  // left, and `cache verify` pass entries it never read.
  if (listing.read_errno != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot list '", dir, "': ", std::strerror(listing.read_errno)));
  }
  std::sort(listing.names.begin(), listing.names.end());
  return std::move(listing.names);
}

// Removes `path`; a file that is already gone (another process pruned it) is not an error.
bool RemoveFile(const std::string& path) { return ::unlink(path.c_str()) == 0 || errno == ENOENT; }

// Opens (with O_CREAT: creates) a lock file for flock: for writing where it can, since an NFS
// client emulates flock with fcntl locks, which need it for an exclusive lock; read-only where
// it cannot (a lock file another user made, mode 0644), which locally still locks.
int OpenLockFile(const std::string& path, int create) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | create, 0644);
  if (fd >= 0 || (errno != EACCES && errno != EROFS && errno != EPERM)) return fd;
  return ::open(path.c_str(), O_RDONLY | O_CLOEXEC | create, 0644);
}

// Removes a lock file unless a process holds it. The unlink happens under the lock, and LockKey
// checks after locking that its file is still the one at the path, so no two processes ever
// hold one key's lock.
void RemoveUnheldLock(const std::string& path) {
  const int fd = OpenLockFile(path, 0);
  if (fd < 0) return;
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) ::unlink(path.c_str());
  ::close(fd);
}

// Removes every file of `dirs` for which remove(dir, name, age in seconds) says so (a lock file
// only when unheld); what cannot be listed or stat'ed is left alone.
template <typename Pred>
void SweepFiles(std::initializer_list<const std::string*> dirs, Pred remove) {
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  for (const std::string* dir : dirs) {
    absl::StatusOr<std::vector<std::string>> names = ListDir(*dir);
    if (!names.ok()) continue;
    for (const std::string& name : *names) {
      const std::string path = absl::StrCat(*dir, "/", name);
      struct stat st;
      if (::stat(path.c_str(), &st) != 0) continue;
      if (!remove(dir, name, now - static_cast<int64_t>(st.st_mtim.tv_sec))) continue;
      if (absl::EndsWith(name, kLockSuffix)) {
        RemoveUnheldLock(path);
      } else {
        RemoveFile(path);
      }
    }
  }
}

}  // namespace

std::string SerializeEntry(const CompiledKernel& k) {
  std::string payload;
  payload.reserve(k.cubin.size() + k.ptx.size() + k.log.size() + 1024);
  PutString(&payload, k.key);
  PutString(&payload, k.arch);
  PutString(&payload, k.kernel_name);
  PutString(&payload, k.name_expression);
  PutString(&payload, k.lowered_name);
  PutString(&payload, NvrtcVersionString());
  PutString(&payload, LibraryVersion());
  PutU64(&payload, static_cast<uint64_t>(std::time(nullptr)));
  PutU64(&payload, static_cast<uint64_t>(static_cast<int64_t>(k.registers)));
  PutU64(&payload, static_cast<uint64_t>(static_cast<int64_t>(k.spill_bytes)));
  PutU64(&payload, static_cast<uint64_t>(static_cast<int64_t>(k.shared_bytes)));
  PutU64(&payload, static_cast<uint64_t>(static_cast<int64_t>(k.compile_ms * 1000.0)));
  PutString(&payload, k.log);
  PutString(&payload, k.ptx);
  PutString(&payload, k.cubin);

  std::string out(kMagic, sizeof(kMagic));
  PutU32(&out, kDiskEntryVersion);
  PutU32(&out, Crc32c(payload.data(), payload.size()));
  PutU64(&out, payload.size());
  out += payload;
  return out;
}

absl::StatusOr<CompiledKernel> ParseEntry(std::string_view bytes, std::string_view expected_key,
                                          DiskEntryMeta* meta) {
  auto bad = [](const std::string& why) { return absl::DataLossError(why); };
  if (bytes.size() < kHeaderBytes) {
    return bad(absl::StrCat("truncated: ", bytes.size(), " bytes, shorter than the ", kHeaderBytes,
                            "-byte header"));
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return bad("bad magic: not a gemvz kernel cache entry");
  }
  const uint32_t version = static_cast<uint32_t>(GetLe(bytes.data() + 8, 4));
  if (version != kDiskEntryVersion) {
    return bad(
        absl::StrCat("entry format version ", version, ", this library reads ", kDiskEntryVersion));
  }
  const uint32_t crc = static_cast<uint32_t>(GetLe(bytes.data() + 12, 4));
  const uint64_t payload_size = GetLe(bytes.data() + 16, 8);
  const std::string_view payload = bytes.substr(kHeaderBytes);
  if (payload.size() != payload_size) {
    return bad(absl::StrCat(payload.size() < payload_size ? "truncated" : "trailing bytes",
                            ": the header announces ", payload_size,
                            " payload bytes, the file has ", payload.size()));
  }
  const uint32_t actual_crc = Crc32c(payload.data(), payload.size());
  if (actual_crc != crc) {
    return bad(absl::StrFormat("checksum mismatch: stored %08x, computed %08x", crc, actual_crc));
  }
  CompiledKernel k;
  DiskEntryMeta m;
  int64_t compile_us = 0;
  FieldReader r(payload);
  r.String("key", &k.key) && r.String("arch", &k.arch) && r.String("kernel_name", &k.kernel_name) &&
      r.String("name_expression", &k.name_expression) &&
      r.String("lowered_name", &k.lowered_name) && r.String("nvrtc_version", &m.nvrtc_version) &&
      r.String("library_version", &m.library_version) && r.I64("created", &m.created_unix) &&
      r.Int("registers", &k.registers) && r.Int("spill_bytes", &k.spill_bytes) &&
      r.Int("shared_bytes", &k.shared_bytes) && r.I64("compile_us", &compile_us) &&
      r.String("log", &k.log) && r.String("ptx", &k.ptx) && r.String("cubin", &k.cubin);
  if (!r.error().empty()) return bad(r.error());
  if (!r.AtEnd()) return bad("unexpected bytes after the last field");
  if (!IsHexKey(k.key)) return bad("the key inside is not a 64-digit hex digest");
  if (!expected_key.empty() && k.key != expected_key) {
    return bad(absl::StrCat("wrong key: the file is named for ", std::string(expected_key),
                            " but holds ", k.key));
  }
  if (k.cubin.empty()) return bad("empty cubin");
  if (k.lowered_name.empty()) return bad("empty lowered name");
  k.compile_ms = static_cast<double>(compile_us) / 1000.0;
  if (k.registers < 0 || k.spill_bytes < 0) {
    // An entry written while ptxas's report was missing: the cubin has the numbers.
    if (auto elf = ReadCubinKernelInfo(k.cubin, k.lowered_name); elf.ok()) {
      k.registers = elf->registers;
      k.spill_bytes = elf->frame_bytes;
      k.shared_bytes = elf->shared_bytes;
    }
  }
  if (meta != nullptr) *meta = std::move(m);
  return k;
}

DiskCache::KeyLock::~KeyLock() {
  ::flock(fd_, LOCK_UN);
  ::close(fd_);
}

DiskCache::DiskCache(std::string directory)
    : root_(std::move(directory)),
      kernels_dir_(absl::StrCat(root_, "/kernels")),
      locks_dir_(absl::StrCat(root_, "/locks")) {}

std::string DiskCache::EntryPath(std::string_view key) const {
  return absl::StrCat(kernels_dir_, "/", std::string(key), kEntrySuffix);
}

bool DiskCache::read_only() const {
  absl::MutexLock lock(&mu_);
  return read_only_;
}

DiskCache::Lookup DiskCache::Read(const std::string& key, CompiledKernel* out, std::string* reason,
                                  bool remove_bad) {
  const std::string path = EntryPath(key);
  absl::StatusOr<std::string> bytes = ReadRegularFile(path, kMaxEntryBytes);
  if (!bytes.ok()) {
    if (absl::IsNotFound(bytes.status())) return Lookup::kMissing;
    // Unreadable (permissions, I/O error): not a cache we can use for this key. Said once when
    // something is there, or every process would recompile it in silence (a path that cannot
    // exist, through a regular file, is the unusable directory the first write reports).
    if (reason != nullptr) *reason = std::string(bytes.status().message());
    static std::atomic<bool> warned{false};
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && !warned.exchange(true)) {
      GEMVZ_LOG_WARNING("kernel cache entry '%s' cannot be read (%s); compiling instead (said once "
                        "per process)",
                        path, bytes.status().message());
    }
    return Lookup::kMissing;
  }
  absl::StatusOr<CompiledKernel> parsed = ParseEntry(*bytes, key);
  if (!parsed.ok()) {
    if (reason != nullptr) *reason = std::string(parsed.status().message());
    if (remove_bad) {
      const bool removed = RemoveFile(path);
      GEMVZ_LOG_WARNING("kernel cache entry '%s' is invalid (%s); %s", path,
                        parsed.status().message(),
                        removed ? "removed it and recompiling"
                                : "cannot remove it (read-only cache?); recompiling");
    }
    return Lookup::kRejected;
  }
  // Touch: the mtime is the LRU clock. Fails quietly on a read-only cache.
  ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);
  *out = *std::move(parsed);
  return Lookup::kHit;
}

absl::Status DiskCache::Write(const CompiledKernel& kernel) {
  {
    absl::MutexLock lock(&mu_);
    if (read_only_) {
      return absl::FailedPreconditionError(
          absl::StrCat("kernel cache '", root_, "' is not writable"));
    }
  }
  absl::Status st = CreateDirectories(kernels_dir_);
  const bool no_directory = !st.ok();
  if (st.ok()) st = AtomicWriteFile(EntryPath(kernel.key), SerializeEntry(kernel));
  if (!st.ok()) {
    // A failure of this entry alone (a directory under its name, another user's file in a
    // sticky shared directory) leaves the cache writable for the other kernels and their locks:
    // only a directory that cannot be made or written to (a read-only file system included) is.
    if (!no_directory && ::access(kernels_dir_.c_str(), W_OK | X_OK) == 0) {
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        GEMVZ_LOG_WARNING(
            "kernel cache entry '%s' cannot be written (%s); that kernel stays in "
            "memory only for this process (said once per process)",
            EntryPath(kernel.key), st.message());
      }
      return st;
    }
    absl::MutexLock lock(&mu_);
    if (!read_only_) {
      read_only_ = true;
      GEMVZ_LOG_WARNING(
          "kernel cache directory '%s' is not writable (%s); compiled kernels stay in memory "
          "only for this process. Set GEMVZ_CACHE_DIR to a writable directory, or "
          "GEMVZ_DISABLE_DISK_CACHE=1 to turn the disk cache off.",
          root_, st.message());
    }
    return st;
  }
  return absl::OkStatus();
}

std::unique_ptr<DiskCache::KeyLock> DiskCache::LockKey(const std::string& key,
                                                      absl::Duration max_wait) {
  {
    absl::MutexLock lock(&mu_);
    if (read_only_) return nullptr;
    if (!dirs_ready_) {
      if (!CreateDirectories(locks_dir_).ok()) return nullptr;
      dirs_ready_ = true;
    }
  }
  const std::string path = absl::StrCat(locks_dir_, "/", key, kLockSuffix);
  // A file system whose inode numbers do not stay put would retry forever; unlocked is still
  // correct (publishing is atomic).
  bool made_dir = false;
  // The steady clock: a step of the wall clock (NTP at boot) must not stretch or cut the wait.
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(max_wait);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = OpenLockFile(path, O_CREAT);
    if (fd < 0) {
      // The directory was removed since (rm -rf of the cache): make it again, once.
      if (errno != ENOENT || made_dir || !CreateDirectories(locks_dir_).ok()) return nullptr;
      made_dir = true;
      continue;
    }
    // Polled rather than blocking, so that a holder that never lets go (a stopped or hung
    // process) costs this one `max_wait`, not forever. A compile takes seconds; the naps stay
    // short next to it.
    absl::Duration nap = absl::Milliseconds(1);
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK || std::chrono::steady_clock::now() >= deadline) {
        if (errno == EWOULDBLOCK) {
          GEMVZ_LOG_WARNING(
              "jit: another process has held the lock %s for over %s (stopped or hung?); "
              "compiling without it",
              path, absl::FormatDuration(max_wait));
        } else {
          static std::atomic<bool> warned{false};
          if (!warned.exchange(true)) {
            GEMVZ_LOG_WARNING("jit: cannot lock %s: %s; processes missing the same kernel may "
                              "compile it at once (harmless, only slower)",
                              path, std::strerror(errno));
          }
        }
        ::close(fd);
        return nullptr;
      }
      absl::SleepFor(nap);
      nap = std::min(nap * 2, absl::Milliseconds(20));
    }
    // A sweep may have removed the file while we waited for it: then lock the one at the path.
    struct stat held, now;
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &now) == 0 && held.st_dev == now.st_dev &&
        held.st_ino == now.st_ino) {
      return std::make_unique<KeyLock>(fd);
    }
    ::close(fd);
  }
  return nullptr;
}

absl::StatusOr<CompiledKernel> ReadEntryFile(const std::string& path, std::string_view expected_key,
                                             DiskEntryMeta* meta) {
  ASSIGN_OR_RETURN(const std::string bytes, ReadRegularFile(path, kMaxEntryBytes));
  return ParseEntry(bytes, expected_key, meta);
}

absl::StatusOr<std::vector<DiskEntryInfo>> DiskCache::List(bool verify) const {
  absl::StatusOr<std::vector<std::string>> names = ListDir(kernels_dir_);
  if (!names.ok()) return names.status();
  std::vector<DiskEntryInfo> out;
  for (const std::string& name : *names) {
    if (!absl::EndsWith(name, kEntrySuffix)) continue;  // temporary files of live writers
    const std::string key = name.substr(0, name.size() - (sizeof(kEntrySuffix) - 1));
    DiskEntryInfo info;
    info.key = key;
    info.path = absl::StrCat(kernels_dir_, "/", name);
    struct stat st;
    if (::stat(info.path.c_str(), &st) != 0) {
      const int err = errno;
      struct stat link;
      if (::lstat(info.path.c_str(), &link) != 0) continue;  // pruned meanwhile
      // A link to nothing, or a loop: listed as bad, so that verify names it and clear removes it.
      info.last_used_unix_ns = MtimeNs(link);
      info.status =
          absl::DataLossError(absl::StrCat("a link that leads nowhere (", std::strerror(err), ")"));
      out.push_back(std::move(info));
      continue;
    }
    info.size_bytes = st.st_size;
    info.last_used_unix_ns = MtimeNs(st);
    if (!IsHexKey(key)) {
      info.status = absl::DataLossError("file name is not <64 hex digits>.gemvzk");
    } else if (verify) {
      absl::StatusOr<CompiledKernel> k = ReadEntryFile(info.path, key, &info.meta);
      if (k.ok()) {
        info.kernel_name = k->kernel_name;
        info.arch = k->arch;
        info.name_expression = k->name_expression;
        info.registers = k->registers;
        info.spill_bytes = k->spill_bytes;
        info.shared_bytes = k->shared_bytes;
      } else {
        info.status = k.status();
      }
    }
    out.push_back(std::move(info));
  }
  std::stable_sort(out.begin(), out.end(), [](const DiskEntryInfo& a, const DiskEntryInfo& b) {
    return a.last_used_unix_ns < b.last_used_unix_ns;
  });
  return out;
}

absl::StatusOr<PruneResult> DiskCache::Prune(int64_t max_bytes, std::string_view keep_key) {
  absl::StatusOr<std::vector<DiskEntryInfo>> entries = List(/*verify=*/false);
  if (!entries.ok()) return entries.status();
  PruneResult r;
  int64_t total = 0;
  for (const DiskEntryInfo& e : *entries) total += e.size_bytes;
  // Oldest use first (List's order).
  for (const DiskEntryInfo& e : *entries) {
    if (total > max_bytes && e.key != keep_key) {
      if (RemoveFile(e.path)) {
        GEMVZ_LOG_INFO("jit: evicted %s (%d bytes) to keep the cache under %d bytes", e.key,
                       e.size_bytes, max_bytes);
        total -= e.size_bytes;
        ++r.removed;
        r.removed_bytes += e.size_bytes;
        continue;
      }
    }
    ++r.kept;
    r.kept_bytes += e.size_bytes;
  }
  // Sweep what crashed writers left: temporary files, and lock files whose entry is gone.
  SweepFiles({&kernels_dir_, &locks_dir_}, [&](const std::string* dir, const std::string& name,
                                              int64_t age) {
    const bool temp = name.find(".tmp.") != std::string::npos && age > kStaleTempSeconds;
    const bool orphan_lock =
        dir == &locks_dir_ && absl::EndsWith(name, kLockSuffix) && age > kStaleLockSeconds &&
        ::access(EntryPath(name.substr(0, name.size() - 5)).c_str(), F_OK) != 0;
    return temp || orphan_lock;
  });
  return r;
}

absl::StatusOr<int> DiskCache::Clear() {
  absl::StatusOr<std::vector<DiskEntryInfo>> entries = List(/*verify=*/false);
  if (!entries.ok()) return entries.status();
  // Every entry is tried: one that cannot be removed (a directory under an entry's name, no
  // permission) does not stop the rest; the first such is named at the end.
  int removed = 0, failed = 0;
  std::string first_failure;
  for (const DiskEntryInfo& e : *entries) {
    if (::unlink(e.path.c_str()) == 0) {
      ++removed;
    } else if (errno != ENOENT) {
      if (failed++ == 0) {
        first_failure = absl::StrCat("'", e.path, "': ", std::strerror(errno));
      }
    }
  }
  // Then what the cache itself makes beside its entries: lock files (those no process holds) and
  // temporary files. A young temporary file may be a live writer's; left to finish its rename. A
  // file of any other name is not the cache's (the directory may be shared, or a link to another
  // place) and stays.
  SweepFiles({&kernels_dir_, &locks_dir_},
             [&](const std::string* dir, const std::string& name, int64_t age) {
               const bool lock = dir == &locks_dir_ && absl::EndsWith(name, kLockSuffix);
               const bool temp = name.find(".tmp.") != std::string::npos && age > kStaleLockSeconds;
               return lock || temp;
             });
  if (failed > 0) {
    return absl::PermissionDeniedError(absl::StrCat("removed ", removed,
                                                    " entries but could not remove ", failed,
                                                    ", the first ", first_failure));
  }
  return removed;
}

int64_t DiskCacheMaxBytes() {
  return GetEnvBytes("GEMVZ_CACHE_MAX_BYTES", DiskCache::kDefaultMaxBytes);
}

}  // namespace gemvz::internal
