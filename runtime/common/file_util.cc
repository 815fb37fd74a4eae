#include "runtime/common/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "runtime/common/temp_files.h"

namespace gemvz::internal {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return ErrnoStatus(absl::StrCat(what, " '", path, "'"));
}

}  // namespace

absl::Status ErrnoStatus(const std::string& what) {
  const int e = errno;
  const std::string msg = absl::StrCat(what, ": ", std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(msg);
  if (e == EACCES || e == EPERM || e == EROFS) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open", path);
  std::string out;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = ErrnoError("cannot read", path);
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

absl::Status AtomicWriteFileStreamed(
    const std::string& path,
    const std::function<absl::Status(const std::function<absl::Status(const void*, size_t)>&)>&
        write) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".",
                                       std::hash<std::thread::id>()(std::this_thread::get_id()),
                                       ".", counter.fetch_add(1));
  // Removed by a signal handler (temp_files.h) if the process is interrupted before the rename.
  TempFileRegistration registration(tmp);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("cannot create", tmp);
  auto fail = [&](absl::Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  auto sink = [&](const void* data, size_t size) -> absl::Status {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError("cannot write", tmp);
      }
      p += n;
      size -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  };
  if (absl::Status s = write(sink); !s.ok()) return fail(s);
  if (::fsync(fd) != 0) return fail(ErrnoError("cannot fsync", tmp));
  if (::close(fd) != 0) {
    absl::Status s = ErrnoError("cannot close", tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status s = ErrnoError("cannot rename into place", path);
    ::unlink(tmp.c_str());
    return s;
  }
  // Make the rename itself durable.
  const int dfd = ::open(DirName(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::Status AtomicWriteFile(const std::string& path, std::string_view data) {
  return AtomicWriteFileStreamed(path, [&](const auto& sink) { return sink(data.data(), data.size()); });
}

absl::Status CreateDirectories(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty directory path");
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError("cannot create directory", cur);
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is not a directory"));
  }
  return absl::OkStatus();
}

}  // namespace gemvz::internal
