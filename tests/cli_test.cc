// Runs the built `gemvz` CLI as a subprocess: help texts, usage errors with clear messages and
// non-zero exits, demo's no-GPU path, bench refusing cleanly without a GPU, and tune's checks.
// With a GPU the same tests take the GPU paths (small shapes) and check their outputs.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gemvz/format.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/cuda/driver.h"
#include "tests/support/temp_files.h"
#include "tools/gemvz/bench_support.h"

#ifndef GEMVZ_FAKE_CUBLAS  // CMakeLists.txt builds it with the CLI
#define GEMVZ_FAKE_CUBLAS ""
#endif

namespace {

struct Result {
  int rc = -1;
  std::string out, err;
};

std::string Quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

using ::gemvz::testing::Exists;
using ::gemvz::testing::ReadAll;

bool HasGpu() { return gemvz::internal::DeviceCount() > 0; }

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(GEMVZ_TOOL_PATH).empty()) GTEST_SKIP() << "the gemvz CLI is not built";
    // Removed when the program ends if every test passed (kept to look at otherwise).
    dir_ = gemvz::testing::MakeTempDir("cli_test");
    ASSERT_FALSE(dir_.empty());
    // A private kernel cache and tuning file: tests neither read nor change the user's.
    env_["GEMVZ_CACHE_DIR"] = dir_ + "/cache";
    env_["GEMVZ_TUNING_FILE"] = dir_ + "/tuning.json";
  }

  // `before` runs in the same shell first (a ulimit, say).
  Result Run(const std::vector<std::string>& args, const std::string& before = "") {
    std::string cmd =
        absl::StrCat("cd ", Quote(dir_), " && ", before.empty() ? "" : before + " && ", "env");
    for (const auto& [k, v] : env_) absl::StrAppend(&cmd, " ", k, "=", Quote(v));
    absl::StrAppend(&cmd, " ", Quote(GEMVZ_TOOL_PATH));
    for (const std::string& a : args) absl::StrAppend(&cmd, " ", Quote(a));
    absl::StrAppend(&cmd, " > ", Quote(dir_ + "/stdout"), " 2> ", Quote(dir_ + "/stderr"));
    Result r;
    const int status = std::system(cmd.c_str());
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = ReadAll(dir_ + "/stdout");
    r.err = ReadAll(dir_ + "/stderr");
    return r;
  }

  // The command names `gemvz help` lists.
  std::vector<std::string> ListedCommands() {
    const Result help = Run({"help"});
    std::vector<std::string> names;
    bool in_list = false;
    for (absl::string_view line : absl::StrSplit(help.out, '\n')) {
      if (line == "commands:") {
        in_list = true;
        continue;
      }
      if (in_list && line.empty()) break;
      if (in_list) {
        std::vector<std::string> words =
            absl::StrSplit(absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
        if (!words.empty()) names.push_back(words[0]);
      }
    }
    return names;
  }

  std::string dir_;
  std::map<std::string, std::string> env_;
};

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "no '" << (needle) << "' in:\n" << (haystack)

// A command line for `name` with `flags`: tune needs a configuration to get past its own checks,
// and the other commands take no --config.
std::vector<std::string> Args(const std::string& name, std::vector<std::string> flags) {
  flags.insert(flags.begin(), name);
  if (name == "tune") flags.push_back("--config=z12.nw8.ug2.nb1.pipe3.s1");
  return flags;
}

const char* const kMeasureFlags[] = {"--replays", "--launches", "--rotate_mb", "--seed", "--pdl",
                                     "--device", "--j"};

TEST_F(CliTest, HelpListsTheCommands) {
  const Result help = Run({"help"});
  EXPECT_EQ(help.rc, 0) << help.err;
  const std::vector<std::string> names = ListedCommands();
  for (const char* mine : {"demo", "bench", "tune"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), mine), names.end()) << help.out;
  }
  const Result bare = Run({});
  EXPECT_NE(bare.rc, 0);
  EXPECT_CONTAINS(bare.err, "commands:");
  const Result unknown = Run({"frobnicate"});
  EXPECT_EQ(unknown.rc, 2);
  EXPECT_CONTAINS(unknown.err, "unknown command 'frobnicate'");
  // help's own help is the overview.
  for (const char* again : {"help", "--help"}) {
    const Result r = Run({"help", again});
    EXPECT_EQ(r.rc, 0) << again << ": " << r.err;
    EXPECT_EQ(r.out, help.out) << again;
  }
}

TEST_F(CliTest, EveryCommandHasAUsageText) {
  const std::vector<std::string> names = ListedCommands();
  ASSERT_GE(names.size(), 3u);
  for (const std::string& name : names) {
    const Result help = Run({name, "--help"});
    EXPECT_EQ(help.rc, 0) << name << ": " << help.err;
    EXPECT_CONTAINS(help.out, "usage: gemvz " + name);
    EXPECT_CONTAINS(help.out, "examples:");
    const Result via_help = Run({"help", name});
    EXPECT_EQ(via_help.rc, 0);
    EXPECT_EQ(via_help.out, help.out) << name;
    const Result short_flag = Run({name, "-h"});
    EXPECT_EQ(short_flag.out, help.out) << name;
  }
}

TEST_F(CliTest, UsageTextsNameEveryFlagWithItsDefault) {
  const std::map<std::string, std::vector<std::string>> flags = {
      {"demo", {"--quick", "--shape", "--arch"}},
      {"bench", {"--shape", "--m", "--json", "--plot", "--commit", "--sequence"}},
      {"tune",
       {"--shape", "--m", "--config", "--sweep", "--sweep_format", "--space", "--top", "--save",
        "--json", "--arch"}},
  };
  for (const auto& [name, own] : flags) {
    const std::string usage = Run({name, "--help"}).out;
    for (const std::string& flag : own) EXPECT_CONTAINS(usage, "  " + flag);
    for (const char* flag : kMeasureFlags) EXPECT_CONTAINS(usage, std::string("  ") + flag);
    EXPECT_CONTAINS(usage, "default");
    EXPECT_CONTAINS(usage, "Exit status");
  }
}

TEST_F(CliTest, UnknownFlagsAndBadValuesFail) {
  for (const char* name : {"demo", "bench", "tune"}) {
    const Result r = Run({name, "--no_such_flag=1"});
    EXPECT_NE(r.rc, 0) << name;
    EXPECT_CONTAINS(r.err, "no_such_flag");
    const Result typed = Run({name, "--replays=many"});
    EXPECT_NE(typed.rc, 0) << name;
    EXPECT_CONTAINS(typed.err, "replays");
    const Result zero = Run(Args(name, {"--replays=0"}));
    EXPECT_EQ(zero.rc, 2) << name << ": " << zero.err;
    EXPECT_CONTAINS(zero.err, "bad --replays=0");
    const Result rotate = Run(Args(name, {"--rotate_mb=0"}));
    EXPECT_EQ(rotate.rc, 2) << name;
    EXPECT_CONTAINS(rotate.err, "bad --rotate_mb=0");
    // A timed graph of no launches would time nothing, and the time per call divides by it.
    const Result launches = Run(Args(name, {"--launches=0"}));
    EXPECT_EQ(launches.rc, 2) << name << ": " << launches.err;
    EXPECT_CONTAINS(launches.err, "bad --launches=0");
    const Result extra = Run({name, "stray"});
    EXPECT_EQ(extra.rc, 2) << name;
    EXPECT_CONTAINS(extra.err, "unexpected argument 'stray'");
  }
}

