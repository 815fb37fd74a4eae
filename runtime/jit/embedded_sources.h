// The files of kernel_sources/, embedded as strings by cmake/embed_sources.cmake at build time.
#pragma once

#include <string_view>
#include <vector>

namespace gemvz::internal {

struct EmbeddedSource {
  std::string_view name;  // path relative to kernel_sources/, e.g. "z12_gemv.cuh"
  std::string_view text;
};

// Every embedded file, sorted by name.
const std::vector<EmbeddedSource>& EmbeddedSources();

}  // namespace gemvz::internal
