#include "runtime/common/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/common/log.h"
#include "runtime/common/status_macros.h"
#include "runtime/common/temp_files.h"

namespace gemvz::internal {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return ErrnoStatus(absl::StrCat(what, " '", path, "'"));
}

// Makes renames and unlinks in `dir` durable. Best effort: a directory that cannot be opened
// for fsync (some network file systems) still holds the entries.
void FsyncDir(const std::string& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
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

std::string BaseName(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

namespace {

// `p` without empty and "." components ("a//b/./c/" -> "a/b/c"); ".." is kept, since only the
// file system knows where it leads.
std::string TidyPath(const std::string& p) {
  std::string out = !p.empty() && p[0] == '/' ? "/" : "";
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find('/', start);
    if (end == std::string::npos) end = p.size();
    const std::string part = p.substr(start, end - start);
    if (!part.empty() && part != ".") {
      if (!out.empty() && out.back() != '/') out += '/';
      out += part;
    }
    start = end + 1;
  }
  return out.empty() ? "." : out;
}

// Whether `path` exists (links followed), its identity then in *id.
bool Identify(const std::string& path, std::pair<dev_t, ino_t>* id) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return false;
  *id = {st.st_dev, st.st_ino};
  return true;
}

// Where the tidy path `p` leads, or will once the directories missing on it are made: its
// nearest ancestor that exists, resolved (realpath: links, ".", ".."), then the names after it,
// a ".." among them taking the name before it. "" when no ancestor resolves.
std::string WhereItLeads(const std::string& p) {
  std::vector<std::string> rest;  // the names after `head`, the last first
  std::string head = p;
  char resolved[PATH_MAX];
  while (::realpath(head.c_str(), resolved) == nullptr) {
    if (head == "." || head == "/") return "";
    rest.push_back(BaseName(head));
    head = DirName(head);
  }
  std::string out = resolved;
  for (auto name = rest.rbegin(); name != rest.rend(); ++name) {
    if (*name == "..") {
      out = DirName(out);
    } else {
      if (out.back() != '/') out += '/';
      out += *name;
    }
  }
  // A ".." may have led back to something that exists ("new/../link"): resolve that too.
  if (!rest.empty() && ::realpath(out.c_str(), resolved) != nullptr) return resolved;
  return out;
}

}  // namespace

bool SameFile(const std::string& a, const std::string& b) {
  std::pair<dev_t, ino_t> ia, ib;
  if (Identify(a, &ia) && Identify(b, &ib)) return ia == ib;  // hard links too
  // One or both still to be written: where each leads. A path longer than PATH_MAX names no file
  // that can be opened, so it is compared as written (and the walk up stays short).
  const std::string ta = TidyPath(a), tb = TidyPath(b);
  if (ta.size() >= PATH_MAX || tb.size() >= PATH_MAX) return ta == tb;
  const std::string la = WhereItLeads(ta), lb = WhereItLeads(tb);
  if (la.empty() || lb.empty()) return ta == tb;
  return la == lb;
}

namespace {

// Reads what is left of `fd` (leaving it open), refusing more than `max_bytes` (negative: no
// limit); `expected` (the size fstat gave, if any) is reserved up front.
absl::StatusOr<std::string> ReadAll(int fd, const std::string& path, int64_t max_bytes,
                                    int64_t expected) {
  std::string out;
  if (expected > 0) out.reserve(static_cast<size_t>(expected));
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {  // a non-blocking pipe: wait for its writer
        struct pollfd p = {fd, POLLIN, 0};
        if (::poll(&p, 1, -1) >= 0 || errno == EINTR) continue;
      }
      return ErrnoError("cannot read", path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (max_bytes >= 0 && static_cast<int64_t>(out.size()) > max_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("'", path, "' holds more than ", max_bytes, " bytes, the most it may"));
    }
  }
  return out;
}

