#include "tools/gemvz/signals.h"

#include <signal.h>

#include <cerrno>

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
}

}  // namespace gemvz::cli
