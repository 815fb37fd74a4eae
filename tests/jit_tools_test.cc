// The warm-up and cache CLI, run as separate processes the way a user runs them: warm-up fills
// the cache and a second run is all hits; configuration files name their bad lines; cache
// list/verify/prune/clear see and manage the entries; an unwritable cache fails loudly.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/common/file_util.h"
#include "tests/support/jit_test_util.h"

namespace gemvz {
namespace {

using ::gemvz::jit_test::CountOccurrences;
using ::gemvz::jit_test::ListFiles;
using ::gemvz::jit_test::TempDir;

struct RunResult {
  int code = -1;
  std::string out, err;
};

class ToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(GEMVZ_TOOL_PATH).empty()) GTEST_SKIP() << "the gemvz CLI is not built";
  }
  // Runs the CLI with GEMVZ_CACHE_DIR=`cache` (and `env`), capturing both streams.
  RunResult Run(const std::string& args, const std::string& cache, const std::string& env = "") {
    RunResult r;
    const std::string out = tmp_.Join("out.txt"), err = tmp_.Join("err.txt");
    const std::string cmd =
        absl::StrCat("env -u GEMVZ_DISABLE_DISK_CACHE -u GEMVZ_LOG GEMVZ_CACHE_DIR='", cache, "' ",
                     env, " '", GEMVZ_TOOL_PATH, "' ", args, " >'", out, "' 2>'", err, "'");
    const int status = std::system(cmd.c_str());
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = internal::ReadFile(out).value_or("");
    r.err = internal::ReadFile(err).value_or("");
    return r;
  }
  TempDir tmp_;
};

// Small real kernels: quick to compile.
constexpr char kConfigs[] =
    "# two kernels, one of them twice (another split count)\n"
    "bf16.nw4.ug1.nb1.pipe0.s1\n"
    "\n"
    "z12.nw4.ug1.nb1.pipe0.s2   # the compressed one\n"
    "z12.nw4.ug1.nb1.pipe0.s4\n";

