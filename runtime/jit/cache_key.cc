// Cache key computation (see cache_key.h).
#include "runtime/jit/cache_key.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "runtime/common/hash.h"

#ifndef GEMVZ_VERSION
#define GEMVZ_VERSION "unknown"
#endif

namespace gemvz::internal {

std::string LibraryVersion() { return GEMVZ_VERSION; }

std::string ComputeCacheKey(const CacheKeyInputs& in) {
  // Every field is length-prefixed and tagged, so no two different inputs can serialise alike.
  Sha256 h;
  h.UpdateField("gemvz-jit-key");
  h.UpdateField(absl::StrCat("schema=", in.schema_version));
  h.UpdateField("library");
  h.UpdateField(in.library_version);
  h.UpdateField("nvrtc");
  h.UpdateField(in.nvrtc_version);
  h.UpdateField("nvrtc-library");
  h.UpdateField(in.nvrtc_library);
  h.UpdateField("arch");
  h.UpdateField(in.arch);
  h.UpdateField(absl::StrCat("options=", in.options.size()));
  for (const std::string& o : in.options) h.UpdateField(o);
  std::vector<EmbeddedSource> sources = in.sources;
  std::sort(sources.begin(), sources.end(),
            [](const EmbeddedSource& a, const EmbeddedSource& b) { return a.name < b.name; });
  h.UpdateField(absl::StrCat("sources=", sources.size()));
  for (const EmbeddedSource& s : sources) {
    h.UpdateField(s.name);
    h.UpdateField(s.text);
  }
  h.UpdateField("tu");
  h.UpdateField(in.generated_source);
  h.UpdateField("name");
  h.UpdateField(in.name_expression);
  return h.HexFinish();
}

}  // namespace gemvz::internal
