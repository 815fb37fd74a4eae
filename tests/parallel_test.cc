// RunWorkers: every worker exactly once, a worker's exception brought back to the caller after
// all have ended, and workers whose thread cannot start run on the caller instead. WorkerCount:
// the pools' sizes.
#include "runtime/common/parallel.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace gemvz::internal {
namespace {

// A request is capped by the items and by kMaxWorkers (PackOptions::threads = INT_MAX on a matrix
// of a million row blocks asked for a million threads and a packing table each); 0 or less is
// every hardware thread; never fewer than one.
TEST(WorkerCount, TheRequestCappedByTheItemsAndTheLimit) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(WorkerCount(3, 100), 3);
  EXPECT_EQ(WorkerCount(8, 5), 5);
  EXPECT_EQ(WorkerCount(INT_MAX, int64_t{1} << 20), kMaxWorkers);
  EXPECT_EQ(WorkerCount(kMaxWorkers + 1, int64_t{1} << 40), kMaxWorkers);
  EXPECT_EQ(WorkerCount(0, int64_t{1} << 20), std::min(hw, kMaxWorkers));
  EXPECT_EQ(WorkerCount(-4, int64_t{1} << 20), std::min(hw, kMaxWorkers));
  EXPECT_EQ(WorkerCount(0, 1), 1);
  EXPECT_EQ(WorkerCount(5, 0), 1);
}

TEST(RunWorkers, RunsEveryWorkerExactlyOnceWorkerZeroOnTheCaller) {
  for (int workers : {1, 2, 7, 32}) {
    std::vector<std::atomic<int>> runs(workers);
    std::atomic<int> on_caller{-1};
    const std::thread::id caller = std::this_thread::get_id();
    RunWorkers(workers, [&](int w) {
      runs[w].fetch_add(1);
      if (std::this_thread::get_id() == caller) on_caller = w;
    });
    for (int w = 0; w < workers; ++w) EXPECT_EQ(runs[w].load(), 1) << w << " of " << workers;
    EXPECT_EQ(on_caller.load(), 0) << workers;
  }
  RunWorkers(0, [](int) { ADD_FAILURE() << "no worker asked for"; });
}

TEST(RunWorkers, AWorkersExceptionIsRethrownOnceEveryWorkerHasEnded) {
  std::atomic<int> finished{0};
  try {
    RunWorkers(6, [&](int w) {
      if (w == 2 || w == 4) throw std::runtime_error("worker " + std::to_string(w));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      finished.fetch_add(1);
    });
    ADD_FAILURE() << "no exception came back";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "worker 2");  // the first in worker order
  }
  EXPECT_EQ(finished.load(), 4);  // the others ran to their end first
}

// The child's part of the test below, in a process of its own, started afresh by exec: no thread
// ever ran there, so no cached thread stack could start one (a forked child inherits the cache).
// Its address space is then capped with no room for another thread's stack, so every std::thread
// fails to start, and the work must still be done, all of it on the calling thread. The exit
// status says what went wrong.
constexpr char kChildVariable[] = "GEMVZ_PARALLEL_TEST_NO_ROOM_FOR_THREADS";

int NoRoomForThreads() {
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  if (pages <= 0) return 3;
  const rlim_t now = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE));
  const rlimit limit{now + (1u << 20), now + (1u << 20)};  // 1 MiB more: no 8 MiB stack
  if (::setrlimit(RLIMIT_AS, &limit) != 0) return 4;
  int runs[8] = {0};
  bool all_on_caller = true;
  const std::thread::id caller = std::this_thread::get_id();
  try {
    RunWorkers(8, [&](int w) {
      ++runs[w];
      all_on_caller = all_on_caller && std::this_thread::get_id() == caller;
    });
  } catch (...) {
    return 5;
  }
  for (int r : runs) {
    if (r != 1) return 6;
  }
  return all_on_caller ? 0 : 7;
}

// Before gtest's main: the child does its part and ends there.
const bool kIsChild = [] {
  if (std::getenv(kChildVariable) != nullptr) ::_exit(NoRoomForThreads());
  return false;
}();

TEST(RunWorkers, WorkersWhoseThreadCannotStartRunOnTheCaller) {
  // This binary's own path, read here (under valgrind /proc/self/exe in the child would be
  // valgrind's tool, but its readlink answers with the program).
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) GTEST_SKIP() << "no /proc/self/exe to start a fresh copy of this test from";
  self[n] = '\0';
  // Threads get stacks of RLIMIT_STACK's size; with a soft limit below 8 MiB one could fit in
  // the child's 1 MiB of room, so the child takes 8 MiB (or what the hard limit allows).
  rlimit stack{};
  ASSERT_EQ(::getrlimit(RLIMIT_STACK, &stack), 0);
  const rlim_t want = rlim_t{8} << 20;
  if (stack.rlim_max != RLIM_INFINITY && stack.rlim_max < want) {
    GTEST_SKIP() << "RLIMIT_STACK's hard limit is below 8 MiB: a thread's stack could fit";
  }
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    stack.rlim_cur = want;
    if (::setrlimit(RLIMIT_STACK, &stack) != 0) ::_exit(8);
    ::setenv(kChildVariable, "1", 1);
    ::execl(self, "parallel_test", static_cast<char*>(nullptr));
    ::_exit(2);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "2: no exec, 3: no statm, 4: no setrlimit, 5: RunWorkers threw, 6: a worker ran other "
         "than once, 7: a thread started after all (the limit left room for it), 8: no stack "
         "limit set";
}

}  // namespace
}  // namespace gemvz::internal