TEST_F(ToolTest, WarmupTwiceThenAllHits) {
  TempDir cache;
  ASSERT_TRUE(internal::AtomicWriteFile(tmp_.Join("configs.txt"), kConfigs).ok());
  RunResult first =
      Run(absl::StrCat("warmup --arch=sm_90 --j=2 --configs=", tmp_.Join("configs.txt"),
                       " --json=", tmp_.Join("w.json")),
          cache.path());
  ASSERT_EQ(first.code, 0) << first.out << first.err;
  EXPECT_NE(first.out.find("2 compiled, 0 hits"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("bf16.nw4.ug1.nb1.pipe0"), std::string::npos);
  EXPECT_NE(first.out.find("z12.nw4.ug1.nb1.pipe0"), std::string::npos);
  EXPECT_NE(first.err.find("[1/2]"), std::string::npos) << "no progress: " << first.err;
  EXPECT_NE(first.err.find("[2/2]"), std::string::npos) << first.err;
  EXPECT_EQ(ListFiles(cache.Join("kernels")).size(), 2u);
  auto json = internal::ReadFile(tmp_.Join("w.json"));
  ASSERT_TRUE(json.ok());
  EXPECT_NE(json->find("\"compiled\": 2"), std::string::npos) << *json;

  EXPECT_NE(json->find("\"hits\": 0"), std::string::npos) << *json;

  RunResult second = Run(absl::StrCat("warmup --arch=sm_90 --configs=", tmp_.Join("configs.txt"),
                                      " --json=", tmp_.Join("w2.json")),
                         cache.path(), "GEMVZ_LOG=1");
  ASSERT_EQ(second.code, 0) << second.out << second.err;
  EXPECT_NE(second.out.find("0 compiled, 2 hits (all hits)"), std::string::npos) << second.out;
  // The report counts what the run did, as the summary line does: here every kernel a hit.
  json = internal::ReadFile(tmp_.Join("w2.json"));
  ASSERT_TRUE(json.ok());
  EXPECT_NE(json->find("\"compiled\": 0"), std::string::npos) << *json;
  EXPECT_NE(json->find("\"hits\": 2"), std::string::npos) << *json;
  EXPECT_EQ(CountOccurrences(second.err, "jit: disk hit"), 2) << second.err;
  EXPECT_EQ(CountOccurrences(second.err, "jit: compiled"), 0) << second.err;

  // Positional configurations, same kernels: hits too.
  RunResult third =
      Run("warmup --arch=sm_90 bf16.nw4.ug1.nb1.pipe0 z12.nw4.ug1.nb1.pipe0.s8", cache.path());
  ASSERT_EQ(third.code, 0) << third.err;
  EXPECT_NE(third.out.find("(all hits)"), std::string::npos) << third.out;
}

// A kernel that fails to compile costs only itself: the others are compiled and published, the
// table and the summary show the failure, the report has its error, and the exit status is 1.
// Spills are errors here, and this bf16 kernel spills on sm_80; first in line with --j=1, it used
// to leave the other uncompiled and nothing on stdout.
TEST_F(ToolTest, WarmupCompilesPastAFailedKernel) {
  TempDir cache;
  ASSERT_TRUE(internal::AtomicWriteFile(tmp_.Join("configs.txt"),
                                        "bf16.nw32.ug1.nb1.pipe2\nz12.nw4.ug1.nb1.pipe0\n")
                  .ok());
  RunResult r = Run(absl::StrCat("warmup --arch=sm_80 --j=1 --configs=", tmp_.Join("configs.txt"),
                                 " --json=", tmp_.Join("w.json")),
                    cache.path(),
                    "GEMVZ_NVRTC_OPTIONS='--ptxas-options=--warn-on-spills "
                    "--ptxas-options=--warning-as-error'");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("bf16.nw32.ug1.nb1.pipe2  sm_80   FAILED   NVRTC failed to compile"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("z12.nw4.ug1.nb1.pipe0    sm_80   compiled"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 kernels for sm_80 on 1 threads"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 compiled, 0 hits, 1 FAILED"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("error: 1 of 2 kernels failed to compile"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("spill"), std::string::npos) << "no NVRTC log: " << r.err;
  EXPECT_EQ(ListFiles(cache.Join("kernels")).size(), 1u);
  absl::StatusOr<std::string> json = internal::ReadFile(tmp_.Join("w.json"));
  ASSERT_TRUE(json.ok()) << r.err;
  const nlohmann::json doc = nlohmann::json::parse(*json);
  EXPECT_EQ(doc["compiled"], 1);
  EXPECT_EQ(doc["failed"], 1);
  ASSERT_EQ(doc["results"].size(), 2u);
  EXPECT_EQ(doc["results"][0]["config"], "bf16.nw32.ug1.nb1.pipe2");
  EXPECT_NE(doc["results"][0]["error"].get<std::string>().find("NVRTC failed to compile"),
            std::string::npos);
  EXPECT_FALSE(doc["results"][0].contains("registers"));
  EXPECT_EQ(doc["results"][1]["config"], "z12.nw4.ug1.nb1.pipe0");
  EXPECT_FALSE(doc["results"][1].contains("error"));
}

TEST_F(ToolTest, BadConfigurationLineIsNamed) {
  TempDir cache;
  ASSERT_TRUE(internal::AtomicWriteFile(tmp_.Join("bad.txt"),
                                        "# ok\nbf16.nw4.ug1.nb1.pipe0\nz12.nw4.ug1.nb1.pipe14\n")
                  .ok());
  RunResult r = Run(absl::StrCat("warmup --configs=", tmp_.Join("bad.txt")), cache.path());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("bad.txt:3:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("PIPE"), std::string::npos) << r.err;
  EXPECT_TRUE(ListFiles(cache.Join("kernels")).empty()) << "nothing may compile before the check";
  RunResult both =
      Run(absl::StrCat("warmup --all_default --configs=", tmp_.Join("bad.txt")), cache.path());
  EXPECT_EQ(both.code, 2);
  // A file with no configuration in it (comments and blank lines) is a mistake, not a warm-up of
  // nothing that succeeds.
  ASSERT_TRUE(internal::AtomicWriteFile(tmp_.Join("empty.txt"), "# nothing yet\n\n").ok());
  RunResult empty = Run(absl::StrCat("warmup --configs=", tmp_.Join("empty.txt")), cache.path());
  EXPECT_EQ(empty.code, 2) << empty.out << empty.err;
  EXPECT_NE(empty.err.find("empty.txt: no configurations in it"), std::string::npos) << empty.err;
  RunResult arch = Run("warmup --arch=sm90 z12.nw4.ug1.nb1.pipe0", cache.path());
  EXPECT_EQ(arch.code, 2);
  EXPECT_NE(arch.err.find("sm90"), std::string::npos) << arch.err;
}

// `warmup --tuned` compiles the tuning file's kernels for the target arch, e.g. a file that
// `tune --save` wrote on another machine; with nothing to warm it fails and says why.
TEST_F(ToolTest, WarmupTunedCompilesTheTuningFilesKernelsForTheArch) {
  TempDir cache;
  const std::string file = tmp_.Join("tuning.json");
  ASSERT_TRUE(internal::AtomicWriteFile(file,
                                        R"({"version": 1, "entries": [
  {"arch": "sm_90", "format": "z12", "m": 8, "n": 4096, "k": 8192,
   "config": "z12.nw4.ug1.nb1.pipe0.s2", "time_us": 10.0},
  {"arch": "sm_90", "format": "z12", "m": 1, "n": 4096, "k": 8192,
   "config": "z12.nw4.ug1.nb1.pipe0.s4", "time_us": 9.0},
  {"arch": "sm_80", "format": "bf16", "m": 8, "n": 4096, "k": 8192,
   "config": "bf16.nw4.ug1.nb1.pipe0.s1", "time_us": 10.0}]})")
                  .ok());
  const std::string env = absl::StrCat("GEMVZ_TUNING_FILE='", file, "'");
  RunResult r = Run("warmup --tuned --arch=sm_90", cache.path(), env);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("z12.nw4.ug1.nb1.pipe0"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("bf16."), std::string::npos) << "another arch's entry: " << r.out;
  EXPECT_NE(r.out.find("1 compiled, 0 hits"), std::string::npos) << r.out;  // two splits, one
  EXPECT_EQ(ListFiles(cache.Join("kernels")).size(), 1u);

  RunResult other = Run("warmup --tuned --arch=sm_89", cache.path(), env);
  EXPECT_EQ(other.code, 1) << other.out;
  EXPECT_NE(other.err.find("no entries for sm_89 (it has entries for sm_80, sm_90"),
            std::string::npos)
      << other.err;
  RunResult missing = Run("warmup --tuned --arch=sm_90", cache.path(),
                          absl::StrCat("GEMVZ_TUNING_FILE='", tmp_.Join("none.json"), "'"));
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find("there is no tuning file at"), std::string::npos) << missing.err;
  ASSERT_TRUE(internal::AtomicWriteFile(tmp_.Join("bad.json"), "{\"version\": 1,").ok());
  RunResult bad = Run("warmup --tuned --arch=sm_90", cache.path(),
                      absl::StrCat("GEMVZ_TUNING_FILE='", tmp_.Join("bad.json"), "'"));
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("bad.json"), std::string::npos) << bad.err;
  RunResult both = Run("warmup --tuned z12.nw4.ug1.nb1.pipe0", cache.path(), env);
  EXPECT_EQ(both.code, 2);
  EXPECT_NE(both.err.find("one way only"), std::string::npos) << both.err;
  RunResult over =
      Run(absl::StrCat("warmup --tuned --arch=sm_90 --json=", file), cache.path(), env);
  EXPECT_EQ(over.code, 2);
  EXPECT_NE(over.err.find("is the tuning file"), std::string::npos) << over.err;
  EXPECT_EQ(ListFiles(cache.Join("kernels")).size(), 1u);  // none of these compiled anything

  // The defaults take the file's kernels first. An NVRTC option that NVRTC refuses makes every
  // compile fail at once, so the run shows what it would warm without compiling 150 kernels.
  const std::string fail = absl::StrCat(env, " GEMVZ_NVRTC_OPTIONS=--no-such-option");
  const std::string report = tmp_.Join("d.json");
  RunResult d = Run(absl::StrCat("warmup --arch=sm_90 --json=", report), cache.path(), fail);
  EXPECT_EQ(d.code, 1) << d.out << d.err;  // the failed compiles
  EXPECT_NE(d.err.find(absl::StrCat("(the tuning file ", file,
                                    "'s 1 first, 1 of them not among the defaults)")),
            std::string::npos)
      << d.err;
  absl::StatusOr<std::string> json = internal::ReadFile(report);
  ASSERT_TRUE(json.ok()) << json.status();
  const nlohmann::json j = nlohmann::json::parse(*json);
  EXPECT_EQ(j["tuning_file"], file);
  EXPECT_EQ(j["tuning_file_kernels"], 1);
  ASSERT_GT(j["results"].size(), 100u);
  EXPECT_EQ(j["results"][0]["config"], "z12.nw4.ug1.nb1.pipe0");
  RunResult all = Run("warmup --all_default --arch=sm_90", cache.path(), fail);
  EXPECT_EQ(CountOccurrences(all.out, "FAILED"), CountOccurrences(d.out, "FAILED"));
  // A tuning file with no entry for the arch is a note; one that cannot be read a warning; the
  // defaults are warmed (here: tried) either way.
  RunResult sm89 = Run("warmup --arch=sm_89", cache.path(), fail);
  EXPECT_NE(sm89.err.find("note: the tuning file"), std::string::npos) << sm89.err;
  EXPECT_NE(sm89.err.find("has no entries for sm_89 (it has entries for sm_80, sm_90"),
            std::string::npos)
      << sm89.err;
  RunResult corrupt = Run("warmup --arch=sm_90", cache.path(),
                          absl::StrCat("GEMVZ_TUNING_FILE='", tmp_.Join("bad.json"),
                                       "' GEMVZ_NVRTC_OPTIONS=--no-such-option"));
  EXPECT_EQ(corrupt.code, 1);
  EXPECT_NE(corrupt.err.find("warning:"), std::string::npos) << corrupt.err;
  EXPECT_NE(corrupt.err.find("its kernels are not warmed"), std::string::npos) << corrupt.err;
  EXPECT_GT(CountOccurrences(corrupt.out, "FAILED"), 100) << corrupt.out;
}