// Flag names may be spelled with dashes: --zero-rows reaches the zero_rows flag, whose check
// then names it; a value after '=' keeps its dashes.
TEST_F(CliTest, DashedFlagNamesAreAccepted) {
  const Result r = Run({"bench", "--zero-rows=x", "--rotate-mb=64"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_CONTAINS(r.err, "bad --zero_rows entry 'x'");
  const Result dashed_value = Run({"tune", "--config=z12.nw8.ug2.nb1.pipe3.s1", "--shape=4096-8192"});
  EXPECT_EQ(dashed_value.rc, 2) << dashed_value.err;
  EXPECT_CONTAINS(dashed_value.err, "4096-8192");
}

// Every flag is defined once for the whole program; each command takes only its own. The list a
// command accepts (which its unknown-flag message prints) is exactly the flags its help text
// documents, so neither can drift from the other.
TEST_F(CliTest, EachCommandTakesExactlyTheFlagsItsHelpDocuments) {
  const std::vector<std::string> names = ListedCommands();
  ASSERT_GE(names.size(), 6u);
  for (const std::string& name : names) {
    std::set<std::string> documented;
    for (absl::string_view line : absl::StrSplit(Run({name, "--help"}).out, '\n')) {
      // "  --name=VALUE  what it does" or "  -o, --o=DIR ...": a flag's own line.
      absl::string_view rest = absl::StripLeadingAsciiWhitespace(line);
      if (rest.size() == line.size() || line.size() - rest.size() > 4) continue;
      if (absl::ConsumePrefix(&rest, "-") && rest.size() > 2 && rest[1] == ',') rest.remove_prefix(3);
      if (!absl::ConsumePrefix(&rest, "--") && !absl::ConsumePrefix(&rest, "-")) continue;
      const size_t end = rest.find_first_not_of("abcdefghijklmnopqrstuvwxyz_");
      documented.insert(std::string(rest.substr(0, end)));
    }
    const Result r = Run({name, "--no_such_flag"});
    EXPECT_EQ(r.rc, 2) << name << ": " << r.err;
    EXPECT_CONTAINS(r.err, "unknown flag '--no_such_flag'");
    const size_t takes = r.err.find("it takes ");
    ASSERT_NE(takes, std::string::npos) << r.err;
    const size_t end = r.err.find(" (see", takes);
    std::set<std::string> accepted;
    for (absl::string_view flag :
         absl::StrSplit(r.err.substr(takes + 9, end - takes - 9), ", ", absl::SkipEmpty())) {
      absl::ConsumePrefix(&flag, "--");
      accepted.insert(std::string(flag));
    }
    EXPECT_EQ(accepted, documented) << name;
  }
}

TEST_F(CliTest, AnotherCommandsFlagOrAbseilsOwnIsAUsageError) {
  for (const std::vector<std::string> args :
       {std::vector<std::string>{"cache", "dir", "--sweep"}, {"demo", "--m=4"},
        {"pack", "in.safetensors", "-o", "out", "--replays=3"}, {"cache", "list", "--helpfull"},
        {"warmup", "--flagfile=x"}, {"bench", "--version"}}) {
    const Result r = Run(args);
    EXPECT_EQ(r.rc, 2) << absl::StrJoin(args, " ") << ": " << r.err;
    EXPECT_CONTAINS(r.err, "unknown flag");
  }
  EXPECT_FALSE(Exists(dir_ + "/out"));
  const Result help = Run({"help", "nosuch"});
  EXPECT_EQ(help.rc, 2);
  EXPECT_CONTAINS(help.err, "unknown command 'nosuch'");
}

// A value is taken as written: after "--" every argument is positional, and a value given as the
// next argument keeps its dashes.
TEST_F(CliTest, ArgumentsAfterDoubleDashAndSeparateValuesKeepTheirDashes) {
  const Result file = Run({"pack", "-o", "out", "--", "-my-model.safetensors"});
  EXPECT_EQ(file.rc, 1) << file.err;
  EXPECT_CONTAINS(file.err, "'-my-model.safetensors'");
  const Result value = Run({"bench", "--zero-rows", "-1,-2"});
  EXPECT_EQ(value.rc, 2) << value.err;
  EXPECT_CONTAINS(value.err, "bad --zero_rows entry '-1'");
  const Result missing = Run({"bench", "--replays"});
  EXPECT_EQ(missing.rc, 2);
  EXPECT_CONTAINS(missing.err, "--replays needs a value");
  const Result negated = Run({"tune", "--nosave", "--pdl=maybe"});
  EXPECT_EQ(negated.rc, 2);
  EXPECT_CONTAINS(negated.err, "bad --pdl=maybe");
  // After "--" even --help is a file name, not a request for the usage text.
  const Result help_file = Run({"pack", "-o", "out", "--", "--help"});
  EXPECT_EQ(help_file.rc, 1) << help_file.out << help_file.err;
  EXPECT_CONTAINS(help_file.err, "'--help'");
  EXPECT_FALSE(absl::StrContains(help_file.out, "usage:")) << help_file.out;
  // --noNAME negates a boolean flag only: --notop is no flag (nor --top taking the next word).
  const Result no_int = Run({"tune", "--notop", "5"});
  EXPECT_EQ(no_int.rc, 2) << no_int.err;
  EXPECT_CONTAINS(no_int.err, "unknown flag '--notop'");
}

// Everything that can be checked is checked before the long work: a bad --arch or GEMVZ_ARCH, an
// output file that cannot be written, --zero_rows outside the shapes, --top below zero.
TEST_F(CliTest, BadArchOutputPathsAndRangesFailBeforeAnyWork) {
  const std::vector<std::vector<std::string>> commands = {
      {"demo", "--shape=16x64"},
      {"tune", "--shape=16x64", "--config=z12.nw1.ug1.nb1.pipe0.s1"},
      {"warmup", "z12.nw1.ug1.nb1.pipe0"}};
  for (std::vector<std::string> args : commands) {
    args.push_back("--arch=sm_foo");
    const Result r = Run(args);
    EXPECT_EQ(r.rc, 2) << args[0] << ": " << r.err;
    EXPECT_CONTAINS(r.err, "--arch: bad target architecture 'sm_foo'");
  }
  env_["GEMVZ_ARCH"] = "sm_foo";
  for (const std::vector<std::string>& args : commands) {
    const Result r = Run(args);
    EXPECT_EQ(r.rc, 2) << args[0] << ": " << r.err;
    EXPECT_CONTAINS(r.err, "GEMVZ_ARCH: bad target architecture 'sm_foo'");
    EXPECT_FALSE(absl::StrContains(r.out, "Packing")) << r.out;
  }
  // GEMVZ_ARCH is the default --arch with or without a GPU.
  env_["GEMVZ_ARCH"] = "sm_80";
  // --j=1024 (kMaxThreads) is the top of --j's range, still accepted.
  const Result warm = Run({"warmup", "z12.nw8.ug2.nb1.pipe3", "--j=1024"});
  EXPECT_EQ(warm.rc, 0) << warm.err;
  EXPECT_CONTAINS(warm.out, "1 kernels for sm_80");
  env_.erase("GEMVZ_ARCH");

  ASSERT_EQ(mkdir((dir_ + "/adir").c_str(), 0755), 0);
  const std::vector<std::vector<std::string>> outputs = {
      {"bench", "--json=adir"},
      {"bench", "--plot=missing/chart.png"},
      {"tune", "--config=z12.nw8.ug2.nb1.pipe3.s1", "--json=adir"},
      {"warmup", "z12.nw8.ug2.nb1.pipe3", "--json=missing/w.json"},
      {"pack", "in.safetensors", "-o", "out", "--json=adir"},
      {"cache", "list", "--json=adir"},
      // A FIFO (as /dev/null, which a root process would replace by a regular file) or a link
      // to one (as /dev/stdout): the report's rename would replace it.
      {"bench", "--json=afifo"},
      {"bench", "--plot=afifo"},
      {"tune", "--config=z12.nw8.ug2.nb1.pipe3.s1", "--json=afifo"},
      {"warmup", "z12.nw8.ug2.nb1.pipe3", "--json=afifo"},
      {"pack", "in.safetensors", "-o", "out", "--json=afifo"},
      {"cache", "list", "--json=afifo"},
      {"cache", "list", "--json=afifo_link"}};
  ASSERT_EQ(mkfifo((dir_ + "/afifo").c_str(), 0644), 0);
  ASSERT_EQ(symlink("afifo", (dir_ + "/afifo_link").c_str()), 0);
  for (const std::vector<std::string>& args : outputs) {
    const Result r = Run(args);
    EXPECT_EQ(r.rc, 2) << absl::StrJoin(args, " ") << ": " << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, "is a directory") ||
                absl::StrContains(r.err, "its directory 'missing' does not exist") ||
                absl::StrContains(r.err, "is not a regular file (a device, FIFO or socket)"))
        << r.err;
    EXPECT_FALSE(absl::StrContains(r.out, "compiled")) << r.out;
  }
  EXPECT_FALSE(Exists(dir_ + "/out"));
  struct stat fifo_info;
  ASSERT_EQ(lstat((dir_ + "/afifo").c_str(), &fifo_info), 0);
  EXPECT_TRUE(S_ISFIFO(fifo_info.st_mode)) << "the FIFO was replaced";
  ASSERT_EQ(lstat((dir_ + "/afifo_link").c_str(), &fifo_info), 0);
  EXPECT_TRUE(S_ISLNK(fifo_info.st_mode)) << "the link was replaced";

  const Result rows = Run({"bench", "--zero_rows=5,99999"});
  EXPECT_EQ(rows.rc, 2) << rows.err;
  EXPECT_CONTAINS(rows.err, "--zero_rows: row 99999 is outside");
  const Result tune_rows = Run({"tune", "--shape=64x64", "--config=z12.nw1.ug1.nb1.pipe0.s1",
                                "--zero_rows=64"});
  EXPECT_EQ(tune_rows.rc, 2) << tune_rows.err;
  EXPECT_CONTAINS(tune_rows.err, "--zero_rows: row 64 is outside 64x64");
  // --exception_rows: ROW:PERCENT, checked as --zero_rows is, for bench and tune alike.
  for (const auto& [value, message] : std::vector<std::pair<std::string, std::string>>{
           {"5", "bad --exception_rows entry '5': expected ROW:PERCENT"},
           {"5:0", "bad --exception_rows entry '5:0'"},
           {"5:100.5", "bad --exception_rows entry '5:100.5'"},
           {"5:x", "bad --exception_rows entry '5:x'"},
           {"-1:2", "bad --exception_rows entry '-1:2'"},
           {"5:1,", "bad --exception_rows entry ''"},
           {"5:1,99999:2", "--exception_rows: row 99999 is outside"},
           {"5:1,5:2", "--exception_rows: row 5 is given twice"}}) {
    for (const char* command : {"bench", "tune"}) {
      const Result r = Run({command, "--exception_rows=" + value});
      EXPECT_EQ(r.rc, 2) << command << " " << value << ": " << r.err;
      EXPECT_CONTAINS(r.err, message);
    }
  }
  const Result both = Run({"bench", "--zero_rows=7", "--exception_rows=7:1"});
  EXPECT_EQ(both.rc, 2) << both.err;
  EXPECT_CONTAINS(both.err, "row 7 is in both --zero_rows and --exception_rows");
  const Result top = Run({"tune", "--sweep", "--top=-5"});
  EXPECT_EQ(top.rc, 2);
  EXPECT_CONTAINS(top.err, "bad --top=-5");
  const Result space = Run({"tune", "--space=adir"});
  EXPECT_EQ(space.rc, 2);
  EXPECT_CONTAINS(space.err, "Is a directory");
  // An empty value (a variable that was not set) is not the flag's default: an empty --configs
  // is not the default set of 150 kernels, an empty --cache_max_bytes not the default cap, an
  // empty --json not "no report", in every command, either way a value is given.
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"warmup", "--configs="},
                                             {"warmup", "--configs", ""},
                                             {"cache", "prune", "--cache_max_bytes="},
                                             {"bench", "--sequence="},
                                             {"tune", "--sweep", "--space="},
                                             {"demo", "--shape="},
                                             {"bench", "--json="},
                                             {"pack", "in.safetensors", "-o", ""}}) {
    const Result r = Run(args);
    EXPECT_EQ(r.rc, 2) << absl::StrJoin(args, " ") << ": " << r.err;
    EXPECT_CONTAINS(r.err, "was given an empty value");
    EXPECT_FALSE(absl::StrContains(r.err, "kernels for")) << r.err;
    EXPECT_EQ(r.out, "") << absl::StrJoin(args, " ");
  }
  // --j: a negative or absurd thread count, in every command that takes it.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"demo", "--j=5000"},
           {"tune", "--config=z12.nw8.ug2.nb1.pipe3.s1", "--j=-1"},
           {"warmup", "z12.nw8.ug2.nb1.pipe3", "--j=5000"},
           {"pack", "in.safetensors", "-o", "out", "--j=-3"},
           {"bench", "--j=100000"}}) {
    const Result r = Run(args);
    EXPECT_EQ(r.rc, 2) << absl::StrJoin(args, " ") << ": " << r.err;
    EXPECT_CONTAINS(r.err, "expected 0 (all cores) to 1024");
    EXPECT_FALSE(absl::StrContains(r.out, "compiled")) << r.out;
  }
}

