// What a handler of SIGINT/SIGTERM/SIGHUP or SIGBUS needs to leave the file system clean: the
// temporary files this process is writing (to remove), and the sections it must not cut in half
// (publishing several files together). Installing the handler is the program's business (gemvz:
// signals.h).
#pragma once

#include <cstddef>
#include <string>

namespace gemvz::internal {

// Room for this many live temporary files at once, each path shorter than kMaxTempPathBytes. The
// storage is fixed so that the signal handler never allocates; a path that does not fit is not
// registered (a signal then leaves that one file behind, as before the registry existed).
inline constexpr int kMaxTempFiles = 128;
inline constexpr size_t kMaxTempPathBytes = 4096;  // PATH_MAX on Linux, the NUL included

// Registers `path` as a temporary file (or directory) of this process from construction until
// Release() or destruction. Register before the file is created, so that no signal finds it
// unregistered; the names are unique to the process (pid and counter), so removing one that does
// not exist yet, or any more, is harmless.
class TempFileRegistration {
 public:
  TempFileRegistration() = default;
  explicit TempFileRegistration(const std::string& path);
  ~TempFileRegistration() { Release(); }
  TempFileRegistration(TempFileRegistration&& other) noexcept : slot_(other.slot_) {
    other.slot_ = -1;
  }
  TempFileRegistration& operator=(TempFileRegistration&& other) noexcept;
  TempFileRegistration(const TempFileRegistration&) = delete;
  TempFileRegistration& operator=(const TempFileRegistration&) = delete;

  // The file was renamed into place or removed: a signal must leave that name alone from now on.
  void Release();
  bool registered() const { return slot_ >= 0; }

 private:
  int slot_ = -1;
};

// Unlinks every registered temporary file, then removes every registered directory (a scratch
// directory is registered beside the files in it, so it is empty by then). Async-signal-safe: no
// allocation, no locks, only lock-free atomics, unlink(2) and rmdir(2). Returns how many paths it
// tried.
int UnlinkTempFilesForSignal();

// While one of these lives, a cooperating signal handler postpones its signal (DeferFatalSignal)
// instead of ending the process, and the signal is raised again when the last one closes: a
// multi-file publish and its rollback then run to the end, so that a Ctrl-C never leaves half the
// outputs new, half old, and the old ones' backups behind.
class FatalSignalDeferral {
 public:
  FatalSignalDeferral();
  ~FatalSignalDeferral();
  FatalSignalDeferral(const FatalSignalDeferral&) = delete;
  FatalSignalDeferral& operator=(const FatalSignalDeferral&) = delete;
};

// For a signal handler, first thing: true when a FatalSignalDeferral is open, in which case `sig`
// has been recorded and will be raised again when it closes, and the handler must return at once.
// Async-signal-safe.
bool DeferFatalSignal(int sig);

// True while a FatalSignalDeferral is open: for a handler of a signal that cannot wait (a fault
// such as SIGBUS, which would recur at once), so that it leaves a publish's files as they are
// instead of removing half of them. Async-signal-safe.
bool FatalSignalDeferralOpen();

}  // namespace gemvz::internal