TEST_F(ToolTest, CacheListVerifyPruneClear) {
  TempDir cache;
  ASSERT_EQ(
      Run("warmup --arch=sm_90 bf16.nw4.ug1.nb1.pipe0 z12.nw4.ug1.nb1.pipe0", cache.path()).code,
      0);
  RunResult list = Run("cache list", cache.path());
  ASSERT_EQ(list.code, 0) << list.err;
  EXPECT_NE(list.out.find("bf16.nw4.ug1.nb1.pipe0"), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("z12.nw4.ug1.nb1.pipe0"), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("2 entries"), std::string::npos) << list.out;
  RunResult dir = Run("cache dir", cache.path());
  EXPECT_EQ(dir.out, cache.path() + "\n");

  RunResult ok = Run("cache verify", cache.path());
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("2 valid, 0 invalid"), std::string::npos) << ok.out;

  const std::vector<std::string> files = ListFiles(cache.Join("kernels"));
  ASSERT_EQ(files.size(), 2u);
  jit_test::FlipByte(cache.Join("kernels/" + files[0]), 100, 0x20);
  RunResult bad = Run("cache verify", cache.path());
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.out.find("BAD"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("checksum"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("2 entries checked in " + cache.path() + ": 1 valid, 1 invalid"),
            std::string::npos)
      << bad.out;
  // list shows the bad entry too, and its JSON marks it invalid with the reason.
  RunResult listed = Run("cache list --json=" + tmp_.Join("list.json"), cache.path());
  EXPECT_EQ(listed.code, 0) << listed.err;
  EXPECT_NE(listed.out.find("2 entries"), std::string::npos) << listed.out;
  EXPECT_NE(listed.out.find("1 invalid"), std::string::npos) << listed.out;
  auto list_json = internal::ReadFile(tmp_.Join("list.json"));
  ASSERT_TRUE(list_json.ok());
  EXPECT_EQ(CountOccurrences(*list_json, "\"valid\": false"), 1) << *list_json;
  EXPECT_EQ(CountOccurrences(*list_json, "\"valid\": true"), 1) << *list_json;
  EXPECT_NE(list_json->find("checksum"), std::string::npos) << *list_json;
  EXPECT_EQ(ListFiles(cache.Join("kernels")).size(), 2u) << "verify alone removes nothing";
  RunResult fixed = Run("cache verify --cache_remove_bad", cache.path());
  EXPECT_EQ(fixed.code, 1);
  EXPECT_EQ(ListFiles(cache.Join("kernels")).size(), 1u);
  EXPECT_EQ(Run("cache verify", cache.path()).code, 0);

  RunResult prune = Run("cache prune --cache_max_bytes=1K", cache.path());
  EXPECT_EQ(prune.code, 0) << prune.err;
  EXPECT_NE(prune.out.find("removed 1"), std::string::npos) << prune.out;
  EXPECT_TRUE(ListFiles(cache.Join("kernels")).empty());

  ASSERT_EQ(Run("warmup --arch=sm_90 bf16.nw4.ug1.nb1.pipe0", cache.path()).code, 0);
  ASSERT_TRUE(internal::AtomicWriteFile(cache.Join("tuning.json"), "{}").ok());
  RunResult clear = Run("cache clear", cache.path());
  EXPECT_EQ(clear.code, 0);
  EXPECT_NE(clear.out.find("removed 1 entries"), std::string::npos) << clear.out;
  EXPECT_TRUE(ListFiles(cache.Join("kernels")).empty());
  EXPECT_EQ(ListFiles(cache.path()), std::vector<std::string>{"tuning.json"});

  EXPECT_EQ(Run("cache", cache.path()).code, 2);
  EXPECT_EQ(Run("cache shred", cache.path()).code, 2);
  EXPECT_EQ(Run("cache prune --cache_max_bytes=lots", cache.path()).code, 2);
}

