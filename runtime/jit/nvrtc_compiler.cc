// NVRTC compile of one kernel (see nvrtc_compiler.h).
#include "runtime/jit/nvrtc_compiler.h"

#include "runtime/jit/cubin_info.h"

#include <link.h>
#include <nvrtc.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "runtime/common/env.h"
#include "runtime/jit/kernel_cache.h"

namespace gemvz::internal {
namespace {

// One check macro for NVRTC: a failure becomes a Status naming the call, its place and the error.
#define NVRTC_RETURN_IF_ERROR(call)                                                                \
  do {                                                                                             \
    const nvrtcResult _gemvz_nvrtc = (call);                                                       \
    if (_gemvz_nvrtc != NVRTC_SUCCESS) {                                                           \
      return absl::InternalError(absl::StrCat(#call, " failed at ", __FILE__, ":", __LINE__, ": ", \
                                              nvrtcGetErrorString(_gemvz_nvrtc)));                 \
    }                                                                                              \
  } while (0)

// Owns an nvrtcProgram so every return path destroys it.
class Program {
 public:
  Program() = default;
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  ~Program() {
    if (prog_ != nullptr) nvrtcDestroyProgram(&prog_);
  }
  nvrtcProgram* out() { return &prog_; }
  nvrtcProgram get() const { return prog_; }

 private:
  nvrtcProgram prog_ = nullptr;
};

std::string ProgramLog(nvrtcProgram prog) {
  size_t size = 0;
  if (nvrtcGetProgramLogSize(prog, &size) != NVRTC_SUCCESS || size <= 1) return "";
  std::string log(size, '\0');
  if (nvrtcGetProgramLog(prog, log.data()) != NVRTC_SUCCESS) return "";
  log.resize(size - 1);  // drop the terminating NUL
  // NVRTC ends each part of the log with a NUL (ptxas's lines after the front end's): as text,
  // everything after the first would be lost (printf's %s, C strings) or escaped (JSON).
  log.erase(std::remove(log.begin(), log.end(), '\0'), log.end());
  return log;
}

const std::vector<int>& SupportedArchs() {
  static const std::vector<int>* const archs = [] {
    auto* v = new std::vector<int>();
    int n = 0;
    if (nvrtcGetNumSupportedArchs(&n) == NVRTC_SUCCESS && n > 0) {
      v->resize(n);
      if (nvrtcGetSupportedArchs(v->data()) != NVRTC_SUCCESS) v->clear();
    }
    return v;
  }();
  return *archs;
}

bool IsDirectoryWith(const std::string& dir, const char* file) {
  struct stat st;
  return ::stat(absl::StrCat(dir, "/", file).c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The integer written just before the first `suffix` in `text` ("24" in "Used 24 registers");
// -1 when absent.
int NumberBefore(std::string_view text, std::string_view suffix) {
  const size_t at = text.find(suffix);
  if (at == std::string_view::npos) return -1;
  size_t begin = at;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(text[begin - 1]))) --begin;
  if (begin == at) return -1;
  int value = -1;
  if (!absl::SimpleAtoi(absl::string_view(text.data() + begin, at - begin), &value)) return -1;
  return value;
}

std::string_view LineAt(std::string_view text, size_t pos) {
  const size_t end = text.find('\n', pos);
  return text.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos);
}

}  // namespace

std::shared_ptr<const SourceSet> SourceSet::Embedded() {
  static const std::shared_ptr<const SourceSet>* const set = [] {
    auto s = std::make_shared<SourceSet>();
    s->files_ = EmbeddedSources();
    std::sort(s->files_.begin(), s->files_.end(),
              [](const EmbeddedSource& a, const EmbeddedSource& b) { return a.name < b.name; });
    return new std::shared_ptr<const SourceSet>(std::move(s));
  }();
  return *set;
}

