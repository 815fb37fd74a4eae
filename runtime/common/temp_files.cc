#include "runtime/common/temp_files.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>

#include "runtime/common/log.h"

namespace gemvz::internal {
namespace {

// NOTES: a slot is a seqlock. Its owner writes the path only while `seq` is even and makes it odd
// once the path is complete, so a handler never unlinks half a path; a handler that copied a path
// while the owner released and refilled the slot sees `seq` change and skips the torn copy.
// The characters are relaxed atomics so that those concurrent reads are not a data race.
struct Slot {
  std::atomic<bool> owned;    // held by a TempFileRegistration
  std::atomic<uint32_t> seq;  // odd: `path` is complete and live
  std::atomic<char> path[kMaxTempPathBytes];
};
static_assert(std::atomic<bool>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<char>::is_always_lock_free && std::atomic<int>::is_always_lock_free,
              "a signal handler may only touch lock-free atomics");

// Zero-initialized static storage (no constructor runs): usable from any static initializer and
// from a signal that arrives before main.
Slot g_slots[kMaxTempFiles];

std::atomic<int> g_deferral_depth;
std::atomic<int> g_deferred_signal;

// Copies the path of a live slot into `path`; false when the slot is free or was released or
// refilled while being copied.
bool CopyLivePath(Slot& s, char (&path)[kMaxTempPathBytes]) {
  const uint32_t before = s.seq.load(std::memory_order_acquire);
  if ((before & 1) == 0) return false;
  size_t k = 0;
  for (; k + 1 < kMaxTempPathBytes; ++k) {
    path[k] = s.path[k].load(std::memory_order_relaxed);
    if (path[k] == '\0') break;
  }
  path[k] = '\0';
  std::atomic_thread_fence(std::memory_order_acquire);
  return s.seq.load(std::memory_order_relaxed) == before;
}

}  // namespace

TempFileRegistration::TempFileRegistration(const std::string& path) {
  if (path.size() >= kMaxTempPathBytes) {
    GEMVZ_LOG_WARNING("temporary file '%s': path too long to register; a signal would leave it",
                      path);
    return;
  }
  for (int i = 0; i < kMaxTempFiles; ++i) {
    bool expected = false;
    if (!g_slots[i].owned.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
      continue;
    }
    Slot& s = g_slots[i];
    // Orders the path's stores after the slot's hand-over: a handler that reads any of them then
    // sees the previous owner's release (seq even or moved on) and drops its copy, never a path
    // half its own and half the last owner's (the seqlock's writer side; a TSan run found it).
    std::atomic_thread_fence(std::memory_order_release);
    for (size_t k = 0; k < path.size(); ++k) s.path[k].store(path[k], std::memory_order_relaxed);
    s.path[path.size()].store('\0', std::memory_order_relaxed);
    s.seq.fetch_add(1, std::memory_order_release);  // now odd: published whole
    slot_ = i;
    return;
  }
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    GEMVZ_LOG_WARNING("more than %d temporary files at once: a signal would leave '%s' behind",
                      kMaxTempFiles, path);
  }
}

TempFileRegistration& TempFileRegistration::operator=(TempFileRegistration&& other) noexcept {
  if (this != &other) {
    Release();
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

void TempFileRegistration::Release() {
  if (slot_ < 0) return;
  Slot& s = g_slots[slot_];
  s.seq.fetch_add(1, std::memory_order_release);  // even: no handler unlinks it from now on
  s.owned.store(false, std::memory_order_release);
  slot_ = -1;
}

int UnlinkTempFilesForSignal() {
  int tried = 0;
  bool directories = false;
  char path[kMaxTempPathBytes];
  for (Slot& s : g_slots) {
    if (!CopyLivePath(s, path)) continue;
    if (::unlink(path) != 0 && errno == EISDIR) directories = true;
    ++tried;
  }
  // Registered directories go once the files above are gone: a scratch directory is registered
  // with every file in it.
  if (directories) {
    for (Slot& s : g_slots) {
      if (CopyLivePath(s, path)) ::rmdir(path);
    }
  }
  return tried;
}

FatalSignalDeferral::FatalSignalDeferral() { g_deferral_depth.fetch_add(1); }

FatalSignalDeferral::~FatalSignalDeferral() {
  if (g_deferral_depth.fetch_sub(1) != 1) return;
  if (const int sig = g_deferred_signal.exchange(0); sig != 0) ::raise(sig);
}

bool FatalSignalDeferralOpen() { return g_deferral_depth.load() > 0; }

bool DeferFatalSignal(int sig) {
  if (g_deferral_depth.load() == 0) return false;
  g_deferred_signal.store(sig);
  if (g_deferral_depth.load() > 0) return true;
  // The last deferral closed between the two loads and may have looked for a signal before the
  // store: whichever of the two takes it back raises it, so it is neither lost nor doubled.
  return g_deferred_signal.exchange(0) == 0;
}

}  // namespace gemvz::internal
