// Tests of publishing several files together (RenameAllOrNothing): all new files in place on
// success, and on any failure every name as it was, replaced files' old bytes included, with no
// backup left behind; also where link(2) fails, as on a file system without hard links.
#include "runtime/common/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/temp_files.h"

namespace gemvz::internal {
namespace {

using ::gemvz::testing::Exists;
using ::gemvz::testing::ListDir;
using ::gemvz::testing::MakeTempDir;
using ::gemvz::testing::ReadAll;
using ::gemvz::testing::WriteAll;

// While set, link(2) fails in this binary as on a file system without hard links (below).
std::atomic<bool> no_hard_links{false};
std::atomic<int> failed_links{0};

TEST(RenameAllOrNothingTest, PublishesEveryFileAndReplacesOldOnes) {
  const std::string dir = MakeTempDir("file_util_test");
  WriteAll(dir + "/a", "old a");
  WriteAll(dir + "/a.tmp", "new a");
  WriteAll(dir + "/b.tmp", "new b");
  ASSERT_TRUE(
      RenameAllOrNothing({{dir + "/a.tmp", dir + "/a"}, {dir + "/b.tmp", dir + "/b"}}).ok());
  EXPECT_EQ(ReadAll(dir + "/a"), "new a");
  EXPECT_EQ(ReadAll(dir + "/b"), "new b");
  // No temporary name and no backup of the old a left.
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(RenameAllOrNothing({}).ok());
}

// A backup left by a run that was killed (a pid used again, as in a container) may be the only
// copy of an older file: a new backup takes another name and never replaces it.
TEST(RenameAllOrNothingTest, ABackupLeftByAKilledRunIsNeverReplaced) {
  const std::string dir = MakeTempDir("file_util_test");
  WriteAll(dir + "/a", "old a");
  WriteAll(dir + "/a.tmp", "new a");
  // The names this process's next backups would take (the counter is below 64 here, so the
  // first tries meet these; past them the publish goes on with a free name).
  std::vector<std::string> left;
  for (int n = 0; n < 64; ++n) {
    left.push_back("a.old." + std::to_string(::getpid()) + "." + std::to_string(n));
    WriteAll(dir + "/" + left.back(), "only copy " + std::to_string(n));
  }
  ASSERT_TRUE(RenameAllOrNothing({{dir + "/a.tmp", dir + "/a"}}).ok());
  EXPECT_EQ(ReadAll(dir + "/a"), "new a");
  for (int n = 0; n < 64; ++n) {
    EXPECT_EQ(ReadAll(dir + "/" + left[n]), "only copy " + std::to_string(n));
  }
  std::vector<std::string> expected = left;
  expected.push_back("a");
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(ListDir(dir), expected);
}

TEST(RenameAllOrNothingTest, ADirectoryInTheWayFailsBeforeAnythingMoves) {
  const std::string dir = MakeTempDir("file_util_test");
  WriteAll(dir + "/a", "old a");
  WriteAll(dir + "/a.tmp", "new a");
  WriteAll(dir + "/b.tmp", "new b");
  ASSERT_EQ(::mkdir((dir + "/b").c_str(), 0755), 0);
  WriteAll(dir + "/b/x", "in the way");
  const absl::Status st =
      RenameAllOrNothing({{dir + "/a.tmp", dir + "/a"}, {dir + "/b.tmp", dir + "/b"}});
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("'" + dir + "/b'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("directory"), std::string::npos) << st;
  EXPECT_EQ(ReadAll(dir + "/a"), "old a");
  // The temporary files stay for their owner to remove.
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"a", "a.tmp", "b", "b.tmp"}));
  EXPECT_EQ(ReadAll(dir + "/b/x"), "in the way");
}