// ReadAll, then close `fd` whatever the result.
absl::StatusOr<std::string> ReadAllAndClose(int fd, const std::string& path, int64_t max_bytes,
                                            int64_t expected) {
  absl::StatusOr<std::string> out = ReadAll(fd, path, max_bytes, expected);
  ::close(fd);
  return out;
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open", path);
  struct stat st;
  int64_t expected = ::fstat(fd, &st) == 0 ? st.st_size : 0;
  if (max_bytes >= 0) expected = std::min(expected, max_bytes);  // a huge sparse file: no reserve
  return ReadAllAndClose(fd, path, max_bytes, expected);
}

absl::StatusOr<std::string> ReadDescriptor(int fd, const std::string& name, int64_t max_bytes) {
  return ReadAll(fd, name, max_bytes, 0);
}

absl::StatusOr<std::string> ReadRegularFile(const std::string& path, int64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoError("cannot open", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    absl::Status s = ErrnoError("cannot stat", path);
    ::close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is not a regular file"));
  }
  if (st.st_size > max_bytes) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "'", path, "' is ", st.st_size, " bytes, more than the ", max_bytes, " it may hold"));
  }
  return ReadAllAndClose(fd, path, max_bytes, st.st_size);
}

std::string SiblingPath(const std::string& path, std::string_view kind, std::string_view unique) {
  constexpr size_t kNameMax = 255;  // NAME_MAX on Linux file systems
  const std::string suffix = absl::StrCat(std::string(kind), ::getpid(), ".", std::string(unique));
  const size_t slash = path.rfind('/');
  const size_t name_start = slash == std::string::npos ? 0 : slash + 1;
  const size_t name_size = path.size() - name_start;
  if (name_size + suffix.size() <= kNameMax) return path + suffix;
  const size_t keep = kNameMax > suffix.size() ? kNameMax - suffix.size() : 0;
  return absl::StrCat(path.substr(0, name_start + std::min(keep, name_size)), suffix);
}

bool IsSpecialFile(const std::string& path) {
  struct stat info;  // stat follows links: a FIFO and a link to one alike
  return ::stat(path.c_str(), &info) == 0 && !S_ISREG(info.st_mode) && !S_ISDIR(info.st_mode);
}

std::string NotARegularFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISREG(st.st_mode)) return "";
    if (S_ISDIR(st.st_mode)) return "a directory";
    if (S_ISFIFO(st.st_mode)) return "a FIFO";
    if (S_ISSOCK(st.st_mode)) return "a socket";
    if (S_ISCHR(st.st_mode)) return "a character device";
    if (S_ISBLK(st.st_mode)) return "a block device";
    return "not a regular file";
  }
  const int e = errno;
  struct stat link;
  if (e == ENOENT && ::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) {
    char target[4096];
    const ssize_t n = ::readlink(path.c_str(), target, sizeof(target));
    return absl::StrCat("a symbolic link to '",
                        n > 0 ? Escaped(std::string_view(target, static_cast<size_t>(n))) : "?",
                        "', which does not exist");
  }
  errno = e;
  return "";
}

absl::StatusOr<std::unique_ptr<StagedFile>> StagedFile::Write(const std::string& path,
                                                              const StreamedContent& write) {
  static std::atomic<uint64_t> counter{0};
  std::unique_ptr<StagedFile> f(new StagedFile());
  f->path_ = path;
  f->temp_path_ = SiblingPath(path, ".tmp.",
                              absl::StrCat(std::hash<std::thread::id>()(std::this_thread::get_id()),
                                           ".", counter.fetch_add(1)));
  const std::string& tmp = f->temp_path_;
  // Removed by a signal handler (temp_files.h) if the process is interrupted before the rename.
  f->registration_ = TempFileRegistration(tmp);
  f->fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f->fd_ < 0) return ErrnoError("cannot create", tmp);
  // From here on `f`'s destructor closes and removes the file on every way out: an error, or an
  // exception from the producer (std::bad_alloc, say) unwinding through here.
  f->owns_temp_ = true;
  auto sink = [&](const void* data, size_t size) -> absl::Status {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(f->fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError("cannot write", tmp);
      }
      p += n;
      size -= static_cast<size_t>(n);
      f->size_ += static_cast<uint64_t>(n);
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(write(sink));
  if (::fsync(f->fd_) != 0) return ErrnoError("cannot fsync", tmp);
  const int fd = f->fd_;
  f->fd_ = -1;
  if (::close(fd) != 0) return ErrnoError("cannot close", tmp);
  return f;
}