std::shared_ptr<const SourceSet> SourceSet::FromFiles(
    std::vector<std::pair<std::string, std::string>> files) {
  auto s = std::make_shared<SourceSet>();
  std::sort(files.begin(), files.end());
  s->storage_ = std::move(files);
  for (const auto& [name, text] : s->storage_) s->files_.push_back({name, text});
  return s;
}

const EmbeddedSource* SourceSet::Find(std::string_view name) const {
  for (const EmbeddedSource& f : files_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string SourceSet::Names() const {
  if (files_.empty()) return "(none: kernel_sources/ was empty at build time)";
  std::vector<std::string> names;
  for (const EmbeddedSource& f : files_) names.emplace_back(f.name);
  return absl::StrJoin(names, ", ");
}

absl::Status CheckArch(std::string_view arch) {
  const std::string a(arch);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("bad target architecture '", a, "': ", why));
  };
  if (a.size() < 5 || a.compare(0, 3, "sm_") != 0) {
    return bad("it must look like sm_90 or sm_90a");
  }
  size_t end = 3;
  while (end < a.size() && std::isdigit(static_cast<unsigned char>(a[end]))) ++end;
  const std::string suffix = a.substr(end);
  if (end == 3 || !(suffix.empty() || suffix == "a" || suffix == "f")) {
    return bad("it must be sm_<digits> with an optional 'a' or 'f' suffix, e.g. sm_90 or sm_90a");
  }
  // NVRTC refuses sm_090 (an invalid option, at the compile): said here, before any work.
  if (a[3] == '0') return bad("the number has a leading zero (sm_90, not sm_090)");
  int number = 0;
  if (!absl::SimpleAtoi(a.substr(3, end - 3), &number)) return bad("number out of range");
  const std::vector<int>& supported = SupportedArchs();
  if (!supported.empty() &&
      std::find(supported.begin(), supported.end(), number) == supported.end()) {
    // Only the targets this check then takes: NVRTC 13 still lists sm_75, which it refuses below.
    std::vector<std::string> names;
    for (int s : supported) {
      if (s >= 80) names.push_back(absl::StrCat("sm_", s));
    }
    return bad(
        absl::StrCat("NVRTC ", NvrtcVersionString(),
                     " cannot target it; of the kernels' targets (sm_80 or later) it supports ",
                     absl::StrJoin(names, ", ")));
  }
  if (number < 80) {
    // The kernels use bf16 mma.sync, which needs sm_80 or later.
    return bad("the kernels need sm_80 or later (bf16 tensor-core mma)");
  }
  return absl::OkStatus();
}

std::string NvrtcVersionString() {
  static const std::string* const version = [] {
    int major = 0, minor = 0;
    if (nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) return new std::string("unknown");
    return new std::string(absl::StrCat(major, ".", minor));
  }();
  return *version;
}

std::string NvrtcLibraryIdentity() {
  static const std::string* const identity = [] {
    // The loaded object named libnvrtc.so*: an address of nvrtcVersion taken here could be a
    // PLT stub of the executable.
    std::string path;
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) {
          const std::string_view name = info->dlpi_name == nullptr ? "" : info->dlpi_name;
          const size_t slash = name.rfind('/');
          const std::string_view base =
              slash == std::string_view::npos ? name : name.substr(slash + 1);
          if (base.rfind("libnvrtc.so", 0) != 0) return 0;
          *static_cast<std::string*>(out) = std::string(name);
          return 1;
        },
        &path);
    struct stat st;
    if (path.empty() || ::stat(path.c_str(), &st) != 0) return new std::string("unknown");
    return new std::string(absl::StrCat(path.substr(path.rfind('/') + 1), ", ",
                                        static_cast<int64_t>(st.st_size), " bytes, mtime ",
                                        static_cast<int64_t>(st.st_mtim.tv_sec)));
  }();
  return *identity;
}