TEST(RenameAllOrNothingTest, AFailedRenameTakesBackTheOnesBefore) {
  const std::string dir = MakeTempDir("file_util_test");
  // a and c replace old files, b is new; the last rename fails (its temporary file is gone), after
  // the others have been made.
  WriteAll(dir + "/a", "old a");
  WriteAll(dir + "/c", "old c");
  WriteAll(dir + "/a.tmp", "new a");
  WriteAll(dir + "/b.tmp", "new b");
  const absl::Status st = RenameAllOrNothing(
      {{dir + "/a.tmp", dir + "/a"}, {dir + "/b.tmp", dir + "/b"}, {dir + "/c.tmp", dir + "/c"}});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cannot rename '" + dir + "/c.tmp'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("nothing was published"), std::string::npos) << st;
  EXPECT_EQ(st.message().find("rolling back failed"), std::string::npos) << st;
  EXPECT_EQ(ReadAll(dir + "/a"), "old a");
  EXPECT_EQ(ReadAll(dir + "/c"), "old c");
  EXPECT_FALSE(Exists(dir + "/b"));
  // The renamed temporary files went with the rollback; no backup is left.
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"a", "c"}));
}

TEST(RenameAllOrNothingTest, TheSameTargetTwiceIsRefused) {
  const std::string dir = MakeTempDir("file_util_test");
  WriteAll(dir + "/a.tmp", "1");
  WriteAll(dir + "/b.tmp", "2");
  const absl::Status st =
      RenameAllOrNothing({{dir + "/a.tmp", dir + "/a"}, {dir + "/b.tmp", dir + "/a"}});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("twice"), std::string::npos) << st;
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"a.tmp", "b.tmp"}));
}

// A device, FIFO or socket under a name to publish, or a link to one, would be replaced by the
// rename (a root process packing into /dev's directory, say): refused before anything moves.
TEST(RenameAllOrNothingTest, ASpecialFileOrALinkToOneFailsBeforeAnythingMoves) {
  const std::string dir = MakeTempDir("file_util_test");
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0644), 0);
  ASSERT_EQ(::symlink((dir + "/fifo").c_str(), (dir + "/link").c_str()), 0);
  WriteAll(dir + "/a", "old a");
  WriteAll(dir + "/a.tmp", "new a");
  WriteAll(dir + "/b.tmp", "new b");
  for (const std::string name : {"fifo", "link"}) {
    const std::string to = dir + "/" + name;
    const absl::Status st =
        RenameAllOrNothing({{dir + "/a.tmp", dir + "/a"}, {dir + "/b.tmp", to}});
    ASSERT_FALSE(st.ok()) << name;
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("'" + to + "'"), std::string::npos) << st;
    EXPECT_NE(st.message().find("not a regular file"), std::string::npos) << st;
    EXPECT_EQ(ReadAll(dir + "/a"), "old a");
    EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"a", "a.tmp", "b.tmp", "fifo", "link"}));
  }
  struct stat info;
  ASSERT_EQ(::lstat((dir + "/fifo").c_str(), &info), 0);
  EXPECT_TRUE(S_ISFIFO(info.st_mode));
  ASSERT_EQ(::lstat((dir + "/link").c_str(), &info), 0);
  EXPECT_TRUE(S_ISLNK(info.st_mode));
}

// Where link(2) fails (EPERM: a file system without hard links), the old file is renamed aside
// instead, and its name is empty until the publish ends; a failed publish must rename it back.
// Unlinking the backup as if it were a second link, as when link(2) works, would lose the only
// copy.
TEST(RenameAllOrNothingTest, WithoutHardLinksTheOldFilesAreMovedAsideAndBack) {
  const std::string dir = MakeTempDir("file_util_test");
  no_hard_links = true;
  failed_links = 0;
  // a replaces an old file, b is new: published, with no backup left.
  WriteAll(dir + "/a", "old a");
  WriteAll(dir + "/a.tmp", "new a");
  WriteAll(dir + "/b.tmp", "new b");
  absl::Status st =
      RenameAllOrNothing({{dir + "/a.tmp", dir + "/a"}, {dir + "/b.tmp", dir + "/b"}});
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(ReadAll(dir + "/a"), "new a");
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"a", "b"}));
  // a and c replace old files, both moved aside; c's rename fails after a's has been made.
  WriteAll(dir + "/a", "old a");
  WriteAll(dir + "/c", "old c");
  WriteAll(dir + "/a.tmp", "newer a");
  st = RenameAllOrNothing({{dir + "/a.tmp", dir + "/a"}, {dir + "/c.tmp", dir + "/c"}});
  no_hard_links = false;
  EXPECT_GE(failed_links, 3) << "link(2) was not replaced: nothing was tested";
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cannot rename '" + dir + "/c.tmp'"), std::string::npos) << st;
  EXPECT_EQ(st.message().find("rolling back failed"), std::string::npos) << st;
  EXPECT_EQ(ReadAll(dir + "/a"), "old a");
  EXPECT_EQ(ReadAll(dir + "/c"), "old c") << "the only copy of the old c is lost";
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"a", "b", "c"}));
}