TEST_F(CliTest, BenchSequenceUsageErrorsSayWhy) {
  const Result bad = Run({"bench", "--sequence=4096x4096,nope"});
  EXPECT_EQ(bad.rc, 2) << bad.err;
  EXPECT_CONTAINS(bad.err, "bad --sequence entry 'nope'");
  for (const std::string clash : {"--shape=4096x4096", "--plot=x.png", "--pdl"}) {
    const Result r = Run({"bench", "--sequence=llama3-8b", clash});
    EXPECT_EQ(r.rc, 2) << clash << ": " << r.err;
    EXPECT_CONTAINS(r.err, "drop --shape, --plot and --pdl");
  }
}

TEST_F(CliTest, BadShapesAndRowCountsFailSayingWhy) {
  for (const char* name : {"demo", "bench", "tune"}) {
    for (const std::string shape : {"4096", "0x64", "axb", "4096x8192x2"}) {
      const Result r = Run(Args(name, {"--shape=" + shape}));
      EXPECT_EQ(r.rc, 2) << name << " --shape=" << shape << ": " << r.err;
      EXPECT_CONTAINS(r.err, "bad shape '" + shape + "'");
      EXPECT_CONTAINS(r.err, "NxK");
    }
  }
  for (const char* name : {"bench", "tune"}) {
    for (const std::string m : {"0", "1,,8", "8,8", "x"}) {
      const Result r = Run(Args(name, {"--m=" + m}));
      EXPECT_EQ(r.rc, 2) << name << " --m=" << m << ": " << r.err;
      EXPECT_CONTAINS(r.err, "bad --m '" + m + "'");
    }
  }
  // The demo packs, so its shape must be packable.
  const Result odd = Run({"demo", "--shape=100x64"});
  EXPECT_EQ(odd.rc, 2) << odd.err;
  EXPECT_CONTAINS(odd.err, "100x64");
}

TEST_F(CliTest, TuneExplainsWhatItNeeds) {
  const Result neither = Run({"tune", "--shape=4096x8192", "--m=8"});
  EXPECT_EQ(neither.rc, 2);
  EXPECT_CONTAINS(neither.err, "give --config");
  const Result both = Run({"tune", "--shape=4096x8192", "--config=z12.nw8.ug2.nb1.pipe3.s1",
                           "--sweep"});
  EXPECT_EQ(both.rc, 2);
  EXPECT_CONTAINS(both.err, "exclude");
  const Result unparsable = Run({"tune", "--shape=4096x8192", "--m=8", "--config=z12.nw8"});
  EXPECT_EQ(unparsable.rc, 2);
  EXPECT_CONTAINS(unparsable.err, "--config");
  EXPECT_CONTAINS(unparsable.err, "z12.nw8");
  const Result bad_rule = Run({"tune", "--shape=4096x8192", "--m=8", "--config=z12.nw8.ug2.nb4.pipe3.s1x"});
  EXPECT_EQ(bad_rule.rc, 2);
  const Result format = Run({"tune", "--shape=4096x8192", "--sweep", "--sweep_format=fp8"});
  EXPECT_EQ(format.rc, 2);
  EXPECT_CONTAINS(format.err, "bad --sweep_format 'fp8'");
  const Result no_file = Run({"tune", "--shape=4096x8192", "--space=" + dir_ + "/missing.txt"});
  EXPECT_EQ(no_file.rc, 2);
  EXPECT_CONTAINS(no_file.err, "missing.txt");
}