// A cache directory may be shared, so its file names are anyone's: list and verify show them
// escaped (a terminal escape would act on the screen of whoever lists them); verify
// --cache_remove_bad removes a link that leads nowhere under an entry's name (which reads as "not
// found", as an entry pruned meanwhile does); and clear removes what the cache makes (entries,
// unheld locks), never a file of another name in kernels/ or locks/.
TEST_F(ToolTest, CacheShowsNamesEscapedAndRemovesOnlyWhatItMakes) {
  TempDir cache;
  ASSERT_EQ(Run("warmup --arch=sm_90 bf16.nw4.ug1.nb1.pipe0", cache.path()).code, 0);
  const std::string hostile = cache.Join("kernels/\x1b]0;pwned\x07\x1b[2Jx.gemvzk");
  ASSERT_TRUE(internal::AtomicWriteFile(hostile, "x").ok());
  const std::string nowhere = cache.Join("kernels/" + std::string(64, 'a') + ".gemvzk");
  ASSERT_EQ(::symlink(tmp_.Join("nothing").c_str(), nowhere.c_str()), 0);
  ASSERT_TRUE(internal::AtomicWriteFile(cache.Join("kernels/README.txt"), "notes").ok());
  ASSERT_TRUE(internal::AtomicWriteFile(cache.Join("locks/settings.conf"), "x").ok());
  ASSERT_TRUE(
      internal::AtomicWriteFile(cache.Join("locks/" + std::string(64, 'b') + ".lock"), "").ok());
  auto no_control = [](const std::string& text) {
    return text.find_first_of("\x1b\x07") == std::string::npos;
  };
  RunResult list = Run("cache list", cache.path());
  EXPECT_EQ(list.code, 0) << list.err;
  EXPECT_TRUE(no_control(list.out)) << absl::CHexEscape(list.out);
  EXPECT_NE(list.out.find("\\x1b]0;pwned"), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("3 entries"), std::string::npos) << list.out;
  RunResult verify = Run("cache verify --cache_remove_bad", cache.path());
  EXPECT_EQ(verify.code, 1);
  EXPECT_TRUE(no_control(verify.out)) << absl::CHexEscape(verify.out);
  EXPECT_NE(verify.out.find("a link that leads nowhere"), std::string::npos) << verify.out;
  EXPECT_NE(verify.out.find("1 valid, 2 invalid, 2 removed"), std::string::npos) << verify.out;
  struct stat st;
  EXPECT_NE(::lstat(nowhere.c_str(), &st), 0) << "the link that leads nowhere is still there";
  EXPECT_NE(::lstat(hostile.c_str(), &st), 0);
  EXPECT_EQ(Run("cache verify", cache.path()).code, 0);
  RunResult clear = Run("cache clear", cache.path());
  EXPECT_EQ(clear.code, 0) << clear.err;
  EXPECT_NE(clear.out.find("removed 1 entries"), std::string::npos) << clear.out;
  EXPECT_EQ(ListFiles(cache.Join("kernels")), std::vector<std::string>{"README.txt"});
  EXPECT_EQ(ListFiles(cache.Join("locks")), std::vector<std::string>{"settings.conf"});
}

