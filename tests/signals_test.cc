// Tests of the CLI's signal handlers, in child processes: a writer interrupted by SIGINT, SIGTERM
// or SIGHUP leaves no temporary file and the child still dies by that signal; a signal during a
// deferral waits for its end; a signal ignored at start stays ignored.
#include "tools/gemvz/signals.h"

#include <fcntl.h>
#include <signal.h>
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

// The handlers as a fresh `gemvz` would install them, whatever the test runner ignores.
void InstallFromDefaults() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, SIG_DFL);
  InstallTempFileCleanupOnSignals();
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

TEST(SignalsTest, ASignalDuringADeferralWaitsForItsEnd) {
  const std::string dir = MakeTempDir("signals_test");
  const std::string temp = dir + "/x.tmp.1", marker = dir + "/deferral ran to its end";
  const int status = RunChild([&](int) {
    InstallFromDefaults();
    internal::TempFileRegistration r(temp);
    Touch(temp);
    {
      internal::FatalSignalDeferral defer;
      ::raise(SIGTERM);
      Touch(marker);  // still alive: the publish this stands for finishes
    }
    ::_exit(6);  // raised again when the deferral closed
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << Describe(status);
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  EXPECT_EQ(ListDir(dir), (std::vector<std::string>{"deferral ran to its end"}));
}

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

}  // namespace
}  // namespace gemvz::cli
