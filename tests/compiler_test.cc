// NVRTC compiler: real kernels compile for sm_90 without a GPU into cubin + PTX holding the
// tensor-core and byte-permute instructions; failures carry log, options and configuration;
// ptxas statistics are parsed; architectures are checked.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gemvz/config.h"
#include "gtest/gtest.h"
#include "runtime/jit/cubin_info.h"
#include "runtime/jit/kernel_cache.h"
#include "runtime/jit/nvrtc_compiler.h"
#include "tests/support/jit_test_util.h"

namespace gemvz::internal {
namespace {

using ::gemvz::jit_test::RandomValidConfig;
using ::gemvz::jit_test::Rng;
using ::gemvz::jit_test::StandInSources;

CompiledKernel CompileOrDie(const KernelConfig& config, const std::string& arch,
                            const SourceSet& sources) {
  const CompileRequest request = RequestForConfig(config, arch);
  absl::StatusOr<CompiledKernel> k = CompileWithNvrtc(request, sources, CanonicalOptions(arch, {}));
  EXPECT_TRUE(k.ok()) << k.status();
  return k.ok() ? *std::move(k) : CompiledKernel{};
}

TEST(CompilerTest, RealZ12KernelForSm90HasMmaAndPrmt) {
  const SourceSet& sources = *SourceSet::Embedded();
  ASSERT_NE(sources.Find("z12_gemv.cuh"), nullptr) << "embedded: " << sources.Names();
  KernelConfig config;  // z12.nw8.ug2.nb2.pipe3
  const CompiledKernel k = CompileOrDie(config, "sm_90", sources);
  EXPECT_FALSE(k.cubin.empty());
  // An ELF image for the GPU.
  ASSERT_GE(k.cubin.size(), 4u);
  EXPECT_EQ(k.cubin.substr(0, 4),
            "\x7f"
            "ELF");
  EXPECT_NE(k.ptx.find("mma.sync"), std::string::npos);
  EXPECT_NE(k.ptx.find("prmt"), std::string::npos);
  EXPECT_NE(k.ptx.find(".target sm_90"), std::string::npos);
  EXPECT_NE(k.ptx.find(k.lowered_name), std::string::npos);
  EXPECT_EQ(k.lowered_name.rfind("_Z", 0), 0u) << k.lowered_name;
  EXPECT_GT(k.registers, 0);
  EXPECT_EQ(k.spill_bytes, 0) << k.log;
  EXPECT_GT(k.shared_bytes, 0);
  EXPECT_GT(k.compile_ms, 0);
  std::printf("real %s for sm_90: %.1f ms, %d registers, %d spill bytes, %d bytes smem\n",
              config.KernelName().c_str(), k.compile_ms, k.registers, k.spill_bytes,
              k.shared_bytes);
}

// RB 2 is the kernel's fifth template argument, named only when it is not 1.
TEST(CompilerTest, RealZ12KernelWithTwoRowBlocksPerCta) {
  const SourceSet& sources = *SourceSet::Embedded();
  const KernelConfig config{WeightFormat::kZ12, 4, 1, 2, 3, 1, 2};
  const CompileRequest request = RequestForConfig(config, "sm_90");
  EXPECT_EQ(request.name_expression, "gemvz_z12_kernel<4, 1, 2, 3, 2>");
  EXPECT_EQ(request.kernel_name, "z12.nw4.ug1.nb2.pipe3.rb2");
  EXPECT_EQ(RequestForConfig(KernelConfig{}, "sm_90").name_expression,
            "gemvz_z12_kernel<8, 2, 2, 3>");
  const CompiledKernel k = CompileOrDie(config, "sm_90", sources);
  EXPECT_NE(k.lowered_name.find("ILi4ELi1ELi2ELi3ELi2ELi0EE"), std::string::npos) << k.lowered_name;
  EXPECT_EQ(k.spill_bytes, 0) << k.log;
  EXPECT_LE(k.shared_bytes, config.shared_bytes());
  EXPECT_GE(k.shared_bytes + 16, config.shared_bytes());
}

// Group-major weights are the sixth template argument, GM = 1; RB is then spelt out even when it
// is 1, and the block-major kernels keep the names they had before GM existed.
TEST(CompilerTest, RealZ12KernelForGroupMajorWeights) {
  const SourceSet& sources = *SourceSet::Embedded();
  KernelConfig config{WeightFormat::kZ12, 3, 4, 2, 7, 1};
  config.order = WeightOrder::kGroupMajor;
  const CompileRequest request = RequestForConfig(config, "sm_90");
  EXPECT_EQ(request.name_expression, "gemvz_z12_kernel<3, 4, 2, 7, 1, 1>");
  EXPECT_EQ(request.kernel_name, "z12.nw3.ug4.nb2.pipe7.gm");
  KernelConfig rb4{WeightFormat::kZ12, 3, 1, 2, 3, 1, 4, WeightOrder::kGroupMajor};
  EXPECT_EQ(RequestForConfig(rb4, "sm_90").name_expression, "gemvz_z12_kernel<3, 1, 2, 3, 4, 1>");
  const CompiledKernel k = CompileOrDie(config, "sm_90", sources);
  EXPECT_NE(k.lowered_name.find("ILi3ELi4ELi2ELi7ELi1ELi1EE"), std::string::npos)
      << k.lowered_name;
  EXPECT_EQ(k.spill_bytes, 0) << k.log;
}

TEST(CompilerTest, RealBf16KernelForSm90aCompiles) {
  const SourceSet& sources = *SourceSet::Embedded();
  ASSERT_NE(sources.Find("bf16_gemv.cuh"), nullptr) << "embedded: " << sources.Names();
  KernelConfig config;
  config.format = WeightFormat::kBf16;
  const CompiledKernel k = CompileOrDie(config, "sm_90a", sources);
  EXPECT_NE(k.ptx.find(".target sm_90a"), std::string::npos);
  EXPECT_NE(k.ptx.find("mma.sync"), std::string::npos);
  EXPECT_EQ(k.arch, "sm_90a");
  EXPECT_GT(k.registers, 0);
}

TEST(CompilerTest, RandomConfigurationsCompileAndKeepTheirTemplateArguments) {
  auto sources = StandInSources();
  for (int i = 0; i < 3; ++i) {
    const KernelConfig config = RandomValidConfig(Rng());
    SCOPED_TRACE(config.ToString());
    const CompiledKernel k = CompileOrDie(config, "sm_90", *sources);
    // Itanium mangling of <NW, UG, NB, PIPE>: ILi8ELi2ELi2ELi3EE.
    const std::string args =
        absl::StrFormat("ILi%dELi%dELi%dELi%dEE", config.nw, config.ug, config.nb, config.pipe);
    EXPECT_NE(k.lowered_name.find(args), std::string::npos) << k.lowered_name;
    EXPECT_EQ(k.kernel_name, config.KernelName());
    EXPECT_NE(k.ptx.find("mma.sync"), std::string::npos);
  }
}

TEST(CompilerTest, FailedCompileCarriesLogOptionsAndConfiguration) {
  auto files = jit_test::StandInKernelFiles();
  for (auto& [name, text] : files) {
    if (name == "z12_gemv.cuh")
      text += "\nthis_is_not_cuda_code_" + std::to_string(Rng()() % 1000) + ";\n";
  }
  auto sources = SourceSet::FromFiles(files);
  KernelConfig config;
  config.nw = 6;
  config.nb = 3;
  const CompileRequest request = RequestForConfig(config, "sm_90");
  absl::StatusOr<CompiledKernel> k =
      CompileWithNvrtc(request, *sources, CanonicalOptions("sm_90", {}));
  ASSERT_FALSE(k.ok());
  const std::string msg(k.status().message());
  EXPECT_NE(msg.find("z12.nw6.ug2.nb3.pipe3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gemvz_z12_kernel<6, 2, 3, 3>"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--gpu-architecture=sm_90"), std::string::npos) << msg;
  EXPECT_NE(msg.find("-std=c++17"), std::string::npos) << msg;
  EXPECT_NE(msg.find("this_is_not_cuda_code_"), std::string::npos) << "no log in: " << msg;
  EXPECT_NE(msg.find("error"), std::string::npos) << msg;
}

// The log comes back whole: NVRTC counts its terminating NUL in the size, and only that is
// dropped. Its last line ("N errors detected in the compilation of ...") ends with a newline.
TEST(CompilerTest, FailedCompileKeepsTheWholeLog) {
  auto files = jit_test::StandInKernelFiles();
  for (auto& [name, text] : files) {
    if (name == "z12_gemv.cuh") text += "\nnot_cuda_either;\n";
  }
  const CompileRequest request = RequestForConfig(KernelConfig{}, "sm_90");
  absl::StatusOr<CompiledKernel> k =
      CompileWithNvrtc(request, *SourceSet::FromFiles(files), CanonicalOptions("sm_90", {}));
  ASSERT_FALSE(k.ok());
  const std::string msg(k.status().message());
  const size_t log = msg.find("\nlog:\n");
  ASSERT_NE(log, std::string::npos) << msg;
  EXPECT_NE(msg.find("not_cuda_either", log), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\0'), std::string::npos) << "a NUL kept in the log";
  ASSERT_FALSE(msg.empty());
  EXPECT_EQ(msg.back(), '\n') << "the log's last line was cut short: " << msg.substr(log);
}

// A compile that fails in ptxas (spills made an error): NVRTC's log holds the front end's part
// and ptxas's, each ended by a NUL. The message keeps ptxas's error line, with no NUL in it
// (printed with %s it stopped at the first, and the JSON showed \u0000).
TEST(CompilerTest, APtxasErrorReachesTheMessageWithoutNuls) {
  const KernelConfig config{WeightFormat::kBf16, 32, 1, 1, 2, 1};  // spills on sm_80
  absl::StatusOr<CompiledKernel> k = CompileWithNvrtc(
      RequestForConfig(config, "sm_80"), *SourceSet::Embedded(),
      CanonicalOptions("sm_80",
                       {"--ptxas-options=--warn-on-spills", "--ptxas-options=--warning-as-error"}));
  ASSERT_FALSE(k.ok());
  const std::string msg(k.status().message());
  EXPECT_NE(msg.find("ptxas error"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\0'), std::string::npos) << "a NUL kept in the log";
}

TEST(CompilerTest, MissingIncludeFailsWithoutTouchingTheFileSystem) {
  // Only in-memory headers exist: a file that is not embedded must not be found anywhere.
  CompileRequest request;
  request.arch = "sm_90";
  request.source_file = "no_such_file.cuh";
  request.name_expression = "gemvz_z12_kernel<8, 2, 2, 3>";
  request.kernel_name = "missing";
  absl::StatusOr<CompiledKernel> k =
      CompileWithNvrtc(request, *StandInSources(), CanonicalOptions("sm_90", {}));
  ASSERT_FALSE(k.ok());
  EXPECT_NE(std::string(k.status().message()).find("no_such_file.cuh"), std::string::npos);
}

TEST(CompilerTest, OptionsAreFixedAndNeverFastMath) {
  const std::vector<std::string> o = CanonicalOptions("sm_90a", {"-maxrregcount=64"});
  ASSERT_FALSE(o.empty());
  EXPECT_EQ(o.front(), "--gpu-architecture=sm_90a");
  EXPECT_NE(std::find(o.begin(), o.end(), "-std=c++17"), o.end());
  EXPECT_EQ(o.back(), "-maxrregcount=64");
  for (const std::string& s : o) {
    EXPECT_EQ(s.find("fast-math"), std::string::npos) << s;
    EXPECT_EQ(s.find("fast_math"), std::string::npos) << s;
    EXPECT_EQ(s.find("-I"), std::string::npos) << "machine paths must stay out of the key: " << s;
  }
  EXPECT_EQ(CanonicalOptions("sm_90a", {}), CanonicalOptions("sm_90a", {}));
}

TEST(CompilerTest, ArchitecturesAreChecked) {
  EXPECT_TRUE(CheckArch("sm_90").ok());
  EXPECT_TRUE(CheckArch("sm_90a").ok());
  EXPECT_TRUE(CheckArch("sm_80").ok());
  for (const char* bad : {"", "sm90", "sm_", "compute_90", "sm_90b", "SM_90", "sm_9x", "sm_12345",
                          "sm_090", "sm_0090a"}) {
    absl::Status st = CheckArch(bad);
    EXPECT_FALSE(st.ok()) << bad;
    EXPECT_NE(std::string(st.message()).find(absl::StrCat("'", bad, "'")), std::string::npos) << st;
  }
  EXPECT_FALSE(CheckArch("sm_70").ok());  // no bf16 mma
}

// NVRTC 13 no longer targets sm_70, but still targets sm_75 (Turing): only CheckArch's own
// bound keeps the kernels, which need bf16 mma.sync, off it. Ampere and later pass.
TEST(CompilerTest, TuringIsRefusedForWantOfBf16Mma) {
  for (const char* old : {"sm_75", "sm_75a", "sm_72", "sm_79"}) {
    const absl::Status st = CheckArch(old);
    EXPECT_FALSE(st.ok()) << old;
    EXPECT_NE(std::string(st.message()).find(absl::StrCat("'", old, "'")), std::string::npos) << st;
  }
  const absl::Status turing = CheckArch("sm_75");
  EXPECT_NE(std::string(turing.message()).find("sm_80 or later"), std::string::npos)
      << "sm_75 should be refused for its lack of bf16 mma, not as unknown to NVRTC: " << turing;
  EXPECT_TRUE(CheckArch("sm_86").ok());
}

// An architecture NVRTC cannot target is refused with the ones it can: each of those must be one
// the library takes, or the message sends the user (GEMVZ_ARCH=sm_70 on a Volta host, a typo such
// as sm_91) to sm_75, which NVRTC 13 still targets and CheckArch then refuses.
TEST(CompilerTest, AnUnknownArchitectureIsAnsweredWithUsableOnesOnly) {
  for (const char* unknown : {"sm_70", "sm_91", "sm_999"}) {
    const absl::Status st = CheckArch(unknown);
    ASSERT_FALSE(st.ok()) << unknown;
    const std::string message(st.message());
    const size_t list = message.find("it supports ");
    if (list == std::string::npos) continue;  // an NVRTC that cannot list its targets
    int offered = 0;
    for (absl::string_view name :
         absl::StrSplit(message.substr(list + 12), ", ", absl::SkipWhitespace())) {
      ++offered;
      EXPECT_TRUE(CheckArch(std::string(name)).ok())
          << unknown << "'s message offers " << name << ", which CheckArch refuses: " << st;
    }
    EXPECT_GT(offered, 0) << st;
    EXPECT_NE(message.find("sm_90"), std::string::npos) << st;
  }
}

TEST(CompilerTest, PtxasReportIsParsedForTheRightFunction) {
  const int regs = 20 + static_cast<int>(Rng()() % 200);
  const int stores = static_cast<int>(Rng()() % 100), loads = static_cast<int>(Rng()() % 100);
  const int smem = static_cast<int>(Rng()() % 40000);
  const std::string log = absl::StrCat(
      "ptxas info    : 0 bytes gmem\n"
      "ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z5otherv\n"
      "ptxas         .     0 bytes stack frame, 999 bytes spill stores, 999 bytes spill loads\n"
      "ptxas info    : Used 255 registers, used 1 barriers, 999 bytes smem\n"
      "ptxas info    : Compiling entry function '_Z4minev' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z4minev\n"
      "ptxas         .     8 bytes stack frame, ",
      stores, " bytes spill stores, ", loads,
      " bytes spill loads\n"
      "ptxas info    : Used ",
      regs, " registers, used 1 barriers, ", smem, " bytes smem, 400 bytes cmem[0]\n");
  const PtxasStats s = ParsePtxasLog(log, "_Z4minev");
  EXPECT_EQ(s.registers, regs);
  EXPECT_EQ(s.spill_bytes, stores + loads);
  EXPECT_EQ(s.shared_bytes, smem);
  const PtxasStats none = ParsePtxasLog(log, "_Z7missingv");
  EXPECT_EQ(none.registers, -1);
  // No "smem" means none.
  const PtxasStats no_smem = ParsePtxasLog(
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "ptxas info    : Function properties for k\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 24 registers, used 0 barriers\n",
      "k");
  EXPECT_EQ(no_smem.registers, 24);
  EXPECT_EQ(no_smem.shared_bytes, 0);
  EXPECT_EQ(no_smem.spill_bytes, 0);
}

TEST(CompilerTest, GeneratedSourceIncludesTheKernelFileOnly) {
  const std::string tu = GeneratedSource("z12_gemv.cuh");
  EXPECT_NE(tu.find("#include \"z12_gemv.cuh\""), std::string::npos);
  EXPECT_EQ(jit_test::CountOccurrences(tu, "#include"), 1);
}

TEST(CompilerTest, NvrtcVersionIsKnown) {
  const std::string v = NvrtcVersionString();
  EXPECT_NE(v, "unknown");
  EXPECT_NE(v.find('.'), std::string::npos) << v;
  // The library file, named without its directory, with its size and time.
  const std::string lib = NvrtcLibraryIdentity();
  EXPECT_EQ(lib.rfind("libnvrtc.so", 0), 0u) << lib;
  EXPECT_NE(lib.find(" bytes, mtime "), std::string::npos) << lib;
  EXPECT_EQ(lib.find('/'), std::string::npos) << lib;
}

}  // namespace
}  // namespace gemvz::internal

namespace gemvz::internal {
namespace {

// The cubin's own register count, frame and shared memory agree with ptxas's report, so the
// statistics survive a compile whose -v report comes back without the kernel's lines (seen on
// the H200 host for some fresh compiles). A fresh NVRTC compile each time: a kernel from the
// disk cache carries no report. Every report present must agree; at least one must be present.
TEST(CubinInfoTest, AgreesWithThePtxasReport) {
  int compared = 0;
  for (const char* text : {"z12.nw8.ug2.nb2.pipe3", "bf16.nw16.ug1.nb1.pipe2", "z12.nw4.ug1.nb1.pipe1",
                           "z12.nw8.ug1.nb2.pipe5"}) {
    auto config = KernelConfig::Parse(text);
    ASSERT_TRUE(config.ok()) << config.status();
    const CompiledKernel k = CompileOrDie(*config, "sm_90", *SourceSet::Embedded());
    ASSERT_FALSE(k.cubin.empty()) << text;
    auto elf = ReadCubinKernelInfo(k.cubin, k.lowered_name);
    ASSERT_TRUE(elf.ok()) << elf.status();
    EXPECT_GT(elf->registers, 0) << text;
    EXPECT_EQ(k.registers, elf->registers) << text << ": the compile's statistics are the cubin's";
    const PtxasStats log = ParsePtxasLog(k.log, k.lowered_name);
    if (log.registers <= 0) {
      std::printf("[ info ] %s: the -v report has no lines for %s; its first 600 bytes:\n%s\n",
                  text, k.lowered_name.c_str(), k.log.substr(0, 600).c_str());
      continue;
    }
    ++compared;
    EXPECT_EQ(elf->registers, log.registers) << text;
    EXPECT_EQ(elf->shared_bytes, log.shared_bytes) << text;
    EXPECT_EQ(elf->frame_bytes > 0, log.spill_bytes > 0) << text << ": a frame means spills here";
  }
  EXPECT_GT(compared, 0) << "no compile came with a ptxas -v report";
}

TEST(CubinInfoTest, RefusesWhatIsNotACubin) {
  EXPECT_FALSE(ReadCubinKernelInfo("", "k").ok());
  EXPECT_FALSE(ReadCubinKernelInfo(std::string(100, 'x'), "k").ok());
  auto config = KernelConfig::Parse("z12.nw4.ug1.nb1.pipe1");
  ASSERT_TRUE(config.ok());
  auto compiled = GetCompiledKernel(*config, "sm_90");
  ASSERT_TRUE(compiled.ok());
  const std::string& cubin = (*compiled)->cubin;
  EXPECT_FALSE(ReadCubinKernelInfo(cubin, "no_such_kernel").ok());
  EXPECT_FALSE(ReadCubinKernelInfo(cubin.substr(0, cubin.size() / 3), (*compiled)->lowered_name).ok());
  // Each section in turn made SHT_NOBITS with an offset far past the end (a crafted entry whose
  // checksum was recomputed): an answer or an error, never a throw or a read out of bounds.
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0;
  std::memcpy(&shoff, cubin.data() + 0x28, 8);
  std::memcpy(&shentsize, cubin.data() + 0x3A, 2);
  std::memcpy(&shnum, cubin.data() + 0x3C, 2);
  ASSERT_GT(shnum, 0);
  for (uint16_t i = 0; i < shnum; ++i) {
    std::string crafted = cubin;
    const size_t at = shoff + static_cast<size_t>(i) * shentsize;
    const uint32_t nobits = 8;
    const uint64_t far = uint64_t{1} << 60;
    std::memcpy(crafted.data() + at + 4, &nobits, 4);
    std::memcpy(crafted.data() + at + 24, &far, 8);
    (void)ReadCubinKernelInfo(crafted, (*compiled)->lowered_name);
  }
}

}  // namespace
}  // namespace gemvz::internal