// An invalid entry that verify --cache_remove_bad cannot remove (here a directory with a file in
// it under an entry's name; no permission does the same to anyone but root) is named on stderr
// with the reason and counted apart, exit status 1: it was counted as neither, in silence.
TEST_F(ToolTest, CacheVerifyNamesAnEntryItCouldNotRemove) {
  TempDir cache;
  ASSERT_EQ(::mkdir(cache.Join("kernels").c_str(), 0755), 0);
  const std::string stuck = cache.Join("kernels/" + std::string(64, 'c') + ".gemvzk");
  ASSERT_EQ(::mkdir(stuck.c_str(), 0755), 0);
  ASSERT_TRUE(internal::AtomicWriteFile(stuck + "/inside", "x").ok());
  const std::string junk = cache.Join("kernels/" + std::string(64, 'd') + ".gemvzk");
  ASSERT_TRUE(internal::AtomicWriteFile(junk, "not an entry").ok());
  RunResult r = Run("cache verify --cache_remove_bad", cache.path());
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("gemvz cache: could not remove '" + stuck + "': Directory not empty"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("0 valid, 2 invalid, 1 removed, 1 could not be removed"), std::string::npos)
      << r.out;
  struct stat st;
  EXPECT_EQ(::lstat(stuck.c_str(), &st), 0);
  EXPECT_NE(::lstat(junk.c_str(), &st), 0) << "the entry it could remove is still there";
}

