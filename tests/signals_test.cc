// Tests of the CLI's signal handlers, in child processes: a writer interrupted by SIGINT, SIGTERM
// or SIGHUP leaves no temporary file and the child still dies by that signal; a signal during a
// deferral waits for its end; a signal ignored at start stays ignored; a mapped input truncated
// under a reader (SIGBUS) is explained and leaves no temporary file.
#include "tools/gemvz/signals.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/common/file_util.h"
#include "runtime/common/temp_files.h"
#include "tests/support/temp_files.h"

namespace gemvz::cli {
namespace {

using ::gemvz::testing::ListDir;
using ::gemvz::testing::MakeTempDir;
using ::gemvz::testing::ReadAll;

// The handlers as a fresh `gemvz` would install them, whatever the test runner ignores.
void InstallFromDefaults() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGBUS}) ::signal(sig, SIG_DFL);
  InstallTempFileCleanupOnSignals();
}

// In a child that is meant to die by SIGBUS: no core file, and stderr into `path`.
void NoCoreStderrTo(const std::string& path) {
  const struct rlimit none = {0, 0};
  ::setrlimit(RLIMIT_CORE, &none);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) ::dup2(fd, STDERR_FILENO);
}

void Touch(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
}

// Runs `body` in a child (exit status 0 if it returns) and waits for it. `ready` is a pipe the
// child writes a byte to when it wants `parent` run; -1 if no parent step.
int RunChild(const std::function<void(int ready)>& body,
             const std::function<void(pid_t)>& parent = nullptr) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    // A handler that never ends the process (SIGTERM is blocked inside one) must fail the test,
    // not hang it: SIGALRM's default action ends the child, and Describe says so.
    ::alarm(60);
    body(fds[1]);
    ::_exit(0);
  }
  ::close(fds[1]);
  if (parent) {
    char c;
    if (::read(fds[0], &c, 1) == 1) parent(pid);
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

std::string Describe(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  return "status " + std::to_string(status);
}

class SignalsTest : public ::testing::TestWithParam<int> {};

TEST_P(SignalsTest, ASafetensorsWriterKilledMidTensorLeavesNothing) {
  const int sig = GetParam();
  const std::string dir = MakeTempDir("signals_test");
  std::vector<std::string> seen;
  const int status = RunChild(
      [&](int ready) {
        InstallFromDefaults();
        auto w = internal::SafetensorsWriter::Create(dir + "/m.safetensors", 256);
        if (!w.ok() || !(*w)->BeginTensor("t", "U8", {1 << 20}).ok()) ::_exit(3);
        const std::string half(1 << 19, 'x');
        if (!(*w)->Write(half.data(), half.size()).ok()) ::_exit(4);
        (void)!::write(ready, "r", 1);
        while (true) ::pause();  // killed here, the writer's destructor never runs
      },
      [&](pid_t child) {
        seen = ListDir(dir);
        ::kill(child, sig);
      });
  ASSERT_TRUE(WIFSIGNALED(status)) << Describe(status);
  EXPECT_EQ(WTERMSIG(status), sig) << "the exit status must say the signal";
  ASSERT_EQ(seen.size(), 1u) << "the temporary file existed when the signal came";
  EXPECT_EQ(seen[0].rfind("m.safetensors.tmp.", 0), 0u) << seen[0];
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{});
}

TEST_P(SignalsTest, AnAtomicWriteInterruptedFromWithinLeavesNothing) {
  const int sig = GetParam();
  const std::string dir = MakeTempDir("signals_test");
  const int status = RunChild([&](int) {
    InstallFromDefaults();
    (void)internal::AtomicWriteFileStreamed(dir + "/f.json", [&](const auto& sink) {
      (void)sink("{", 1);
      ::raise(sig);
      return absl::OkStatus();
    });
    ::_exit(5);  // the signal must not return here
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << Describe(status);
  EXPECT_EQ(WTERMSIG(status), sig);
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{});
}

INSTANTIATE_TEST_SUITE_P(Signals, SignalsTest, ::testing::Values(SIGINT, SIGTERM, SIGHUP),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == SIGINT    ? "SIGINT"
                                              : info.param == SIGTERM ? "SIGTERM"
                                                                      : "SIGHUP");
                         });

TEST(SignalsTest, WithoutTheHandlersTheTemporaryFileWouldStay) {
  // What the handlers fix: the default action ends the process before any destructor runs.
  const std::string dir = MakeTempDir("signals_test");
  const int status = RunChild([&](int) {
    ::signal(SIGTERM, SIG_DFL);
    auto w = internal::SafetensorsWriter::Create(dir + "/m.safetensors", 256);
    ::raise(SIGTERM);
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << Describe(status);
  EXPECT_EQ(ListDir(dir).size(), 1u);
}

// SIGTERM, and SIGBUS sent by a process (kill -BUS is a request to end, not a fault): it waits
// for a publish, then removes the temporary files and ends the process by that signal, silently.
class DeferredSignalsTest : public ::testing::TestWithParam<int> {};

TEST_P(DeferredSignalsTest, ASignalDuringADeferralWaitsForItsEnd) {
  const int sig = GetParam();
  const std::string dir = MakeTempDir("signals_test"), log_dir = MakeTempDir("signals_test");
  const std::string temp = dir + "/x.tmp.1", marker = dir + "/deferral ran to its end";
  const std::string log = log_dir + "/stderr.txt";
  const int status = RunChild([&](int) {
    NoCoreStderrTo(log);
    InstallFromDefaults();
    internal::TempFileRegistration r(temp);
    Touch(temp);
    {
      internal::FatalSignalDeferral defer;
      ::raise(sig);
      Touch(marker);  // still alive: the publish this stands for finishes
    }
    ::_exit(6);  // raised again when the deferral closed
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << Describe(status) << "; stderr: " << ReadAll(log);
  EXPECT_EQ(WTERMSIG(status), sig);
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"deferral ran to its end"}));
  EXPECT_EQ(ReadAll(log), "");
}

INSTANTIATE_TEST_SUITE_P(Signals, DeferredSignalsTest, ::testing::Values(SIGTERM, SIGBUS),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == SIGTERM ? "SIGTERM" : "SentSIGBUS");
                         });

