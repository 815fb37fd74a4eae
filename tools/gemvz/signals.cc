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

// From a handler of `sig`: restores its default action and raises it again. Blocked while the
// handler runs, it is delivered, with the default action, as the handler returns. Only
// async-signal-safe calls: sigaction, raise.
void DieByDefaultActionOnReturn(int sig) {
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);
}

// Only async-signal-safe calls: the registry's unlinks, sigaction, raise.
void RemoveTempFilesThenDie(int sig) {
  const int saved_errno = errno;
  // A multi-file publish in progress finishes (or rolls back) first; it raises `sig` again.
  if (internal::DeferFatalSignal(sig)) {
    errno = saved_errno;
    return;
  }
  internal::UnlinkTempFilesForSignal();
  DieByDefaultActionOnReturn(sig);
  errno = saved_errno;
}

std::atomic<bool> g_fault_reported{false};  // constant-initialized: no guard in the handler

void WriteStderr(const char* s) { (void)!::write(STDERR_FILENO, s, std::strlen(s)); }

// `v` in hexadecimal, 16 digits after "0x", into `out` (19 bytes with the NUL).
void Hex(uintptr_t v, char (&out)[19]) {
  out[0] = '0';
  out[1] = 'x';
  for (int i = 0; i < 16; ++i) out[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 0xF];
  out[18] = '\0';
}

// A SIGBUS the kernel raised for a load: on Linux a read of a memory-mapped page the file no
// longer has (it shrank while mapped) or that its storage could not deliver (BUS_ADRERR,
// BUS_OBJERR); else a misaligned access or a memory error (BUS_ADRALN, BUS_MCEERR_*). The inputs
// of `gemvz pack` and the packed checkpoints are mapped. A fault cannot be postponed (returning
// retries the load), so the handler removes the temporary files unless a publish is under way
// (anywhere in the process: its files are then left as they are, half removed would be worse),
// then says what happened (after the removal: a stalled stderr must not keep the files), and lets
// the default action end the process. Only async-signal-safe calls: a lock-free atomic, write,
// pause, the registry's unlinks, sigaction, raise.
void ReportFaultThenDie(int sig, const siginfo_t& info) {
  // Packing threads that fault together: the first reports and ends the process, the rest wait.
  if (g_fault_reported.exchange(true)) {
    for (;;) ::pause();
  }
  const bool publishing = internal::FatalSignalDeferralOpen();
  if (!publishing) internal::UnlinkTempFilesForSignal();
  char address[19];
  Hex(reinterpret_cast<uintptr_t>(info.si_addr), address);
  const int c = info.si_code > 0 && info.si_code < 10 ? info.si_code : 0;  // 1-5 on Linux
  const char code[2] = {static_cast<char>('0' + c), '\0'};
  WriteStderr("\ngemvz: SIGBUS (a bus error, code ");
  WriteStderr(code);
  WriteStderr(") at address ");
  WriteStderr(address);
  if (info.si_code == BUS_ADRERR || info.si_code == BUS_OBJERR) {
    WriteStderr(
        ": a memory-mapped input file could not be read. Most likely it shrank (was truncated) "
        "while gemvz had it open, or its storage returned an I/O error; check the file and run "
        "again.");
  } else {
    WriteStderr(": not a mapped file's page (a misaligned access or a memory error).");
  }
  WriteStderr(publishing ? " Outputs were being published: they are left as they are.\n"
                         : " The run's temporary files were removed.\n");
  DieByDefaultActionOnReturn(sig);
}

// SIGBUS sent by a process (kill, raise: si_code <= 0) is a request to end like SIGTERM, which
// can wait for a publish; one the kernel raised is a fault.
void OnSigbus(int sig, siginfo_t* info, void*) {
  if (info == nullptr || info->si_code <= 0) {
    RemoveTempFilesThenDie(sig);
  } else {
    ReportFaultThenDie(sig, *info);
  }
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
  struct sigaction bus = sa;
  bus.sa_sigaction = OnSigbus;
  bus.sa_flags = SA_SIGINFO | SA_RESTART;
  sigaction(SIGBUS, &bus, nullptr);
}

}  // namespace gemvz::cli