// A file name near NAME_MAX (255 bytes) is a valid name; its temporary and backup names beside
// it must be valid too, so that writing it and replacing it work.
TEST(SiblingPathTest, NamesNearNameMaxStillWriteAndReplace) {
  EXPECT_EQ(SiblingPath("d/f.json", ".tmp.", "7"), "d/f.json.tmp." + std::to_string(getpid()) + ".7");
  const std::string long_name(250, 'n');
  const std::string sibling = SiblingPath("/x/" + long_name, ".old.", "12");
  EXPECT_EQ(sibling.size() - 3, 255u) << sibling;
  EXPECT_EQ(sibling.rfind("/x/nnn", 0), 0u);

  const std::string dir = MakeTempDir("file_util_test");
  const std::string path = dir + "/" + long_name;
  ASSERT_TRUE(AtomicWriteFile(path, "first").ok());
  ASSERT_TRUE(AtomicWriteFile(path, "second").ok());
  EXPECT_EQ(ReadAll(path), "second");
  // Replaced by a publish, which keeps the old file under a backup name until the end.
  WriteAll(dir + "/new", "third");
  const absl::Status st = RenameAllOrNothing({{dir + "/new", path}});
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(ReadAll(path), "third");
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{long_name}));
}

// A producer that throws (std::bad_alloc, say) unwinds through the write: the exception reaches
// the caller, and no temporary file is left beside the target.
TEST(AtomicWriteFileStreamedTest, AProducerThatThrowsLeavesNoTemporaryFile) {
  const std::string dir = MakeTempDir("file_util_test");
  EXPECT_THROW((void)AtomicWriteFileStreamed(dir + "/f",
                                             [](const auto& sink) -> absl::Status {
                                               (void)sink("half", 4);
                                               throw std::bad_alloc();
                                             }),
               std::bad_alloc);
  EXPECT_TRUE(ListDir(dir).empty());
}

// A FIFO (a device or socket alike: /dev/null under a root process), or a link to one, is not
// replaced by a regular file: refused before anything is written, left as it was. A regular file
// and a link to one are published as before.
TEST(AtomicWriteFileTest, ASpecialFileOrALinkToOneIsRefusedAndKept) {
  const std::string dir = MakeTempDir("file_util_test");
  const std::string fifo = dir + "/fifo", link = dir + "/link";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  ASSERT_EQ(::symlink(fifo.c_str(), link.c_str()), 0);
  for (const std::string& path : {fifo, link}) {
    const absl::Status st = AtomicWriteFile(path, "report");
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << path << ": " << st;
    EXPECT_NE(st.message().find("not a regular file"), std::string::npos) << st;
    EXPECT_NE(st.message().find(path), std::string::npos) << st;
  }
  struct stat info;
  ASSERT_EQ(::lstat(fifo.c_str(), &info), 0);
  EXPECT_TRUE(S_ISFIFO(info.st_mode));
  ASSERT_EQ(::lstat(link.c_str(), &info), 0);
  EXPECT_TRUE(S_ISLNK(info.st_mode));
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"fifo", "link"}));  // no temporary file
  WriteAll(dir + "/file", "old");
  ASSERT_EQ(::symlink((dir + "/file").c_str(), (dir + "/filelink").c_str()), 0);
  EXPECT_TRUE(AtomicWriteFile(dir + "/file", "new").ok());
  EXPECT_EQ(ReadAll(dir + "/file"), "new");
  EXPECT_TRUE(AtomicWriteFile(dir + "/filelink", "newer").ok());
  EXPECT_EQ(ReadAll(dir + "/filelink"), "newer");
}