TEST_F(ToolTest, UnwritableCacheFailsWarmupWithOneWarning) {
  ASSERT_TRUE(internal::AtomicWriteFile(tmp_.Join("plain"), "x").ok());
  RunResult r = Run("warmup --arch=sm_90 --j=2 bf16.nw4.ug1.nb1.pipe0 z12.nw4.ug1.nb1.pipe0",
                    tmp_.Join("plain/cache"));
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(CountOccurrences(r.err, "not writable"), 1) << r.err;
  EXPECT_NE(r.out.find("could not be written"), std::string::npos) << r.out;
}

TEST_F(ToolTest, UsageTextsAreComplete) {
  RunResult w = Run("warmup --help", tmp_.path());
  EXPECT_EQ(w.code, 0);
  for (const char* s : {"usage:", "--arch", "--configs", "--all_default", "--tuned", "--j",
                        "--json", "examples:", "GEMVZ_CACHE_DIR"}) {
    EXPECT_NE(w.out.find(s), std::string::npos) << s;
  }
  RunResult c = Run("cache --help", tmp_.path());
  EXPECT_EQ(c.code, 0);
  for (const char* s : {"usage:", "list", "verify", "prune", "clear", "--cache_max_bytes",
                        "--cache_remove_bad", "--json", "examples:"}) {
    EXPECT_NE(c.out.find(s), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace gemvz
