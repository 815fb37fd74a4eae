// The cache key: a SHA-256 over everything that determines a compiled kernel's bytes, and over
// nothing else, so that a key names one binary on every machine that computes it.
#pragma once

#include <string>
#include <vector>

#include "runtime/jit/embedded_sources.h"

namespace gemvz::internal {

// Bump when the compile pipeline or the entry layout changes meaning.
inline constexpr int kJitSchemaVersion = 1;

struct CacheKeyInputs {
  int schema_version = kJitSchemaVersion;
  std::string library_version;          // GEMVZ_VERSION
  std::string nvrtc_version;            // "13.0"
  std::string nvrtc_library;            // NvrtcLibraryIdentity(): the patch release's file
  std::string arch;                     // "sm_90"
  std::vector<std::string> options;     // CanonicalOptions(): order matters to NVRTC, so kept
  std::vector<EmbeddedSource> sources;  // every header NVRTC sees; sorted by name inside
  std::string generated_source;         // the translation unit
  std::string name_expression;          // "gemvz_z12_kernel<8, 2, 2, 3>"
};

// 64 lowercase hex digits.
std::string ComputeCacheKey(const CacheKeyInputs& inputs);

// The library version compiled in (GEMVZ_VERSION).
std::string LibraryVersion();

}  // namespace gemvz::internal