TEST_F(CliTest, TuneReportsTheRuleAnInvalidConfigurationBreaks) {
  // K = 8192 is 64 trips of UG = 2 groups: 4 per slice of S = 16, fewer than NW = 8 warps.
  const Result r = Run({"tune", "--shape=4096x8192", "--m=8",
                        "--config=z12.nw8.ug2.nb1.pipe3.s16"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_CONTAINS(r.err, "z12.nw8.ug2.nb1.pipe3.s16");
  EXPECT_CONTAINS(r.err, "m8.n4096.k8192");
  EXPECT_CONTAINS(r.err, "K/(64*S*UG) = 4 trips per K slice must be at least NW = 8");
}

// A configuration is checked as a Gemv call runs it: one launch of its chunk of m. NB = 1 takes
// m = 16 as two launches of 8 rows, and NB = 4 takes m = 48 as two of 24 (LaunchRowsFor), so
// both are valid; the rules still apply to that launch.
TEST_F(CliTest, TuneChecksAConfigurationAtItsChunkOfM) {
  env_["GEMVZ_WEIGHT_ORDER"] = "block";  // the configurations as written (4096x8192 is group-major)
  for (const auto& [m, config] : {std::pair<std::string, std::string>{"16", "z12.nw8.ug2.nb1.pipe3.s1"},
                                  {"48", "z12.nw8.ug1.nb4.pipe3.s1"},
                                  {"100", "bf16.nw8.ug1.nb4.pipe2.s1"}}) {
    const Result r = Run({"tune", "--shape=4096x8192", "--m=" + m, "--config=" + config,
                          "--replays=5", "--launches=16", "--rotate_mb=256"});
    // Without a GPU it is validated and compiled; with one, timed and ranked.
    EXPECT_CONTAINS(r.out, HasGpu() ? "1  " + config : config + " for 4096x8192 m=" + m + ": valid")
        << r.err;
    EXPECT_EQ(r.out.find(" is invalid"), std::string::npos) << r.out;
    EXPECT_EQ(r.rc, HasGpu() ? 0 : 1) << r.out << r.err;
  }
  // The tuning file keys one launch's rows: a winner at m = 48 (two launches) is not saved, as
  // --save says before any work; with no m it can save, that is a usage error.
  for (const std::string ms : {"48", "8,48"}) {
    const Result save =
        Run({"tune", "--shape=4096x8192", "--m=" + ms, "--config=z12.nw8.ug1.nb4.pipe3.s1",
             "--save", "--replays=5", "--launches=16", "--rotate_mb=256"});
    const std::string note =
        "--save: m = 48 is not saved: it runs as launches of 24 rows; tune --m=24 to choose";
    EXPECT_CONTAINS(save.err, note);
    EXPECT_LT(save.err.find(note), save.err.find("[tune] compiling")) << save.err;
    if (ms == "48") {
      EXPECT_EQ(save.rc, 2) << save.out << save.err;
      EXPECT_CONTAINS(save.err, "--save: no m asked can be saved");
      EXPECT_EQ(save.out, "");
      EXPECT_FALSE(Exists(dir_ + "/tuning.json"));
    } else {
      EXPECT_EQ(save.rc, HasGpu() ? 0 : 1) << save.out << save.err;
      EXPECT_CONTAINS(save.err, "note: " + note);
      EXPECT_EQ(Exists(dir_ + "/tuning.json"), HasGpu());  // m = 8's winner
    }
  }
  const Result bad = Run({"tune", "--shape=4096x8192", "--m=48",
                          "--config=z12.nw8.ug2.nb4.pipe3.s16"});
  EXPECT_EQ(bad.rc, 2) << bad.err;
  EXPECT_CONTAINS(bad.err, "m24.n4096.k8192");  // the launch the call would make
  EXPECT_CONTAINS(bad.err, "trips per K slice must be at least NW = 8");
}

// 4096x8192's weights are uploaded group-major (the built-in table's order for it on sm_90), so
// the configuration runs, and is saved, as the group-major kernel, and tune says so.
TEST_F(CliTest, TuneOneConfiguration) {
  const Result r =
      Run({"tune", "--shape=4096x8192", "--m=8", "--config=z12.nw8.ug2.nb1.pipe3.s1", "--save",
           "--replays=5", "--launches=16", "--rotate_mb=256", "--json=" + dir_ + "/tune.json"});
  EXPECT_CONTAINS(r.err, "4096x8192's 12-bit weights are uploaded group-major here");
  if (!HasGpu()) {
    // Validated and compiled, then a plain refusal; nothing saved.
    EXPECT_EQ(r.rc, 1) << r.out << r.err;
    EXPECT_CONTAINS(r.out, "z12.nw8.ug2.nb1.pipe3.gm.s1 for 4096x8192 m=8: valid; compiled");
    EXPECT_CONTAINS(r.err, "checking and timing need a GPU");
    EXPECT_CONTAINS(r.err, "nothing was saved");
    EXPECT_CONTAINS(r.err, "no JSON was written");
    EXPECT_FALSE(Exists(dir_ + "/tuning.json"));
    EXPECT_FALSE(Exists(dir_ + "/tune.json"));
    return;
  }
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_CONTAINS(r.out, "dispatcher's choice");
  EXPECT_CONTAINS(r.out, "winner: ");
  EXPECT_CONTAINS(r.out, "saved 1 winner(s)");
  ASSERT_TRUE(Exists(dir_ + "/tuning.json"));
  EXPECT_CONTAINS(ReadAll(dir_ + "/tuning.json"), "4096");
  EXPECT_CONTAINS(ReadAll(dir_ + "/tuning.json"), ".gm.");
  EXPECT_CONTAINS(ReadAll(dir_ + "/tune.json"), "gemvz.tune/1");
}

TEST_F(CliTest, TuneSpaceFileSkipsBadLinesAndInvalidConfigurations) {
  env_["GEMVZ_WEIGHT_ORDER"] = "block";
  {
    std::ofstream space(dir_ + "/space.txt");
    space << "# configurations to try\n"
          << "z12.nw8.ug2.nb1.pipe3.s1   # a comment after a configuration, as in --configs\n"
          << "not-a-config\n"
          << "\n"
          << "z12.nw8.ug2.nb1.pipe3.s16\n";
  }
  // --top=0 prints every ranking line: a value of its range, not a usage error.
  const Result r = Run({"tune", "--shape=4096x8192", "--m=8", "--space=" + dir_ + "/space.txt",
                        "--json=" + dir_ + "/tune.json", "--replays=5", "--launches=16",
                        "--rotate_mb=256", "--top=0"});
  EXPECT_FALSE(absl::StrContains(r.err, "bad --top")) << r.err;
  EXPECT_CONTAINS(r.err, "space.txt:3: skipped");
  // The '#' line and the '#' after a configuration are comments: neither parsed nor reported.
  EXPECT_FALSE(absl::StrContains(r.err, "space.txt:1:")) << r.err;
  EXPECT_FALSE(absl::StrContains(r.err, "space.txt:2:")) << r.err;
  EXPECT_CONTAINS(r.out, "skipped: configuration z12.nw8.ug2.nb1.pipe3.s16");
  if (!HasGpu()) {
    EXPECT_EQ(r.rc, 1) << r.err;
    EXPECT_CONTAINS(r.out, "1 valid configuration(s) compiled or found in the cache for sm_90, 0 failed to compile, 1 invalid");
    EXPECT_FALSE(Exists(dir_ + "/tune.json"));
    return;
  }
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  std::ifstream in(dir_ + "/tune.json");
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_EQ(doc["schema"], "gemvz.tune/1");
  ASSERT_EQ(doc["results"].size(), 1u);
  const nlohmann::json& res = doc["results"][0];
  EXPECT_EQ(res["m"], 8);
  EXPECT_EQ(res["shape"]["n"], 4096);
  ASSERT_EQ(res["candidates"].size(), 2u);
  EXPECT_TRUE(res["candidates"][0]["check_ok"].get<bool>());
  EXPECT_GT(res["candidates"][0]["time_us"].get<double>(), 0);
  EXPECT_GT(res["dispatcher"]["time_us"].get<double>(), 0);  // timed in turn with it
  EXPECT_TRUE(res["candidates"][1].contains("invalid"));
  EXPECT_TRUE(res["winner"].is_object());
}

// A space that lists a configuration twice (spelt alike, spelt otherwise, or alike once in the
// weight order) checks and times it once, where it first comes: each copy was a candidate of its
// own, timed again and ranked against itself.
TEST_F(CliTest, TuneSpaceTimesEachConfigurationOnce) {
  env_["GEMVZ_WEIGHT_ORDER"] = "block";
  gemvz::testing::WriteAll(dir_ + "/space.txt",
                           "z12.nw8.ug2.nb1.pipe3.s1\n"
                           "z12.nw4.ug1.nb1.pipe0\n"
                           "z12.nw8.ug2.nb1.pipe3         # .s1 is the default\n"
                           "z12.nw8.ug2.nb1.pipe3.gm.s1   # runs block-major here\n"
                           "z12.nw8.ug2.nb1.pipe3.s16\n"
                           "z12.nw8.ug2.nb1.pipe3.s16\n"
                           "z12.nw4.ug1.nb1.pipe0.s1\n");
  const Result r = Run({"tune", "--shape=4096x8192", "--m=8", "--space=space.txt",
                        "--json=" + dir_ + "/tune.json", "--replays=5", "--launches=16",
                        "--rotate_mb=256", "--top=0"});
  auto count = [](const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count(r.out, "skipped: configuration z12.nw8.ug2.nb1.pipe3.s16"), 1) << r.out;
  if (!HasGpu()) {
    EXPECT_EQ(r.rc, 1) << r.out << r.err;
    EXPECT_CONTAINS(r.out,
                    "2 valid configuration(s) compiled or found in the cache for sm_90, 0 failed "
                    "to compile, 1 invalid");
    return;
  }
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  std::ifstream in(dir_ + "/tune.json");
  const nlohmann::json doc = nlohmann::json::parse(in);
  ASSERT_EQ(doc["results"].size(), 1u);
  std::vector<std::string> configs;
  for (const nlohmann::json& c : doc["results"][0]["candidates"]) configs.push_back(c["config"]);
  EXPECT_EQ(configs,
            (std::vector<std::string>{"z12.nw8.ug2.nb1.pipe3.s1", "z12.nw4.ug1.nb1.pipe0.s1",
                                      "z12.nw8.ug2.nb1.pipe3.s16"}));
}

// warmup's --configs and tune's --space files may start with a UTF-8 byte order mark, as some
// editors save them: it is skipped, not read as part of the first configuration.
TEST_F(CliTest, ConfigurationFilesMayStartWithAByteOrderMark) {
  gemvz::testing::WriteAll(dir_ + "/bom.txt", "\xEF\xBB\xBFz12.nw4.ug1.nb1.pipe0\n");
  const Result warmup = Run({"warmup", "--arch=sm_90", "--configs=bom.txt"});
  EXPECT_EQ(warmup.rc, 0) << warmup.out << warmup.err;
  EXPECT_CONTAINS(warmup.out, "z12.nw4.ug1.nb1.pipe0");
  EXPECT_FALSE(absl::StrContains(warmup.err, "bom.txt:1:")) << warmup.err;
  env_["GEMVZ_WEIGHT_ORDER"] = "block";
  const Result tune = Run({"tune", "--shape=4096x4096", "--m=1", "--space=bom.txt", "--replays=5",
                           "--launches=16", "--rotate_mb=256"});
  EXPECT_FALSE(absl::StrContains(tune.err, "bom.txt:1:")) << tune.err;
  EXPECT_EQ(tune.rc, HasGpu() ? 0 : 1) << tune.out << tune.err;
  if (!HasGpu()) {
    EXPECT_CONTAINS(tune.out, "1 valid configuration(s) compiled or found in the cache");
  }
}

// A configuration list with no end (/dev/zero, an endless pipe on standard input) is refused at
// 16 MiB, naming what it read, not read until memory runs out (2 GB of address space here).
TEST_F(CliTest, ConfigurationListsOfNoEndAreRefusedNotReadUntilMemoryRunsOut) {
  const std::string limit = "ulimit -v 2000000";
  const Result file = Run({"warmup", "--arch=sm_90", "--configs=/dev/zero"}, limit);
  EXPECT_EQ(file.rc, 2) << file.out << file.err;
  EXPECT_CONTAINS(file.err, "'/dev/zero' holds more than 16777216 bytes");
  const Result in = Run({"warmup", "--arch=sm_90", "--configs=-"}, limit + " && exec < /dev/zero");
  EXPECT_EQ(in.rc, 2) << in.out << in.err;
  EXPECT_CONTAINS(in.err, "'<stdin>' holds more than 16777216 bytes");
  const Result tune = Run({"tune", "--shape=4096x4096", "--m=1", "--space=/dev/zero"}, limit);
  EXPECT_EQ(tune.rc, 2) << tune.out << tune.err;
  EXPECT_CONTAINS(tune.err, "--space: '/dev/zero' holds more than 16777216 bytes");
}

// A --configs file may be a pipe, read as `cat` reads one: a FIFO whose writer comes later is
// waited for (open blocks until a writer opens it, as it must for the writer to be found; Ctrl-C
// or SIGTERM ends the wait), and /dev/stdin on a pipe (`<(...)` in bash names one as
// /dev/fd/63) is read even once its writer is gone. Opened without waiting (O_NONBLOCK), the
// FIFO would read as empty: "no configurations in it".
TEST_F(CliTest, ConfigurationListsAreReadFromPipesAndFifos) {
  const Result fifo =
      Run({"warmup", "--arch=sm_90", "--configs=c.fifo"},
          // The writer gives up after a while, and holds none of the test's output open: were
          // the FIFO read as empty, nothing would ever open it for reading.
          "mkfifo c.fifo && { (sleep 1; exec timeout 20 sh -c \"printf 'z12.nw4.ug1.nb1.pipe0\\n' "
          "> c.fifo\") < /dev/null > /dev/null 2>&1 & }");
  EXPECT_EQ(fifo.rc, 0) << fifo.out << fifo.err;
  EXPECT_CONTAINS(fifo.out, "z12.nw4.ug1.nb1.pipe0");
  std::string cmd =
      absl::StrCat("cd ", Quote(dir_), " && printf 'z12.nw4.ug1.nb1.pipe0\\n' | { sleep 1; env");
  for (const auto& [k, v] : env_) absl::StrAppend(&cmd, " ", k, "=", Quote(v));
  absl::StrAppend(&cmd, " ", Quote(GEMVZ_TOOL_PATH),
                  " warmup --arch=sm_90 --configs=/dev/stdin > stdout 2> stderr; }");
  const int status = std::system(cmd.c_str());
  const std::string out = ReadAll(dir_ + "/stdout"), err = ReadAll(dir_ + "/stderr");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << out << err;
  EXPECT_CONTAINS(out, "z12.nw4.ug1.nb1.pipe0");
}

// Standard input that cannot be read (a directory) is named with the reason, not taken for an
// empty list.
TEST_F(CliTest, UnreadableStandardInputSaysWhy) {
  const Result in = Run({"warmup", "--arch=sm_90", "--configs=-"}, "exec < /");
  EXPECT_EQ(in.rc, 2) << in.out << in.err;
  EXPECT_CONTAINS(in.err, "cannot read '<stdin>': Is a directory");
  EXPECT_EQ(in.err.find("no configurations"), std::string::npos) << in.err;
}

// A kernel that fails to compile costs only itself: the others are compiled in parallel with their
// progress, and the failing one is compiled once, not again with the rest one by one. Spills are
// errors here, and this bf16 kernel spills on sm_80.
TEST_F(CliTest, TuneCompilesPastAFailedKernel) {
  env_["GEMVZ_NVRTC_OPTIONS"] =
      "--ptxas-options=--warn-on-spills --ptxas-options=--warning-as-error";
  env_["GEMVZ_WEIGHT_ORDER"] = "block";
  env_["GEMVZ_LOG"] = "1";
  gemvz::testing::WriteAll(dir_ + "/space.txt",
                           "bf16.nw32.ug1.nb1.pipe2\nz12.nw2.ug1.nb1.pipe0\nz12.nw4.ug1.nb1.pipe0\n"
                           "z12.nw4.ug2.nb1.pipe0\nz12.nw8.ug1.nb1.pipe0\n");
  const Result r = Run({"tune", "--shape=4096x4096", "--m=1", "--space=space.txt", "--j=2",
                        "--arch=sm_80", "--replays=5", "--launches=16", "--rotate_mb=256"});
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_CONTAINS(r.out, "compile FAILED");
  EXPECT_CONTAINS(r.out, "bf16.nw32.ug1.nb1.pipe2.s1");
  for (const std::string& good : {"z12.nw2.ug1.nb1.pipe0", "z12.nw4.ug1.nb1.pipe0",
                                  "z12.nw4.ug2.nb1.pipe0", "z12.nw8.ug1.nb1.pipe0"}) {
    EXPECT_CONTAINS(r.err, "/5 " + good + ": ");  // its progress line
  }
  const std::string miss = "jit: miss bf16.nw32.ug1.nb1.pipe2 for sm_80";
  size_t misses = 0;
  for (size_t at = r.err.find(miss); at != std::string::npos; at = r.err.find(miss, at + 1)) {
    ++misses;
  }
  EXPECT_EQ(misses, 1u) << r.err;
  if (!HasGpu()) {
    EXPECT_CONTAINS(r.out,
                    "4 valid configuration(s) compiled or found in the cache for sm_80, 1 "
                    "failed to compile");
  }
}

// A sweep with nothing valid to try for any shape and m asked is a usage error before any work, as
// a --config that fits none is (with a GPU it timed the dispatcher's choices alone, status 0).
TEST_F(CliTest, TuneSweepWithNothingValidToTryIsAUsageError) {
  gemvz::testing::WriteAll(dir_ + "/space.txt", "z12.nw8.ug2.nb1.pipe3.s16\n");
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"tune", "--shape=4100x8192", "--m=1,8", "--sweep"},
       "nothing to try: --sweep (--sweep_format=z12) has no configuration valid for any shape"},
      {{"tune", "--shape=1x64", "--sweep", "--sweep_format=bf16"},
       "nothing to try: --sweep (--sweep_format=bf16) has no configuration valid"},
      {{"tune", "--shape=4096x8192", "--m=8", "--space=space.txt"},
       "nothing to try: --space space.txt has no configuration valid"},
  };
  for (const auto& c : cases) {
    const Result r = Run(c.args);
    EXPECT_EQ(r.rc, 2) << absl::StrJoin(c.args, " ") << ": " << r.out << r.err;
    EXPECT_CONTAINS(r.err, c.message);
    EXPECT_EQ(r.out, "") << absl::StrJoin(c.args, " ");
  }
}

