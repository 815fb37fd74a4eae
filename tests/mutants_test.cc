// tools/mutants.tsv lists deliberate bugs that tools/mutation_check.sh plants one at a time (the
// kernels' on a GPU machine), to check that the tests catch each one. This CPU test keeps the
// list usable as the code changes: each mutant's text occurs exactly once in its file (the script
// refuses one that does not), its replacement differs (it may be empty: a deletion), it says what
// the bug is and which tests should catch it, and no two mutants share a name.
#include <cstddef>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/support/temp_files.h"

namespace {

using ::gemvz::testing::ReadAll;

TEST(Mutants, EachAppliesToExactlyOnePlace) {
  const std::string dir = GEMVZ_SOURCE_DIR;
  std::ifstream table(dir + "/tools/mutants.tsv");
  ASSERT_TRUE(table) << "cannot read " << dir << "/tools/mutants.tsv";
  std::set<std::string> names;
  std::string line;
  int mutants = 0;
  while (std::getline(table, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> f = absl::StrSplit(line, '\t');
    ASSERT_EQ(f.size(), 6u) << "not name, file, text, replacement, what, tests (tab-separated): "
                            << line;
    const std::string &name = f[0], &file = f[1], &text = f[2], &replacement = f[3];
    EXPECT_FALSE(name.empty()) << line;
    EXPECT_TRUE(names.insert(name).second) << "two mutants named " << name;
    EXPECT_FALSE(text.empty()) << name;
    EXPECT_NE(text, replacement) << name << " changes nothing";
    EXPECT_FALSE(f[4].empty()) << name << " does not say what the bug is";
    EXPECT_FALSE(f[5].empty()) << name << " does not say which tests to run (gpu, or a regex)";
    const std::string source = ReadAll(dir + "/" + file);
    ASSERT_FALSE(source.empty()) << name << ": cannot read " << file;
    size_t count = 0;
    for (size_t p = source.find(text); p != std::string::npos; p = source.find(text, p + 1)) {
      ++count;
    }
    EXPECT_EQ(count, 1u) << name << ": '" << text << "' occurs " << count << " times in " << file
                         << " (edit tools/mutants.tsv with the code it mutates)";
    ++mutants;
  }
  EXPECT_GE(mutants, 259) << "the table lost mutants";
}

}  // namespace
