#include "tests/support/fail_readdir.h"

#include <dirent.h>
#include <dlfcn.h>

#include <cerrno>

std::atomic<int> g_readdir_entries_left{-1};
std::atomic<int> g_readdir_error{0};

extern "C" struct dirent* readdir(DIR* d) {
  static const auto real = reinterpret_cast<struct dirent* (*)(DIR*)>(dlsym(RTLD_NEXT, "readdir"));
  int left = g_readdir_entries_left.load();
  while (left > 0 && !g_readdir_entries_left.compare_exchange_weak(left, left - 1)) {
  }
  if (left == 0) {
    errno = g_readdir_error.load();
    return nullptr;
  }
  return real(d);
}