// --save's tuning file is checked before any work, not after all the timing: none at all, a
// directory, one under a plain file, or one of a newer gemvz is a usage error; one whose
// directories are still to be made is fine (the save makes them).
TEST_F(CliTest, TuneSaveChecksItsTuningFileBeforeAnyWork) {
  const std::vector<std::string> args = {
      "tune",   "--shape=4096x4096", "--m=1",         "--config=z12.nw4.ug1.nb1.pipe0.s1",
      "--save", "--replays=5",       "--launches=16", "--rotate_mb=256"};
  ASSERT_EQ(mkdir((dir_ + "/adir").c_str(), 0755), 0);
  gemvz::testing::WriteAll(dir_ + "/plain", "x");
  gemvz::testing::WriteAll(dir_ + "/newer.json", "{\"version\": 99, \"entries\": []}");
  const struct {
    std::string file;  // "": none, with the disk cache disabled
    std::string message;
  } cases[] = {
      {"", "--save: no tuning file to write: the disk cache is disabled"},
      {dir_ + "/adir",
       "--save: cannot write the tuning file '" + dir_ + "/adir': it is a directory"},
      {dir_ + "/plain/sub/tuning.json", "'" + dir_ + "/plain' is not a directory"},
      {dir_ + "/newer.json", "schema version 99 is newer"},
  };
  for (const auto& c : cases) {
    env_["GEMVZ_TUNING_FILE"] = c.file;  // empty is unset
    env_["GEMVZ_DISABLE_DISK_CACHE"] = c.file.empty() ? "1" : "0";
    const Result r = Run(args);
    EXPECT_EQ(r.rc, 2) << c.file << ": " << r.out << r.err;
    EXPECT_CONTAINS(r.err, c.message);
    EXPECT_EQ(r.out, "") << c.file;  // nothing compiled
  }
  EXPECT_FALSE(Exists(dir_ + "/plain/sub"));
  env_["GEMVZ_TUNING_FILE"] = dir_ + "/new/sub/tuning.json";
  const Result r = Run(args);
  EXPECT_EQ(r.rc, HasGpu() ? 0 : 1) << r.out << r.err;
  EXPECT_FALSE(absl::StrContains(r.err, "--save:")) << r.err;
  EXPECT_EQ(Exists(dir_ + "/new/sub/tuning.json"), HasGpu());
}

// An empty entry of --zero_rows is a usage error, as an empty flag value is, not skipped.
TEST_F(CliTest, AnEmptyZeroRowsEntryIsAUsageError) {
  for (const std::string rows : {"5,,6", ",,", "5,", ",5"}) {
    for (const char* name : {"bench", "tune"}) {
      const Result r = Run(Args(name, {"--zero_rows=" + rows}));
      EXPECT_EQ(r.rc, 2) << name << " --zero_rows=" << rows << ": " << r.err;
      EXPECT_CONTAINS(r.err, "bad --zero_rows entry ''");
    }
  }
}