// SameFile: what a command checks before an output may replace a file.
TEST(SameFileTest, ExistingFilesByInodeFilesToBeWrittenByDirectoryAndName) {
  const std::string dir = MakeTempDir("file_util_test");
  WriteAll(dir + "/a", "a");
  WriteAll(dir + "/b", "b");
  ASSERT_EQ(::mkdir((dir + "/d").c_str(), 0755), 0);
  ASSERT_EQ(::symlink((dir + "/a").c_str(), (dir + "/link").c_str()), 0);
  ASSERT_EQ(::link((dir + "/a").c_str(), (dir + "/hard").c_str()), 0);
  ASSERT_EQ(::symlink(dir.c_str(), (dir + "/dirlink").c_str()), 0);
  // Existing: one inode, whatever the spelling.
  EXPECT_TRUE(SameFile(dir + "/a", dir + "/a"));
  EXPECT_TRUE(SameFile(dir + "/a", dir + "//./a"));
  EXPECT_TRUE(SameFile(dir + "/a", dir + "/link"));
  EXPECT_TRUE(SameFile(dir + "/a", dir + "/hard"));
  EXPECT_TRUE(SameFile(dir + "/a", dir + "/d/../a"));
  EXPECT_FALSE(SameFile(dir + "/a", dir + "/b"));
  // One exists, the other not: two files, unless the other leads to it once made.
  EXPECT_FALSE(SameFile(dir + "/a", dir + "/d/a"));
  EXPECT_TRUE(SameFile(dir + "/a", dir + "/made/../a"));
  EXPECT_TRUE(SameFile(dir + "/a", dir + "/made/x/../../link"));
  // Neither exists: the same name in one directory, compared by inode where it exists...
  EXPECT_TRUE(SameFile(dir + "/d/new", dir + "/dirlink/d/new"));
  EXPECT_TRUE(SameFile(dir + "/d/new", dir + "/d/../d/new"));
  EXPECT_FALSE(SameFile(dir + "/d/new", dir + "/d/other"));
  EXPECT_FALSE(SameFile(dir + "/d/new", dir + "/new"));
  // ... and, where it is still to be made, by name up to the nearest directory that exists.
  EXPECT_TRUE(SameFile(dir + "/made/new", dir + "/made//./new"));
  EXPECT_TRUE(SameFile(dir + "/made/", dir + "/made"));
  EXPECT_TRUE(SameFile(dir + "/made/deeper/new", dir + "/dirlink/made/deeper/new"));
  EXPECT_TRUE(SameFile(dir + "/made/new", dir + "/d/../made/new"));
  EXPECT_TRUE(SameFile(dir + "/d/new", dir + "/d/made/../new"));
  EXPECT_TRUE(SameFile(dir + "/made/new", dir + "/made/x/y/../../new"));
  EXPECT_FALSE(SameFile(dir + "/made/new", dir + "/made2/new"));
  EXPECT_FALSE(SameFile(dir + "/made/new", dir + "/made/new2"));
  EXPECT_FALSE(SameFile(dir + "/made/new", dir + "/d/made/new"));
  // Relative against absolute, the working directory being `dir`.
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  ASSERT_EQ(::chdir(dir.c_str()), 0);
  EXPECT_TRUE(SameFile("made/new", dir + "/made/new"));
  EXPECT_TRUE(SameFile("new", dir + "/new"));
  EXPECT_TRUE(SameFile("a", dir + "/a"));
  EXPECT_FALSE(SameFile("made/new", dir + "/d/new"));
  EXPECT_TRUE(SameFile("d/x/../new", dir + "/d/new"));
  ASSERT_EQ(::chdir(cwd), 0);
  // Paths past PATH_MAX (no file can be opened by them) are compared as written, at once: the
  // walk up to an ancestor that exists never starts (60000 names once took 100 s and a crash).
  std::string long_path;
  for (int i = 0; i < 60000; ++i) long_path += "a/";
  EXPECT_TRUE(SameFile(long_path + "x", long_path + "./x"));
  EXPECT_FALSE(SameFile(long_path + "x", long_path + "y"));
}

