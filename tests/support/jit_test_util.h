// Helpers for the JIT tests: temporary directories, scoped environment variables, child
// processes, random configurations, and stand-in kernel sources that compile in milliseconds.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gemvz/config.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz::jit_test {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it at destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Sets (or, with nullopt, unsets) an environment variable for the scope's lifetime.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Files named like kernel_sources/ (gemv_params.cuh, common.cuh, z12_gemv.cuh, bf16_gemv.cuh)
// whose kernels have the real names, template parameters and argument types, but tiny bodies
// (still using mma.sync and prmt), so NVRTC compiles one in tens of milliseconds. `salt` is
// appended to common.cuh as a comment: different salts give different source texts.
std::vector<std::pair<std::string, std::string>> StandInKernelFiles(const std::string& salt = "");
std::shared_ptr<const internal::SourceSet> StandInSources(const std::string& salt = "");

// KernelCache options over the stand-in sources, with `disk_directory` ("" for none), no dump
// directory and no extra options, whatever the environment says.
internal::KernelCacheOptions StandInOptions(const std::string& disk_directory);

// A random engine seeded from std::random_device; the seed is printed so a failure can be
// replayed with GEMVZ_TEST_SEED.
std::mt19937_64& Rng();
// A random configuration that ValidateConfig accepts (NW up to `max_nw`).
KernelConfig RandomValidConfig(std::mt19937_64& rng, int max_nw = 16);

// Runs `body` in a forked child and returns its exit status (or -1 when it did not exit
// normally). The child leaves with _exit, so the parent's test state is untouched.
int RunInChild(const std::function<int()>& body);

// Names of the regular files in `dir` (sorted), empty when it does not exist.
std::vector<std::string> ListFiles(const std::string& dir);

// Occurrences of `needle` in `haystack`.
int CountOccurrences(const std::string& haystack, const std::string& needle);

// Overwrites one byte of a file (XOR with a nonzero mask) / cuts it to `size` bytes.
void FlipByte(const std::string& path, int64_t offset, uint8_t mask);
void TruncateFile(const std::string& path, int64_t size);
int64_t FileSize(const std::string& path);

}  // namespace gemvz::jit_test