// GEMVZ_FORCE_CONFIG is process-wide: the demo plans it, as Gemv runs it, in each matrix's weight
// order (on sm_90 4096x8192 is uploaded group-major, 6144x4096 block-major).
// An output file may not replace another file of the same command line: usage errors, before
// any work, and the file as it was (pack's inputs and outputs: checkpoint_test).
TEST_F(CliTest, AnOutputThatWouldReplaceAnotherFileOfTheCommandIsAUsageError) {
  const std::string configs = "z12.nw8.ug2.nb1.pipe3\n";
  gemvz::testing::WriteAll(dir_ + "/configs.txt", configs);
  gemvz::testing::WriteAll(dir_ + "/space.txt", configs);
  gemvz::testing::WriteAll(dir_ + "/tuning.json", "{}");
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"warmup", "--configs=configs.txt", "--json=configs.txt"},
       "--json=configs.txt is the --configs file"},
      {{"warmup", "--configs=configs.txt", "--json=./configs.txt"},
       "--json=./configs.txt is the --configs file"},
      {{"tune", "--space=space.txt", "--json=space.txt"}, "--json=space.txt is the --space file"},
      {{"tune", "--config=z12.nw8.ug2.nb1.pipe3.s1", "--save", "--json=tuning.json"},
       "--json=tuning.json is the tuning file that --save writes"},
      {{"bench", "--json=r.json", "--plot=./r.json"}, "--plot=./r.json is the --json file"},
  };
  for (const auto& c : cases) {
    const Result r = Run(c.args);
    EXPECT_EQ(r.rc, 2) << absl::StrJoin(c.args, " ") << ": " << r.err;
    EXPECT_CONTAINS(r.err, c.message);
    EXPECT_FALSE(absl::StrContains(r.out, "compiled")) << r.out;
  }
  EXPECT_EQ(ReadAll(dir_ + "/configs.txt"), configs);
  EXPECT_EQ(ReadAll(dir_ + "/space.txt"), configs);
  EXPECT_EQ(ReadAll(dir_ + "/tuning.json"), "{}");
  EXPECT_FALSE(Exists(dir_ + "/r.json"));
}

// Every --json report written is announced on stdout as "wrote FILE", as bench, tune and warmup
// say it: cache list and pack wrote theirs in silence.
TEST_F(CliTest, JsonReportsSayWhereTheyWereWritten) {
  const Result list = Run({"cache", "list", "--json=list.json"});
  EXPECT_EQ(list.rc, 0) << list.out << list.err;
  EXPECT_TRUE(Exists(dir_ + "/list.json"));
  EXPECT_TRUE(absl::EndsWith(list.out, "\nwrote list.json\n")) << list.out;

  const std::string header = R"({"w":{"dtype":"BF16","shape":[16,64],"data_offsets":[0,2048]}})";
  std::string file;
  for (int i = 0; i < 8; ++i) file += static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  file += header + std::string(2048, '\x3f');
  gemvz::testing::WriteAll(dir_ + "/in.safetensors", file);
  const Result pack = Run({"pack", "in.safetensors", "-o", "packed", "--json=pack.json"});
  EXPECT_EQ(pack.rc, 0) << pack.out << pack.err;
  EXPECT_TRUE(Exists(dir_ + "/pack.json"));
  EXPECT_TRUE(absl::EndsWith(pack.out, "\nwrote pack.json\n")) << pack.out;
}

// Each write prunes the cache to its cap: a cap too small for a warm-up's kernels evicts some of
// them, and the warm-up, whose job is to leave them all there, fails saying so.
TEST_F(CliTest, WarmupFailsWhenTheCacheCapCannotHoldItsKernels) {
  const std::vector<std::string> args = {"warmup",
                                         "z12.nw8.ug2.nb1.pipe3",
                                         "bf16.nw4.ug2.nb1.pipe3",
                                         "z12.nw16.ug1.nb1.pipe2",
                                         "--arch=sm_90",
                                         "--j=2"};
  env_["GEMVZ_CACHE_MAX_BYTES"] = "100K";  // each entry is 40-90 KiB
  const Result small = Run(args);
  EXPECT_EQ(small.rc, 1) << small.out << small.err;
  EXPECT_CONTAINS(small.out, "of 3 kernels are no longer in " + dir_ + "/cache");
  EXPECT_CONTAINS(small.out, "evicted by its size cap, 102400 bytes");
  env_.erase("GEMVZ_CACHE_MAX_BYTES");
  const Result fits = Run(args);
  EXPECT_EQ(fits.rc, 0) << fits.out << fits.err;
  EXPECT_CONTAINS(fits.out, "cache: " + dir_ + "/cache");
  const Result again = Run(args);
  EXPECT_EQ(again.rc, 0) << again.out << again.err;
  EXPECT_CONTAINS(again.out, "(all hits)");
}

// Settings that would otherwise be ignored, or taken in a way the user did not mean.
TEST_F(CliTest, FlagsAndVariablesThatWouldBeIgnoredAreUsageErrors) {
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"cache", "verify", "--json=v.json"}, "--json is for 'gemvz cache list', not 'verify'"},
      {{"cache", "dir", "--json=v.json"}, "--json is for 'gemvz cache list', not 'dir'"},
      {{"cache", "clear", "--cache_remove_bad"},
       "--cache_remove_bad is for 'gemvz cache verify', not 'clear'"},
      {{"cache", "list", "--cache_max_bytes=1G"},
       "--cache_max_bytes is for 'gemvz cache prune', not 'list'"},
      {{"demo", "--quick", "--shape=64x64"}, "--quick and --shape both choose the shapes"},
      {{"tune", "--space=space.txt", "--sweep_format=bf16"},
       "--sweep_format chooses what --sweep explores"},
      {{"tune", "--space=space.txt", "--sweep_format=z12"},  // its default, given all the same
       "--sweep_format chooses what --sweep explores"},
      {{"tune", "--space=space.txt", "--sweep", "--sweep_format=bf16"},  // --space's list wins
       "--sweep_format chooses what --sweep explores"},
      {{"cache", "list", "--cache_remove_bad=false"},
       "--cache_remove_bad is for 'gemvz cache verify', not 'list'"},
      {{"demo", "--device=-1"}, "bad --device=-1: expected a GPU ordinal, 0 or more"},
      {{"bench", "--device=-1"}, "bad --device=-1: expected a GPU ordinal, 0 or more"},
      {{"tune", "--config=z12.nw8.ug2.nb1.pipe3.s1", "--device=-2"}, "bad --device=-2"},
  };
  gemvz::testing::WriteAll(dir_ + "/space.txt", "z12.nw8.ug2.nb1.pipe3\n");
  for (const auto& c : cases) {
    const Result r = Run(c.args);
    EXPECT_EQ(r.rc, 2) << absl::StrJoin(c.args, " ") << ": " << r.err;
    EXPECT_CONTAINS(r.err, c.message);
  }
  EXPECT_FALSE(Exists(dir_ + "/v.json"));
  // A configuration Gemv would refuse for a shape is refused by the demo before it packs, as is
  // a bad GEMVZ_WEIGHT_ORDER: the environment's mistakes are usage errors, as in tune.
  env_["GEMVZ_FORCE_CONFIG"] = "z12.nw8.ug2.nb1.pipe3.s64";
  Result r = Run({"demo", "--shape=4096x4096"});
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_CONTAINS(r.err,
                  "GEMVZ_FORCE_CONFIG=z12.nw8.ug2.nb1.pipe3.s64 cannot run 4096x4096 at "
                  "m = 1: configuration z12.nw8.ug2.nb1.pipe3.s64");
  EXPECT_CONTAINS(r.err, "K must be divisible by 64*S*UG = 8192");
  EXPECT_FALSE(absl::StrContains(r.out, "1. Pack")) << r.out;
  env_.erase("GEMVZ_FORCE_CONFIG");
  env_["GEMVZ_WEIGHT_ORDER"] = "sideways";
  r = Run({"demo", "--quick"});
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_CONTAINS(r.err, "GEMVZ_WEIGHT_ORDER must be block, group or auto, not 'sideways'");
  env_.erase("GEMVZ_WEIGHT_ORDER");
  // A cache "directory" that is a file is no cache: `cache dir` says so, as `list` does.
  gemvz::testing::WriteAll(dir_ + "/afile", "");
  env_["GEMVZ_CACHE_DIR"] = dir_ + "/afile";
  r = Run({"cache", "dir"});
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_CONTAINS(r.err, "the cache directory '" + dir_ + "/afile' is not a directory");
  // Nor is a path that cannot be looked up (it printed the path and exited 0): a symlink loop, a
  // file as a parent. A directory yet to be made is fine.
  ASSERT_EQ(::symlink((dir_ + "/loop").c_str(), (dir_ + "/loop").c_str()), 0) << strerror(errno);
  for (const std::string& bad : {dir_ + "/loop", dir_ + "/afile/sub"}) {
    env_["GEMVZ_CACHE_DIR"] = bad;
    r = Run({"cache", "dir"});
    EXPECT_EQ(r.rc, 1) << bad << ": " << r.out;
    EXPECT_CONTAINS(r.err, "the cache directory '" + bad + "' cannot be looked up: ");
    EXPECT_EQ(r.out, "") << bad;
  }
  env_["GEMVZ_CACHE_DIR"] = dir_ + "/not/yet";
  r = Run({"cache", "dir"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, dir_ + "/not/yet\n");
  // A GEMVZ_LOG that is no level does not silence the warnings (atoi made -1 hide them all).
  env_["GEMVZ_CACHE_DIR"] = dir_ + "/cache";
  env_["GEMVZ_CACHE_MAX_BYTES"] = "lots";
  for (const char* level : {"-1", "debug", "99999999999999999999"}) {
    env_["GEMVZ_LOG"] = level;
    r = Run({"cache", "prune"});
    EXPECT_EQ(r.rc, 0) << level << ": " << r.err;
    EXPECT_CONTAINS(r.err, absl::StrCat("GEMVZ_LOG='", level, "' is not a level"));
    EXPECT_CONTAINS(r.err, "GEMVZ_CACHE_MAX_BYTES: bad byte size 'lots'");
  }
}