// The codes callers see from every file gemvz writes or reads (Save, checkpoints, the JIT cache):
// a read-only file system is PermissionDenied, something the caller can fix, like EACCES and
// EPERM, never Internal, which reads as a bug of gemvz.
TEST(ErrnoStatusTest, MapsErrnoToTheCodeCallersSee) {
  const std::pair<int, absl::StatusCode> cases[] = {
      {ENOENT, absl::StatusCode::kNotFound},        {EACCES, absl::StatusCode::kPermissionDenied},
      {EPERM, absl::StatusCode::kPermissionDenied}, {EROFS, absl::StatusCode::kPermissionDenied},
      {EIO, absl::StatusCode::kInternal},           {ENOSPC, absl::StatusCode::kInternal},
  };
  for (const auto& [err, code] : cases) {
    errno = err;
    const absl::Status st = ErrnoStatus("cannot write 'x'");
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_EQ(st.message(), std::string("cannot write 'x': ") + std::strerror(err));
  }
}

TEST(BaseNameTest, IsWhatFollowsTheLastSlash) {
  EXPECT_EQ(BaseName("a/b/c.json"), "c.json");
  EXPECT_EQ(BaseName("c.json"), "c.json");
  EXPECT_EQ(BaseName("/c"), "c");
}

// What gemvz keeps on disk is read only if it is a regular file of bounded size: a FIFO left
// under an entry's name is refused at once (it used to block the reader forever, waiting for a
// writer), and so are a device, a directory and a file above the limit.
TEST(ReadRegularFileTest, RefusesWhatIsNotARegularFileWithoutBlocking) {
  const std::string dir = MakeTempDir("file_util_test");
  WriteAll(dir + "/small", "0123456789");
  auto read = ReadRegularFile(dir + "/small", 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "0123456789");
  read = ReadRegularFile(dir + "/small", 9);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(read.status().message().find("is 10 bytes, more than the 9"), std::string::npos)
      << read.status();
  EXPECT_TRUE(absl::IsNotFound(ReadRegularFile(dir + "/none", 10).status()));
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", (dir + "/zero").c_str()), 0);
  for (const std::string path : {dir + "/fifo", dir + "/zero", dir, std::string("/dev/null")}) {
    read = ReadRegularFile(path, 1 << 20);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition) << path;
    EXPECT_NE(read.status().message().find("is not a regular file"), std::string::npos)
        << read.status();
  }
  // ReadFile still reads what a user names, a pipe included.
  EXPECT_EQ(*ReadFile("/dev/null"), "");
}

// A descriptor in non-blocking mode (standard input that a parent set so, a shared pipe) is
// read to its end all the same: EAGAIN waits for data rather than ending the read with an error.
// The writer sends its bytes in two parts, late, and then closes; the descriptor stays open.
TEST(ReadDescriptorTest, WaitsOnANonBlockingPipeAndLeavesItOpen) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ASSERT_EQ(::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK), 0);
  std::thread writer([w = fds[1]] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(::write(w, "z12.nw8", 7), 7);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(::write(w, ".ug2\n", 5), 5);
    ::close(w);
  });
  absl::StatusOr<std::string> read = ReadDescriptor(fds[0], "<stdin>", 1 << 20);
  writer.join();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "z12.nw8.ug2\n");
  EXPECT_EQ(::fcntl(fds[0], F_GETFD), 0) << "the descriptor was closed";
  ::close(fds[0]);
}

}  // namespace
}  // namespace gemvz::internal

// link(2) for the whole test binary, RenameAllOrNothing's call included (the library is linked in
// statically, or resolves the symbol to the executable's): the real one, through linkat(2),
// unless a test asks for a file system without hard links.
extern "C" int link(const char* from, const char* to) noexcept {
  if (gemvz::internal::no_hard_links) {
    ++gemvz::internal::failed_links;
    errno = EPERM;
    return -1;
  }
  return ::linkat(AT_FDCWD, from, AT_FDCWD, to, 0);
}