StagedFile::~StagedFile() {
  if (fd_ >= 0) ::close(fd_);
  if (owns_temp_ && !published_) ::unlink(temp_path_.c_str());
}

void StagedFile::Published() {
  published_ = true;
  registration_.Release();
}

absl::Status AtomicWriteFileStreamed(const std::string& path, const StreamedContent& write) {
  // The rename would put a regular file in the place of a device, FIFO or socket (/dev/null
  // replaced under a root process), or of a link to one (/dev/stdout): refused, untouched.
  if (IsSpecialFile(path)) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path,
                     "' is not a regular file (a device, FIFO or socket, or a link to one): it "
                     "is published by a rename, which would replace it; give a file's path"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<StagedFile> staged, StagedFile::Write(path, write));
  if (::rename(staged->temp_path().c_str(), path.c_str()) != 0) {
    return ErrnoError("cannot rename into place", path);  // `staged` removes the file
  }
  staged->Published();
  FsyncDir(DirName(path));  // make the rename itself durable
  return absl::OkStatus();
}

// NOTES: rename(2) is atomic for one name only; POSIX has no call that publishes several. So the
// old files are kept under backup names until every new one is in place, and a failure puts them
// back. Each backup is a hard link, so that every `to` always holds either its old or its new
// file, never nothing (rename aside, with `to` missing meanwhile, only where the file system
// has no hard links). The steps run to the end even if SIGINT/SIGTERM/SIGHUP arrive (the gemvz
// handler defers them, temp_files.h). What remains: a crash, power loss or SIGKILL in the middle
// of the renames leaves some `to`s new and some old, with the `.old.` backups of the replaced ones
// beside them (never unlinked by a signal handler: they may be the only copy of the old file), and
// the unpublished `from`s. Only swapping a whole directory would close that, which would replace
// every other file of the output directory too.
absl::Status RenameAllOrNothing(const std::vector<PendingRename>& renames) {
  FatalSignalDeferral defer_signals;
  static std::atomic<uint64_t> counter{0};

  // Refuse what would fail before touching anything: a directory in the way, a name twice.
  std::set<std::string> targets, dirs;
  std::vector<bool> replaces(renames.size(), false);
  for (size_t i = 0; i < renames.size(); ++i) {
    const std::string& to = renames[i].to;
    if (!targets.insert(to).second) {
      return absl::InvalidArgumentError(absl::StrCat("'", to, "' would be published twice"));
    }
    dirs.insert(DirName(to));
    struct stat st;
    if (::lstat(to.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cannot publish '", to, "': a directory is in the way (nothing was published)"));
      }
      // The rename would put a regular file in the place of a device, FIFO or socket, or of a
      // link to one, as AtomicWriteFileStreamed refuses to.
      if (IsSpecialFile(to)) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot publish '", to,
                         "': it is not a regular file (a device, FIFO or socket, or a link to "
                         "one), which the rename would replace (nothing was published)"));
      }
      replaces[i] = true;
    } else if (errno != ENOENT) {
      return ErrnoError("cannot publish: cannot stat", to);
    }
  }

  struct Step {
    std::string backup;  // "" when `to` did not exist
    bool aside = false;  // the backup was made by renaming `to` away (no hard links)
    bool renamed = false;
  };
  std::vector<Step> steps(renames.size());

  // Undoes every step taken; says what could not be undone (with where the old file now is).
  auto roll_back = [&](absl::Status error) {
    std::string left;
    for (size_t i = steps.size(); i-- > 0;) {
      const Step& s = steps[i];
      const std::string& to = renames[i].to;
      if (s.renamed || s.aside) {
        // The old file back in place, or the new one away when there was none.
        const bool ok = s.backup.empty() ? ::unlink(to.c_str()) == 0
                                         : ::rename(s.backup.c_str(), to.c_str()) == 0;
        if (!ok) {
          const int e = errno;
          absl::StrAppend(&left, "; cannot restore '", to, "': ", std::strerror(e),
                          s.backup.empty() ? std::string(" (it holds the new file)")
                                           : absl::StrCat(" (the old file is '", s.backup, "')"));
        }
      } else if (!s.backup.empty()) {
        ::unlink(s.backup.c_str());  // a link to the untouched `to`
      }
    }
    for (const std::string& d : dirs) FsyncDir(d);
    if (left.empty()) return error;
    return absl::Status(error.code(), absl::StrCat(error.message(), "; rolling back failed", left));
  };

  // The old files: a second name each, so that they outlive the renames until all have worked.
  for (size_t i = 0; i < renames.size(); ++i) {
    if (!replaces[i]) continue;
    const std::string& to = renames[i].to;
    Step& s = steps[i];
    // Neither way of keeping the old file may replace anything already at the backup's name: a
    // backup left by a killed run (the same pid again, in a container) may be the only copy of
    // some older file. So link(2), which never replaces, or rename with RENAME_NOREPLACE, and a
    // fresh name when one is taken.
    int e = EEXIST;
    for (int attempt = 0; attempt < 100 && e == EEXIST; ++attempt) {
      s.backup = SiblingPath(to, ".old.", absl::StrCat(counter.fetch_add(1)));
      if (::link(to.c_str(), s.backup.c_str()) == 0) {
        e = 0;
      } else if (errno == EEXIST || errno == ENOENT) {
        e = errno;
      } else if (::renameat2(AT_FDCWD, to.c_str(), AT_FDCWD, s.backup.c_str(),
                             RENAME_NOREPLACE) == 0) {  // no hard links here (EPERM, EXDEV...)
        s.aside = true;
        e = 0;
      } else {
        e = errno;
      }
    }
    if (e == 0) continue;
    if (e == ENOENT) {  // removed since the check: nothing to keep
      s.backup.clear();
      continue;
    }
    errno = e;
    absl::Status error = ErrnoError(
        absl::StrCat("cannot keep the old file aside as '", s.backup, "' before replacing"), to);
    s.backup.clear();
    return roll_back(std::move(error));
  }

  for (size_t i = 0; i < renames.size(); ++i) {
    if (::rename(renames[i].from.c_str(), renames[i].to.c_str()) != 0) {
      return roll_back(ErrnoStatus(absl::StrCat("cannot rename '", renames[i].from, "' to '",
                                                renames[i].to, "' (nothing was published)")));
    }
    steps[i].renamed = true;
  }
  for (const std::string& d : dirs) FsyncDir(d);

  // Every new file is in place: the old ones can go.
  bool removed = false;
  for (const Step& s : steps) {
    if (s.backup.empty()) continue;
    if (::unlink(s.backup.c_str()) == 0) {
      removed = true;
    } else {
      GEMVZ_LOG_WARNING("cannot remove the old file's backup '%s': %s", s.backup,
                        std::strerror(errno));
    }
  }
  if (removed) {
    for (const std::string& d : dirs) FsyncDir(d);
  }
  return absl::OkStatus();
}

absl::Status AtomicWriteFile(const std::string& path, std::string_view data) {
  return AtomicWriteFileStreamed(path, [&](const auto& sink) { return sink(data.data(), data.size()); });
}

absl::Status CreateDirectories(const std::string& path, std::vector<std::string>* created) {
  if (path.empty()) return absl::InvalidArgumentError("empty directory path");
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) == 0) {
      if (created != nullptr) created->push_back(cur);
    } else if (errno != EEXIST) {
      return ErrnoError("cannot create directory", cur);
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is not a directory"));
  }
  return absl::OkStatus();
}

void RemoveCreatedDirectories(const std::vector<std::string>& created) {
  for (auto it = created.rbegin(); it != created.rend(); ++it) ::rmdir(it->c_str());
}

DirectoryListing ListDirectory(const std::string& dir) {
  DirectoryListing listing;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    listing.open_errno = errno;
    return listing;
  }
  while (true) {
    errno = 0;  // readdir leaves it alone at the end: what is there then is the failure's
    const struct dirent* e = ::readdir(d);
    if (e == nullptr) {
      listing.read_errno = errno;
      break;
    }
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    listing.names.emplace_back(e->d_name);
  }
  ::closedir(d);
  return listing;
}

}  // namespace gemvz::internal