std::vector<std::string> CanonicalOptions(std::string_view arch,
                                          const std::vector<std::string>& extra) {
  // No fast-math: the kernels' arithmetic must be bitwise reproducible. -v makes ptxas report
  // registers, spills and shared memory into the log.
  std::vector<std::string> options = {
      absl::StrCat("--gpu-architecture=", std::string(arch)),
      "-std=c++17",
      "--ptxas-options=-v",
      "-DGEMVZ_NVRTC=1",
  };
  options.insert(options.end(), extra.begin(), extra.end());
  return options;
}

const std::vector<std::string>& ToolkitIncludeOptions() {
  static const std::vector<std::string>* const options = [] {
    std::vector<std::string> candidates;
    for (const char* var : {"GEMVZ_CUDA_INCLUDE_DIR", "CUDA_HOME", "CUDA_PATH"}) {
      if (std::optional<std::string> v = GetEnv(var)) {
        candidates.push_back(std::string(var) == "GEMVZ_CUDA_INCLUDE_DIR" ? *v : *v + "/include");
      }
    }
#ifdef GEMVZ_CUDA_INCLUDE_DIR
    for (absl::string_view d : absl::StrSplit(GEMVZ_CUDA_INCLUDE_DIR, ';')) {
      if (!d.empty()) candidates.emplace_back(d);
    }
#endif
    candidates.push_back("/usr/local/cuda/include");
    auto* out = new std::vector<std::string>();
    for (const std::string& dir : candidates) {
      if (IsDirectoryWith(dir, "cuda_bf16.h")) {
        out->push_back(absl::StrCat("-I", dir));
        break;
      }
    }
    return out;
  }();
  return *options;
}

std::string GeneratedSource(std::string_view source_file) {
  return absl::StrCat("// Generated by the gemvz JIT: one kernel instantiation per program.\n",
                      "#include \"", std::string(source_file), "\"\n");
}

PtxasStats ParsePtxasLog(std::string_view log, std::string_view lowered_name) {
  PtxasStats stats;
  const std::string entry =
      absl::StrCat("Compiling entry function '", std::string(lowered_name), "'");
  size_t begin = log.find(entry);
  if (begin == std::string_view::npos) return stats;
  size_t end = log.find("Compiling entry function '", begin + entry.size());
  const std::string_view block =
      log.substr(begin, end == std::string_view::npos ? std::string_view::npos : end - begin);
  // "Function properties for <name>" is followed by the line with the spill counts.
  const std::string props = absl::StrCat("Function properties for ", std::string(lowered_name));
  const size_t p = block.find(props);
  if (p != std::string_view::npos) {
    const size_t next = block.find('\n', p);
    if (next != std::string_view::npos) {
      const std::string_view line = LineAt(block, next + 1);
      const int stores = NumberBefore(line, " bytes spill stores");
      const int loads = NumberBefore(line, " bytes spill loads");
      if (stores >= 0 && loads >= 0) stats.spill_bytes = stores + loads;
    }
  }
  const size_t used = block.find("Used ");
  if (used != std::string_view::npos) {
    const std::string_view line = LineAt(block, used);
    stats.registers = NumberBefore(line, " registers");
    const int smem = NumberBefore(line, " bytes smem");
    stats.shared_bytes = smem >= 0 ? smem : 0;  // ptxas omits "smem" when there is none
    if (stats.spill_bytes < 0 && stats.registers >= 0) stats.spill_bytes = 0;
  }
  return stats;
}