TEST(SignalsTest, ASignalIgnoredAtStartStaysIgnored) {
  // nohup: a hang-up must neither end the process nor remove its files.
  const std::string dir = MakeTempDir("signals_test");
  const std::string temp = dir + "/x.tmp.1";
  const int status = RunChild([&](int) {
    ::signal(SIGHUP, SIG_IGN);
    InstallTempFileCleanupOnSignals();
    internal::TempFileRegistration r(temp);
    Touch(temp);
    ::raise(SIGHUP);
    r.Release();
  });
  ASSERT_TRUE(WIFEXITED(status)) << Describe(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"x.tmp.1"}));
}

// A file of `pages` pages mapped read-only, then truncated to nothing: reading it faults with
// SIGBUS (BUS_ADRERR), as an input does that another process cuts under `gemvz pack`. Returns the
// mapping, or nullptr.
const uint8_t* MapThenTruncate(const std::string& path, size_t pages) {
  const size_t bytes = pages * 4096;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return nullptr;
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED || ::truncate(path.c_str(), 0) != 0) return nullptr;
  return static_cast<const uint8_t*>(map);
}

TEST(SignalsTest, AMappedInputTruncatedUnderTheReaderIsExplainedAndLeavesNothing) {
  // The packer's situation: an input mapped, an output half written, and another process
  // truncates the input. Reading the lost pages raises SIGBUS.
  const std::string in_dir = MakeTempDir("signals_test"), out_dir = MakeTempDir("signals_test");
  const std::string input = in_dir + "/in.safetensors", log = in_dir + "/stderr.txt";
  {
    auto w = internal::SafetensorsWriter::Create(input, 256);
    ASSERT_TRUE(w.ok()) << w.status();
    const std::string bytes(1 << 20, '\x5a');
    ASSERT_TRUE((*w)->AddTensor("w", "U8", {1 << 20}, bytes.data(), bytes.size()).ok());
    ASSERT_TRUE((*w)->Finish().ok());
    ASSERT_TRUE((*w)->Publish().ok());
  }
  const int status = RunChild([&](int) {
    NoCoreStderrTo(log);
    InstallFromDefaults();
    auto f = internal::SafetensorsFile::Open(input);
    if (!f.ok() || (*f)->Find("w") == nullptr) ::_exit(3);
    auto w = internal::SafetensorsWriter::Create(out_dir + "/out.safetensors", 256);
    if (!w.ok() || !(*w)->BeginTensor("w", "U8", {1 << 20}).ok()) ::_exit(4);
    const uint8_t* data = (*f)->data(*(*f)->Find("w"));
    if (!(*w)->Write(data, 4096).ok()) ::_exit(5);  // the first page, read before the loss
    if (ListDir(out_dir).size() != 1) ::_exit(6);     // the temporary output is there
    if (::truncate(input.c_str(), 8) != 0) ::_exit(7);
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < (size_t{1} << 20); i += 4096) sink ^= data[i];
    ::_exit(8);  // a read past the file's new end must not return
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << Describe(status) << "; stderr: " << ReadAll(log);
  EXPECT_EQ(WTERMSIG(status), SIGBUS) << "the exit status must say the signal";
  EXPECT_EQ(ListDir(out_dir), std::vector<std::string>{});
  const std::string err = ReadAll(log);
  EXPECT_NE(err.find("gemvz: SIGBUS (a bus error, code 2) at address 0x"), std::string::npos)
      << err;
  EXPECT_NE(err.find("memory-mapped input file could not be read"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  EXPECT_NE(err.find("temporary files were removed"), std::string::npos) << err;
}

TEST(SignalsTest, ABusErrorDuringAPublishLeavesItsFilesAsTheyAre) {
  // A fault cannot wait for the deferral to end; removing half a publish's files would be worse
  // than leaving them, so the handler leaves them and says so.
  const std::string dir = MakeTempDir("signals_test"), log_dir = MakeTempDir("signals_test");
  const std::string temp = dir + "/x.tmp.1", log = log_dir + "/stderr.txt";
  const int status = RunChild([&](int) {
    NoCoreStderrTo(log);
    InstallFromDefaults();
    internal::TempFileRegistration r(temp);
    Touch(temp);
    const uint8_t* lost = MapThenTruncate(log_dir + "/mapped", 2);
    if (lost == nullptr) ::_exit(3);
    internal::FatalSignalDeferral defer;
    volatile uint8_t sink = lost[4096];
    (void)sink;
    ::_exit(9);  // not postponed: it must not return here
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << Describe(status) << "; stderr: " << ReadAll(log);
  EXPECT_EQ(WTERMSIG(status), SIGBUS);
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"x.tmp.1"}));
  const std::string err = ReadAll(log);
  EXPECT_NE(err.find("memory-mapped input file could not be read"), std::string::npos) << err;
  EXPECT_NE(err.find("being published: they are left as they are"), std::string::npos) << err;
}

}  // namespace
}  // namespace gemvz::cli