// Host memory running out ends a command with a message and exit 1, not an abort.
TEST_F(CliTest, RunningOutOfHostMemoryIsReportedNotAnAbort) {
  // 65536 x 65536 BF16 weights are 8 GiB: more than the 4 GiB of address space allowed here.
  const Result r = Run({"demo", "--shape=65536x65536", "--j=1"}, "ulimit -v 4000000");
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_CONTAINS(r.err,
                  "gemvz demo: out of host memory: an allocation failed, so it stopped here");
  EXPECT_FALSE(absl::StrContains(r.err, "terminate called")) << r.err;
}

// Packing a tensor too large for the memory left names the file and the tensor (it said only
// "out of host memory"), and leaves no output behind. The input is a sparse file of zeros: 2 GiB
// of the address space once mapped, and packing it needs about 1.5 GiB more than the 2.8 GB
// allowed here.
TEST_F(CliTest, PackRunningOutOfHostMemoryNamesTheFileAndTensor) {
  const int64_t rows = 32768, cols = 32768;
  const std::string header = absl::StrCat(R"({"w":{"dtype":"BF16","shape":[)", rows, ",", cols,
                                          R"(],"data_offsets":[0,)", rows * cols * 2, "]}}");
  const std::string input = dir_ + "/big.safetensors";
  {
    std::ofstream f(input, std::ios::binary);
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xFF));
    f << header;
    ASSERT_TRUE(f.good());
  }
  ASSERT_EQ(::truncate(input.c_str(), static_cast<off_t>(8 + header.size() + rows * cols * 2)), 0);
  const Result r = Run({"pack", input, "-o", "out", "--j=1"}, "ulimit -v 2800000");
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_CONTAINS(r.err, "gemvz pack: '" + input +
                             "', tensor 'w' [32768, 32768]: out of host memory while packing it");
  EXPECT_FALSE(absl::StrContains(r.err, "terminate called")) << r.err;
  EXPECT_FALSE(Exists(dir_ + "/out"));
  ASSERT_EQ(::unlink(input.c_str()), 0);
}

TEST_F(CliTest, DemoPlansAForcedConfigurationInEachMatrixOrder) {
  env_["GEMVZ_FORCE_CONFIG"] = "z12.nw8.ug2.nb1.pipe3.s1";
  env_["GEMVZ_ARCH"] = "sm_90";
  const Result r = Run({"demo", "--quick", "--replays=5", "--launches=16", "--rotate_mb=256"});
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  bool group = false, block = false;
  for (const absl::string_view line : absl::StrSplit(r.out, '\n')) {
    group = group || (absl::StartsWith(line, "z12.nw8.ug2.nb1.pipe3.gm ") &&
                      absl::StrContains(line, "4096x8192 m1"));
    block = block || (absl::StartsWith(line, "z12.nw8.ug2.nb1.pipe3 ") &&
                      absl::StrContains(line, "6144x4096 m1"));
  }
  EXPECT_TRUE(group) << r.out;
  EXPECT_TRUE(block) << r.out;
}

TEST_F(CliTest, DemoQuick) {
  const Result r = Run({"demo", "--quick", "--replays=5", "--launches=16", "--rotate_mb=256"});
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_CONTAINS(r.out, "4096x8192");
  EXPECT_CONTAINS(r.out, "6144x4096");
  EXPECT_EQ(r.out.find("4096x4096"), std::string::npos) << "--quick packs two shapes only";
  EXPECT_CONTAINS(r.out, "bit-exact");
  EXPECT_EQ(r.out.find("FAILED"), std::string::npos) << r.out;
  EXPECT_CONTAINS(r.out, "z12.nw");  // the kernel table
  EXPECT_CONTAINS(r.err, "[demo]");  // progress goes to stderr
  if (!HasGpu()) {
    EXPECT_CONTAINS(r.out, "skipped (no GPU: ");
    EXPECT_CONTAINS(r.out, "running Gemv at m = 1, 8, 16");
    EXPECT_CONTAINS(r.out, "speed table against cuBLAS");
  } else {
    EXPECT_CONTAINS(r.out, "demo: everything is right.");
    EXPECT_CONTAINS(r.out, "geometric mean");
  }
}

TEST_F(CliTest, DemoCompilesColdThenFindsTheDiskCache) {
  const Result cold = Run({"demo", "--shape=4096x4096", "--replays=3", "--launches=8",
                           "--rotate_mb=128"});
  ASSERT_EQ(cold.rc, 0) << cold.out << cold.err;
  EXPECT_CONTAINS(cold.out, "from the disk cache");
  EXPECT_CONTAINS(cold.out, "nvrtc");
  const Result warm = Run({"demo", "--shape=4096x4096", "--replays=3", "--launches=8",
                           "--rotate_mb=128"});
  ASSERT_EQ(warm.rc, 0) << warm.out << warm.err;
  EXPECT_CONTAINS(warm.out, " 0 compiled");
  EXPECT_EQ(warm.out.find("nvrtc"), std::string::npos) << warm.out;
}

TEST_F(CliTest, BenchNeedsAGpuOrWritesTheDocumentedJson) {
  const std::string json = dir_ + "/bench.json";
  const Result r = Run({"bench", "--shape=1024x2048", "--m=1,16", "--json=" + json,
                        "--replays=3", "--launches=8", "--rotate_mb=128", "--commit=cafe"});
  if (!HasGpu()) {
    EXPECT_EQ(r.rc, 1) << r.out << r.err;
    EXPECT_CONTAINS(r.err, "a GPU is needed to benchmark");
    EXPECT_CONTAINS(r.err, "no JSON was written");
    EXPECT_FALSE(Exists(json));
    return;
  }
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  std::ifstream in(json);
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_EQ(doc["schema"], "gemvz.bench/1");
  EXPECT_EQ(doc["commit"], "cafe");
  EXPECT_FALSE(doc["gpu"]["name"].get<std::string>().empty());
  ASSERT_EQ(doc["cases"].size(), 2u);
  for (const nlohmann::json& c : doc["cases"]) {
    for (const char* path : {"z12", "plain", "cublas", "probe", "probe_z12"}) {
      EXPECT_GT(c["paths"][path]["time_us"].get<double>(), 0) << path;
    }
    // Both probes name the fastest of the read kernel's forms.
    for (const char* path : {"probe", "probe_z12"}) {
      const std::string kernel = c["paths"][path]["kernel"].get<std::string>();
      const std::vector<gemvz::cli::ProbeForm>& forms = gemvz::cli::ProbeForms();
      EXPECT_TRUE(std::any_of(forms.begin(), forms.end(),
                              [&](const gemvz::cli::ProbeForm& f) { return f.Name() == kernel; }))
          << path << ": " << kernel;
    }
    // The bound's probe reads the packed weights' bytes: fewer than the BF16 probe's.
    EXPECT_LT(c["paths"]["probe_z12"]["bytes"].get<int64_t>(),
              c["paths"]["probe"]["bytes"].get<int64_t>());
    EXPECT_GT(c["bound_vs_cublas"].get<double>(), 0);
    EXPECT_TRUE(c["ok"].get<bool>());
  }
  EXPECT_TRUE(doc["ok"].get<bool>());
}

// An attribute of GPU 0; 0 if the driver does not say.
int DeviceAttribute(CUdevice_attribute attribute) {
  absl::StatusOr<const gemvz::internal::DriverApi*> drv = gemvz::internal::Driver();
  CUdevice dev = 0;
  int value = 0;
  if (!drv.ok() || (*drv)->cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      (*drv)->cuDeviceGetAttribute(&value, attribute, dev) != CUDA_SUCCESS) {
    return 0;
  }
  return value;
}

// The peak DRAM bandwidth of GPU 0 from its attributes (2 transfers a clock over the bus), in
// TB/s; 0 if the driver does not say.
double PeakDramTbps() {
  const int khz = DeviceAttribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
  const int bits = DeviceAttribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
  return 2.0 * khz * 1e3 * (bits / 8) / 1e12;
}