absl::StatusOr<CompiledKernel> CompileWithNvrtc(const CompileRequest& request,
                                                const SourceSet& sources,
                                                const std::vector<std::string>& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::string source = GeneratedSource(request.source_file);
  std::vector<const char*> header_names, header_texts;
  // NVRTC wants NUL-terminated strings; the sources are views.
  std::vector<std::string> names, texts;
  names.reserve(sources.files().size());
  texts.reserve(sources.files().size());
  for (const EmbeddedSource& f : sources.files()) {
    names.emplace_back(f.name);
    texts.emplace_back(f.text);
  }
  for (size_t i = 0; i < names.size(); ++i) {
    header_names.push_back(names[i].c_str());
    header_texts.push_back(texts[i].c_str());
  }
  Program prog;
  NVRTC_RETURN_IF_ERROR(nvrtcCreateProgram(prog.out(), source.c_str(), "gemvz_jit.cu",
                                           static_cast<int>(header_names.size()),
                                           header_texts.data(), header_names.data()));
  NVRTC_RETURN_IF_ERROR(nvrtcAddNameExpression(prog.get(), request.name_expression.c_str()));

  std::vector<std::string> all_options = options;
  const std::vector<std::string>& includes = ToolkitIncludeOptions();
  all_options.insert(all_options.end(), includes.begin(), includes.end());
  std::vector<const char*> option_ptrs;
  for (const std::string& o : all_options) option_ptrs.push_back(o.c_str());

  const nvrtcResult result =
      nvrtcCompileProgram(prog.get(), static_cast<int>(option_ptrs.size()), option_ptrs.data());
  std::string log = ProgramLog(prog.get());
  if (result != NVRTC_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVRTC failed to compile ", request.kernel_name, " (", request.name_expression,
                     " from ", request.source_file, ") for ", request.arch, ": ",
                     nvrtcGetErrorString(result), "\noptions: ", absl::StrJoin(all_options, " "),
                     "\nheaders: ", sources.Names(), "\nlog:\n", log));
  }

  CompiledKernel out;
  out.arch = request.arch;
  out.name_expression = request.name_expression;
  out.kernel_name = request.kernel_name;
  const char* lowered = nullptr;
  NVRTC_RETURN_IF_ERROR(nvrtcGetLoweredName(prog.get(), request.name_expression.c_str(), &lowered));
  if (lowered == nullptr || *lowered == '\0') {
    return absl::InternalError(
        absl::StrCat("NVRTC reported no lowered name for ", request.name_expression));
  }
  out.lowered_name = lowered;

  size_t cubin_size = 0;
  NVRTC_RETURN_IF_ERROR(nvrtcGetCUBINSize(prog.get(), &cubin_size));
  if (cubin_size == 0) {
    return absl::InternalError(absl::StrCat("NVRTC produced no cubin for ", request.kernel_name,
                                            " on ", request.arch,
                                            " (a virtual architecture gives PTX only)"));
  }
  out.cubin.resize(cubin_size);
  NVRTC_RETURN_IF_ERROR(nvrtcGetCUBIN(prog.get(), out.cubin.data()));

  // PTX comes along with a cubin compile at no extra cost; keep it when NVRTC offers it.
  size_t ptx_size = 0;
  if (nvrtcGetPTXSize(prog.get(), &ptx_size) == NVRTC_SUCCESS && ptx_size > 1) {
    out.ptx.resize(ptx_size);
    if (nvrtcGetPTX(prog.get(), out.ptx.data()) == NVRTC_SUCCESS) {
      out.ptx.resize(ptx_size - 1);
    } else {
      out.ptx.clear();
    }
  }

  PtxasStats stats = ParsePtxasLog(log, out.lowered_name);
  if (stats.registers < 0 || stats.spill_bytes < 0) {
    // ptxas's -v report can come back without the kernel's lines (seen on an H200 host); the
    // cubin itself always has the register count and the local-memory frame, which for these
    // kernels (no local arrays, no calls) is their spill space.
    if (auto elf = ReadCubinKernelInfo(out.cubin, out.lowered_name); elf.ok()) {
      stats.registers = elf->registers;
      stats.spill_bytes = elf->frame_bytes;
      stats.shared_bytes = elf->shared_bytes;
    }
  }
  out.registers = stats.registers;
  out.spill_bytes = stats.spill_bytes;
  out.shared_bytes = stats.shared_bytes;
  out.log = std::move(log);
  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace gemvz::internal
