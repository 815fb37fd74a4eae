#include "tools/gemvz/signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "runtime/common/temp_files.h"

namespace gemvz::cli {
namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};

// Only async-signal-safe calls: the registry's unlinks, sigaction, raise.
void RemoveTempFilesThenDie(int sig) {
  const int saved_errno = errno;
  // A multi-file publish in progress finishes (or rolls back) first; it raises `sig` again.
  if (internal::DeferFatalSignal(sig)) {
    errno = saved_errno;
    return;
  }
  internal::UnlinkTempFilesForSignal();
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  // Blocked while this handler runs: delivered, with the default action, as it returns.
  raise(sig);
  errno = saved_errno;
}

std::atomic<bool> g_fault_reported{false};  // constant-initialized: no guard in the handler

void WriteStderr(const char* s) { (void)!::write(STDERR_FILENO, s, std::strlen(s)); }

// SIGBUS: on Linux, a read of a memory-mapped page the file no longer has (it shrank while
// mapped) or that its storage could not deliver (an I/O error). The inputs of `gemvz pack` and
// the packed checkpoints are mapped. A fault cannot be postponed (returning retries the load), so
// the handler says what happened, removes the temporary files unless a publish is under way (its
// files are then left as they are: half removed would be worse), and lets the default action end
// the process. Only async-signal-safe calls: a lock-free atomic, write, pause, the registry's
// unlinks, sigaction, raise.
void ReportFaultThenDie(int sig, siginfo_t* info, void*) {
  // Packing threads that fault together: the first reports and ends the process, the rest wait.
  if (g_fault_reported.exchange(true)) {
    for (;;) ::pause();
  }
  char address[2 + 16 + 1] = "0x";
  const uintptr_t a = reinterpret_cast<uintptr_t>(info != nullptr ? info->si_addr : nullptr);
  for (int i = 0; i < 16; ++i) address[2 + i] = "0123456789abcdef"[(a >> (60 - 4 * i)) & 0xF];
  address[18] = '\0';
  WriteStderr("\ngemvz: SIGBUS (a bus error) reading address ");
  WriteStderr(address);
  WriteStderr(
      ": a memory-mapped input file could not be read. Most likely it was truncated or rewritten "
      "while gemvz had it open, or its storage returned an I/O error; check the file and run "
      "again.");
  if (internal::FatalSignalDeferralOpen()) {
    WriteStderr(" Outputs were being published: they are left as they are.\n");
  } else {
    internal::UnlinkTempFilesForSignal();
    WriteStderr(" The run's temporary files are removed.\n");
  }
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);  // blocked in the handler: delivered with the default action as it returns
}

}  // namespace

void InstallTempFileCleanupOnSignals() {
  struct sigaction sa = {};
  sa.sa_handler = RemoveTempFilesThenDie;
  // The other two wait while one is handled, so that the cleanup is not cut short. SA_RESTART:
  // a deferred signal returns into the interrupted call instead of failing it with EINTR.
  sigemptyset(&sa.sa_mask);
  for (int sig : kSignals) sigaddset(&sa.sa_mask, sig);
  sa.sa_flags = SA_RESTART;
  for (int sig : kSignals) {
    struct sigaction old = {};
    if (sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    sigaction(sig, &sa, nullptr);
  }

  // A fault is never ignored (POSIX leaves ignoring SIGBUS undefined), so no check for SIG_IGN.
  struct sigaction bus = {};
  bus.sa_sigaction = ReportFaultThenDie;
  sigemptyset(&bus.sa_mask);
  for (int sig : kSignals) sigaddset(&bus.sa_mask, sig);
  bus.sa_flags = SA_SIGINFO;
  sigaction(SIGBUS, &bus, nullptr);
}

}  // namespace gemvz::cli