// What docs/CLI.md says of each number of a bench case, on a shape whose BF16 copy (64 MiB) is
// above the 60 MB L2: bytes z12 = packed weights + side tables (what Pack counts) + x + out,
// BF16 = 2 N K + x + out, the probes 2 N K and the packed bytes (whole 16-byte units); each
// path's copies as many as reach --rotate_mb (at least 2), launches per replay the fewest whole
// rotations of at least --launches. And what physics allows: with the copies rotating above L2
// no path moves its bytes faster than the DRAM's peak (a slower GPU, busy with other tests, only
// moves further from it); plain BF16 and cuBLAS move at least the probe's bytes, and z12 at
// least the bound's, so none is well above 100 % of them; the probe over all 2 N K bytes streams
// at about the pace of the same kernel over the packed bytes' prefix. Those three compare paths
// timed in turn, replay by replay, so a busy GPU slows both sides alike (measured on the H200
// beside two processes that kept it at 100 %: every time about 11 % longer, the ratios within a
// point of an idle GPU's, 15 % or more inside their limits). On a GPU with too little free memory
// for the copies bench makes fewer, and says so: the test skips.
TEST_F(CliTest, BenchCountsBytesCopiesAndLaunchesAsDocumentedAndStaysPhysical) {
  if (!HasGpu()) GTEST_SKIP() << "no GPU: bench refuses (BenchNeedsAGpuOrWritesTheDocumentedJson)";
  constexpr int64_t kN = 4096, kK = 8192, kRotateMiB = 256, kLaunches = 10;
  const std::string json = dir_ + "/bench.json";
  const Result r = Run({"bench", "--shape=4096x8192", "--m=1,8", "--json=" + json,
                        "--replays=15", "--launches=" + std::to_string(kLaunches),
                        "--rotate_mb=" + std::to_string(kRotateMiB), "--seed=7"});
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  if (r.out.find("fit in free GPU memory") != std::string::npos ||
      r.err.find("fit in free GPU memory") != std::string::npos) {
    GTEST_SKIP() << "too little free GPU memory for --rotate_mb=" << kRotateMiB << ": " << r.err;
  }
  std::ifstream in(json);
  const nlohmann::json doc = nlohmann::json::parse(in);
  ASSERT_TRUE(doc["ok"].get<bool>());
  const int64_t rotate = doc["settings"]["rotate_bytes"].get<int64_t>();
  EXPECT_EQ(rotate, kRotateMiB << 20);
  const int64_t l2 = DeviceAttribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  ASSERT_GT(l2, 0) << "the GPU's L2 size could not be read";
  EXPECT_GE(rotate, 2 * l2) << "the test's premise: each path's copies exceed the L2 twice";

  // The packed weights' bytes, from the same weights (the seed, the shape) packed here.
  absl::StatusOr<gemvz::cli::MatrixShape> shape = gemvz::cli::ParseShape("4096x8192");
  ASSERT_TRUE(shape.ok());
  const std::vector<uint16_t> w =
      gemvz::cli::NormalBf16(kN * kK, 1.0 / std::sqrt(static_cast<double>(kK)),
                             gemvz::cli::WeightSeed(doc["settings"]["seed"].get<uint64_t>(), *shape),
                             0);
  absl::StatusOr<gemvz::PackedMatrix> packed = gemvz::Pack(w.data(), kN, kK);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const int64_t packed_bytes = packed->stats.total_bytes;
  const int64_t bf16_bytes = 2 * kN * kK;
  ASSERT_LT(packed_bytes, bf16_bytes);
  auto copies_for = [&](int64_t bytes) {
    return std::max<int64_t>(2, (rotate + bytes - 1) / bytes);
  };

  const double peak = PeakDramTbps();
  ASSERT_GT(peak, 0) << "the GPU's memory clock and bus width could not be read";
  const double fastest = 1.25 * peak;  // a margin for x and out, which stay in L2
  ASSERT_EQ(doc["cases"].size(), 2u);
  for (const nlohmann::json& c : doc["cases"]) {
    const int64_t m = c["m"].get<int64_t>();
    SCOPED_TRACE("m = " + std::to_string(m));
    const int64_t io = 2 * m * kK + 2 * m * kN;
    const nlohmann::json& p = c["paths"];
    EXPECT_EQ(c["dispatch"]["weight_format"], "z12");
    EXPECT_EQ(p["z12"]["bytes"].get<int64_t>(), packed_bytes + io);
    EXPECT_EQ(p["plain"]["bytes"].get<int64_t>(), bf16_bytes + io);
    EXPECT_EQ(p["cublas"]["bytes"].get<int64_t>(), bf16_bytes + io);
    EXPECT_EQ(p["probe"]["bytes"].get<int64_t>(), bf16_bytes);
    EXPECT_EQ(p["probe_z12"]["bytes"].get<int64_t>(), packed_bytes / 16 * 16);

    const nlohmann::json& rot = c["rotation"];
    for (const auto& [kind, bytes] : {std::pair<const char*, int64_t>{"z12", packed_bytes},
                                      {"bf16", bf16_bytes}}) {
      const int64_t copies = rot[std::string("copies_") + kind].get<int64_t>();
      const int64_t launches = rot[std::string("launches_") + kind].get<int64_t>();
      EXPECT_EQ(copies, copies_for(bytes)) << kind << ": " << bytes << " bytes a copy";
      EXPECT_GE(copies * bytes, rotate) << kind;
      EXPECT_EQ(launches % copies, 0) << kind << ": " << launches << " launches, " << copies
                                      << " copies: not whole rotations";
      EXPECT_GE(launches, kLaunches) << kind;
      EXPECT_LT(launches, kLaunches + copies) << kind << ": more rotations than --launches needs";
    }

    for (const char* path : {"z12", "plain", "cublas", "probe", "probe_z12"}) {
      const double us = p[path]["time_us"].get<double>();
      ASSERT_GT(us, 0) << path;
      const double tbps = p[path]["bytes"].get<int64_t>() / (us * 1e-6) / 1e12;
      EXPECT_NEAR(p[path]["tbps"].get<double>(), tbps, 1e-9 * tbps) << path;
      EXPECT_LE(tbps, fastest) << path << " moved " << p[path]["bytes"] << " bytes in " << us
                               << " us, faster than the DRAM's peak of " << peak << " TB/s";
    }
    for (const char* path : {"plain", "cublas"}) {
      EXPECT_LE(p[path]["pct_of_ceiling"].get<double>(), 110.0)
          << path << " read its 2 N K bytes well faster than the probe: " << p[path]["time_us"]
          << " us against the probe's " << p["probe"]["time_us"];
    }
    EXPECT_LE(c["pct_of_bound"].get<double>(), 110.0)
        << "z12 read its bytes well faster than the probe: " << p["z12"]["time_us"]
        << " us against " << p["probe_z12"]["time_us"];
    EXPECT_LE(c["ceiling_tbps"].get<double>(), 1.2 * p["probe_z12"]["tbps"].get<double>())
        << "the probe over 2 N K bytes (" << p["probe"]["time_us"]
        << " us) streams far faster than over the packed bytes' prefix ("
        << p["probe_z12"]["time_us"] << " us): it reads fewer bytes than it counts";
    EXPECT_TRUE(c["ok"].get<bool>());
  }
}

// A matrix whose copies would number more than 1024 to reach --rotate_mb gets 1024, and bench
// says that it reads less than asked (perhaps from L2); one that needs fewer gets no such note.
TEST_F(CliTest, BenchSaysWhenItsCopiesFallShortOfRotateMb) {
  if (!HasGpu()) GTEST_SKIP() << "no GPU: bench refuses (BenchNeedsAGpuOrWritesTheDocumentedJson)";
  const std::string json = dir_ + "/small.json";
  const Result r = Run({"bench", "--shape=64x128", "--m=1", "--replays=3", "--launches=4",
                        "--rotate_mb=64", "--json=" + json});
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_CONTAINS(r.err, "1024 copies of");
  EXPECT_CONTAINS(r.err, "fall short of --rotate_mb (64 MiB)");
  std::ifstream in(json);
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_EQ(doc["cases"][0]["rotation"]["copies_bf16"].get<int64_t>(), 1024);
  const Result big =
      Run({"bench", "--shape=1024x4096", "--m=1", "--replays=3", "--launches=4", "--rotate_mb=64"});
  ASSERT_EQ(big.rc, 0) << big.out << big.err;
  EXPECT_FALSE(absl::StrContains(big.err, "fall short")) << big.err;
}

// A wrong result from one path: a stand-in for libcublas (tests/fake_cublas, named in the
// documented GEMVZ_CUBLAS_LIBRARY) whose GEMM writes zeros. bench must check it, say which check
// failed, mark the case and the report not ok and exit 1, with z12 and plain still right; the
// demo must call the row WRONG and exit 1 too.
TEST_F(CliTest, BenchAndDemoReportAWrongCublasResult) {
  if (!HasGpu()) GTEST_SKIP() << "no GPU: neither runs a GEMV";
  if (std::string(GEMVZ_FAKE_CUBLAS).empty()) GTEST_SKIP() << "tests/fake_cublas is not built";
  env_["GEMVZ_CUBLAS_LIBRARY"] = GEMVZ_FAKE_CUBLAS;
  const std::string json = dir_ + "/bench.json";
  const Result r = Run({"bench", "--shape=1024x2048", "--m=1", "--json=" + json, "--replays=3",
                        "--launches=8", "--rotate_mb=64"});
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_CONTAINS(r.err, "cuBLAS vs reference");
  EXPECT_CONTAINS(r.out, "WRONG");
  EXPECT_CONTAINS(r.out, "SOME RESULTS ARE WRONG");
  std::ifstream in(json);
  ASSERT_TRUE(in) << "no " << json << ": " << r.err;
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_EQ(doc["cublas"]["library"], GEMVZ_FAKE_CUBLAS);
  EXPECT_FALSE(doc["ok"].get<bool>());
  EXPECT_TRUE(doc["errors"].empty());
  ASSERT_EQ(doc["cases"].size(), 1u);
  const nlohmann::json& c = doc["cases"][0];
  EXPECT_FALSE(c["ok"].get<bool>());
  EXPECT_FALSE(c["pair_check_ok"].get<bool>());
  EXPECT_FALSE(c["paths"]["cublas"]["check_ok"].get<bool>());
  EXPECT_GT(c["paths"]["cublas"]["max_err_ratio"].get<double>(), 1.0);
  EXPECT_TRUE(c["paths"]["z12"]["check_ok"].get<bool>());
  EXPECT_TRUE(c["paths"]["plain"]["check_ok"].get<bool>());

  const Result demo = Run({"demo", "--shape=1024x2048", "--replays=3", "--launches=8",
                           "--rotate_mb=64"});
  EXPECT_EQ(demo.rc, 1) << demo.out << demo.err;
  EXPECT_CONTAINS(demo.out, "WRONG");
  EXPECT_CONTAINS(demo.out, "demo: SOMETHING IS WRONG");
  EXPECT_EQ(demo.out.find("everything is right"), std::string::npos) << demo.out;
}

}  // namespace
